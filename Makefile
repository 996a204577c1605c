# moe-launch — the two commands of the README are `make run` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SLURM := tests/slurm/cluster.sh
SLURM_NODES ?= 6
PYTEST_ARGS ?=

.PHONY: run test lint bench venv venv-test clean

# A GPU machine keeps the torch it has (venv sees system site-packages); elsewhere torch 2.13.0, the CPU build that lies
# on disk on our CPU machines, goes in first so that pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then \
	    echo "[make] GPU machine: reusing the system torch"; $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; \
	fi
	$(BIN)/python -m pip install -q --upgrade pip
	@if ! $(BIN)/python -c 'import torch' 2>/dev/null; then $(BIN)/python -m pip install -q torch==2.13.0; fi
	$(BIN)/python -m pip install -q -e .
	@$(BIN)/python -m moe_launch.kernels.interpreter_check >/dev/null 2>&1 || { \
	  echo "[make] this Triton's interpreter (the kernels' CPU path) needs numpy<2.4: installing it into the venv"; \
	  $(BIN)/python -m pip install -q "numpy<2.4"; $(BIN)/python -m moe_launch.kernels.interpreter_check || true; }
	@touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

venv: $(STAMP)
venv-test: $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/moe-launch $(ARGS)

# Brings the local Slurm test cluster up, runs every test, and tears the cluster down again (also on failure).
test: $(TEST_STAMP)
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || echo "[make] chromium not installed: the HTML report test will fail"
	bash $(SLURM) up $(SLURM_NODES)
	@set -o pipefail; rc=0; \
	  OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slurm" -n 2 --timeout 900 $(PYTEST_ARGS) || rc=$$?; \
	  OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m slurm --timeout 900 $(PYTEST_ARGS) || rc=$$?; \
	  bash $(SLURM) down || true; \
	  exit $$rc

lint: $(TEST_STAMP)
	$(BIN)/ruff check .

bench:
	@echo "Benchmarks need an NVIDIA GPU (results: benchmarks/RESULTS.md). On a GPU machine:"
	@echo "  make venv && PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/moe_layer.py     # MoE layer fwd+bwd"
	@echo "  .venv/bin/python benchmarks/train_step.py                                      # training step vs HF"
	@echo "  .venv/bin/torchrun --nproc-per-node 2 benchmarks/ep_train.py                   # EP=2, EPSO vs ZeRO-1"
	@echo "  .venv/bin/python benchmarks/health_gpu.py                                      # GPU check + all-to-all"

clean:
	rm -rf $(VENV) build *.egg-info
