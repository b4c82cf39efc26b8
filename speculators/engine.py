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

from .proposers import Draft, Proposer, SamplingParams, StepInput
from .target import Target


@dataclass
class GenerationStats:
    tokens: list[int] = field(default_factory=list)
    target_forwards: int = 0  # verification forwards (the prefill is not counted)
    steps_tokens: int = 0  # tokens produced by verification forwards
    drafted: list[int] = field(default_factory=list)  # per draft position: steps that proposed it
    accepted: list[int] = field(default_factory=list)  # per draft position: steps that accepted it
    sources: dict[str, int] = field(default_factory=dict)  # steps whose draft came from each source
    seconds: float = 0.0


class SpeculativeDecoder:
    """Runs where the target's weights are: on CUDA the verification and proposal kernels are the Triton
    ones (they dispatch on the tensors' device), on CPU their PyTorch references."""

    def __init__(self, target: Target, proposer: Proposer | None = None, k: int = 3):
        self.target, self.proposer, self.k = target, proposer, k
        self.device = target.lm_head.weight.device
        self.eos = set(_as_list(target.tokenizer.eos_token_id)) | set(_as_list(target.model.generation_config.eos_token_id))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], sp: SamplingParams) -> GenerationStats:
        stats = GenerationStats(drafted=[0] * self.k, accepted=[0] * self.k)
        tree = self.proposer is not None and self.proposer.drafts_trees and self.k > 0
        if tree and sp.temperature > 0 and not self.proposer.typical:
            raise ValueError("tree drafting at temperature > 0 needs typical acceptance (TreeProposer(typical=True)), "
                             "which does not preserve the target's distribution; use chain drafting to sample exactly")
        start = time.perf_counter()
        cache = DynamicCache()
        out = self.target(torch.tensor([prompt_ids], device=self.device), past_key_values=cache, use_cache=True)
        cached = len(prompt_ids)
        step = 0
        token, hidden = self._first_token(out.logits[0, -1], sp, step), out.hidden[0, -1]
        history = list(prompt_ids) + [token]
        stats.tokens.append(token)
        if self.proposer is not None:
            self.proposer.start(list(prompt_ids))
            self.proposer.extend([token])
        while len(stats.tokens) < sp.max_new_tokens and token not in self.eos:
            step += 1
            inp = StepInput(history, hidden, sp, sp.seed * 1_000_003 + step)
            if tree:
                emitted, n_acc, depth, next_hidden = self._tree_step(cache, cached, inp)
            else:
                emitted, n_acc, depth, next_hidden, source = self._chain_step(cache, inp)
                if source:
                    stats.sources[source] = stats.sources.get(source, 0) + 1
            stats.target_forwards += 1
            for j in range(depth):
                stats.drafted[j] += 1
                stats.accepted[j] += int(j < n_acc)
            accepted = emitted  # every token the target accepted, before max_new_tokens and EOS cut them
            room = sp.max_new_tokens - len(stats.tokens)
            emitted = _cut_at_eos(emitted[:room], self.eos)
            stats.tokens.extend(emitted)
            stats.steps_tokens += len(emitted)
            history.extend(emitted)
            if self.proposer is not None:
                # as in vLLM, whose model runner hands its proposer a step's tokens before the
                # scheduler trims them, so lookup caches and the hybrid's statistics match there
                self.proposer.extend(accepted)
            # Keep the KV of `token` and the accepted drafts; the last emitted token is fed next step.
            cached += 1 + n_acc
            rejected = cache.get_seq_length() - cached
            if rejected:
                cache.crop(-rejected)  # drop the rejected drafts' KV
            token, hidden = emitted[-1], next_hidden
        if self.proposer is not None:
            self.proposer.finish()
        stats.seconds = time.perf_counter() - start
        return stats

    def _chain_step(self, cache, inp: StepInput):
        """One chain step: (emitted tokens, accepted drafts, drafts proposed, hidden state of the last
        accepted position, the draft's source); the rejected drafts' KV entries are still to be cropped."""
        draft = self.proposer.propose(inp, self.k) if self.proposer is not None and self.k > 0 else Draft([])
        drafts = draft.tokens[: self.k]
        out = self.target(torch.tensor([[inp.history[-1]] + drafts], device=self.device), past_key_values=cache,
                          use_cache=True)
        probs = draft.probs[: len(drafts)] if draft.probs is not None else None
        emitted, n_acc = self._verify(out.logits[0], drafts, inp.sp, inp.seed, probs)
        return emitted, n_acc, len(drafts), out.hidden[0, n_acc], draft.source if drafts else ""

    def _tree_step(self, cache, cached: int, inp: StepInput):
        """One tree step: (emitted tokens, accepted drafts, tree depth, hidden state of the last
        accepted node). The tree's KV entries are appended at cached + node; on return the accepted
        path's entries sit contiguously after the prefix and the rest is still to be cropped."""
        tb = self.proposer.propose(inp, self.k)
        n = int(tb.num_nodes[0])
        tokens, parents, depth = tb.tree_tokens[:, :n], tb.parents[:, :n], tb.depth[:, :n]
        dtype = self.target.lm_head.weight.dtype
        # Additive mask: 0 where a node may attend (the whole prefix, itself and its ancestors).
        mask = torch.zeros(1, 1, n, cached + n, dtype=dtype, device=self.device)
        mask[0, 0, :, cached:] = torch.where(tb.attn_mask[0, :n, :n], 0.0, torch.finfo(dtype).min)
        out = self.target(tokens, attention_mask=mask, position_ids=cached + depth, past_key_values=cache,
                          use_cache=True)
        typical = inp.sp.temperature > 0
        res = tree_verify(out.logits.float(), tokens, parents, mode="typical" if typical else "greedy",
                          temperature=inp.sp.temperature if typical else None,
                          seeds=torch.tensor([inp.seed], device=self.device) if typical else None)
        n_acc = int(res.num_accepted[0])
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):  # [1, heads, seq, head_dim]
                compact_accepted_kv_(kv, res.accepted_nodes, res.num_accepted, [cached], seq_dim=2)
        last = int(res.accepted_nodes[0, n_acc])
        return res.output_tokens[0, : n_acc + 1].tolist(), n_acc, int(depth.max()), out.hidden[0, last]

    def _first_token(self, logits, sp, step) -> int:
        out, _ = self._verify(logits[None], [], sp, sp.seed * 1_000_003 + step)
        return out[0]

    def _verify(self, logits: torch.Tensor, drafts: list[int], sp: SamplingParams, seed: int, draft_probs=None):
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
                seeds=torch.tensor([seed], device=dev),
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
