"""Greedy chain τ of MLP-speculator exports, without running speculative decoding.

Greedy speculative decoding emits exactly the target's greedy output, and each chain step's drafts
depend only on the target's hidden state at the last accepted position and the token it chose. So
one forward over plain greedy output gives every step's inputs: this script replays the accept/reject
walk over them. It agrees with `speculators eval` to the printed digits up to rounding (the quick
export: 1.378 here, 1.38 there) and takes about a minute instead of several, which makes it the tool
for comparing recipes; speed still needs `speculators eval`.

    python benchmarks/teacher_forced_tau.py runs/a/export runs/b/export --k 3 --num-prompts 20
"""

import argparse

import torch

from speculators.data import chat_ids, eval_prompts
from speculators.export.vllm_format import load_speculator
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exports", nargs="+")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", default="mt-bench", choices=["mt-bench", "humaneval"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    target = Target.load(args.target, torch.float32)
    seqs = greedy_outputs(target, args.data, args.num_prompts, args.max_new_tokens)
    for path in args.exports:
        tau, acc = chain_tau(target, load_speculator(path).float(), seqs, args.k)
        print(f"{path}: tau {tau:.3f}  acceptance/pos {' / '.join(f'{a:.3f}' for a in acc)}")


if __name__ == "__main__":
    main()
