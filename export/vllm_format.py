"""`speculators export`: a checked checkpoint in vLLM's `mlp_speculator` / `medusa` layout, or a
draft model as a plain HF causal-LM directory (vLLM's `draft_model` method), with a model card that
says how to load it in each vLLM version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from speculators.models import MODEL_TYPES
from speculators.models.base import CONFIG_NAME, CheckpointError, atomic_write_dir, unfinished_writes
from speculators.draft import DraftModel, check_draft_against_target, is_draft_checkpoint, load_draft
from speculators.target import model_config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_checkpoint(path: str | Path) -> Path:
    """A model directory, or a training run directory (its `final/`, else its latest checkpoint)."""
    path = Path(path)
    if (path / CONFIG_NAME).exists():
        return path
    if (path / "final" / CONFIG_NAME).exists():
        return path / "final"
    latest = path / "checkpoints" / "latest"
    if latest.exists():
        return path / "checkpoints" / latest.read_text().strip() / "model"
    raise CheckpointError(f"no checkpoint at {path} (expected a config.json, a final/ or checkpoints/latest)")


def load_speculator(path: str | Path, allow_pickle: bool = False):
    path = find_checkpoint(path)
    try:
        model_type = json.loads((path / CONFIG_NAME).read_text()).get("model_type")
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path / CONFIG_NAME} is not valid JSON ({err})") from None
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{path}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type].from_pretrained(path, allow_pickle=allow_pickle)


def check_against_target(model, target: str) -> dict:
    """Vocab, hidden size and architecture of the checkpoint against the target's config."""
    tcfg = model_config(target).get_text_config()
    c = model.config
    hidden = c.emb_dim if hasattr(c, "emb_dim") else c.hidden_size
    if c.vocab_size != tcfg.vocab_size:
        raise CheckpointError(f"vocab size {c.vocab_size} does not fit the target's {tcfg.vocab_size}; "
                              f"train the speculator for this target")
    if hidden != tcfg.hidden_size:
        raise CheckpointError(f"hidden size {hidden} does not fit the target's {tcfg.hidden_size}; "
                              f"train the speculator for this target")
    arch = (tcfg.architectures or ["?"])[0]
    recorded = c.speculators_target.get("architecture")
    if recorded and recorded != arch:
        raise CheckpointError(f"the checkpoint was trained for a {recorded} but the target is a {arch}")
    return {"architecture": arch, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size}


def export(ckpt: str | Path, out: str | Path, target: str | None = None, force: bool = False,
           dtype: str | None = None, allow_pickle: bool = False) -> Path:
    out = Path(out)
    # The export replaces `out` whole, with what interrupted writes left beside it (atomic_write_dir):
    # never over the checkpoint being exported or a training run.
    if out.exists():
        source = find_checkpoint(ckpt).resolve()
        if out.resolve() in (source, *source.parents):
            raise CheckpointError(f"{out} holds the checkpoint being exported; choose another --out")
    run = next((d for top in (out, *unfinished_writes(out)) for d, dirs, files in os.walk(top)
                if "checkpoints" in dirs or "history.jsonl" in files), None)
    if run is not None:
        raise CheckpointError(f"exporting to {out} would delete the training run in {run}; choose another --out")
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} is not empty; pass --force to replace it")
    if is_draft_checkpoint(find_checkpoint(ckpt)):
        return export_draft(find_checkpoint(ckpt), out, target, dtype)
    model = load_speculator(ckpt, allow_pickle)
    target = target or model.config.speculators_target.get("name")
    if not target:
        raise CheckpointError("the checkpoint does not record its target; pass --target")
    check_against_target(model, target)
    if dtype:
        model = model.to(DTYPES[dtype])

    return _write_export(out, model.save_pretrained, model_card(model, target, out))


def _write_export(out: Path, save_pretrained, card: str) -> Path:
    """save_pretrained's files plus the model card, into `out` atomically. save_pretrained writes
    its own directory atomically, so it gets a subdirectory whose files are then moved up."""

    def write(tmp: Path):
        save_pretrained(tmp / "model")
        for f in (tmp / "model").iterdir():
            f.rename(tmp / f.name)
        (tmp / "model").rmdir()
        (tmp / "README.md").write_text(card)

    atomic_write_dir(out, write)
    return out


def model_card(model, target: str, out: Path) -> str:
    c = model.config
    kind = c.MODEL_TYPE
    k = c.n_predict if kind == "mlp_speculator" else c.num_heads
    d = str(out)
    lines = [
        f"# {kind} speculator for {target}",
        "",
        f"Trained with `speculators`. {k} heads; target architecture {c.speculators_target.get('architecture')}, "
        f"vocab {c.vocab_size}.",
        "",
        "## Load it in vLLM",
        "",
        "| vLLM | how |",
        "|---|---|",
        f"| ≤ 0.8.1 (V0) | `LLM(model=TARGET, speculative_model=\"{d}\", num_speculative_tokens={k})` "
        f"/ `--speculative-model {d} --num-speculative-tokens {k}` |",
        f"| 0.8.2 – 0.9.2 | `LLM(model=TARGET, speculative_config={{\"model\": \"{d}\", \"num_speculative_tokens\": {k}}})` |",
    ]
    if kind == "medusa":
        lines.append(f"| 0.10 – 0.32 | `speculative_config={{\"method\": \"medusa\", \"model\": \"{d}\", "
                     f"\"num_speculative_tokens\": {k}}}` (native) |")
    else:
        lines.append("| 0.10 – 0.32 | not routed natively: V1 has no `mlp_speculator` method |")
    lines += [
        f"| 0.33 | not loadable natively: vLLM 0.33 removed {'Medusa' if kind == 'medusa' else 'MLP speculators'} |",
        "",
        "The input is the target's post-final-norm hidden state; drafts are a top-1 chain.",
        "",
    ]
    return "\n".join(lines)


def export_draft(path: Path, out: Path, target: str | None, dtype: str | None) -> Path:
    """The draft as a plain HF causal-LM directory (safetensors, config, tokenizer) plus a model card."""
    model, tokenizer = load_draft(path)
    target = target or (getattr(model.config, "speculators_target", None) or {}).get("name")
    if not target:
        raise CheckpointError("the checkpoint does not record its target; pass --target")
    check_draft_against_target(model, tokenizer, target)
    if dtype:
        model = model.to(DTYPES[dtype])

    return _write_export(out, DraftModel(model, tokenizer).save_pretrained, draft_model_card(model, target, out))


def draft_model_card(model, target: str, out: Path, k: int = 4) -> str:
    c, d = model.config, str(out)
    return "\n".join([
        f"# Draft model for {target}",
        "",
        f"Distilled with `speculators` (DistillSpec): a {c.architectures[0]} with {c.num_hidden_layers} layers and "
        f"the target's vocabulary ({c.vocab_size}). vLLM uses the target's tokenizer; the draft's tensor-parallel size "
        "must be 1 or the target's, and its max_model_len caps the target's.",
        "",
        f"## Load it in vLLM (k = {k} shown; any k works)",
        "",
        "| vLLM | how |",
        "|---|---|",
        f"| ≤ 0.8.1 (V0) | `LLM(model=TARGET, speculative_model=\"{d}\", num_speculative_tokens={k})` "
        f"/ `--speculative-model {d} --num-speculative-tokens {k}` |",
        f"| 0.8.2 – 0.9.2 | `LLM(model=TARGET, speculative_config={{\"model\": \"{d}\", \"num_speculative_tokens\": {k}}})` |",
        f"| 0.10 – 0.33 | `LLM(model=TARGET, speculative_config={{\"method\": \"draft_model\", \"model\": \"{d}\", "
        f"\"num_speculative_tokens\": {k}}})` / `--speculative-config '{{\"method\": \"draft_model\", \"model\": \"{d}\", "
        f"\"num_speculative_tokens\": {k}}}'` |",
        "",
        "Pass `\"method\": \"draft_model\"` explicitly: vLLM 0.33 guesses the method from the directory name.",
        "",
    ])
