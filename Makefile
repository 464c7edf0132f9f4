# The two commands: `make train` and `make test`. Both create/reuse .venv and install what is
# needed. On a CPU-only machine torch==2.13.0 installs from local disk; a python that already
# has a torch (e.g. a CUDA/ROCm build on a cluster) keeps it (VENV_FLAGS=--system-site-packages
# lets the venv see it).
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
NPROC ?= 4
STAMP := $(VENV)/.installed

.PHONY: train test test-all lint gpu-check clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

$(STAMP): $(PY) pyproject.toml
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  echo "[setup] installing torch==2.13.0 (CPU build)"; \
	  $(PY) -m pip install -q "torch==2.13.0"; \
	else echo "[setup] keeping installed torch $$($(PY) -c 'import torch; print(torch.__version__)')"; fi
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) train.py --config configs/tiny.toml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
