# One command to set up, one to test. `.ci/run` runs exactly these.
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip

.PHONY: setup test test-slow test-fast train bench bench-cpu bench-net clean

# Creates .venv and installs the package with exact pins (constraints.txt). torch is pinned to
# 2.13.0: an open range would pull a multi-GB CUDA build onto CPU machines. The same files install
# on CUDA machines, where pip picks the CUDA wheel of the same version.
setup:
	$(PY) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=23.2"
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	@$(VENV)/bin/python -c "import torch, scape_train; print('scape_train ready: torch', torch.__version__)"

# `test`: everything not marked slow, under 10 minutes on 2 quiet CPU cores. `test-slow`: the
# multi-minute tests (every paper experiment end to end, the larger world sizes and variants);
# together they are the whole suite, and `.ci/run` runs both.
test:
	$(VENV)/bin/python -m pytest -q --timeout=900 -m "not slow" tests

test-slow:
	$(VENV)/bin/python -m pytest -q --timeout=900 -m slow tests

test-fast:
	$(VENV)/bin/python -m pytest -q -m "not slow and not netns" tests

# The embedded default job: a tiny Llama on public-domain English text, on the CPU, offline.
train:
	$(VENV)/bin/python -m scape_train

# Figures into docs/ (see docs/performance.md). bench-cpu needs nothing special; bench-net needs
# root with ip/tc (network namespaces) and takes about an hour on 2 cores.
bench: bench-cpu bench-net

bench-cpu:
	$(VENV)/bin/python scripts/bench_data.py
	$(VENV)/bin/python scripts/bench_volume.py
	$(VENV)/bin/python scripts/bench_checkpoint.py
	$(VENV)/bin/python scripts/bench_optim.py
	$(VENV)/bin/python scripts/bench_quality.py --steps 200 --seq-len 128 --density-warmup 40
	$(VENV)/bin/python scripts/cost_model.py

bench-net:
	$(VENV)/bin/python scripts/bench_speed.py --fresh --repeats 3
	$(VENV)/bin/python scripts/bench_time_to_quality.py
	$(VENV)/bin/python scripts/bench_gasloc.py

clean:
	rm -rf outputs .pytest_cache
