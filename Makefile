# One command runs the demo, one runs the tests; both bootstrap .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench gpu-check install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the pinned version resolves to the local CPU wheel, never the CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[train,demo,test,bench]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/boost-hf demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=30 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# On a CUDA machine (CUDA only; elsewhere it says so and exits 0): training steps of every architecture and layout,
# the fused norm kernels, rank_cost --device cuda --compile and gpu_throughput, readings in benchmarks/results/gpu/.
# Installs nothing: runs .venv's python where `make install` made it, else python3 (GPU_PYTHON=... to choose the
# python whose torch is the CUDA build), on this checkout.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) outputs
