"""Greedy chain τ of speculator (MLP, Medusa) and draft-model checkpoints, without running speculative decoding.

Greedy speculative decoding emits exactly the target's greedy output. A speculator's drafts at a step
depend only on the target's hidden state at the last accepted position and the token it chose (Medusa
ignores the token); a draft model's n-th draft, as long as the drafts before it were accepted, is its
argmax after the target's own tokens. So one forward over plain greedy output gives every step's
inputs, and this script replays the accept/reject walk over them. It agrees with `speculators eval` to the printed
digits up to rounding (the quick export: 1.378 here, 1.38 there) and takes about a minute instead of
several, which makes it the tool for comparing recipes; speed still needs `speculators eval`.

For draft models it also prints α, DistillSpec's expected acceptance per token at T = 1: the mean of
Σ_v min(p(v), q(v)) = 1 - TVD(p, q) over the same continuations (teacher-forced, so only a proxy for
sampled decoding, where the draft conditions on its own samples).

    python benchmarks/teacher_forced_tau.py runs/a/export runs/b/final --k 4 --data mt-bench humaneval
"""

import argparse

import torch

from speculators.data import chat_ids, eval_prompts
from speculators.draft import is_draft_checkpoint, load_draft
from speculators.export.vllm_format import find_checkpoint, load_speculator
from speculators.target import Target


def greedy_outputs(target: Target, data: str, n: int, max_new_tokens: int) -> list[tuple[int, torch.Tensor]]:
    out = []
    for messages in eval_prompts(data, n):
        ids = chat_ids(target.tokenizer, messages)
        seq = target.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        out.append((len(ids), seq[0]))
    return out


def walk(seq: torch.Tensor, first: int, draft_at, k: int, accepted: list[int]) -> tuple[int, int]:
    """Replay greedy chain verification over the target's output `seq` from the prefill's position
    `first`: draft_at(i, n) is the n-th draft of the step after position i. Adds to `accepted` per
    position; returns (steps, tokens emitted)."""
    steps = tokens = 0
    i = first
    while i + 2 < len(seq):
        n = 0
        while n < k and i + 2 + n < len(seq) and draft_at(i, n) == seq[i + 2 + n]:
            accepted[n] += 1
            n += 1
        steps, tokens, i = steps + 1, tokens + n + 1, i + n + 1
    return steps, tokens


@torch.no_grad()
def chain_tau(target: Target, model, seqs, k: int) -> tuple[float, list[float]]:
    steps = tokens = 0
    accepted = [0] * k
    for prompt_len, seq in seqs:
        hidden = target(seq[None], logits=False).hidden[0]
        first = prompt_len - 1  # the prefill's position: its hidden state and the token it chose
        pos = torch.arange(first, len(seq) - 2)
        drafts = model.propose(hidden[pos], seq[pos + 1], k)
        s, t = walk(seq, first, lambda i, n: drafts[i - first][n], k, accepted)
        steps, tokens = steps + s, tokens + t
    return tokens / steps, [a / steps for a in accepted]


@torch.no_grad()
def target_probs(target: Target, seqs) -> list[torch.Tensor]:
    """The target's T = 1 distribution at every position that predicts a generated token, per sequence."""
    return [torch.softmax(target(seq[None]).logits[0, prompt_len - 1 : len(seq) - 1], -1) for prompt_len, seq in seqs]


@torch.no_grad()
def draft_chain_tau(lm, seqs, probs: list[torch.Tensor], k: int) -> tuple[float, list[float], float]:
    """(τ, acceptance per position, α) of a draft model over the target's greedy continuations; `probs`
    from target_probs."""
    steps = tokens = 0
    accepted = [0] * k
    overlap = n_overlap = 0.0
    for (prompt_len, seq), p in zip(seqs, probs):
        logits = lm(input_ids=seq[None]).logits[0].float()
        guess = logits.argmax(-1)  # guess[j]: the draft's greedy token after seq[: j + 1]
        s, t = walk(seq, prompt_len - 1, lambda i, n: guess[i + 1 + n], k, accepted)
        steps, tokens = steps + s, tokens + t
        q = torch.softmax(logits[prompt_len - 1 : len(seq) - 1], -1)
        overlap += torch.minimum(p, q).sum().item()
        n_overlap += p.shape[0]
    return tokens / steps, [a / steps for a in accepted], overlap / n_overlap


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exports", nargs="+", help="speculator (MLP, Medusa) exports or draft-model checkpoints / run directories")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", nargs="+", default=["mt-bench"], choices=["mt-bench", "humaneval"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    target = Target.load(args.target, torch.float32)
    drafts, heads = {}, {}
    for path in args.exports:
        ckpt = find_checkpoint(path)
        if is_draft_checkpoint(ckpt):
            drafts[path] = load_draft(ckpt)[0]
        else:
            heads[path] = load_speculator(path).float()
    for data in args.data:
        seqs = greedy_outputs(target, data, args.num_prompts, args.max_new_tokens)
        def show(path, tau, acc, extra=""):
            print(f"{data} {path}: tau {tau:.3f}  acceptance/pos {' / '.join(f'{a:.3f}' for a in acc)}{extra}",
                  flush=True)

        for path, model in heads.items():
            show(path, *chain_tau(target, model, seqs, args.k))
        probs = target_probs(target, seqs) if drafts else []
        for path, lm in drafts.items():
            tau, acc, alpha = draft_chain_tau(lm, seqs, probs, args.k)
            show(path, tau, acc, f"  alpha(T=1) {alpha:.3f}")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
