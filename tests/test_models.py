"""The proposers compute exactly what vLLM's loaders compute, under exactly vLLM's tensor names."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from speculators.models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig

V, D, INNER = 97, 24, 32


def mlp(tie=False, scale=False, inner=INNER, n=3):
    torch.manual_seed(0)
    return MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, inner_dim=inner, n_predict=n, tie_weights=tie,
                                             scale_input=scale))


def test_mlp_names_and_shapes_untied(tmp_path):
    m = mlp()
    m.save_pretrained(tmp_path)
    shapes = {k: tuple(v.shape) for k, v in load_file(tmp_path / "model.safetensors").items()}
    expected = {}
    for i in range(3):
        expected[f"emb.{i}.weight"] = (V, INNER)
        expected[f"proj.{i}.weight"] = (INNER, D if i == 0 else INNER)
        expected[f"ln.{i}.weight"] = (INNER,)
        expected[f"ln.{i}.bias"] = (INNER,)
        expected[f"head.{i}.weight"] = (V, INNER)
    assert shapes == expected
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["MLPSpeculatorPreTrainedModel"] and cfg["model_type"] == "mlp_speculator"
    assert (cfg["vocab_size"], cfg["emb_dim"], cfg["inner_dim"], cfg["n_predict"]) == (V, D, INNER, 3)
    assert len(cfg["top_k_tokens_per_head"]) == 3 and cfg["tie_weights"] is False


def test_mlp_names_tied(tmp_path):
    m = mlp(tie=True, n=4)
    m.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == {"emb.0.weight", "proj.0.weight", "proj.1.weight", "ln.0.weight", "ln.0.bias", "head.0.weight"}


def reference_mlp(sd, cfg, h, tok, k):
    """vLLM's MLP-speculator math, written out from the format description."""
    n = cfg.n_predict
    state_w = 0.5 ** (0.5 / n)
    emb_w = math.sqrt((1 - state_w**2) * (cfg.inner_dim / 2))
    idx = (lambda i: 0) if cfg.tie_weights else (lambda i: i)
    if cfg.scale_input:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    out = []
    for i in range(k):
        p = min(i, 1) if cfg.tie_weights else i
        s = h @ sd[f"proj.{p}.weight"].T + sd[f"emb.{idx(i)}.weight"][tok] * (emb_w / state_w)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * sd[f"ln.{idx(i)}.weight"] + sd[f"ln.{idx(i)}.bias"]
        s = 0.5 * s * (1 + torch.erf(s / math.sqrt(2)))  # exact GELU
        tok = (s @ sd[f"head.{idx(i)}.weight"].T).argmax(-1)
        out.append(tok)
        h = s
    return torch.stack(out, 1)


@pytest.mark.parametrize("tie,scale", [(False, False), (True, True), (False, True)])
def test_mlp_matches_vllm_math(tie, scale):
    m = mlp(tie=tie, scale=scale)
    with torch.no_grad():
        for ln in m.ln:
            ln.weight.normal_()
            ln.bias.normal_()
    h, tok = torch.randn(5, D), torch.randint(0, V, (5,))
    ref = reference_mlp({k: v.double() for k, v in m.vllm_state_dict().items()}, m.config, h.double(), tok, 3)
    assert torch.equal(m.propose(h, tok, 3), ref)


def test_mlp_training_states_are_teacher_forced():
    m = mlp()
    h, ids = torch.randn(2, 7, D), torch.randint(0, V, (2, 7))
    states = m(h, ids)
    assert states.shape == (3, 2, 7, INNER)
    # stage 1 at position t reads stage 0's state at t and token t+2
    s1 = m.step(1, states[0][:, 2], ids[:, 2 + 2])
    torch.testing.assert_close(states[1][:, 2], s1)


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_names_shapes_and_math(tmp_path, shared):
    torch.manual_seed(0)
    m = Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3, num_hidden_layers=2, original_lm_head=shared))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    expected = {f"blocks.{h}.layers.{l}.{w}": (D, D) if w == "weight" else (D,)
                for h in range(3) for l in range(2) for w in ("weight", "bias")}
    expected.update({"lm_head.weight": (V, D)} if shared else {f"lm_heads.{h}.weight": (V, D) for h in range(3)})
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert cfg["medusa_fc_bias"] is True and cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == 2
    assert cfg["original_lm_head"] is shared and cfg["truncated_vocab_size"] == V
    # vLLM renames any key with "num" and "heads"/"layers": only the two intended ones may exist
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    h = torch.randn(4, D)
    for head in range(3):
        x = h
        for l in range(2):
            x = x + F.silu(x @ sd[f"blocks.{head}.layers.{l}.weight"].T + sd[f"blocks.{head}.layers.{l}.bias"])
        w = sd["lm_head.weight"] if shared else sd[f"lm_heads.{head}.weight"]
        assert torch.equal(m.propose(h, None, 3)[:, head], (x @ w.T).argmax(-1))


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_draft_vocab_proposes_as_vllm_reads_the_full_heads(shared):
    """Medusa heads kept to a draft vocabulary propose from those rows plus the lowest-id zero rows only,
    yet give the full stored heads' argmax chain and top-k tree tokens, zero rows winning included."""
    from speculators.kernels.medusa_proposal import medusa_propose_reference

    torch.manual_seed(5)
    m = Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3, original_lm_head=shared))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    live = torch.tensor([5, 17, 60])
    m.keep_vocab_(live)
    m = m.double()
    assert torch.equal(m.draft_vocab(), live)
    assert len(m.proposal_vocab()) == len(live) + m.widest_topk()
    h = torch.randn(64, D, dtype=torch.float64)
    sd = m.vllm_state_dict()
    blocks = torch.stack([torch.stack([sd[f"blocks.{i}.layers.0.weight"]]) for i in range(3)])
    bias = torch.stack([torch.stack([sd[f"blocks.{i}.layers.0.bias"]]) for i in range(3)])
    full = sd["lm_head.weight"] if shared else torch.stack([sd[f"lm_heads.{i}.weight"] for i in range(3)])
    _, topk = medusa_propose_reference(h, blocks, bias, full, m.widest_topk())
    chain = m.propose(h, None, 3)
    assert torch.equal(chain, topk[:, :, 0])
    assert not torch.isin(chain, live).all()  # some rows' drafts are zero rows, as in vLLM
    tree = m.propose_tree(h, torch.zeros(64, dtype=torch.long), 3)
    from speculators.kernels.tree import medusa_tree, medusa_tree_tokens
    from speculators.models.medusa import DEFAULT_CHOICES

    t = medusa_tree([c for c in DEFAULT_CHOICES if len(c) <= 3], h.device)
    assert torch.equal(tree.tree_tokens, medusa_tree_tokens(t, torch.zeros(64, dtype=torch.long), topk))


@pytest.mark.parametrize("make", [lambda: mlp(), lambda: mlp(tie=True),
                                  lambda: Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=2))])
def test_round_trip(tmp_path, make):
    m = make()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(tmp_path)
    back = type(m).from_pretrained(tmp_path)
    assert back.config == m.config
    for (k, a), (_, b) in zip(m.vllm_state_dict().items(), back.vllm_state_dict().items()):
        assert torch.equal(a, b), k
    h = torch.randn(3, D)
    assert torch.equal(m.propose(h, torch.tensor([1, 2, 3]), 2), back.propose(h, torch.tensor([1, 2, 3]), 2))


@pytest.mark.parametrize("tie", [True, False])
def test_mlp_regression_init_is_the_linear_predictor(tie):
    """After init_regression every stage computes scale * normalise(A·state + t[tok]) and reads it out
    through the target's head W: the signed [p; -p] construction is exact, not approximate."""
    m = MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, inner_dim=2 * D, n_predict=3, tie_weights=tie))
    torch.manual_seed(1)
    A, tv, W = torch.randn(D, D) / D**0.5, torch.randn(V, D), torch.randn(V, D)
    m.init_regression(A, tv, W, scale=1.7)
    h, tok = torch.randn(6, D), torch.randint(0, V, (6,))
    expected, x, t = [], h, tok
    for _ in range(3):
        p = x @ A.T + tv[t]
        x = 1.7 * p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6)
        t = (x @ W.T).argmax(-1)
        expected.append(t)
    assert torch.equal(m.propose(h, tok, 3), torch.stack(expected, 1))
    states = m(h[None], torch.cat([tok[:1], tok[:-1]])[None])  # stage 0 at position 0 reads ids[1] = tok[0]
    folded = states[0, 0, 0, :D] - states[0, 0, 0, D:]
    p = h[0] @ A.T + tv[tok[0]]
    torch.testing.assert_close(folded, 1.7 * p * torch.rsqrt(p.pow(2).mean() + 1e-6), rtol=1e-4, atol=1e-4)


def test_mlp_regression_init_needs_the_signed_width():
    with pytest.raises(ValueError, match="inner_dim = 2"):
        mlp(inner=INNER).init_regression(torch.eye(D), torch.zeros(V, D), torch.zeros(V, D), 1.0)


@pytest.mark.parametrize("tie", [True, False])
def test_mlp_signed_head_readout_equals_the_stored_heads(tie):
    """A head stored as [W, -W] is read out as W·(s[:D] - s[D:]): the same drafts as vLLM's math on the
    full stored head, and the shortcut is dropped as soon as the head stops being signed."""
    m = MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, inner_dim=2 * D, n_predict=3, tie_weights=tie))
    torch.manual_seed(2)
    m.init_regression(torch.randn(D, D) / D**0.5, torch.randn(V, D), torch.randn(V, D), scale=1.3)
    m = m.double()
    h, tok = torch.randn(7, D, dtype=torch.float64), torch.randint(0, V, (7,))
    assert m.signed_readout() is not None and m.signed_readout()[0].shape == (V, D)
    full = reference_mlp(m.vllm_state_dict(), m.config, h, tok, 3)
    assert torch.equal(m.propose(h, tok, 3), full)
    with torch.no_grad():
        m.head_weight[..., 0] += 1.0  # in place: the next call sees a new tensor version
    assert m.signed_readout() is None
    assert torch.equal(m.propose(h, tok, 3), reference_mlp(m.vllm_state_dict(), m.config, h, tok, 3))


@pytest.mark.parametrize("signed", [True, False])
def test_mlp_draft_vocab_proposes_as_vllm_reads_the_full_heads(signed):
    """Heads trained on a draft vocabulary (every other row zero) are proposed from those rows plus the
    lowest-id zero rows only, yet give vLLM's drafts on the full stored heads — including rows where
    every draft-vocabulary logit is negative and a zero row wins the argmax."""
    if signed:
        m = MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, inner_dim=2 * D, n_predict=3))
        torch.manual_seed(4)
        m.init_regression(torch.randn(D, D) / D**0.5, torch.randn(V, D), torch.randn(V, D), scale=1.3)
    else:
        m = mlp()
    live = torch.tensor([5, 17, 60])
    m.keep_vocab_(live)
    m = m.double()
    assert torch.equal(m.draft_vocab(), live)
    assert (m.signed_readout() is not None) == signed
    assert len(m.proposal_vocab()) == len(live) + max(m.config.top_k_tokens_per_head)
    h, tok = torch.randn(64, D, dtype=torch.float64), torch.randint(0, V, (64,))
    drafts = m.propose(h, tok, 3)
    assert torch.equal(drafts, reference_mlp(m.vllm_state_dict(), m.config, h, tok, 3))
    assert bool(torch.isin(drafts, live).any()) and not bool(torch.isin(drafts, live).all())  # both cases ran
    assert set(drafts[~torch.isin(drafts, live)].tolist()) == {0}  # the lowest-id zero row


def draft_vocab_models():
    """An MLP speculator and Medusa heads (per-head and shared lm heads), each kept to a draft vocabulary."""
    torch.manual_seed(6)
    models = [mlp(), Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3)),
              Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3, original_lm_head=True))]
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.3)
        m.keep_vocab_(torch.tensor([60, 5, 17, 5, 90, 33]))  # unsorted, one repeat
    return models


@pytest.mark.parametrize("which", range(3))
def test_draft_vocab_is_saved_and_loaded(tmp_path, which):
    """The draft vocabulary is stored explicitly: config.json's speculators_draft_vocab_size and an int64
    draft_vocab_ids tensor (ascending) beside vLLM's tensors, whose names, shapes and values are those of
    the same heads saved without it; loading (from_pretrained, or load_weights as a resumed run does)
    gives it back."""
    from speculators.models.base import read_safetensors

    m = draft_vocab_models()[which]
    ids = torch.tensor([5, 17, 33, 60, 90])
    assert torch.equal(m.draft_vocab(), ids)
    m.save_pretrained(tmp_path / "ckpt")
    sd = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sd["draft_vocab_ids"].dtype == torch.int64 and torch.equal(sd.pop("draft_vocab_ids"), ids)
    vllm = m.vllm_state_dict()
    assert set(sd) == set(vllm) and all(torch.equal(sd[k], vllm[k]) for k in sd)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg.pop("speculators_draft_vocab_size") == 5
    fresh = type(m)(type(m.config)(**{**m.config.__dict__, "speculators_draft_vocab_size": 0}))
    fresh_cfg = fresh.config.to_json()
    assert fresh.draft_vocab() is None and fresh_cfg.pop("speculators_draft_vocab_size") == 0 and cfg == fresh_cfg
    loaded = type(m).from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.draft_vocab(), ids) and loaded.config.speculators_draft_vocab_size == 5
    fresh.load_weights(read_safetensors(tmp_path / "ckpt" / "model.safetensors"))
    assert torch.equal(fresh.draft_vocab(), ids) and fresh.config.speculators_draft_vocab_size == 5
    h, tok = torch.randn(16, D), torch.randint(0, V, (16,))
    assert torch.equal(loaded.propose(h, tok, 3), m.propose(h, tok, 3))


@pytest.mark.parametrize("which", range(3))
def test_draft_vocab_proposals_equal_full_vocabulary_proposals(which):
    """Proposing from the draft vocabulary's rows gives exactly the chains (and Medusa's trees) of the
    same heads read in full (no draft vocabulary), whose other rows are zero. The MLP speculator's trees
    rank paths by log-probabilities normalized over the rows read, so they are left out here."""
    m = draft_vocab_models()[which].double()
    full = type(m)(m.config)
    full.load_state_dict(m.state_dict())  # the weights alone: the ids are not in state_dict
    full = full.double()
    assert full.draft_vocab() is None and m.proposal_vocab() is not None
    h, tok = torch.randn(64, D, dtype=torch.float64), torch.randint(0, V, (64,))
    for k in (1, 3):
        assert torch.equal(m.propose(h, tok, k), full.propose(h, tok, k))
    if isinstance(m, Medusa):
        a, b = m.propose_tree(h, tok), full.propose_tree(h, tok)
        assert torch.equal(a.tree_tokens, b.tree_tokens) and torch.equal(a.parents, b.parents)


def test_draft_vocab_of_a_checkpoint_without_ids_is_read_from_its_zero_rows(tmp_path):
    """A checkpoint that marks its draft vocabulary only by all-zero head rows gets it at load, and saves
    it explicitly from then on."""
    m = draft_vocab_models()[0]
    m.save_pretrained(tmp_path / "ckpt")
    sd = load_file(tmp_path / "ckpt" / "model.safetensors")
    del sd["draft_vocab_ids"]
    from safetensors.torch import save_file
    save_file(sd, str(tmp_path / "ckpt" / "model.safetensors"))
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del cfg["speculators_draft_vocab_size"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    loaded = MLPSpeculator.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(loaded.draft_vocab(), m.draft_vocab()) and loaded.config.speculators_draft_vocab_size == 5
    loaded.save_pretrained(tmp_path / "again")
    assert torch.equal(load_file(tmp_path / "again" / "model.safetensors")["draft_vocab_ids"], m.draft_vocab())
    assert MLPSpeculator.from_pretrained(tmp_path / "again").draft_vocab() is not None
    assert mlp().draft_vocab() is None  # heads without zero rows: the whole vocabulary


@pytest.mark.parametrize("damage, needle", [
    ("drop_ids", "lack the draft_vocab_ids"),
    ("size", "speculators_draft_vocab_size implies"),
    ("unsorted", "not ascending"),
    ("out_of_range", "not ascending"),
    ("live_row", "not zero"),
])
def test_inconsistent_draft_vocab_is_refused(tmp_path, damage, needle):
    from safetensors.torch import save_file

    from speculators.models.base import CheckpointError

    m = draft_vocab_models()[1]
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    if damage == "drop_ids":
        del sd["draft_vocab_ids"]
    elif damage == "size":
        sd["draft_vocab_ids"] = sd["draft_vocab_ids"][:4]
    elif damage == "unsorted":
        sd["draft_vocab_ids"] = sd["draft_vocab_ids"].flip(0)
    elif damage == "out_of_range":
        sd["draft_vocab_ids"][-1] = V
    else:
        sd["lm_heads.1.weight"][0, 0] = 1.0
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=needle):
        Medusa.from_pretrained(tmp_path)
