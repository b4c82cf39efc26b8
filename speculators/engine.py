"""The built-in speculative decoding loop (batch 1, PyTorch path, HF KV cache).

Each step the target verifies `[last token] + k drafts` in one forward pass, the
verification rule accepts a prefix, and the KV cache is cropped back to it. The
rule is vLLM's: greedy drafts are one-hot, acceptance min(1, p/q), recovery from
norm(max(p - q, 0)), a bonus token when every draft is accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .kernels.verification import rejection_sample
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
        drafts = self.model.propose(hidden.view(1, -1).to(dtype), torch.tensor([token]), k)
        return drafts[0].tolist()


class SpeculativeDecoder:
    def __init__(self, target: Target, proposer=None, k: int = 3):
        self.target, self.proposer, self.k = target, proposer, k
        self.eos = set(_as_list(target.tokenizer.eos_token_id)) | set(_as_list(target.model.generation_config.eos_token_id))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sp: SamplingParams) -> GenerationStats:
        stats = GenerationStats(drafted=[0] * self.k, accepted=[0] * self.k)
        start = time.perf_counter()
        cache = DynamicCache()
        out = self.target(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
        cached = len(prompt_ids)
        step = 0
        token, hidden = self._first_token(out.logits[0, -1], sp, step), out.hidden[0, -1]
        history = list(prompt_ids) + [token]
        stats.tokens.append(token)
        while len(stats.tokens) < sp.max_new_tokens and token not in self.eos:
            step += 1
            drafts = self._propose(history, hidden, token)
            inp = torch.tensor([[token] + drafts])
            out = self.target(inp, past_key_values=cache, use_cache=True)
            emitted, n_acc = self._verify(out.logits[0], drafts, sp, step)
            stats.target_forwards += 1
            for j in range(len(drafts)):
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
            token, hidden = emitted[-1], out.hidden[0, n_acc]
        stats.seconds = time.perf_counter() - start
        return stats

    def _first_token(self, logits, sp, step) -> int:
        out, _ = self._verify(logits[None], [], sp, step)
        return out[0]

    def _propose(self, history, hidden, token) -> list[int]:
        if self.proposer is None or self.k == 0:
            return []
        if self.proposer.needs_hidden:
            return self.proposer.propose(hidden, token, self.k)
        return self.proposer.propose(history, self.k)

    def _verify(self, logits: torch.Tensor, drafts: list[int], sp: SamplingParams, step: int):
        """(emitted tokens, number of accepted drafts) for one request's [n+1, V] logits."""
        n, width = len(drafts), max(self.k, 1)
        draft_tokens = torch.tensor([drafts + [0] * (width - n)], dtype=torch.long)
        target_logits = logits.new_zeros(1, width + 1, logits.shape[-1], dtype=torch.float32)
        target_logits[0, : n + 1] = logits.float()
        greedy = sp.temperature == 0
        kwargs = {}
        if not greedy:
            # One seed per (request, step) keeps runs reproducible and independent of batching.
            kwargs = dict(
                temperature=torch.tensor([sp.temperature]),
                top_k=torch.tensor([sp.top_k]),
                top_p=torch.tensor([sp.top_p]),
                seeds=torch.tensor([sp.seed * 1_000_003 + step]),
            )
        tokens, n_acc = rejection_sample(target_logits, draft_tokens, torch.tensor([n]), **kwargs)
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
