"""The frozen target model: any HF causal LM (Hub id, local directory or GGUF file).

The speculators read the target's *post-final-norm* hidden state (what feeds its
lm_head), so `Target` exposes the decoder body and the lm_head separately.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .assets import CHUNKED_MODELS, DEFAULT_TARGET, AssetError, chunked_model_dir, default_target_dir

# Offline by default: nothing here reaches the Hub unless the user says HF_HUB_OFFLINE=0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def resolve_model_path(name: str) -> tuple[str, str | None]:
    """(directory or Hub id, gguf file name or None) for a user-given model name."""
    if name == DEFAULT_TARGET:
        return str(default_target_dir()), None
    if name in CHUNKED_MODELS:
        return str(chunked_model_dir(name)), None
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise AssetError(f"GGUF file not found: {path}")
        return str(path.parent), path.name
    if path.exists():
        if not (path / "config.json").exists():
            raise AssetError(f"{path} is not a model directory (no config.json)")
        return str(path), None
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise AssetError(f"model not found: {name} (give a model directory, a .gguf file or a Hub id)")
    if os.environ.get("HF_HUB_OFFLINE", "1") not in ("0", "false", "False"):
        raise AssetError(
            f"model {name!r} is not a local path and the Hub is offline "
            f"(set HF_HUB_OFFLINE=0 to download it, or pass a local directory or .gguf file)"
        )
    return name, None


def load_causal_lm(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for a causal LM given by alias, directory, GGUF file or Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor bar for a 1-second load is noise
    path, gguf = resolve_model_path(name)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if gguf else dtype, **kwargs)
    except OSError as err:
        raise AssetError(f"could not load model {name!r}: {str(err).splitlines()[0]}") from None
    if gguf:
        model = model.to(dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def convert_gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint once into an ordinary safetensors model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".part")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained until its quantization config is dropped;
    # the weights are already dequantized floats.
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out_dir)


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B, T, D] post-final-norm hidden states
    logits: torch.Tensor | None  # [B, T, V] or None when not requested
    past_key_values: object = None


class Target(nn.Module):
    """A frozen causal LM split into decoder body and lm_head."""

    def __init__(self, model, tokenizer, name: str = ""):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.body = model.get_decoder()
        self.lm_head = model.get_output_embeddings()

    @classmethod
    def load(cls, name: str, dtype: torch.dtype = torch.float32) -> "Target":
        model, tokenizer = load_causal_lm(name, dtype)
        return cls(model, tokenizer, name)

    def shard_layers(self, device: torch.device, world: int) -> tuple[int, int]:
        """FSDP2: shard every decoder layer (the classes the model names in _no_split_modules, as HF's
        own FSDP auto-wrap does) across the `world` processes of the initialized process group, moving
        the shards to `device`. The embeddings, final norm and lm head stay whole: the loss reads the
        lm head's weight outside any forward, and they are a small part of a large model. Every process
        must then run the same sequence of target forwards. Returns (elements of the layers held by this
        process, elements of the layers in all)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        names = set(getattr(self.model, "_no_split_modules", None) or [])
        layers = [m for m in self.body.modules() if type(m).__name__ in names]
        if not layers:
            raise ValueError(f"{self.architecture} names no decoder layer class to shard (_no_split_modules)")
        total = sum(p.numel() for m in layers for p in m.parameters())
        mesh = init_device_mesh(device.type, (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        local = sum(p.to_local().numel() for m in layers for p in m.parameters())
        self.to(device)
        return local, total

    @property
    def hidden_size(self) -> int:
        return self.lm_head.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def architecture(self) -> str:
        return (self.model.config.architectures or [type(self.model).__name__])[0]

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, *, logits=True, past_key_values=None, use_cache=False,
                position_ids=None) -> TargetOutput:
        out = self.body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        return TargetOutput(hidden, self.lm_head(hidden).float() if logits else None, out.past_key_values)
