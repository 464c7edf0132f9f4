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
	  $(PY) -m pip install -q "torch==2.13.0"; \
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
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py --config configs/tiny.toml $(ARGS)

# The edit loop: unit tests only (no torchrun/gloo processes, no end-to-end train.py or CLI
# runs, no Triton interpreter, no network namespaces); under 2 minutes on 2 cores.
FAST_MARKERS := not slow and not gpu and not multiproc and not integration and not interpreter and not netns
HEAVY_MARKERS := not slow and not gpu and (multiproc or integration or interpreter or netns)
FAST_WORKERS ?= 2
HEAVY_WORKERS ?= 2

# The default tier. Without ARGS: the unit tests on FAST_WORKERS pytest workers, then the
# tests that start processes of their own on HEAVY_WORKERS workers, a test file per worker
# (--dist loadfile: a file's module fixtures are built once, and the one file that builds
# network namespaces never runs beside itself). Run one at a time, those tests kept 1.0 of
# the 2 cores busy on average (rendezvous, start-up, waits); two at a time they finish in
# 0.70x the wall time (370 s vs 530 s, both on an idle 2-core machine). Both phases run,
# and the target fails if either did. With ARGS: one plain pytest run.
test: $(STAMP)
ifeq ($(strip $(ARGS)),)
	@$(PY) -m pytest -q -n $(FAST_WORKERS) -m "$(FAST_MARKERS)"; a=$$?; \
	  $(PY) -m pytest -q -n $(HEAVY_WORKERS) --dist loadfile -m "$(HEAVY_MARKERS)"; b=$$?; \
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

# GPU tier: compiled Triton kernels in bf16, a short bf16 training of the tiny model (its loss
# curve and tokens/s), autotuning of one preset, both kernel benchmarks. One command, < 8
# minutes on one GPU; every result lands in one folder (OUT_DIR=...).
gpu-check: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH bash benchmarks/gpu_check.sh $(OUT_DIR)

# Several GPUs: PP=2 x EP=2 (4 GPUs) or PP=2 (2 GPUs) on NCCL, losses against one process in
# fp32 and bf16; exits non-zero past the stated tolerances. About 6 minutes.
gpu-check-multi: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH bash benchmarks/gpu_check_multi.sh $(OUT_DIR)
