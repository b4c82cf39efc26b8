#!/usr/bin/env bash
# The GPU checks of the Triton kernels, in one call (at most 7 minutes: each step has a time limit):
#   1. the fused loss benchmark at the issue's shape (T=16384, V=128256, D=4096, 4 heads, bf16):
#      naive / Liger-style chunked / ours, then their accuracy vs float64 at a smaller shape;
#   2. the inference-kernel benchmark (verification B=256 K=4 V=128256; fused proposal B=64);
#   3. the kernel test suite against the compiled kernels (tests/kernels/conftest.py);
#   4. the engine tests on the GPU (greedy speculative decoding equals plain greedy decoding, chain and
#      tree, with the Triton kernels doing proposal and verification), on a tiny random target that
#      carries the default target's tokenizer: make it first, here, into .gpu_assets/ (git-ignored;
#      carry it to the GPU machine with the repo):
#        bash scripts/gpu_check.sh --make-assets
# Needs python3 with torch + triton + pytest on a CUDA machine; installs nothing. The package is laid
# out as pip installs it (kernels/ -> speculators/kernels) in a scratch folder, so no install is needed.
#
#   bash scripts/gpu_check.sh [LOG_DIR]        # the checks above (logs: LOG_DIR, default runs/gpu_check)
#   bash scripts/gpu_check.sh LOG_DIR tune     # launch-configuration sweeps of the two benchmarks
#   bash scripts/gpu_check.sh LOG_DIR engine   # step 4 alone
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ "${1:-}" = --make-assets ]; then
  cd "$REPO" && exec .venv/bin/python -c "
import sys; sys.path.insert(0, 'tests')
from conftest import make_tiny_target
from speculators.assets import default_target_dir
make_tiny_target('.gpu_assets/tiny-target', default_target_dir())"
fi
LOG=${1:-$REPO/runs/gpu_check}
MODE=${2:-check}
mkdir -p "$LOG"
W=$(mktemp -d)
cp -r "$REPO/speculators" "$W/speculators"
cp -r "$REPO/kernels" "$W/speculators/kernels"
cp -r "$REPO/export" "$W/speculators/export"
cp -r "$REPO/tests" "$REPO/benchmarks" "$REPO/pyproject.toml" "$W/"
cd "$W"
export PYTHONPATH="$W" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$LOG/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG/gpu.txt"

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $LOG/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
}

engine_tests() {
  if [ ! -d "$REPO/.gpu_assets/tiny-target" ]; then
    echo "=== engine_tests: skipped (no .gpu_assets/tiny-target; see the header)"; return
  fi
  step engine_tests 150 env SPECULATORS_TEST_DEVICE=cuda SPECULATORS_TINY_TARGET="$REPO/.gpu_assets/tiny-target" \
    python3 -m pytest -q -p no:cacheprovider tests/test_engine.py -k "lossless or seeded or needs_typical_acceptance"
}
if [ "$MODE" = engine ]; then
  engine_tests; tail -n 30 "$LOG/engine_tests.log" 2>/dev/null; exit 0
fi
if [ "$MODE" = tune ]; then
  step loss_tune 200 python3 benchmarks/bench_fused_linear_divergence.py --device cuda --tune
  step verify_tune 100 python3 benchmarks/bench_inference_kernels.py --device cuda --only verify --tune --no-reference
  for f in loss_tune verify_tune; do echo; echo "##### $f"; tail -n 40 "$LOG/$f.log"; done
  exit 0
fi
step loss_bench 120 python3 benchmarks/bench_fused_linear_divergence.py --device cuda
step loss_accuracy 45 python3 benchmarks/bench_fused_linear_divergence.py --device cuda --accuracy \
  --T 2048 --V 32768 --D 1024
step inference_bench 100 python3 benchmarks/bench_inference_kernels.py --device cuda
step kernel_tests 120 env SPECULATORS_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -p no:cacheprovider \
  tests/kernels -W ignore::DeprecationWarning
engine_tests
for f in loss_bench loss_accuracy inference_bench kernel_tests engine_tests; do
  echo; echo "##### $f"; tail -n 40 "$LOG/$f.log"
done
