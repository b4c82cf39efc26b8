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
    with torch.no_grad():
        cold = torch.ones(V, dtype=torch.bool)
        cold[live] = False
        m.head_weight[:, cold] = 0
    m = m.double()
    assert torch.equal(m.draft_vocab(), live)
    assert (m.signed_readout() is not None) == signed
    assert len(m.proposal_vocab()) == len(live) + max(m.config.top_k_tokens_per_head)
    h, tok = torch.randn(64, D, dtype=torch.float64), torch.randint(0, V, (64,))
    drafts = m.propose(h, tok, 3)
    assert torch.equal(drafts, reference_mlp(m.vllm_state_dict(), m.config, h, tok, 3))
    assert bool(torch.isin(drafts, live).any()) and not bool(torch.isin(drafts, live).all())  # both cases ran
    assert set(drafts[~torch.isin(drafts, live)].tolist()) == {0}  # the lowest-id zero row
