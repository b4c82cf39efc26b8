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
