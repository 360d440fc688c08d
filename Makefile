# One command runs the demo, one runs the tests; both bootstrap .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-min test-order bench gpu-check install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, at the pinned leg's release (2.14.1: a CUDA build, from the machine's wheel folder where it has one;
	# it runs on the CPU), so that nothing after it resolves another torch.
	$(PY) -m pip install -q torch==2.14.1
	$(PY) -m pip install -q -c constraints.txt -e ".[train,demo,test,bench]"
	touch $(STAMP)

# The second leg of `make test`: the minimum supported versions (constraints-min.txt: the lent GPU machine's stack),
# the core install only (no [train] extra: no datasets, evaluate or deepspeed). PyPI's torch 2.11 is its CUDA build
# (no CPU build of 2.11 is on the registry); it runs on the CPU.
MIN_VENV := .venv-min
MIN_PY := $(MIN_VENV)/bin/python
MIN_STAMP := $(MIN_VENV)/.installed
# What the minimum leg runs: import and install, the model and generation, remote code with plain transformers, TP and
# SP exactness at tp 2, the pipeline at pp 2, the GPU check on the CPU, the version declarations, and what the lent GPU
# machine's torch generates: the fused ops' kernels (one each) and the ops each layout's layer dispatches.
MIN_TESTS := tests/test_install.py tests/test_modeling.py tests/test_hf_contract.py tests/test_generation.py tests/test_lax.py \
	tests/test_tensor_train.py tests/test_configuration.py tests/hub/test_remote_code.py tests/parallel/test_tensor_parallel.py \
	tests/parallel/test_sequence_parallel.py tests/parallel/test_pipeline.py tests/benchmarks/test_gpu_check.py tests/perf/test_fake_group.py tests/test_versions.py \
	tests/parallel/test_latent_op.py tests/parallel/test_statistics_op.py tests/perf/test_op_count.py

$(MIN_STAMP): pyproject.toml constraints-min.txt
	$(PYTHON) -m venv $(MIN_VENV)
	$(MIN_PY) -m pip install -q --upgrade pip
	$(MIN_PY) -m pip install -q -c constraints-min.txt -e . pytest pytest-timeout matplotlib
	touch $(MIN_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/boost-hf demo

# The third leg: the model, release, exactness and precision tests again in another order of fp32 summation, so that
# no tolerance holds for one machine only: ATen's portable kernels instead of this CPU's vectorised ones, MKL's
# generic code path for the GEMMs, two intra-op threads (tests/tolerances.py says how the bounds are derived).
ORDER_TESTS := tests/test_modeling.py tests/test_lax.py tests/test_tensor_train.py tests/test_hf_contract.py \
	tests/test_boost_release.py tests/test_authors_checkpoint.py tests/parallel/test_tensor_parallel.py \
	tests/parallel/test_sequence_parallel.py tests/parallel/test_pipeline.py tests/parallel/test_megatron.py \
	tests/parallel/test_fused.py tests/parallel/test_latent_op.py tests/parallel/test_statistics_op.py tests/parallel/test_rmsnorm_op.py \
	tests/parallel/test_fully_shard.py tests/training/test_precision.py
ORDER_ENV := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE BOOST_HF_TEST_THREADS=2

# The three legs, each even if an earlier one failed; fails if any did.
test: $(STAMP) $(MIN_STAMP)
	$(PY) -m pytest -q --durations=30 tests; pinned=$$?; \
	BOOST_HF_MINIMUM_VERSIONS=1 $(MIN_PY) -m pytest -q -rs --durations=10 $(MIN_TESTS); minimum=$$?; \
	$(ORDER_ENV) $(PY) -m pytest -q --durations=10 $(ORDER_TESTS); order=$$?; \
	echo "make test: pinned versions exit $$pinned, minimum versions exit $$minimum, another summation order exit $$order"; \
	[ $$pinned -eq 0 ] && [ $$minimum -eq 0 ] && [ $$order -eq 0 ]

test-order: $(STAMP)
	$(ORDER_ENV) $(PY) -m pytest -q --durations=10 $(ORDER_TESTS)

test-min: $(MIN_STAMP)
	BOOST_HF_MINIMUM_VERSIONS=1 $(MIN_PY) -m pytest -q -rs --durations=10 $(MIN_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# On a CUDA machine (elsewhere it says so and exits 0): the plan of benchmarks/gpu_check.py's docstring, its three
# commands in order, each inside its budget (6 min): 1. one rank's layer at the release's 7B and 13B TP4 shapes and with
# SP; 2. 1B throughput beside transformers' LlamaForCausalLM, the CUDA kernel counts, training-step correctness;
# 3. activation checkpointing; readings in benchmarks/results/gpu/. Installs nothing: runs .venv's python
# where `make install` made it, else python3 (GPU_PYTHON=... to choose the python whose torch is the CUDA build), on
# this checkout. GPU_CHECK_ARGS passes options to both, e.g. GPU_CHECK_ARGS="--out /tmp/gpu".
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --command 1 $(GPU_CHECK_ARGS); first=$$?; \
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --command 2 $(GPU_CHECK_ARGS); second=$$?; \
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --command 3 $(GPU_CHECK_ARGS); third=$$?; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ] && [ $$third -eq 0 ]

clean:
	rm -rf $(VENV) $(MIN_VENV) outputs
