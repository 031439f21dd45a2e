#!/usr/bin/env bash
# Wheels the device machine's image lacks, into .whl/ (git-ignored), for scripts/gpu_check.sh:
# the config stack at the versions constraints.txt pins (pure Python, so one build serves), and
# torchft.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
pin() { grep -i "^$1==" constraints.txt | head -1; }
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$(pin hydra-core)" "$(pin omegaconf)"
"$PY" -m pip wheel -q --no-deps -w .whl "$(pin antlr4-python3-runtime)"   # sdist only on PyPI
# torchft, for the optional elastic check: a platform wheel, for the image's Python 3.12
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 -d .whl "$(pin torchft)"
ls -1 .whl
