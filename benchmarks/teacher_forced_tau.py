"""Greedy chain τ of MLP-speculator and draft-model checkpoints, without running speculative decoding.

Greedy speculative decoding emits exactly the target's greedy output. An MLP speculator's drafts at
a step depend only on the target's hidden state at the last accepted position and the token it chose;
a draft model's n-th draft, as long as the drafts before it were accepted, is its argmax after the
target's own tokens. So one forward over plain greedy output gives every step's inputs, and this
script replays the accept/reject walk over them. It agrees with `speculators eval` to the printed
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


@torch.no_grad()
def chain_tau(target: Target, model, seqs, k: int) -> tuple[float, list[float]]:
    steps = tokens = 0
    accepted = [0] * k
    for prompt_len, seq in seqs:
        hidden = target(seq[None], logits=False).hidden[0]
        first = prompt_len - 1  # the prefill's position: its hidden state and the token it chose
        pos = torch.arange(first, len(seq) - 2)
        drafts = model.propose(hidden[pos], seq[pos + 1], k)
        i = first
        while i + 2 < len(seq):
            d, n = drafts[i - first], 0
            while n < k and i + 2 + n < len(seq) and d[n] == seq[i + 2 + n]:
                accepted[n] += 1
                n += 1
            steps, tokens, i = steps + 1, tokens + n + 1, i + n + 1
    return tokens / steps, [a / steps for a in accepted]


@torch.no_grad()
def draft_chain_tau(target: Target, lm, seqs, k: int) -> tuple[float, list[float], float]:
    """(τ, acceptance per position, α) of a draft model over the target's greedy continuations."""
    steps = tokens = 0
    accepted = [0] * k
    overlap = n_overlap = 0.0
    for prompt_len, seq in seqs:
        logits = lm(input_ids=seq[None]).logits[0].float()
        guess = logits.argmax(-1)  # guess[j]: the draft's greedy token after seq[: j + 1]
        i = prompt_len - 1  # seq[i + 1] is the prefill's token; the first step drafts seq[i + 2 ...]
        while i + 2 < len(seq):
            n = 0
            while n < k and i + 2 + n < len(seq) and guess[i + 1 + n] == seq[i + 2 + n]:
                accepted[n] += 1
                n += 1
            steps, tokens, i = steps + 1, tokens + n + 1, i + n + 1
        span = slice(prompt_len - 1, len(seq) - 1)  # positions that predict a generated token
        p = torch.softmax(target(seq[None]).logits[0, span], -1)
        q = torch.softmax(logits[span], -1)
        overlap += torch.minimum(p, q).sum().item()
        n_overlap += p.shape[0]
    return tokens / steps, [a / steps for a in accepted], overlap / n_overlap


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exports", nargs="+", help="MLP-speculator exports or draft-model checkpoints / run directories")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", nargs="+", default=["mt-bench"], choices=["mt-bench", "humaneval"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    target = Target.load(args.target, torch.float32)
    for data in args.data:
        seqs = greedy_outputs(target, data, args.num_prompts, args.max_new_tokens)
        for path in args.exports:
            ckpt = find_checkpoint(path)
            if is_draft_checkpoint(ckpt):
                tau, acc, alpha = draft_chain_tau(target, load_draft(ckpt)[0], seqs, args.k)
                extra = f"  alpha(T=1) {alpha:.3f}"
            else:
                tau, acc = chain_tau(target, load_speculator(path).float(), seqs, args.k)
                extra = ""
            print(f"{data} {path}: tau {tau:.3f}  acceptance/pos {' / '.join(f'{a:.3f}' for a in acc)}{extra}",
                  flush=True)


if __name__ == "__main__":
    main()
