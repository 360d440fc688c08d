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

# On a CUDA machine (elsewhere it says so and exits 0): one rank's 7B TP4 decoder layer beside the estimator, LLaMA-1B vs
# CoLA-1B throughput, training steps of every architecture and layout, the fused norm kernels, in that order, inside
# a time budget; readings in benchmarks/results/gpu/. Installs nothing: runs .venv's python where `make install` made
# it, else python3 (GPU_PYTHON=... to choose the python whose torch is the CUDA build), on this checkout.
# GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--only layer throughput --budget-s 440 --out /tmp/gpu".
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) outputs
