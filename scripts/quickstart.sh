#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct): set up, distill an MLP
# speculator with Accelerate, export it for vLLM, evaluate it on MT-Bench, print tau and speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
RUN=${RUN:-runs/quickstart}
if [ -e "$RUN/final" ]; then
  echo "$RUN/final exists: reusing it (delete $RUN to train again)"
else
  accelerate launch --num_processes 1 --cpu train/distill.py --config train/configs/mlp_quick.yaml --output_dir="$RUN"
fi
speculators export "$RUN" --out "$RUN/export" --force
speculators eval "$RUN/export" --data mt-bench --k 3 --num-prompts 20 --max-new-tokens 128 --out "$RUN/eval"
