"""How MKL's CBWR mode changes the cost of a verification forward on this CPU.

Speculative decoding pays one target forward over k+1 tokens per step, so its speedup depends on
that forward costing little more than a 1-token forward (the GEMMs stay weight-bandwidth-bound).
torch's CPU BLAS (MKL) takes a much slower fp32 path for a few rows on AMD CPUs by default; setting
MKL_CBWR (which the `speculators` entry points do) avoids it. MKL reads the variable at its first GEMM, so
each setting runs in its own process; the two run one after the other in one invocation.

It also times the batch-1 proposal's GEMV through a [16384 x 576] fp32 head (the quick recipe's draft
vocabulary) stored row-major ([out, in], as nn.Linear keeps it) and input-major ([in, out]), which is how
MLPSpeculator lays its heads out for the CPU proposal.

    python benchmarks/bench_cpu_gemm.py --tokens 1 4 5
"""

import argparse
import json
import os
import subprocess
import sys
import time


def measure(target: str, tokens: list[int], reps: int, threads: int) -> dict[int, float]:
    """Median ms of a target forward over n new tokens after a 200-token cached prefix."""
    import torch
    from transformers import DynamicCache

    from speculators.target import Target

    torch.set_num_threads(threads)
    model = Target.load(target, torch.float32)
    prefix = torch.randint(0, model.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    result = {}
    for n in tokens:
        cache = DynamicCache()
        model(prefix, past_key_values=cache, use_cache=True)
        times = []
        for _ in range(reps):
            ids = torch.randint(0, model.vocab_size, (1, n))
            start = time.perf_counter()
            model(ids, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-n)
        result[n] = sorted(times)[reps // 2] * 1e3
    heads = [torch.randn(16384, model.hidden_size) for _ in range(6)]  # 226 MB: out of cache
    x = torch.randn(1, model.hidden_size)
    for name, mats in (("gemv row-major", heads), ("gemv input-major", [h.t().contiguous().t() for h in heads])):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for h in mats:
                x @ h.t()
            times.append((time.perf_counter() - start) / len(mats))
        result[name] = sorted(times)[reps // 2] * 1e3
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 5])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.target, args.tokens, args.reps, args.threads)))
        return
    rows = {}
    # An empty value keeps MKL's default.
    for label, cbwr in (("MKL default", ""), ("MKL_CBWR=AUTO", "AUTO")):
        env = {**os.environ, "MKL_CBWR": cbwr}
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, check=True,
                             capture_output=True, text=True).stdout
        rows[label] = {(int(n) if n.isdigit() else n): ms for n, ms in json.loads(out.strip().splitlines()[-1]).items()}
    print(f"fp32 target forward after a 200-token prefix, {args.threads} threads, median of {args.reps}")
    print(f"| MKL | {' | '.join(f'{n} tokens (ms)' for n in args.tokens)} | {args.tokens[-1]} / 1 token |")
    print("|---|" + "---|" * (len(args.tokens) + 1))
    for label, ms in rows.items():
        print(f"| {label} | {' | '.join(f'{ms[n]:.1f}' for n in args.tokens)} | {ms[args.tokens[-1]] / ms[args.tokens[0]]:.2f}x |")
    print("\nbatch-1 GEMV through a [16384 x 576] fp32 head, ms")
    print("| MKL | row-major | input-major | row / input |")
    print("|---|---|---|---|")
    for label, ms in rows.items():
        row, inp = ms["gemv row-major"], ms["gemv input-major"]
        print(f"| {label} | {row:.2f} | {inp:.2f} | {row / inp:.2f}x |")


if __name__ == "__main__":
    main()
