"""Greedy τ of the hybrid (suffix lookup or heads, per step) against each source alone, replayed over the
target's greedy output: the tool for tuning the hybrid's rule.

Greedy speculative decoding emits the target's greedy output whatever is drafted, so every step's
inputs are known from one forward over that output (as in teacher_forced_tau.py): the heads' draft
after each position, and the lookup's draft from the suffix trees fed the tokens emitted so far. The
replay walks the accept/reject steps with `speculators.proposers.Hybrid`, the same object the engine
and the vLLM plugin use, so a rule's τ here is the τ `speculators eval --hybrid` measures (up to fp
near-ties between the HF generate output and the engine's). It also times the proposal's parts as the
engine runs them at batch 1: the lookup's drafting and appends per step, and the heads' proposal alone.
Rows, per data set:

- `ngram`: vLLM's prompt lookup (n = 1..4); `suffix`: suffix decoding alone (`no-cache`: without the
  tree over earlier requests' outputs); `heads`: the export alone;
- `hybrid m=M`: the hybrid at margin M (lookup wins when its score >= the heads' expected + M);
- `oracle`: each step the source whose draft the target accepts further (an upper bound for any rule
  that picks one chain; verifying both chains as a two-branch tree reaches it).

    python benchmarks/hybrid_replay.py runs/quickstart/export --k 3 --data mt-bench humaneval \\
        --margins -0.5 0 0.5 1
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from speculators.export.vllm_format import load_speculator
from speculators.proposers import Hybrid, HybridConfig, ngram_lookup
from speculators.target import Target
from teacher_forced_tau import greedy_outputs  # this script's directory: the same greedy continuations


@torch.no_grad()
def heads_drafts(target: Target, model, seqs, k: int) -> list[list[list[int]]]:
    """Per sequence, the heads' k-token draft after every position from the prefill's on."""
    out = []
    for prompt_len, seq in seqs:
        t = torch.tensor(seq)
        hidden = target(t[None], logits=False).hidden[0]
        pos = torch.arange(prompt_len - 1, len(seq) - 1)
        out.append(model.propose(hidden[pos].to(next(model.parameters()).dtype), t[pos + 1], k).tolist())
    return out


def accepted_len(draft: list[int], seq: list[int], at: int) -> int:
    n = 0
    while n < len(draft) and at + n < len(seq) and draft[n] == seq[at + n]:
        n += 1
    return n


@torch.no_grad()
def heads_ms_per_step(target: Target, model, seqs, k: int, n: int = 200) -> float:
    """The heads' proposal alone at batch 1, as the engine calls it each step: ms per call."""
    prompt_len, seq = seqs[0]
    t = torch.tensor(seq)
    hidden = target(t[None], logits=False).hidden[0].to(next(model.parameters()).dtype)
    rows = [prompt_len - 1 + j % (len(seq) - prompt_len) for j in range(n)]
    for r in rows[:10]:  # warm-up
        model.propose(hidden[r : r + 1], t[r + 1 : r + 2], k)
    start = time.perf_counter()
    for r in rows:
        model.propose(hidden[r : r + 1], t[r + 1 : r + 2], k)
    return (time.perf_counter() - start) / n * 1e3


def replay(seqs, drafts, k: int, rule: str, config: HybridConfig) -> dict:
    """Walk greedy verification over every sequence with one proposer rule, its state kept across
    sequences in order (the lookup's cache of outputs, the heads' running acceptance), as in eval."""
    hybrid = Hybrid(config)
    steps = tokens = 0
    accepted = [0] * k
    sources = {"lookup": 0, "heads": 0}
    lookup_s = 0.0  # time in the suffix lookup's drafting and appends
    for r, ((prompt_len, seq), heads) in enumerate(zip(seqs, drafts)):
        i = prompt_len  # seq[i] is the token the prefill chose; the step drafts what follows it
        hybrid.start(r, seq[:prompt_len])
        hybrid.extend(r, [seq[i]])
        while i + 1 < len(seq):
            head = heads[i - prompt_len]
            if rule == "ngram":
                draft = ngram_lookup(seq[: i + 1], k, 1, 4)
            else:
                t0 = time.perf_counter()
                lookup = hybrid.lookup_draft(r, k)
                lookup_s += time.perf_counter() - t0
                if rule == "suffix":
                    draft = lookup[0]
                elif rule == "heads":
                    draft = head
                elif rule == "oracle":
                    a, b = accepted_len(lookup[0], seq, i + 1), accepted_len(head, seq, i + 1)
                    draft = lookup[0] if a > b else head
                    sources["lookup" if a > b else "heads"] += 1
                else:
                    source = hybrid.choose(r, lookup, head)
                    draft = lookup[0] if source == "lookup" else head
                    sources[source] += 1
            n = accepted_len(draft, seq, i + 1)
            for j in range(n):
                accepted[j] += 1
            emitted = seq[i + 1 : i + 2 + n]
            t0 = time.perf_counter()
            hybrid.extend(r, emitted)
            lookup_s += time.perf_counter() - t0
            steps, tokens, i = steps + 1, tokens + len(emitted), i + len(emitted)
        hybrid.finish(r)
    total = sum(sources.values()) or 1
    return {"tau": tokens / steps, "acceptance": [a / steps for a in accepted],
            "lookup_share": sources["lookup"] / total, "lookup_us_per_step": lookup_s / steps * 1e6}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", help="an MLP-speculator or Medusa export")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--data", nargs="+", default=["mt-bench", "humaneval"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--margins", type=float, nargs="+", default=[-0.5, -0.25, 0.0, 0.25, 0.5, 1.0])
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    target = Target.load(args.target, torch.float32)
    model = load_speculator(args.export).float()
    base = model.hybrid_config()
    rows = {}
    for data in args.data:
        seqs = [(n, seq.tolist()) for n, seq in greedy_outputs(target, data, args.num_prompts, args.max_new_tokens)]
        drafts = heads_drafts(target, model, seqs, args.k)
        rules = [("ngram", base), ("suffix", base), ("suffix no-cache", replace(base, max_cached_requests=0)),
                 ("heads", base), ("oracle", base)]
        rules += [(f"hybrid m={m:g}", replace(base, margin=m)) for m in args.margins]
        for name, config in rules:
            r = replay(seqs, drafts, args.k, name.split()[0], config)
            rows[f"{data} {name}"] = r
            print(f"{data:>10} {name:>15}: tau {r['tau']:.3f}  acceptance/pos "
                  f"{' / '.join(f'{a:.3f}' for a in r['acceptance'])}  lookup share {r['lookup_share']:.2f}  "
                  f"lookup {r['lookup_us_per_step']:.0f} us/step", flush=True)
        ms = heads_ms_per_step(target, model, seqs, args.k)
        rows[f"{data} heads_ms_per_step"] = ms
        print(f"{data:>10} heads' proposal alone at batch 1: {ms:.2f} ms/step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
