#!/usr/bin/env bash
# Set up and run the whole test suite (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
python -m pytest -q "$@"
