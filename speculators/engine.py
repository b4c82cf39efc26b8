"""The built-in speculative decoding loop (batch 1, PyTorch path, HF KV cache).

Chain drafting: each step the target verifies `[last token] + k drafts` in one forward pass, the
verification rule accepts a prefix, and the KV cache is cropped back to it. The rule is vLLM's:
greedy drafts are one-hot, acceptance min(1, p/q), recovery from norm(max(p - q, 0)), a bonus
token when every draft is accepted.

Tree drafting (TreeProposer): the speculator proposes a candidate tree (IBM's top-k expansion for
an MLP speculator, Medusa's choices), the target scores every node in one forward under a tree
attention mask (each node sees the committed prefix and its own ancestors), tree verification
keeps the longest path the target agrees with, and that path's KV entries are moved to the front
of the tree's slots before the cache is cropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from speculators.kernels.chain_verification import rejection_sample
from speculators.kernels.tree import compact_accepted_kv_
from speculators.kernels.tree_verification import tree_verify

from .target import Target


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0


@dataclass
class GenerationStats:
    tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0  # verification forwards (the prefill is not counted)
    steps_tokens: int = 0  # tokens produced by verification forwards
    drafted: list[int] = field(default_factory=list)  # per draft position: steps that proposed it
    accepted: list[int] = field(default_factory=list)  # per draft position: steps that accepted it
    seconds: float = 0.0


class NgramProposer:
    """vLLM's `[ngram]` prompt lookup: the longest suffix n-gram (min_n..max_n) found earlier
    in the sequence proposes the tokens that followed its first occurrence."""

    needs_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, history: list[int], k: int) -> list[int]:
        n_tokens = len(history)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = history[-n:]
            for start in range(n_tokens - n):
                if history[start : start + n] == suffix:
                    return history[start + n : start + n + k]
        return []


class HeadProposer:
    """An MLP speculator or Medusa: drafts from the target's hidden state at the last position."""

    needs_hidden = True

    def __init__(self, model):
        self.model = model.eval()

    def propose(self, hidden: torch.Tensor, token: int, k: int) -> list[int]:
        dtype = next(self.model.parameters()).dtype
        drafts = self.model.propose(hidden.view(1, -1).to(dtype), torch.tensor([token], device=hidden.device), k)
        return drafts[0].tolist()


class TreeProposer:
    """An MLP speculator or Medusa drafting a candidate tree of depth k from the target's hidden state
    (the model's `propose_tree`: top_k_tokens_per_head / n_candidates, or Medusa choices). Greedy
    verification keeps the target's argmax path, so the output equals plain greedy decoding;
    sampling uses Medusa-2's typical acceptance, which is not distribution-preserving and so only
    runs when asked for (`typical=True`)."""

    needs_hidden = True

    def __init__(self, model, typical: bool = False):
        self.model, self.typical = model.eval(), typical

    def propose_tree(self, hidden: torch.Tensor, token: int, k: int):
        dtype = next(self.model.parameters()).dtype
        return self.model.propose_tree(hidden.view(1, -1).to(dtype), torch.tensor([token], device=hidden.device), k)


class DraftModelProposer:
    """A DistillSpec draft: any causal LM with the target's vocabulary runs k steps of its own decoding,
    keeping its KV cache across verification steps (cropped back to the prefix the target accepted).
    Greedy: the argmax chain. Sampled: it samples its own distribution at the request's temperature and
    returns those probabilities, so verification applies min(1, p/q) and the output keeps the target's
    distribution (no top-k/top-p on the draft side: any q is exact as long as it is what was sampled)."""

    needs_hidden = False

    def __init__(self, model):
        self.model = model.eval()
        self.cache, self.cached = None, []  # the draft's KV cache and the tokens it holds

    @torch.no_grad()
    def propose(self, history: list[int], k: int, sp: SamplingParams, seed: int) -> tuple[list[int], torch.Tensor | None]:
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
        gen = None if greedy else torch.Generator(device=device).manual_seed(seed)
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
        return drafts, (torch.stack(probs) if probs else None)


class SpeculativeDecoder:
    """Runs where the target's weights are: on CUDA the verification and proposal kernels are the Triton
    ones (they dispatch on the tensors' device), on CPU their PyTorch references."""

    def __init__(self, target: Target, proposer=None, k: int = 3):
        self.target, self.proposer, self.k = target, proposer, k
        self.device = target.lm_head.weight.device
        self.eos = set(_as_list(target.tokenizer.eos_token_id)) | set(_as_list(target.model.generation_config.eos_token_id))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sp: SamplingParams) -> GenerationStats:
        stats = GenerationStats(drafted=[0] * self.k, accepted=[0] * self.k)
        start = time.perf_counter()
        cache = DynamicCache()
        out = self.target(torch.tensor([prompt_ids], device=self.device), past_key_values=cache, use_cache=True)
        cached = len(prompt_ids)
        step = 0
        token, hidden = self._first_token(out.logits[0, -1], sp, step), out.hidden[0, -1]
        history = list(prompt_ids) + [token]
        stats.tokens.append(token)
        tree = isinstance(self.proposer, TreeProposer) and self.k > 0
        if tree and sp.temperature > 0 and not self.proposer.typical:
            raise ValueError("tree drafting at temperature > 0 needs typical acceptance (TreeProposer(typical=True)), "
                             "which does not preserve the target's distribution; use chain drafting to sample exactly")
        while len(stats.tokens) < sp.max_new_tokens and token not in self.eos:
            step += 1
            if tree:
                emitted, n_acc, depth, next_hidden = self._tree_step(cache, cached, hidden, token, sp, step)
            else:
                emitted, n_acc, depth, next_hidden = self._chain_step(cache, history, hidden, token, sp, step)
            stats.target_forwards += 1
            for j in range(depth):
                stats.drafted[j] += 1
                stats.accepted[j] += int(j < n_acc)
            room = sp.max_new_tokens - len(stats.tokens)
            emitted = _cut_at_eos(emitted[:room], self.eos)
            stats.tokens.extend(emitted)
            stats.steps_tokens += len(emitted)
            history.extend(emitted)
            # Keep the KV of `token` and the accepted drafts; the last emitted token is fed next step.
            cached += 1 + n_acc
            rejected = cache.get_seq_length() - cached
            if rejected:
                cache.crop(-rejected)  # drop the rejected drafts' KV
            token, hidden = emitted[-1], next_hidden
        stats.seconds = time.perf_counter() - start
        return stats

    def _chain_step(self, cache, history, hidden, token: int, sp: SamplingParams, step: int):
        """One chain step: (emitted tokens, accepted drafts, drafts proposed, hidden state of the last
        accepted position); the rejected drafts' KV entries are still to be cropped."""
        drafts, draft_probs = self._propose(history, hidden, token, sp, step)
        out = self.target(torch.tensor([[token] + drafts], device=self.device), past_key_values=cache, use_cache=True)
        emitted, n_acc = self._verify(out.logits[0], drafts, sp, step, draft_probs)
        return emitted, n_acc, len(drafts), out.hidden[0, n_acc]

    def _tree_step(self, cache, cached: int, hidden, token: int, sp: SamplingParams, step: int):
        """One tree step: (emitted tokens, accepted drafts, tree depth, hidden state of the last
        accepted node). The tree's KV entries are appended at cached + node; on return the accepted
        path's entries sit contiguously after the prefix and the rest is still to be cropped."""
        tb = self.proposer.propose_tree(hidden, token, self.k)
        n = int(tb.num_nodes[0])
        tokens, parents, depth = tb.tree_tokens[:, :n], tb.parents[:, :n], tb.depth[:, :n]
        dtype = self.target.lm_head.weight.dtype
        # Additive mask: 0 where a node may attend (the whole prefix, itself and its ancestors).
        mask = torch.zeros(1, 1, n, cached + n, dtype=dtype, device=self.device)
        mask[0, 0, :, cached:] = torch.where(tb.attn_mask[0, :n, :n], 0.0, torch.finfo(dtype).min)
        out = self.target(tokens, attention_mask=mask, position_ids=cached + depth, past_key_values=cache,
                          use_cache=True)
        typical = sp.temperature > 0
        res = tree_verify(out.logits.float(), tokens, parents, mode="typical" if typical else "greedy",
                          temperature=sp.temperature if typical else None,
                          seeds=torch.tensor([sp.seed * 1_000_003 + step], device=self.device) if typical else None)
        n_acc = int(res.num_accepted[0])
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):  # [1, heads, seq, head_dim]
                compact_accepted_kv_(kv, res.accepted_nodes, res.num_accepted, [cached], seq_dim=2)
        last = int(res.accepted_nodes[0, n_acc])
        return res.output_tokens[0, : n_acc + 1].tolist(), n_acc, int(depth.max()), out.hidden[0, last]

    def _first_token(self, logits, sp, step) -> int:
        out, _ = self._verify(logits[None], [], sp, step)
        return out[0]

    def _propose(self, history, hidden, token, sp, step) -> tuple[list[int], torch.Tensor | None]:
        """(drafts, their [n, V] draft probabilities or None for one-hot drafts)."""
        if self.proposer is None or self.k == 0:
            return [], None
        if self.proposer.needs_hidden:
            return self.proposer.propose(hidden, token, self.k), None
        if isinstance(self.proposer, DraftModelProposer):
            # its own seed stream, independent of verification's counter-based one
            return self.proposer.propose(history, self.k, sp, sp.seed * 1_000_003 + step)
        return self.proposer.propose(history, self.k), None

    def _verify(self, logits: torch.Tensor, drafts: list[int], sp: SamplingParams, step: int, draft_probs=None):
        """(emitted tokens, number of accepted drafts) for one request's [n+1, V] logits."""
        n, width = len(drafts), max(self.k, 1)
        dev = logits.device
        draft_tokens = torch.tensor([drafts + [0] * (width - n)], dtype=torch.long, device=dev)
        target_logits = logits.new_zeros(1, width + 1, logits.shape[-1], dtype=torch.float32)
        target_logits[0, : n + 1] = logits.float()
        greedy = sp.temperature == 0
        kwargs = {}
        if not greedy:
            # One seed per (request, step) keeps runs reproducible and independent of batching.
            kwargs = dict(
                temperature=torch.tensor([sp.temperature], device=dev),
                top_k=torch.tensor([sp.top_k], device=dev),
                top_p=torch.tensor([sp.top_p], device=dev),
                seeds=torch.tensor([sp.seed * 1_000_003 + step], device=dev),
            )
            if draft_probs is not None:
                q = target_logits.new_zeros(1, width, logits.shape[-1])
                q[0, :n] = draft_probs
                kwargs["draft_probs"] = q
        tokens, n_acc = rejection_sample(target_logits, draft_tokens, torch.tensor([n], device=dev), **kwargs)
        n_acc = int(n_acc[0])
        return tokens[0, : n_acc + 1].tolist(), n_acc


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens
