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


def check_causal_lm(config, name: str) -> None:
    """Refuse a model that is not a causal LM. AutoModelForCausalLM would load some encoders anyway
    (a BERT masked-LM directory becomes a BertLMHeadModel with its weights), and training against
    one runs to the end and exports a speculator for a model that does not generate."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )

    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    if archs:
        causal = not set(archs).isdisjoint(CAUSAL.values())
    else:  # no class recorded: the model type decides; an encoder type must be configured as a decoder
        causal = model_type in CAUSAL and (model_type not in MASKED or getattr(config, "is_decoder", False))
    if not causal:
        what = archs[0] if archs else f"{model_type!r} model"
        raise AssetError(f"{name} is a {what}, not a causal language model; the target (or draft) must be a "
                         f"decoder-only causal LM, such as a LlamaForCausalLM")


def model_config(name: str):
    """The transformers config of a model given by alias, directory, GGUF file or Hub id, checked to
    be a causal LM; reads no weights."""
    path, gguf = resolve_model_path(name)  # a missing model is refused before transformers is imported
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as err:
        raise AssetError(f"could not read the config of model {name!r}: {str(err).splitlines()[0]}") from None
    check_causal_lm(config, name)
    return config


def context_window(config) -> int | None:
    """The most positions the model was built for (max_position_embeddings), where its config says."""
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def check_fits(window: int | None, n_prompt: int, max_new_tokens: int, what: str) -> None:
    """Refuse a prompt that, with the tokens to generate, runs past the model's window: beyond
    max_position_embeddings a model computes positions it was never trained on, without a warning."""
    if window and n_prompt + max_new_tokens > window:
        raise ValueError(f"{what} is {n_prompt} tokens, {n_prompt + max_new_tokens} with the {max_new_tokens} to "
                         f"generate: past the target's window of {window} tokens (max_position_embeddings); "
                         f"shorten the prompt or generate fewer tokens (--max-new-tokens)")


def load_causal_lm(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for a causal LM given by alias, directory, GGUF file or Hub id."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor bar for a 1-second load is noise
    config = model_config(name)  # read once (a GGUF file's takes seconds), checked, and used for the model
    path, gguf = resolve_model_path(name)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = load_tokenizer(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32 if gguf else dtype,
                                                     **kwargs)
    except OSError as err:
        raise AssetError(f"could not load model {name!r}: {str(err).splitlines()[0]}") from None
    if gguf:
        model = model.to(dtype)
    return model, tokenizer


def model_tokenizer(name: str):
    """The tokenizer of a model given by alias, directory, GGUF file or Hub id, without its weights."""
    path, gguf = resolve_model_path(name)
    try:
        return load_tokenizer(path, **({"gguf_file": gguf} if gguf else {}))
    except OSError as err:
        raise AssetError(f"could not load the tokenizer of model {name!r}: {str(err).splitlines()[0]}") from None


def load_tokenizer(path: str, **kwargs):
    """A model's tokenizer, padding with EOS where it names no pad token (batches need one)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor in full: a sharded one (a DTensor of a sharded target) is all-gathered, a collective that
    every process must call in the same order."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _read_into(param: torch.Tensor, checkpoint, key: str) -> None:
    """Copy checkpoint tensor `key` (an open safetensors file) into `param`, reading only this process's
    rows of a sharded one (FSDP2 shards dim 0 as torch.chunk does)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        param.copy_(checkpoint.get_tensor(key).to(param.device, param.dtype))
        return
    mesh = param.device_mesh
    rows = -(-param.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * rows, param.shape[0])
    local = checkpoint.get_slice(key)[start:start + rows].to(param.to_local().device, param.dtype)
    param.copy_(DTensor.from_local(local, mesh, param.placements, run_check=False, shape=param.shape,
                                   stride=param.stride()))


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
        self.layers_released = False

    @classmethod
    def load(cls, name: str, dtype: torch.dtype = torch.float32) -> "Target":
        model, tokenizer = load_causal_lm(name, dtype)
        return cls(model, tokenizer, name)

    @classmethod
    def load_sharded(cls, name: str, dtype: torch.dtype, device: torch.device, world: int) -> "Target":
        """FSDP2 without the whole model in any process: the model is built with its parameters on the
        meta device, every decoder layer (the classes the model names in _no_split_modules, as HF's own
        FSDP auto-wrap picks them) is sharded across the `world` processes of the initialized process
        group, and each process then reads the checkpoint one tensor at a time, keeping only its own
        rows of a layer's tensors. The embeddings, final norm and lm head stay whole: the loss reads the
        lm head's weight outside any forward. Every process must then run the same target forwards."""
        from accelerate import init_empty_weights
        from safetensors import safe_open
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        path, gguf = resolve_model_path(name)
        if gguf:
            raise AssetError(f"shard_target reads a safetensors checkpoint tensor by tensor, not the GGUF file {name}; "
                             f"save the dequantized model with save_pretrained and give its directory")
        if not Path(path).is_dir():  # a Hub id, the Hub being online: its files, not the whole model in memory
            from huggingface_hub import snapshot_download
            path = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise AssetError(f"{path} has no .safetensors weights; shard_target loads only those")
        config = AutoConfig.from_pretrained(path)
        check_causal_lm(config, name)
        with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) real
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)  # its EOS ids stop generation
        except OSError:
            pass
        target = cls(model, load_tokenizer(path), name)
        layers = target.decoder_layers()
        if not layers:
            raise AssetError(f"{target.architecture} names no decoder layer class to shard (_no_split_modules)")
        mesh = init_device_mesh(device.type, (world,))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
            # FSDP keeps a root module's parameters gathered after its forward (training would gather
            # them again at once for the backward). Here every layer is a root and no backward comes,
            # so each is resharded as soon as it has run: one gathered layer at a time.
            layer.register_forward_hook(lambda module, args, output: module.reshard())
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        model.to_empty(device=device)  # memory for this process's shards and the whole small parts
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
            if config.get_text_config().tie_word_embeddings:
                model.tie_weights()  # to_empty gave the lm head its own storage
            params = dict(model.named_parameters())
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for key in f.keys() & params.keys():
                        _read_into(params.pop(key), f, key)
        if params:
            raise AssetError(f"{path}: the checkpoint has no tensor for {sorted(params)[:3]}; shard_target loads "
                             f"tensors by the model's parameter names")
        return target

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers: the classes the model names in _no_split_modules (HF's FSDP auto-wrap unit)."""
        names = set(getattr(self.model, "_no_split_modules", None) or [])  # fully_shard subclasses them: see the MRO
        return [m for m in self.body.modules() if any(c.__name__ in names for c in type(m).__mro__)]

    def release_layers(self) -> None:
        """Frees the decoder layers' weights (85% of Qwen2.5-1.5B's), keeping the embeddings and the lm
        head: a cache_hidden run whose stages all read the data set needs nothing else once it has cached."""
        for layer in self.decoder_layers():
            layer.to("meta")
        # A checkpoint stored in the target's dtype loads as views of the memory-mapped file, which stays
        # mapped (and resident) while any view lives: own copies of the kept tensors let it go.
        with torch.no_grad():
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                if not tensor.is_meta:
                    tensor.data = tensor.data.clone()
        self.layers_released = True

    def layer_parameters(self) -> tuple[int, int]:
        """(decoder-layer parameter elements this process holds, elements in all): equal unless sharded."""
        from torch.distributed.tensor import DTensor

        params = [p for layer in self.decoder_layers() for p in layer.parameters()]
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        return local, sum(p.numel() for p in params)

    @property
    def hidden_size(self) -> int:
        return self.lm_head.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def window(self) -> int | None:
        return context_window(self.model.config)

    @property
    def architecture(self) -> str:
        return (self.model.config.architectures or [type(self.model).__name__])[0]

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, *, logits=True, past_key_values=None, use_cache=False,
                position_ids=None) -> TargetOutput:
        if self.layers_released:
            raise RuntimeError("the target's decoder layers were released after caching its hidden states; "
                               "reload the target to run it")
        out = self.body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        return TargetOutput(hidden, self.lm_head(hidden).float() if logits else None, out.past_key_values)
