# The two commands a new machine needs: `make demo` and `make test`.
# Both install first (once) into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo bert4rec oracle test test-compat exactness lint docs gpu-check bench clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt requirements/cuda.txt requirements/dev.txt scripts/install.sh
	bash scripts/install.sh $(VENV)
	touch $(STAMP)

# The main job: TorchRec's DLRM example with lookahead caching on built-in
# synthetic Criteo-shaped data, plain TorchRec beside it for comparison.
demo: install
	$(PY) examples/dlrm/dlrm_main.py --baseline --out results/dlrm

# TorchRec's BERT4Rec example with lookahead caching (one sequence table) on built-in
# synthetic item histories, plain TorchRec beside it for comparison.
bert4rec: install
	$(PY) examples/bert4rec/bert4rec_main.py --baseline --out results/bert4rec

# The oracle report: misses against LRU / LFU / MIN, planning speed.
oracle: install
	$(PY) benchmarks/oracle.py --out results/oracle

test: install
	$(PY) -m pytest -q

# The differential harness: EXACTNESS_CONFIGS random configurations (bag tables,
# sequence tables or both) drawn from EXACTNESS_SEED (EXACTNESS_ONLY=i,j: just those;
# EXACTNESS_HOT_ROWS=1: every one with replicated hot rows), each trained under this
# project and under plain TorchRec and compared step by step. Last line: "exactness: K of N
# configurations agree"; fails unless all do.
EXACTNESS_CONFIGS ?= 20
EXACTNESS_SEED ?= 0
EXACTNESS_ONLY ?=
EXACTNESS_HOT_ROWS ?=
exactness: install
	EXACTNESS_CONFIGS=$(EXACTNESS_CONFIGS) EXACTNESS_SEED=$(EXACTNESS_SEED) \
	EXACTNESS_ONLY=$(EXACTNESS_ONLY) EXACTNESS_HOT_ROWS=$(EXACTNESS_HOT_ROWS) \
	$(PY) -m tests.exactness

# The suite again against the newest TorchRec release and its torch / FBGEMM
# (requirements/compat.txt), in a second virtual environment.
COMPAT_VENV ?= .venv-compat
$(COMPAT_VENV)/.installed: requirements/compat.txt requirements/dev.txt scripts/install-compat.sh
	bash scripts/install-compat.sh $(COMPAT_VENV)
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The CUDA path on a GPU: the CUDA-marked tests (the cache's under the CUDA sanitizer), the
# GPU benchmark's table, two ranks over NCCL where there are two GPUs. Without a GPU it says
# so and fails. On a lent GPU machine with no package registry, scripts/device_pack.sh
# (here) and scripts/device_check.sh (there) install its dependencies and run it instead.
gpu-check: install
	bash scripts/gpu_check.sh $(PY) results/gpu_check

# The design, guides, results and an API reference from the docstrings, warnings as errors.
docs: install
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

bench: install
	$(PY) benchmarks/oracle.py --out results/oracle-large --scale 0.5 --steps 400
	$(PY) benchmarks/host_link.py --out results/host_link
	$(PY) benchmarks/planning.py --out results/planning
	$(PY) benchmarks/gil.py --out results/gil
	$(PY) benchmarks/step_time.py --out results/step_time
	$(PY) benchmarks/step_time.py --out results/step_time_large --scale 0.1 --cache-load-factor 0.02
	$(PY) benchmarks/step_time.py --out results/step_time_ws1 --world-size 1
	$(PY) benchmarks/step_time.py --out results/step_time_ws1_large --world-size 1 --scale 0.1 --cache-load-factor 0.02
	$(PY) benchmarks/step_time.py --out results/step_time_ws2 --world-size 2
	$(PY) benchmarks/step_time.py --out results/step_time_ws2_large --world-size 2 --scale 0.1 --cache-load-factor 0.02
	$(PY) benchmarks/step_time.py --out results/step_time_ws2_small_batch --world-size 2 --batch-size 256
	$(PY) benchmarks/planner.py --out results/planner
	$(PY) benchmarks/planner.py --out results/planner100 --sample-batches 100

clean:
	rm -rf $(VENV) $(COMPAT_VENV) results .cache .pytest_cache .hypothesis *.egg-info docs/_build docs/_api
