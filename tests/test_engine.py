"""The built-in engine: greedy speculative decoding reproduces plain greedy decoding token for
token, whatever the proposer proposes; sampling is reproducible per seed.

SPECULATORS_TEST_DEVICE=cuda runs the engine tests on a GPU, where the engine uses the Triton
kernels (scripts/gpu_check.sh does, with SPECULATORS_TINY_TARGET)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from speculators.engine import SpeculativeDecoder
from speculators.proposers import (Draft, HeadProposer, HybridConfig, HybridProposer, NgramProposer, Proposer,
                                   SamplingParams, SuffixLookupProposer, TreeProposer, add_path, choose_source,
                                   ngram_lookup)
from speculators.kernels.tree import paths_to_tree
from speculators.models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig
from speculators.target import Target


DEVICE = os.environ.get("SPECULATORS_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return Target.load(str(tiny_target_dir)).to(DEVICE)


def on_device(model):
    return model.to(DEVICE)


def prompts(target, n=3):
    torch.manual_seed(1)
    return [torch.randint(100, 20000, (int(torch.randint(3, 12, ())),)).tolist() for _ in range(n)]


class ReplayProposer(Proposer):
    """Proposes the true greedy continuation with every fifth token corrupted: exercises long
    accepted runs, rejections at every position and the bonus token."""

    def __init__(self, reference):
        self.reference = reference

    def propose(self, step, k):
        history = step.history
        for ref in self.reference:
            if history[: len(ref)] == ref[: len(history)] and len(history) < len(ref):
                nxt = ref[len(history) : len(history) + k]
                return Draft([t if (len(history) + j) % 5 else (t + 1) % 49152 for j, t in enumerate(nxt)])
        return Draft([])


def proposers(target, plain_outputs):
    torch.manual_seed(0)
    D, V = target.hidden_size, target.vocab_size
    return {
        "mlp": HeadProposer(on_device(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=4)))),
        "medusa": HeadProposer(on_device(Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=4)))),
        "ngram": NgramProposer(1, 4),
        "suffix": SuffixLookupProposer(),
        "hybrid-mlp": HybridProposer(HeadProposer(on_device(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=4))))),
        "hybrid-medusa": HybridProposer(HeadProposer(on_device(Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=4)))),
                                        HybridConfig(margin=-1.0)),  # takes any lookup draft
        "replay": ReplayProposer(plain_outputs),
    }


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_is_lossless(tiny_target, k):
    sp = SamplingParams(max_new_tokens=20)
    ps = prompts(tiny_target)
    plain = [SpeculativeDecoder(tiny_target, None, 0).generate(p, sp).tokens for p in ps]
    refs = [p + out for p, out in zip(ps, plain)]
    for name, proposer in proposers(tiny_target, refs).items():
        for p, expected in zip(ps, plain):
            st = SpeculativeDecoder(tiny_target, proposer, k).generate(p, sp)
            assert st.tokens == expected, name
            assert st.steps_tokens == len(st.tokens) - 1  # everything after the prefill token
            if name == "replay":
                assert st.steps_tokens / st.target_forwards > 1.0


def test_sampling_reproducible_and_seeded(tiny_target):
    ps = prompts(tiny_target, 1)[0]
    dec = SpeculativeDecoder(tiny_target, NgramProposer(1, 4), 3)
    a = dec.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)).tokens
    b = dec.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)).tokens
    c = dec.generate(ps, SamplingParams(temperature=1.0, max_new_tokens=16, seed=4)).tokens
    assert a == b and a != c


def test_top_k_one_sampling_is_greedy_decoding(tiny_target):
    """top-k 1 leaves one token to sample, so every seed must reproduce greedy decoding (a noise draw
    of exactly 1.0 would hand the sample to a filtered-out token)."""
    ps = prompts(tiny_target, 1)[0]
    plain = SpeculativeDecoder(tiny_target, None, 0).generate(ps, SamplingParams(max_new_tokens=24)).tokens
    dec = SpeculativeDecoder(tiny_target, ReplayProposer([ps + plain]), 3)
    for seed in range(12):
        sp = SamplingParams(temperature=0.8, top_k=1, max_new_tokens=24, seed=seed)
        assert dec.generate(ps, sp).tokens == plain, seed


def test_ngram_rule():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 3, 1, 4) == [9, 1, 2]  # longest suffix 1 2 3 -> what followed it
    assert ngram_lookup([5, 6, 7], 2, 1, 4) == []
    assert ngram_lookup([4, 1, 4], 2, 1, 4) == [1, 4]


def test_choose_source_rule():
    assert choose_source(0, 0.0, 3, 0.4) == "heads"  # no lookup draft
    assert choose_source(4, 2.5, 0, 0.0) == "lookup"  # no heads draft
    assert choose_source(4, 1.2, 3, 0.4) == "lookup"  # the lookup expects more accepted tokens
    assert choose_source(4, 0.3, 3, 0.4) == "heads"
    assert choose_source(4, 0.4, 3, 0.4) == "lookup"  # a tie goes to the lookup (no more costly to verify)
    assert choose_source(4, 0.9, 3, 0.4, margin=0.6) == "heads"


def test_hybrid_takes_confident_lookup_and_tracks_the_heads(tiny_target):
    """A request seen before: the lookup finds the whole answer among cached outputs, drafts it with a
    high score and wins; the heads' expected accepted tokens follow what the target emitted."""
    D, V = tiny_target.hidden_size, tiny_target.vocab_size
    torch.manual_seed(0)
    hybrid = HybridProposer(HeadProposer(on_device(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=3)))),
                            HybridConfig(heads_expected=0.5))
    dec, p, sp = SpeculativeDecoder(tiny_target, hybrid, 3), prompts(tiny_target, 1)[0], SamplingParams(max_new_tokens=16)
    first = dec.generate(p, sp)
    again = dec.generate(p, sp)
    assert again.tokens == first.tokens
    assert again.sources["lookup"] > 0 and sum(again.sources.values()) == again.target_forwards
    assert again.target_forwards < first.target_forwards  # the cached answer is accepted several tokens a step
    assert hybrid.state.expected < 0.5  # random heads: the target confirms almost none of their tokens


def test_add_path_merges_a_lookup_branch():
    tree = paths_to_tree(torch.tensor([7]), torch.tensor([[[1, 2, -1], [1, 3, 4]]]))
    merged = add_path(tree, [1, 2, 5])  # shares 1 -> 2 with the first path
    n = int(merged.num_nodes[0])
    assert n == int(tree.num_nodes[0]) + 1
    nodes = {(int(merged.parents[0, i]), int(merged.tree_tokens[0, i])) for i in range(1, n)}
    two = next(i for i in range(1, n) if int(merged.tree_tokens[0, i]) == 2)
    assert (two, 5) in nodes and len(nodes) == n - 1


def test_hybrid_sampling_keeps_the_target_distribution(tiny_target):
    """Lookup drafts are one-hot proposals: sampled decoding with the hybrid must draw the first two
    tokens with the target's own joint probability (top-k 6, T 0.7, computed exactly from its logits).
    The prompt repeats itself, so the lookup drafts on the first verification step; chi-squared over
    400 seeds."""
    from scipy.stats import chisquare

    prompt = prompts(tiny_target, 1)[0][:4] * 4
    T, top = 0.7, 6

    def probs(ids):
        logits = tiny_target(torch.tensor([ids], device=DEVICE)).logits[0, -1].double().cpu()
        vals, idx = logits.topk(top)
        return dict(zip(idx.tolist(), torch.softmax(vals / T, -1).tolist()))

    with torch.no_grad():
        joint = {(a, b): pa * pb for a, pa in probs(prompt).items() for b, pb in probs(prompt + [a]).items()}
    hybrid = HybridProposer(HeadProposer(on_device(MLPSpeculator(MLPSpeculatorConfig(
        vocab_size=tiny_target.vocab_size, emb_dim=tiny_target.hidden_size, n_predict=3)))), HybridConfig(margin=-1.0))
    dec, n = SpeculativeDecoder(tiny_target, hybrid, 3), 400
    counts = {}
    for seed in range(n):
        pair = tuple(dec.generate(prompt, SamplingParams(temperature=T, top_k=top, max_new_tokens=2, seed=seed)).tokens)
        assert pair in joint, pair  # never a token outside the top-k
        counts[pair] = counts.get(pair, 0) + 1
    assert hybrid.state.sources["lookup"] > n // 2  # the lookup drafted on most first steps
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]  # chi-squared needs expected counts; the rest is one cell
    observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    expected = [joint[c] * n for c in big] + [n - sum(joint[c] * n for c in big)]
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


class ReplayTreeProposer(TreeProposer):
    """A candidate tree of three paths: the true greedy continuation corrupted at its first token,
    then corrupted from its second token on, then the true continuation. The accepted path is never
    the tree's first nodes, so its KV entries must be moved, and since the true path is always there
    every step accepts it whole: the proposer knows where the next step starts."""

    def __init__(self, reference: list[int], start: int):
        self.reference, self.pos, self.typical = reference, start, False

    def propose(self, step, k):
        token = step.history[-1]
        assert self.reference[self.pos] == token
        nxt = self.reference[self.pos + 1 : self.pos + 1 + k]
        self.pos += len(nxt) + 1
        if not nxt:
            return paths_to_tree(torch.tensor([token], device=DEVICE), torch.full((1, 1, k), -1, device=DEVICE))
        wrong0 = [(nxt[0] + 7) % 49152] + nxt[1:]
        wrong1 = nxt[:1] + [(t + 3) % 49152 for t in nxt[1:]]
        paths = [p + [-1] * (k - len(p)) for p in (wrong0, wrong1, nxt)]
        return paths_to_tree(torch.tensor([token], device=DEVICE), torch.tensor([paths], device=DEVICE))


def test_tree_drafting_is_lossless(tiny_target):
    sp = SamplingParams(max_new_tokens=24)
    ps = prompts(tiny_target)
    plain = [SpeculativeDecoder(tiny_target, None, 0).generate(p, sp).tokens for p in ps]
    torch.manual_seed(0)
    D, V = tiny_target.hidden_size, tiny_target.vocab_size
    mlp = on_device(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=3)))
    medusa = on_device(Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=3, original_lm_head=True)))
    medusa.init_from_target(None, tiny_target.lm_head.weight)
    for p, expected in zip(ps, plain):
        replay = ReplayTreeProposer(p + expected, len(p))
        for name, proposer in (("mlp", TreeProposer(mlp)), ("medusa", TreeProposer(medusa)), ("replay", replay),
                               ("hybrid-mlp", HybridProposer(TreeProposer(mlp))),
                               ("hybrid-medusa", HybridProposer(TreeProposer(medusa)))):
            st = SpeculativeDecoder(tiny_target, proposer, 3).generate(p, sp)
            assert st.tokens == expected, name
            assert st.steps_tokens == len(st.tokens) - 1
            if name == "replay":  # the true path is always in the tree: every step accepts all it can
                assert st.steps_tokens / st.target_forwards > 3.0
                assert st.accepted[2] > 0


def test_tree_sampling_needs_typical_acceptance(tiny_target):
    D, V = tiny_target.hidden_size, tiny_target.vocab_size
    mlp = on_device(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=3)))
    p = prompts(tiny_target, 1)[0]
    with pytest.raises(ValueError, match="typical acceptance"):
        SpeculativeDecoder(tiny_target, TreeProposer(mlp), 3).generate(p, SamplingParams(temperature=1.0, max_new_tokens=8))
    out = SpeculativeDecoder(tiny_target, TreeProposer(mlp, typical=True), 3).generate(
        p, SamplingParams(temperature=1.0, max_new_tokens=8))
    assert len(out.tokens) == 8


PROCESS_VARS = ("MKL_CBWR", "HF_HUB_OFFLINE")


def test_importing_the_package_changes_no_environment_variable():
    """A library import leaves the caller's process as it was; the entry points set what they need."""
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_VARS}
    code = ("import os; before = dict(os.environ); import speculators, speculators.target, speculators.engine, "
            "speculators.cli, speculators.vllm_plugin; print(dict(os.environ) == before)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("preset", [None, {"MKL_CBWR": "COMPATIBLE", "HF_HUB_OFFLINE": "0"}])
def test_entry_points_set_mkl_cbwr_and_offline_hub_unless_the_user_did(preset):
    """The verification forward's speed on AMD CPUs rests on MKL_CBWR being set before MKL's first
    GEMM, and the CLI stays off the Hub unless told: `speculators` sets both first thing, keeping a
    user's own values. The environment is read where the subcommand runs."""
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_VARS}
    env.update(preset or {})
    code = ("import os, sys, speculators.cli as c\n"
            "c._fetch = lambda args: print(os.environ['MKL_CBWR'], os.environ['HF_HUB_OFFLINE'])\n"
            "sys.argv = ['speculators', 'fetch']; c.main()")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == (["COMPATIBLE", "0"] if preset else ["AUTO", "1"])


def run_generate(*args):
    proc = subprocess.run([sys.executable, "-m", "speculators.cli", "generate", *map(str, args)],
                          capture_output=True, text=True)
    return proc, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_generate_cli_is_plain_greedy_decoding_for_every_proposer(tmp_path, tiny_target_dir):
    torch.manual_seed(0)
    MLPSpeculator(MLPSpeculatorConfig(vocab_size=49152, emb_dim=64, n_predict=3,
                                      speculators_target={"name": str(tiny_target_dir)})).save_pretrained(tmp_path / "mlp")
    common = ["--target", tiny_target_dir, "--raw", "--json", "--max-new-tokens", 12, "--k", 3,
              "--prompt", "the cat sat on the", "--prompt", "1 2 3 4"]
    plain_proc, plain = run_generate(*common)
    assert plain_proc.returncode == 0, plain_proc.stderr
    assert [r["proposer"] for r in plain] == ["plain", "plain"] and all(r["tokens"] == 12 for r in plain)
    for extra, name in (([tmp_path / "mlp"], "mlp_speculator"), ([tmp_path / "mlp", "--tree"], "mlp_speculator-tree"),
                        (["--ngram"], "ngram"), (["--suffix"], "suffix"),
                        ([tmp_path / "mlp", "--hybrid"], "hybrid-mlp_speculator"),
                        ([tmp_path / "mlp", "--hybrid", "--tree"], "hybrid-mlp_speculator-tree")):
        proc, recs = run_generate(*extra, *common)
        assert proc.returncode == 0, proc.stderr
        assert [r["proposer"] for r in recs] == [name, name]
        assert [r["output"] for r in recs] == [r["output"] for r in plain], name


def test_eval_cli_own_prompts_with_suffix_and_hybrid(tmp_path, tiny_target_dir):
    """eval on the user's own prompt file, lookup and hybrid beside the heads in one run: greedy outputs
    equal plain decoding (eval checks), and the hybrid reports each source's share of steps."""
    torch.manual_seed(0)
    MLPSpeculator(MLPSpeculatorConfig(vocab_size=49152, emb_dim=64, n_predict=3,
                                      speculators_target={"name": str(tiny_target_dir)})).save_pretrained(tmp_path / "mlp")
    (tmp_path / "mine.jsonl").write_text('{"prompt": "the cat sat on the mat"}\n{"text": "1 2 3 4 1 2 3"}\n')
    proc = subprocess.run([sys.executable, "-m", "speculators.cli", "eval", str(tmp_path / "mlp"), "--target",
                           str(tiny_target_dir), "--data", str(tmp_path / "mine.jsonl"), "--suffix", "--hybrid",
                           "--max-new-tokens", "10", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])["datasets"][str(tmp_path / "mine.jsonl")]
    assert res["prompts"] == 2 and set(res["results"]) == {"plain", "mlp_speculator", "suffix", "hybrid-mlp_speculator"}
    share = res["results"]["hybrid-mlp_speculator"]["source_share"]
    assert set(share) <= {"lookup", "heads"} and abs(sum(share.values()) - 1) < 1e-9


def test_generate_cli_tree_sampling_needs_typical(tmp_path, tiny_target_dir):
    torch.manual_seed(0)
    MLPSpeculator(MLPSpeculatorConfig(vocab_size=49152, emb_dim=64, n_predict=3,
                                      speculators_target={"name": str(tiny_target_dir)})).save_pretrained(tmp_path / "mlp")
    args = [tmp_path / "mlp", "--target", tiny_target_dir, "--raw", "--json", "--max-new-tokens", 6, "--tree",
            "--temperature", 1.0, "--prompt", "hello"]
    proc, _ = run_generate(*args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("speculators generate: error: --tree at --temperature > 0 needs --typical")
    proc, recs = run_generate(*args, "--typical")
    assert proc.returncode == 0, proc.stderr
    assert recs[0]["tokens"] == 6
    proc, _ = run_generate("--target", tiny_target_dir)
    assert proc.returncode == 2 and "no prompt" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_generate_cli_device_without_cuda_is_a_one_line_error(tiny_target_dir):
    proc, _ = run_generate("--target", tiny_target_dir, "--raw", "--max-new-tokens", 4, "--prompt", "hi", "--device", "cuda")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no CUDA device is visible here; use --device cpu" in proc.stderr.strip().splitlines()[-1]
    proc, _ = run_generate("--target", tiny_target_dir, "--prompt", "hi", "--device", "gpu0")
    assert proc.returncode == 2 and "is not a device; use cpu, cuda or cuda:N" in proc.stderr
    proc, recs = run_generate("--target", tiny_target_dir, "--raw", "--json", "--max-new-tokens", 4, "--prompt", "hi",
                              "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert recs[0]["tokens"] == 4
