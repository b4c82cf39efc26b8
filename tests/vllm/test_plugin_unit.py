"""The vLLM plugin's own logic, without vLLM (main venv): recognising exports, the version gate, the
routing rewrite, and the proposer's choice of hidden-state rows against our engine's proposer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import speculators.vllm_plugin.versions as plugin
from speculators.proposers import HeadProposer, SamplingParams, StepInput
from speculators.models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig
from speculators.vllm_plugin import routing
from speculators.vllm_plugin.proposer import SpeculatorsProposer

V, D = 97, 32


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "mlp_speculator":
        return MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=3,
                                                 speculators_target={"name": "t"}))
    m = Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3, speculators_target={"name": "t"}))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.fixture(params=["mlp_speculator", "medusa"])
def export_dir(request, tmp_path):
    tiny(request.param).save_pretrained(tmp_path / request.param)
    return tmp_path / request.param


@pytest.fixture
def version(monkeypatch):
    def set_version(v):
        monkeypatch.setattr(plugin, "vllm_version", lambda: v)
    set_version("0.32.0")
    return set_version


def test_read_export_recognises_only_ours(export_dir, tmp_path):
    cfg = routing.read_export(str(export_dir))
    assert cfg["model_type"] in routing.KINDS and routing.num_heads(cfg) == 3
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    data = json.loads((export_dir / "config.json").read_text())
    data.pop("speculators_target")
    (foreign / "config.json").write_text(json.dumps(data))
    assert routing.read_export(str(foreign)) is None  # someone else's Medusa: vLLM's business
    assert routing.read_export("ngram") is None
    assert routing.read_export("my_pkg.MyProposer") is None
    assert routing.read_export(None) is None


@pytest.mark.parametrize("v,ok", [("0.32.0", True), ("0.32.3+cpu", True), ("0.33.1", True), ("0.31.2", False),
                                  ("0.34.0", False), ("1.0.0", False), ("dev", False)])
def test_version_gate(version, v, ok, monkeypatch):
    version(v)
    monkeypatch.delenv(plugin.ALLOW_UNTESTED_ENV, raising=False)
    if ok:
        assert plugin.check_vllm_version() == v
    else:
        with pytest.raises(plugin.UnsupportedVLLMVersion, match=r"0\.32\.x \(tested\) and 0\.33\.x"):
            plugin.check_vllm_version()
        monkeypatch.setenv(plugin.ALLOW_UNTESTED_ENV, "1")
        assert plugin.check_vllm_version() == v


def engine_args(**kw):
    base = dict(speculative_config=None, spec_method=None, spec_model=None, spec_tokens=None, additional_config={})
    return SimpleNamespace(**{**base, **kw})


def test_route_rewrites_our_export(export_dir, version):
    args = engine_args(speculative_config={"model": str(export_dir), "num-speculative-tokens": 2})
    assert routing.route_export(args) is True
    assert args.speculative_config == {"model": plugin.PROPOSER_CLASS, "method": "custom_class",
                                       "num_speculative_tokens": 2}
    assert args.additional_config["speculators"]["export_dir"] == str(export_dir.resolve())


def test_route_leaves_everything_else_alone(export_dir, version):
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "draft_model", "model": str(export_dir), "num_speculative_tokens": 3}):
        args = engine_args(speculative_config=spec)
        before = dict(vars(args))
        assert routing.route_export(args) is False
        assert vars(args) == before
    version("0.40.0")  # an unsupported vLLM is only an error when an export of ours is involved
    assert routing.route_export(engine_args(speculative_config={"method": "ngram"})) is False
    with pytest.raises(plugin.UnsupportedVLLMVersion):
        routing.route_export(engine_args(speculative_config={"model": str(export_dir)}))


@pytest.mark.parametrize("v", ["0.8.5.post2", "0.9.2", "0.20.2", "0.31.0"])
def test_route_leaves_natively_loaded_formats_to_vllm(export_dir, version, v, monkeypatch):
    """V0 (vLLM <= 0.9) loads both formats with its own classes and V1 up to 0.31 loads Medusa: the
    plugin stays out of the way there. An MLP export on 0.10 - 0.31 has no loader at all: one message."""
    version(v)
    monkeypatch.delenv(plugin.ALLOW_UNTESTED_ENV, raising=False)
    kind = json.loads((export_dir / "config.json").read_text())["model_type"]
    for spec in ({"model": str(export_dir), "num_speculative_tokens": 3},
                 {"method": kind, "model": str(export_dir), "num_speculative_tokens": 3}):
        args = engine_args(speculative_config=dict(spec))
        if kind in plugin.native_kinds(v):
            assert routing.route_export(args) is False and args.speculative_config == spec
        else:
            with pytest.raises(plugin.UnsupportedVLLMVersion, match=rf"vLLM {v}, whose own loaders take only medusa"):
                routing.route_export(args)
    assert plugin.native_kinds(v) == (("mlp_speculator", "medusa") if v.startswith("0.8") or v.startswith("0.9")
                                      else ("medusa",))


def test_route_hybrid_setting(export_dir, version):
    """The export's speculators_hybrid.enabled decides; additional_config={"speculators": {"hybrid": b}}
    overrides it; anything else under that key is refused with one message."""
    spec = {"model": str(export_dir), "num_speculative_tokens": 3}
    args = engine_args(speculative_config=dict(spec))
    routing.route_export(args)
    assert args.additional_config["speculators"]["hybrid"] is True
    user = {"speculators": {"hybrid": False}, "other": 1}
    args = engine_args(speculative_config=dict(spec), additional_config=user)
    routing.route_export(args)
    assert args.additional_config["speculators"]["hybrid"] is False and args.additional_config["other"] == 1
    assert user == {"speculators": {"hybrid": False}, "other": 1}  # the caller's dict is not changed
    for bad in ({"hybrid": "yes"}, {"export_dir": "/x"}, ["hybrid"]):
        with pytest.raises(ValueError, match="takes one key, 'hybrid'"):
            routing.route_export(engine_args(speculative_config=dict(spec), additional_config={"speculators": bad}))


def test_route_aliases_and_k_checks(export_dir, version):
    args = engine_args(spec_model=str(export_dir), spec_tokens=3)
    assert routing.route_export(args) is True
    assert args.spec_model is None and args.spec_tokens is None
    assert args.speculative_config["num_speculative_tokens"] == 3
    with pytest.raises(ValueError, match="num_speculative_tokens=4 must be 1..3"):
        routing.route_export(engine_args(speculative_config={"model": str(export_dir), "num_speculative_tokens": 4}))


def head_drafts(reference: HeadProposer, hidden: torch.Tensor, token: int) -> list[int]:
    return reference.propose(StepInput([int(token)], hidden, SamplingParams(), 0), 3).tokens


@dataclass
class FakeSpecDecodeMetadata:  # the one field of vLLM's SpecDecodeMetadata the proposer reads
    num_draft_tokens: list[int]


@pytest.mark.parametrize("kind", ["mlp_speculator", "medusa"])
def test_proposer_rows_match_our_engine(kind):
    """The row of the runner's sample_hidden_states for each request is its last accepted token's,
    and the drafts are exactly our engine's HeadProposer drafts from that row."""
    model = tiny(kind).eval()
    proposer = object.__new__(SpeculatorsProposer)  # no vLLM here: set what __init__/load_model set
    proposer.heads, proposer.num_speculative_tokens, proposer.dtype = model, 3, torch.float32
    proposer.hybrid = None
    reference = HeadProposer(model)
    torch.manual_seed(1)
    # Step with drafts: requests verified 3, 0 (prefill just finished: one row) and 3 drafts;
    # request 0 accepted 1 draft (2 tokens), request 1 sampled 1, request 2 accepted all 3 (4 tokens);
    # request 3 is a partial prefill chunk with no sampled token.
    num_draft, sampled = [3, 0, 3, 0], [[5, 7], [11], [1, 2, 3, 4], []]
    hidden = torch.randn(sum(n + 1 for n in num_draft), D)
    proposer.set_runner_inputs(hidden, FakeSpecDecodeMetadata(num_draft), None)
    drafts = proposer.propose(sampled, None, None)
    rows = [1, 4, 8]  # offset + len(tokens) - 1, offsets 0, 4, 5
    for i, row in zip(range(3), rows):
        assert drafts[i] == head_drafts(reference, hidden[row], sampled[i][-1])
    assert drafts[3] == []
    # Step without drafts (one row per request).
    hidden = torch.randn(2, D)
    proposer.set_runner_inputs(hidden, None, None)
    assert proposer.propose([[9], [10]], None, None) == [head_drafts(reference, hidden[i], t) for i, t in ((0, 9), (1, 10))]
    with pytest.raises(RuntimeError, match="did not hand over its hidden states"):
        proposer.propose([[9]], None, None)  # inputs are consumed once


def test_proposer_hybrid_per_request(tmp_path):
    """The plugin's hybrid keys the lookup by vLLM's request id: a request that left the batch is
    finished before the next one drafts, so a second request with the same prompt finds the first
    one's output in the lookup's cache and drafts it; requests in one batch keep separate histories;
    the heads' draft stays where the lookup has nothing."""
    from speculators.proposers import Hybrid, HybridConfig

    import numpy as np

    model = tiny("mlp_speculator").eval()
    proposer = object.__new__(SpeculatorsProposer)
    proposer.heads, proposer.num_speculative_tokens, proposer.dtype = model, 3, torch.float32
    proposer.max_model_len = 1024
    proposer.hybrid = Hybrid(HybridConfig(heads_expected=0.0))
    prompt, answer = [3, 1, 4, 1, 5, 9, 2, 6], [50, 51, 52, 53, 54, 55, 56, 57, 58]
    tokens = np.zeros((2, 64), dtype=np.int64)

    def step(req_ids, new, sizes):
        batch = SimpleNamespace(req_ids=req_ids, num_tokens_no_spec=np.array(sizes), greedy_reqs=set(req_ids))
        proposer._last_hidden = torch.randn(len(req_ids), D)
        proposer.set_runner_inputs(proposer._last_hidden, None, batch)
        return proposer.propose(new, None, tokens)

    # request "a": the prompt, then one token per step
    tokens[0, :8] = prompt
    n = 8
    for t in answer:
        tokens[0, n] = t
        n += 1
        drafts = step(["a"], [[t]], [n])
    assert proposer.hybrid.active == {"a"}
    # "b" (same prompt) and "c" (another) arrive together after "a" left
    tokens[0, :9] = prompt + [answer[0]]
    tokens[1, :5] = [7, 8, 10, 11, 12]
    drafts = step(["b", "c"], [[answer[0]], [12]], [9, 5])
    assert set(proposer.hybrid.active) == {"b", "c"}
    # a's output, cached (as long as the match: suffix decoding's max_spec_factor 1)
    assert drafts[0] == answer[1:2]
    assert drafts[1] == head_drafts(HeadProposer(model), proposer._last_hidden[1], 12)  # nothing to look up
