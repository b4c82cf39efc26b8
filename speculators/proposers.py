"""The proposers of the built-in engine, behind one interface.

Each decoding step the engine hands a proposer a `StepInput` (the token history, the target's hidden
state for the last token, the sampling parameters and this step's seed) and gets back a `Draft` (a chain
of tokens, their draft distribution when sampled, and where they came from) or, for a tree proposer
(`drafts_trees = True`), a `TreeBatch` of candidate paths. `start`, `extend` and `finish` tell a proposer
a request's lifecycle: the prompt, every token the target emitted, and the end.

- `NgramProposer`: vLLM's `[ngram]` prompt lookup, the simple baseline;
- `SuffixLookupProposer`: suffix decoding over this request and recent requests' outputs (scored drafts);
- `HeadProposer` / `TreeProposer`: an MLP speculator or Medusa heads reading the target's hidden state;
- `DraftModelProposer`: a small causal LM decoding k tokens of its own;
- `HybridProposer`: per step, the lookup draft or the heads' draft, by `choose_source`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .kernels.tree import TreeBatch, paths_to_tree
from .suffix import SuffixProposer


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0


@dataclass
class StepInput:
    history: list[int]  # the prompt and every emitted token; history[-1] is fed to the target next
    hidden: torch.Tensor  # [D] the target's final hidden state at the position that emitted history[-1]
    sp: SamplingParams
    seed: int  # this step's seed: one per (request, step), so runs are reproducible


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the distribution each token was sampled from; None: one-hot
    source: str = ""  # which proposer of a hybrid drafted it


class Proposer:
    """The engine's proposer interface; the lifecycle hooks do nothing unless a proposer keeps state."""

    drafts_trees = False
    typical = False  # trees verified with Medusa-2's typical acceptance (sampling without exactness)

    def start(self, prompt_ids: list[int]) -> None:
        """A new request begins with these prompt tokens."""

    def extend(self, tokens: list[int]) -> None:
        """The target emitted these tokens (the first token after the prefill, then each step's)."""

    def finish(self) -> None:
        """The request is done."""

    def propose(self, step: StepInput, k: int) -> Draft | TreeBatch:
        raise NotImplementedError


class NgramProposer(Proposer):
    """vLLM's `[ngram]` prompt lookup: the longest suffix n-gram (min_n..max_n) found earlier in the
    sequence proposes the tokens that followed its first occurrence."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, step: StepInput, k: int) -> Draft:
        return Draft(ngram_lookup(step.history, k, self.min_n, self.max_n), source="ngram")


def ngram_lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n_tokens = len(history)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = history[-n:]
        for start in range(n_tokens - n):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


class SuffixLookupProposer(Proposer):
    """Suffix decoding (`speculators.suffix`): drafts from this request's prompt and output and from the
    outputs of the last `max_cached_requests` requests, each with a score, the number of its tokens the
    target is estimated to accept. Requests are decoded one at a time by the engine."""

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 256, min_token_prob: float = 0.1):
        self.lookup = SuffixProposer(max_depth=max_depth, max_cached_requests=max_cached_requests,
                                     min_token_prob=min_token_prob)
        self.active = False

    def start(self, prompt_ids: list[int]) -> None:
        self.finish()
        self.lookup.start_request(0, prompt_ids)
        self.active = True

    def extend(self, tokens: list[int]) -> None:
        self.lookup.append(0, tokens)

    def finish(self) -> None:
        if self.active:
            self.lookup.finish_request(0)
            self.active = False

    def propose_scored(self, k: int) -> tuple[list[int], float]:
        return self.lookup.speculate(0, k)

    def propose(self, step: StepInput, k: int) -> Draft:
        return Draft(self.propose_scored(k)[0], source="suffix")


class HeadProposer(Proposer):
    """An MLP speculator or Medusa: a greedy chain from the target's hidden state at the last position."""

    def __init__(self, model):
        self.model = model.eval()
        self.dtype = next(self.model.parameters()).dtype

    def propose(self, step: StepInput, k: int) -> Draft:
        token = torch.tensor([step.history[-1]], device=step.hidden.device)
        return Draft(self.model.propose(step.hidden.view(1, -1).to(self.dtype), token, k)[0].tolist(), source="heads")


class TreeProposer(Proposer):
    """An MLP speculator or Medusa drafting a candidate tree of depth k from the target's hidden state
    (the model's `propose_tree`: top_k_tokens_per_head / n_candidates, or Medusa choices). Greedy
    verification keeps the target's argmax path, so the output equals plain greedy decoding; sampling
    uses Medusa-2's typical acceptance, which does not preserve the target's distribution and so only
    runs when asked for (`typical=True`)."""

    drafts_trees = True

    def __init__(self, model, typical: bool = False):
        self.model, self.typical = model.eval(), typical
        self.dtype = next(self.model.parameters()).dtype

    def propose(self, step: StepInput, k: int) -> TreeBatch:
        token = torch.tensor([step.history[-1]], device=step.hidden.device)
        return self.model.propose_tree(step.hidden.view(1, -1).to(self.dtype), token, k)


class DraftModelProposer(Proposer):
    """A DistillSpec draft: any causal LM with the target's vocabulary runs k steps of its own decoding,
    keeping its KV cache across verification steps (cropped back to the prefix the target accepted).
    Greedy: the argmax chain. Sampled: it samples its own distribution at the request's temperature and
    returns those probabilities, so verification applies min(1, p/q) and the output keeps the target's
    distribution (no top-k/top-p on the draft side: any q is exact as long as it is what was sampled)."""

    def __init__(self, model):
        self.model = model.eval()
        self.cache, self.cached = None, []  # the draft's KV cache and the tokens it holds

    @torch.no_grad()
    def propose(self, step: StepInput, k: int) -> Draft:
        history, sp = step.history, step.sp
        keep = 0
        limit = min(len(self.cached), len(history) - 1)  # at least one new token must be fed
        while keep < limit and self.cached[keep] == history[keep]:
            keep += 1
        if keep == 0:
            self.cache, self.cached = DynamicCache(), []
        elif len(self.cached) > keep:
            self.cache.crop(keep - len(self.cached))
            self.cached = self.cached[:keep]
        greedy = sp.temperature == 0
        device = next(self.model.parameters()).device
        # its own seed stream, independent of verification's counter-based one
        gen = None if greedy else torch.Generator(device=device).manual_seed(step.seed)
        feed, drafts, probs = history[keep:], [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.tensor([feed], device=device), past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1).logits[0, -1].float()
            self.cached += feed
            if greedy:
                token = int(logits.argmax())
            else:
                q = torch.softmax(logits / sp.temperature, -1)
                token = int(torch.multinomial(q, 1, generator=gen))
                probs.append(q)
            drafts.append(token)
            feed = [token]
        return Draft(drafts, torch.stack(probs) if probs else None, source="draft")


def choose_source(lookup_tokens: int, lookup_score: float, heads_tokens: int, heads_expected: float,
                  margin: float = 0.0) -> str:
    """'lookup' or 'heads': which draft a hybrid sends to verification this step.

    `lookup_score` is suffix decoding's estimate of how many lookup tokens the target accepts;
    `heads_expected` the same for the heads' draft (their running mean of accepted tokens). The lookup
    wins when it expects at least `margin` more accepted tokens, so an empty or hopeless lookup leaves
    the step to the heads and a long confident match on code or repeated text takes it from them."""
    if lookup_tokens == 0:
        return "heads"
    if heads_tokens == 0:
        return "lookup"
    return "lookup" if lookup_score >= heads_expected + margin else "heads"


@dataclass
class HybridConfig:
    """The hybrid's settings: recorded in an export's config.json (`speculators_hybrid`) so that eval,
    generate and the vLLM plugin apply the same rule."""

    enabled: bool = True  # the vLLM plugin serves the hybrid (additional_config={"speculators": {"hybrid": ...}} overrides)
    # lookup wins when its score >= heads_expected + margin; 0.25 is the best of -0.5..1 on MT-Bench and
    # HumanEval for the quick MLP export (benchmarks/hybrid_replay.py): suffix scores run optimistic
    margin: float = 0.25
    heads_expected: float = 0.5  # the heads' accepted tokens per step before any step is observed
    max_depth: int = 24  # suffix trie depth
    max_cached_requests: int = 256  # finished requests whose outputs the lookup also searches
    min_token_prob: float = 0.1  # suffix drafting stops when its path probability falls under this

    IGNORED_KEYS = ()


class Hybrid:
    """The hybrid's state across requests, keyed by request id, shared by the engine's `HybridProposer`
    and the vLLM plugin: suffix lookup over every request, the heads' expected accepted tokens per step,
    and which draft each step sent.

    Per step a caller drafts with the heads, asks `lookup_draft`, and lets `choose` pick. The expected
    accepted tokens of the heads are a running mean over all requests (the first 64 steps a plain mean,
    then a moving one) of how many tokens of their draft the target's emitted tokens confirm. It also
    learns on steps the lookup won, so a heads' draft that was not sent still counts."""

    def __init__(self, config: HybridConfig | None = None):
        self.config = config or HybridConfig()
        c = self.config
        self.lookup = SuffixProposer(max_depth=c.max_depth, max_cached_requests=c.max_cached_requests,
                                     min_token_prob=c.min_token_prob)
        self.expected = c.heads_expected
        self.steps = 0
        self.heads_drafts: dict = {}  # request id -> the heads' draft of the step in flight
        self.sources = {"lookup": 0, "heads": 0}

    @property
    def active(self):
        """The ids of the requests started and not finished."""
        return self.lookup.active_requests

    def start(self, request_id, prompt_ids) -> None:
        self.lookup.start_request(request_id, prompt_ids)

    def extend(self, request_id, tokens: list[int]) -> None:
        """The target emitted `tokens` for this request (every accepted token and the bonus token)."""
        self.lookup.append(request_id, tokens)
        draft = self.heads_drafts.pop(request_id, None)
        if draft:
            agreed = 0
            while agreed < min(len(draft), len(tokens)) and draft[agreed] == tokens[agreed]:
                agreed += 1
            self.steps += 1
            self.expected += (agreed - self.expected) / min(self.steps, 64)

    def finish(self, request_id) -> None:
        self.heads_drafts.pop(request_id, None)
        self.lookup.finish_request(request_id)

    def lookup_draft(self, request_id, k: int) -> tuple[list[int], float]:
        return self.lookup.speculate(request_id, k)

    def choose(self, request_id, lookup: tuple[list[int], float], heads_tokens: list[int],
               learn: bool = True) -> str:
        """'lookup' or 'heads' for this request's step; `learn`: score the heads' draft against the
        tokens the target emits next (greedy only: a sampled target's tokens do not show what it accepts)."""
        if learn:
            self.heads_drafts[request_id] = heads_tokens
        source = choose_source(len(lookup[0]), lookup[1], len(heads_tokens), self.expected, self.config.margin)
        self.sources[source] += 1
        return source


class HybridProposer(Proposer):
    """Suffix lookup and trained heads in one proposer for the built-in engine (`Hybrid`, one request
    at a time). Both draft every step and `choose_source` picks one by their expected accepted tokens.

    With tree heads (`TreeProposer`) the lookup draft joins the heads' candidate paths as one more
    branch of the same tree, so the target verifies both in one forward."""

    def __init__(self, heads: HeadProposer | TreeProposer, config: HybridConfig | None = None):
        self.heads, self.state = heads, Hybrid(config)
        self.drafts_trees, self.typical = heads.drafts_trees, heads.typical
        self.request = None

    def start(self, prompt_ids: list[int]) -> None:
        self.finish()
        self.request = 0
        self.state.start(self.request, prompt_ids)

    def extend(self, tokens: list[int]) -> None:
        self.state.extend(self.request, tokens)

    def finish(self) -> None:
        if self.request is not None:
            self.state.finish(self.request)
            self.request = None

    def propose(self, step: StepInput, k: int) -> Draft | TreeBatch:
        looked = self.state.lookup_draft(self.request, k)
        if self.drafts_trees:
            tree = self.heads.propose(step, k)
            return add_path(tree, looked[0]) if looked[0] else tree
        heads = self.heads.propose(step, k)
        source = self.state.choose(self.request, looked, heads.tokens, learn=step.sp.temperature == 0)
        return Draft(looked[0], source="lookup") if source == "lookup" else heads


def add_path(tree: TreeBatch, path: list[int]) -> TreeBatch:
    """The same candidate tree (a batch of one) with one more root path, merged where it shares a prefix."""
    n = int(tree.num_nodes[0])
    parents, tokens = tree.parents[0, :n].tolist(), tree.tree_tokens[0, :n].tolist()
    inner = set(parents[1:])
    paths = []
    for leaf in (i for i in range(1, n) if i not in inner):
        nodes = [leaf]
        while parents[nodes[-1]] > 0:
            nodes.append(parents[nodes[-1]])
        paths.append([tokens[i] for i in reversed(nodes)])
    paths.append(path)
    padded = torch.full((1, len(paths), max(map(len, paths))), -1, dtype=torch.int64)
    for i, p in enumerate(paths):
        padded[0, i, : len(p)] = torch.tensor(p)
    return paths_to_tree(tree.tree_tokens[:, 0], padded.to(tree.tree_tokens.device))
