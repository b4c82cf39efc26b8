"""The built-in engine: greedy speculative decoding reproduces plain greedy decoding token for
token, whatever the proposer proposes; sampling is reproducible per seed."""

import pytest
import torch

from speculators.engine import HeadProposer, NgramProposer, SamplingParams, SpeculativeDecoder
from speculators.models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig
from speculators.target import Target


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return Target.load(str(tiny_target_dir))


def prompts(target, n=3):
    torch.manual_seed(1)
    return [torch.randint(100, 20000, (int(torch.randint(3, 12, ())),)).tolist() for _ in range(n)]


class ReplayProposer:
    """Proposes the true greedy continuation with every other token corrupted: exercises long
    accepted runs, rejections at every position and the bonus token."""

    needs_hidden = False

    def __init__(self, reference):
        self.reference = reference

    def propose(self, history, k):
        for ref in self.reference:
            if history[: len(ref)] == ref[: len(history)] and len(history) < len(ref):
                nxt = ref[len(history) : len(history) + k]
                return [t if (len(history) + j) % 5 else (t + 1) % 49152 for j, t in enumerate(nxt)]
        return []


def proposers(target, plain_outputs):
    torch.manual_seed(0)
    D, V = target.hidden_size, target.vocab_size
    return {
        "mlp": HeadProposer(MLPSpeculator(MLPSpeculatorConfig(vocab_size=V, emb_dim=D, n_predict=4))),
        "medusa": HeadProposer(Medusa(MedusaConfig(hidden_size=D, vocab_size=V, num_heads=4))),
        "ngram": NgramProposer(1, 4),
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


def test_ngram_rule():
    ng = NgramProposer(1, 4)
    assert ng.propose([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # longest suffix 1 2 3 -> what followed it
    assert ng.propose([5, 6, 7], 2) == []
    assert ng.propose([4, 1, 4], 2) == [1, 4]
