"""Recognise a `speculators` export in a vLLM speculative config and route it to our proposer.

vLLM builds its `SpeculativeConfig` in `EngineArgs.create_speculative_config`, in the process that
creates the engine (`LLM(...)`, `vllm serve`), after loading general plugins. We wrap that method:
when `speculative_config["model"]` (or `--spec-model`) is a directory holding a config.json with
`model_type` mlp_speculator/medusa and our `speculators_target` key, the dict becomes
`{"method": "custom_class", "model": PROPOSER_CLASS, ...}` and the directory goes into
`additional_config["speculators"]`, which reaches every worker inside the `VllmConfig`.
Anything else passes through untouched.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

from . import versions
from .versions import EXPORT_KEY, PROPOSER_CLASS, check_vllm_version, native_kinds, plugin_runs_on

# A child of vLLM's own logger, so our lines print with its format and level.
logger = logging.getLogger("vllm.speculators")

KINDS = ("mlp_speculator", "medusa")

# Private vLLM names the plugin depends on; identical in 0.32.0 and 0.33.0 (read in both sources).
PRIVATE_NAMES = (
    "vllm.engine.arg_utils.EngineArgs.create_speculative_config(self, target_model_config, target_parallel_config)",
    "EngineArgs.speculative_config / spec_method / spec_model / spec_tokens / additional_config",
    "vllm.config.speculative.SpeculativeMethod (a Literal; 'medusa' in it means native Medusa)",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids(..., sample_hidden_states, "
    "..., spec_decode_metadata, ...)",
    "SpecDecodeMetadata.num_draft_tokens",
    "custom_class protocol: Class(vllm_config), load_model(target_model), "
    "propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)",
)

_ALIASES = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))


def read_export(model: Any) -> dict | None:
    """The config.json of a `speculators` export at `model`, or None if `model` is anything else."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    path = Path(model).expanduser()
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("model_type") not in KINDS or "speculators_target" not in cfg:
        return None
    return cfg


def num_heads(cfg: dict) -> int:
    return int(cfg["n_predict"] if cfg["model_type"] == "mlp_speculator" else cfg["num_heads"])


def route_export(engine_args, target_model_config=None) -> bool:
    """Rewrite `engine_args` in place if its speculative model is one of our exports; True if it did."""
    spec = getattr(engine_args, "speculative_config", None)
    if spec is not None and not isinstance(spec, dict):
        return False
    spec = {k.replace("-", "_"): v for k, v in (spec or {}).items()}
    aliases = {key: getattr(engine_args, attr, None) for attr, key in _ALIASES}
    model = spec.get("model", aliases["model"])
    cfg = read_export(model)
    if cfg is None:
        return False
    kind = cfg["model_type"]
    method = spec.get("method", aliases["method"])
    if method not in (None, "custom_class", kind):
        return False  # an explicit other method (e.g. draft_model) is the user's call; vLLM reports on it
    version = versions.vllm_version()  # looked up at call time, so a test can set it
    if kind in native_kinds(version) and (method == kind or not plugin_runs_on(version)):
        # vLLM's own classes load this format: asked for by name (Medusa on vLLM <= 0.32), or on a vLLM
        # the plugin does not run on (V0's MLPSpeculator and Medusa up to 0.9, Medusa up to 0.31).
        logger.info("speculators: %s is a %s export; vLLM %s runs it natively", model, kind, version)
        return False
    # Ours to route: on a vLLM we have not checked, stop here with one message.
    check_vllm_version()
    # Merge the --spec-* aliases exactly as vLLM would (it refuses a key given both ways).
    for attr, key in _ALIASES:
        value = aliases[key]
        if value is None:
            continue
        if key in spec:
            raise ValueError(f"--{attr.replace('_', '-')} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
        setattr(engine_args, attr, None)
    export_dir = str(Path(model).expanduser().resolve())
    heads = num_heads(cfg)
    k = spec.get("num_speculative_tokens") or heads
    if not 1 <= k <= heads:
        raise ValueError(f"{export_dir} has {heads} {kind} heads; num_speculative_tokens={k} must be 1..{heads}")
    _check_target(cfg, export_dir, target_model_config)
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").lower() in ("1", "true"):
        raise ValueError(
            f"{export_dir}: vLLM's custom_class proposers run only on the V1 model runner; "
            f"unset VLLM_USE_V2_MODEL_RUNNER (vLLM falls back to V1 by itself)"
        )
    additional = getattr(engine_args, "additional_config", None)
    if additional is None:
        additional = {}
    if not isinstance(additional, dict):
        raise ValueError(f"additional_config must be a dict to carry the speculators export, got {type(additional)}")
    additional = dict(additional)  # the caller's dict stays as it was
    user = additional.get(EXPORT_KEY) or {}
    if not isinstance(user, dict) or set(user) - {"hybrid"} or not isinstance(user.get("hybrid", True), bool):
        raise ValueError(f"additional_config['{EXPORT_KEY}'] takes one key, 'hybrid' (true or false: suffix lookup "
                         f"beside the heads, default from the export's speculators_hybrid.enabled), got {user!r}")
    hybrid = user.get("hybrid", bool((cfg.get("speculators_hybrid") or {}).get("enabled", False)))
    additional[EXPORT_KEY] = {"export_dir": export_dir, "kind": kind, "hybrid": hybrid}
    engine_args.additional_config = additional
    spec.update(method="custom_class", model=PROPOSER_CLASS, num_speculative_tokens=k)
    engine_args.speculative_config = spec
    logger.info("speculators: routing %s export %s (k=%d%s) to the custom_class proposer on vLLM %s",
                kind, export_dir, k, ", hybrid with suffix lookup" if hybrid else "", version)
    return True


def _check_target(cfg: dict, export_dir: str, target_model_config) -> None:
    """Vocab and hidden size against the target, so a mismatch fails here, not in the runner."""
    if target_model_config is None:
        return
    try:
        vocab = target_model_config.get_vocab_size()
        hidden = target_model_config.get_hidden_size()
    except Exception:  # an exotic config: the proposer checks the sizes again when it loads
        return
    want_hidden = cfg.get("emb_dim", cfg.get("hidden_size"))
    if cfg.get("vocab_size") != vocab or want_hidden != hidden:
        raise ValueError(
            f"{export_dir} was trained for a target with vocab {cfg.get('vocab_size')} and hidden size "
            f"{want_hidden}, but {target_model_config.model} has vocab {vocab} and hidden size {hidden}"
        )


def install_config_hook() -> None:
    """Wrap EngineArgs.create_speculative_config once per process (plugins may be loaded repeatedly)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # pragma: no cover - not a vLLM we know
        logger.warning("speculators: vllm.engine.arg_utils.EngineArgs not found (vLLM %s); plugin inactive",
                       versions.vllm_version())
        return
    orig = getattr(EngineArgs, "create_speculative_config", None)
    if orig is None:
        logger.warning("speculators: EngineArgs.create_speculative_config not found (vLLM %s); plugin inactive",
                       versions.vllm_version())
        return
    if getattr(orig, "_speculators_hook", False):
        return

    @functools.wraps(orig)
    def create_speculative_config(self, *args, **kwargs):
        target_model_config = args[0] if args else kwargs.get("target_model_config")
        route_export(self, target_model_config)
        return orig(self, *args, **kwargs)

    create_speculative_config._speculators_hook = True
    EngineArgs.create_speculative_config = create_speculative_config
