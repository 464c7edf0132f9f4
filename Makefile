# The two commands: `make train` and `make test`. Both create/reuse .venv and install what is
# needed. On a CPU-only machine torch==2.13.0 installs from local disk; when $(PYTHON) already
# has a torch (e.g. a CUDA/ROCm build on a cluster) the venv is created with
# --system-site-packages and keeps that torch.
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
NPROC ?= 4
STAMP := $(VENV)/.installed

.PHONY: train test test-fast test-all lint typecheck check gpu-check gpu-check-multi clean-venv

$(PY):
	@if [ -z "$(VENV_FLAGS)" ] && $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "[setup] $(PYTHON) already has torch: the venv will see it (--system-site-packages)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else $(PYTHON) -m venv $(VENV_FLAGS) $(VENV); fi

$(STAMP): $(PY) pyproject.toml
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  echo "[setup] installing torch==2.13.0 (CPU build)"; \
	  $(PY) -m pip install -q --no-compile "torch==2.13.0"; \
	else echo "[setup] keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; fi
	@# A kept torch below pyproject's floor would make pip replace it with a download (or fail
	@# later on a missing API): refuse, naming both versions and the ways out.
	@$(PY) -c 'import re, sys, tomllib, torch; \
	  deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
	  floor = next(d for d in deps if d.startswith("torch>=")).split(">=")[1]; \
	  num = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:2]); \
	  sys.exit(0 if num(torch.__version__) >= num(floor) else \
	    f"[setup] error: torch {torch.__version__} ({torch.__file__}) is older than the floor torch>={floor} " \
	    f"of pyproject.toml. Install torch>={floor} for $(PYTHON) (e.g. a newer cluster module), or " \
	    f"build a venv without it: make clean-venv && make VENV_FLAGS=--clear (pip installs torch 2.13.0)")'
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	@# pip byte-compiles one file at a time; compileall on every core does the same in ~0.5x
	@# the time (72 s -> 34 s for this venv's 14,400 files on 2 cores). The .pyc files matter
	@# where PYTHONDONTWRITEBYTECODE is set: without them every process compiles what it imports.
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py --config configs/tiny.toml $(ARGS)

# The edit loop: unit tests only (no torchrun/gloo processes, no end-to-end train.py or CLI
# runs, no Triton interpreter, no network namespaces); under 2 minutes on 2 cores.
FAST_MARKERS := not slow and not gpu and not multiproc and not integration and not interpreter and not netns
HEAVY_MARKERS := not slow and not gpu and (multiproc or integration or interpreter or netns)
FAST_WORKERS ?= 2
HEAVY_WORKERS ?= 2

# The default tier. Without ARGS: the tests that start processes of their own on
# HEAVY_WORKERS pytest workers, a test file per worker (--dist loadfile: a file's module
# fixtures are built once, and the one file that builds network namespaces never runs beside
# itself), and beside them the unit tests in one more process (UNIT_WORKERS=0: no xdist),
# their output printed after. The process tests keep the cores only partly busy (rendezvous,
# start-up, waits: one at a time they kept 1.0 of 2 cores busy; two at a time they finish in
# 0.70x the wall time, 370 s vs 530 s on an idle 2-core machine); the unit tests fill the
# rest instead of running before them. Both runs finish, and the target fails if either did.
# With ARGS: one plain pytest run.
UNIT_WORKERS ?= 0
test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	@log=$$(mktemp "$${TMPDIR:-/tmp}/piper-unit-tests.XXXXXX"); \
	  $(PY) -m pytest -q -n $(UNIT_WORKERS) -m "$(FAST_MARKERS)" > "$$log" 2>&1 & u=$$!; \
	  $(PY) -m pytest -q -n $(HEAVY_WORKERS) --dist loadfile -m "$(HEAVY_MARKERS)"; b=$$?; \
	  wait $$u; a=$$?; echo "--- unit tests (ran beside the process tests) ---"; cat "$$log"; rm -f "$$log"; \
	  if [ $$a -ne 0 ] || [ $$b -ne 0 ]; then echo "make test: unit tests exit $$a, process tests exit $$b" >&2; exit 1; fi
else
	$(PY) -m pytest -q $(ARGS)
endif
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) -m "$(FAST_MARKERS)" $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy over the packages and train.py ([tool.mypy] in pyproject.toml; tests are not checked).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# What CI runs (.ci/run): lint, the type check, then the default test tier.
check: lint typecheck test

clean-venv:
	rm -rf $(VENV)

# GPU tier: compiled Triton kernels in bf16, short bf16 trainings of the tiny model (their loss
# curves and tokens/s), the kernel benchmarks, autotuning of one preset. One command, within
# GPU_CHECK_BUDGET_S (default 540 s) on one GPU; every result lands in one folder
# (OUT_DIR=...), and ARCHIVE=path.tar.gz packs it into one file. Where $(PYTHON) already has a
# GPU torch and no $(VENV) exists (a lent machine's image, offline), it runs with that Python
# as is and installs nothing.
gpu-check:
	@if [ ! -f $(STAMP) ] && $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	  echo "[gpu-check] $(PYTHON) has torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') with a GPU and there is no $(VENV): using it as is"; \
	  py="$$(command -v $(PYTHON))"; \
	else $(MAKE) --no-print-directory $(STAMP) || exit 1; py=$(abspath $(PY)); fi; \
	PATH=$(abspath $(VENV))/bin:$$PATH PY="$$py" GPU_CHECK_ARCHIVE="$(ARCHIVE)" bash benchmarks/gpu_check.sh $(OUT_DIR)

# Several GPUs: PP=2 x EP=2 (4 GPUs) or PP=2 (2 GPUs), ZeRO-3, TP=2, the all-to-all overlap
# and dedup, elastic re-planning on NCCL, losses against one process in fp32 and bf16; exits
# non-zero past the stated tolerances. Its step limits add up to 2120-2260 s.
gpu-check-multi: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH GPU_CHECK_ARCHIVE="$(ARCHIVE)" bash benchmarks/gpu_check_multi.sh $(OUT_DIR)
