"""DistillSpec draft models: a small causal LM with the target's vocabulary, trained to match the
target's next-token distribution, then served as vLLM's `draft_model` proposer.

A draft starts from one of three places (the recipe's `draft_init`):
  * "layers": a subset of the target's own decoder layers, with its embeddings, final norm and lm
    head copied — a real transformers model of the target's architecture with fewer layers;
  * "model": an existing smaller model (alias, directory, GGUF file) that shares the tokenizer;
  * "config": the target's config with overrides (`draft_config`), randomly initialised.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from torch import nn

from .config import ConfigError
from .models.base import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, atomic_write_dir, read_safetensors
from .target import Target, load_causal_lm, resolve_model_path, whole

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def check_vocab(draft_vocab: int, draft_tokenizer, target_vocab: int, target_tokenizer) -> None:
    """vLLM refuses a draft whose vocabulary differs from the target's; so do we, before training."""
    if draft_vocab != target_vocab:
        raise ConfigError(f"Target and draft model should have the same vocabulary size (target {target_vocab}, "
                          f"draft {draft_vocab}); choose a draft that uses the target's tokenizer")
    if draft_tokenizer is not None and target_tokenizer is not None:
        dv, tv = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if dv != tv:
            differ = sum(dv.get(t) != i for t, i in tv.items())
            raise ConfigError(f"Target and draft model should have the same vocabulary size and tokenizer: "
                              f"{differ} of the target's {len(tv)} tokens have another id in the draft's tokenizer")


def add_transformers4_keys(directory: Path) -> None:
    """Let transformers 4 read a directory that transformers 5 wrote (vLLM <= 0.9 pins transformers < 4.54).

    transformers 5 writes `rope_parameters` and `dtype` and names the tokenizer class TokenizersBackend;
    transformers 4 reads that as no rope_theta (silently its default 10000, not the model's) and an unknown
    tokenizer class. The legacy keys go beside the new ones, which transformers 5 reads unchanged."""
    cfg_path, tok_path = directory / "config.json", directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if tok_path.exists():
        tok = json.loads(tok_path.read_text())
        if tok.get("tokenizer_class") == "TokenizersBackend":
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
            tok_path.write_text(json.dumps(tok, indent=2) + "\n")


class DraftModel(nn.Module):
    """A causal LM wrapped for the trainer: forward gives its post-final-norm hidden states as one
    "head" [1, B, T, D], `head_weights` its lm head, so the shared fused loss computes its logits."""

    def __init__(self, lm, tokenizer):
        super().__init__()
        self.lm = lm
        self.tokenizer = tokenizer

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask=None) -> torch.Tensor:
        out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.last_hidden_state[None]

    def head_weights(self) -> torch.Tensor:
        return self.lm.get_output_embeddings().weight

    def save_pretrained(self, out_dir: str | Path) -> None:
        """A plain HF causal-LM directory (one safetensors file, config, tokenizer), written atomically,
        readable by transformers 4 and 5 (vLLM <= 0.9 and later)."""

        def write(tmp: Path):
            self.lm.save_pretrained(tmp, max_shard_size="1000GB")
            self.tokenizer.save_pretrained(tmp)
            add_transformers4_keys(tmp)

        atomic_write_dir(Path(out_dir), write)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Weights from a directory this class saved (a tied lm head is stored once, as the embedding)."""
        missing, unexpected = self.lm.load_state_dict(tensors, strict=False)
        tied = set(getattr(self.lm, "_tied_weights_keys", None) or {}) if self.lm.config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise CheckpointError(f"draft checkpoint does not fit the model: missing {sorted(set(missing) - tied)[:4]}, "
                                  f"unexpected {sorted(unexpected)[:4]}")


def build_draft(cfg, target: Target) -> DraftModel:
    """The recipe's initial draft, in fp32, checked against the target's vocabulary."""
    from transformers import AutoModelForCausalLM

    tcfg = target.model.config
    tokenizer = target.tokenizer
    if cfg.draft_init == "layers":
        n = tcfg.num_hidden_layers
        layers = list(cfg.draft_layers)
        if not layers or any(not isinstance(i, int) or not 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"draft_layers={layers!r}: give distinct layer indices of the target's 0..{n - 1}")
        dcfg = copy.deepcopy(tcfg)
        dcfg.num_hidden_layers = len(layers)
        if getattr(dcfg, "layer_types", None):  # per-layer attention kinds (Qwen2 sliding windows) follow their layer
            dcfg.layer_types = [dcfg.layer_types[i] for i in layers]
        lm = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
        src = target.model.state_dict()
        # draft layer j is target layer layers[j]; every other tensor (embeddings, norm, lm head) is shared.
        # A sharded target's layer tensors are gathered one by one, in the same order in every process.
        lm.load_state_dict({name: whole(src[_LAYER.sub(lambda m: f".layers.{layers[int(m.group(1))]}.", name, count=1)])
                            for name in lm.state_dict()})
    elif cfg.draft_init == "model":
        if not cfg.draft_model:
            raise ConfigError("draft_init=model needs draft_model (an alias, model directory or .gguf file)")
        lm, tokenizer = load_causal_lm(cfg.draft_model, torch.float32)
        if getattr(lm, "hf_quantizer", None) is not None:  # GGUF: already dequantized; drop the flag so it saves
            lm.hf_quantizer.remove_quantization_config(lm)
    else:
        dcfg = copy.deepcopy(tcfg)
        for key, value in cfg.draft_config.items():
            if not hasattr(dcfg, key):
                raise ConfigError(f"draft_config: the target's config has no key {key!r}")
            setattr(dcfg, key, value)
        torch.manual_seed(cfg.seed)
        lm = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    check_vocab(lm.get_output_embeddings().weight.shape[0], tokenizer, target.vocab_size, target.tokenizer)
    lm.config.speculators_target = {"name": target.name, "architecture": target.architecture,
                                    "vocab_size": target.vocab_size}
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return DraftModel(lm.float().train(), tokenizer)


def is_draft_checkpoint(path: Path) -> bool:
    """A plain HF causal-LM directory (what the trainer writes for kind: draft_model)."""
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return any(a.endswith("ForCausalLM") for a in config.get("architectures") or [])


def load_draft(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a draft checkpoint or export; refuses pickles (only safetensors are read)."""
    path = Path(path)
    if not (path / WEIGHTS_NAME).exists() and not (path / "model.safetensors.index.json").exists():
        raise CheckpointError(f"{path} has no {WEIGHTS_NAME}; drafts are read from safetensors only")
    if (path / WEIGHTS_NAME).exists():
        read_safetensors(path / WEIGHTS_NAME)  # a truncated file fails here in one line, not deep in transformers
    model, tokenizer = load_causal_lm(str(path), dtype)
    return model.eval(), tokenizer


def check_draft_against_target(model, tokenizer, target: str) -> dict:
    """The export-time check: the draft's vocabulary and tokenizer against the target's files."""
    from transformers import AutoConfig, AutoTokenizer

    path, gguf = resolve_model_path(target)
    kwargs = {"gguf_file": gguf} if gguf else {}
    tcfg = AutoConfig.from_pretrained(path, **kwargs).get_text_config()
    ttok = AutoTokenizer.from_pretrained(path, **kwargs)
    try:
        check_vocab(model.get_output_embeddings().weight.shape[0], tokenizer, tcfg.vocab_size, ttok)
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
    return {"architecture": (tcfg.architectures or ["?"])[0], "vocab_size": tcfg.vocab_size}
