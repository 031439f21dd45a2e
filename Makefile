# One command to set up, one to test. `.ci/run` runs exactly these.
PY ?= python3
VENV ?= .venv
PIP := $(VENV)/bin/python -m pip

.PHONY: setup test test-fast train bench clean

# Creates .venv and installs the package with exact pins (constraints.txt). torch is pinned to
# 2.13.0: an open range would pull a multi-GB CUDA build onto CPU machines. The same files install
# on CUDA machines, where pip picks the CUDA wheel of the same version.
setup:
	$(PY) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=23.2"
	$(PIP) install --quiet -c constraints.txt -e ".[dev]"
	@$(VENV)/bin/python -c "import torch, scape_train; print('scape_train ready: torch', torch.__version__)"

# The whole suite; under 15 minutes on 2 CPU cores.
test:
	$(VENV)/bin/python -m pytest -q --timeout=900 tests

test-fast:
	$(VENV)/bin/python -m pytest -q -m "not slow and not netns" tests

# The embedded default job: a tiny Llama on public-domain English text, on the CPU, offline.
train:
	$(VENV)/bin/python -m scape_train

bench:
	$(VENV)/bin/python scripts/bench_data.py

clean:
	rm -rf outputs .pytest_cache
