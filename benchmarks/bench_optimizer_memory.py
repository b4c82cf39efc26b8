"""Optimizer state memory and step time of a draft model: torch's AdamW against AdamW8bit, one run.

Trains every parameter of the model (as the DistillSpec trainer does) for a few steps on a short
real-token batch and reports, per optimizer, the bytes held in its state, the fp32 training memory
it implies (weights + gradients + state) and the median optimizer-step time.

    python benchmarks/bench_optimizer_memory.py --model qwen2.5-coder-0.5b-instruct
"""

import argparse
import statistics
import time

import torch

from speculators.optim import AdamW8bit, state_bytes
from speculators.target import load_causal_lm

GB = 1024**3


def measure(model, tokenizer, optimizer_cls, steps: int) -> tuple[int, float]:
    opt = optimizer_cls(model.parameters(), lr=1e-5, betas=(0.9, 0.95))
    ids = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n", return_tensors="pt")["input_ids"]
    times = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    n = state_bytes(opt)
    del opt
    return n, statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="alias, directory or .gguf file")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    model, tokenizer = load_causal_lm(args.model, torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:.0f}M parameters, fp32 weights {weights / GB:.2f} GiB, gradients the same")
    rows = {}
    for name, cls in (("adamw", torch.optim.AdamW), ("adamw8bit", AdamW8bit)):
        rows[name] = measure(model, tokenizer, cls, args.steps)
        state, step_s = rows[name]
        print(f"{name:10s} state {state / GB:6.2f} GiB ({state / n_params:.2f} B/param)   "
              f"weights+grads+state {(2 * weights + state) / GB:6.2f} GiB   optimizer step {step_s * 1e3:7.0f} ms")
    (a, ta), (b, tb) = rows["adamw"], rows["adamw8bit"]
    print(f"adamw8bit / adamw: state {b / a:.3f}x, weights+grads+state {(2 * weights + b) / (2 * weights + a):.3f}x, "
          f"step time {tb / ta:.2f}x")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
