# Two entry points that create and fill their own environment: `make demo`, `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv demo lint test fuzz bench gpu-check docs clean

venv: $(STAMP)

# A torch already on the system (a GPU machine's CUDA build) is kept and seen through
# --system-site-packages; otherwise the CPU build 2.13.0 is installed before anything
# else, so that no dependency pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@echo "make: creating $(VENV) and installing tetron into it (torch first where the system has none: a few"
	@echo "      minutes, once; later runs reuse it)"
	@if python3 -c "import torch" 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# Again, it moves the earlier demo aside to runs/demo.old-N (a run folder holds one run; nothing is deleted).
demo: $(STAMP)
	@echo "make: training the demo (configs/demo.yaml) on 2 ranks into runs/demo; the first time it also trains"
	@echo "      a tokenizer on the stdlib and tokenizes it (about a minute, then cached)"
	$(VENV)/bin/tetron train configs/demo.yaml --out runs/demo --overwrite

lint: $(STAMP)
	$(PY) -m ruff check .

# The linter first: a lint error fails CI before the (longer) test suite starts. One pytest worker per core
# (pytest-xdist), each test file on one worker (its module fixtures run once): while one worker runs a
# single-process test, the other's ranks take the second core; the longest files first (tests/conftest.py).
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder tests

# The layout fuzzer (tests/fuzz_layouts.py): COUNT random configurations of seed SEED, each validated and, where
# accepted, trained on forked ranks against the single process; one summary line, and each failure written to
# fuzz-failures/ as YAML that `tetron train FILE` runs again.
SEED  ?= 0
COUNT ?= 50
fuzz: $(STAMP)
	PYTHONPATH=. $(PY) tests/fuzz_layouts.py --seed $(SEED) --count $(COUNT) --failures fuzz-failures

# The GPU check: correctness, speed (tokens/s, MFU) and the memory model as one table, within 8 minutes on
# one GPU; tiny sizes in seconds without one. No install, no network: the venv's python if there is one,
# else the machine's python3 on this checkout.
gpu-check:
	@if [ -x $(PY) ]; then PYTHONPATH=. $(PY) -m bench.gpu_check; else PYTHONPATH=. python3 -m bench.gpu_check; fi

bench: $(STAMP)
	$(PY) bench/data_parallel.py
	$(PY) bench/tensor_parallel.py
	$(PY) bench/pipeline_parallel.py
	$(PY) bench/context_parallel.py
	$(PY) bench/zero.py
	$(PY) bench/step_overhead.py
	$(PY) bench/documents.py
	$(PY) bench/checkpoint.py
	$(PY) bench/moe.py

# docs/config.md from the config's field comments, and the docs' live outputs (docs/build.py says which).
docs: $(STAMP)
	$(PY) docs/build.py

clean:
	rm -rf $(VENV) runs
