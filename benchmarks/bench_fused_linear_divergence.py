"""Peak memory and time of the multi-head divergence loss (forward + backward), three ways.

  naive    divergence_reference in the input dtype: each head's [T, V] logits materialized
           and kept for autograd.
  chunked  Liger-style loop: per head, token chunks of [chunk, V] logits (Liger's chunk-size
           heuristic), loss and gradients per chunk.
  ours     fused_linear_divergence (Triton on CUDA, chunked PyTorch on CPU).

    python benchmarks/bench_fused_linear_divergence.py --device cpu
    python benchmarks/bench_fused_linear_divergence.py --device cuda
    python benchmarks/bench_fused_linear_divergence.py --device cuda --accuracy --T 2048 --V 32768 --D 1024

--tune (CUDA) times ours over a few tile shapes / warps / pipeline stages, whole op and
forward (statistics pass) alone.

--accuracy compares each variant's loss and gradients with a float64 reference instead of
timing them (a smaller shape: the reference materializes float64 logits).

Memory is the peak above what the inputs already hold, gradients included. On CUDA it is
torch.cuda.max_memory_allocated minus the allocation before the call. On CPU each variant
runs in a fresh process and reports its peak RSS (ru_maxrss) minus its RSS just before the
first call: the operating system's own count of touched pages, so it sees every allocator
(torch's, glibc's, BLAS scratch) and cannot be fooled by caching in torch's allocator.
"""

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

import speculators.kernels.fused_linear_divergence as fld
from speculators.kernels.fused_linear_divergence import (
    divergence_reference,
    fused_linear_divergence,
    per_token_divergence,
)

VARIANTS = ("naive", "chunked", "ours")
DEFAULTS = {  # one CPU round of the default shape takes minutes
    "cpu": dict(T=4096, V=49152, D=576, heads=4, dtype="float32", repeats=1),
    "cuda": dict(T=16384, V=128256, D=4096, heads=4, dtype="bfloat16", repeats=3),
}


def liger_chunk(T, V, D):
    """Liger's FLCE heuristic: token chunks whose [chunk, V] logits are about as big as [T, D]."""
    return 1 << (math.ceil(T / math.ceil(V / D)) - 1).bit_length()


def make_inputs(a):
    """Student and teacher hidden states + lm-heads, drawn in place to avoid temporaries."""
    dtype, dev = getattr(torch, a.dtype), a.device
    g = torch.Generator(dev).manual_seed(0)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype).mul_(std)

    # W ~ N(0, 4/D) gives logits of std ~2, roughly a trained lm-head's spread.
    x = randn(a.heads, a.T, a.D).requires_grad_()
    w = randn(a.V, a.D, std=2 / math.sqrt(a.D)).requires_grad_()
    xt, wt = randn(a.heads, a.T, a.D), randn(a.V, a.D, std=2 / math.sqrt(a.D))
    labels = (torch.randint(0, a.V, (a.heads, a.T), generator=g, device=dev)
              if a.divergence == "ce" else None)
    return x, w, xt, wt, labels


def per_head_chunked(x, w, xt, wt, labels, divergence):
    """Liger-style baseline; fills x.grad and w.grad, returns the loss."""
    H, T, D = x.shape
    V = w.shape[0]
    chunk = liger_chunk(T, V, D)
    x_, w_ = x.detach(), w.detach()
    gx = torch.empty_like(x_)
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    loss = torch.zeros((), device=x.device)
    for h in range(H):
        for t0 in range(0, T, chunk):
            xc = x_[h, t0:t0 + chunk]
            zs = (xc @ w_.T).float().requires_grad_()
            if divergence == "ce":
                lc = torch.nn.functional.cross_entropy(zs, labels[h, t0:t0 + chunk], reduction="sum")
            else:
                log_p = (xt[h, t0:t0 + chunk] @ wt.T).float().log_softmax(-1)
                lc = per_token_divergence(zs.log_softmax(-1), log_p, divergence).sum()
            (dz,) = torch.autograd.grad(lc, zs)
            dz = dz.to(x.dtype)
            gx[h, t0:t0 + chunk] = dz @ w_
            gw += dz.T @ xc
            loss += lc.detach()
    x.grad, w.grad = gx, gw.to(w.dtype)
    return loss


def run_variant(name, inputs, divergence):
    x, w, xt, wt, labels = inputs
    x.grad = w.grad = None
    if name == "chunked":
        return per_head_chunked(x, w, xt, wt, labels, divergence)
    fn = divergence_reference if name == "naive" else fused_linear_divergence
    loss = fn(x, w, xt, wt, labels=labels, divergence=divergence)
    loss.backward()
    return loss


def cpu_child(a):
    """One call of one variant in this fresh process: prints {"peak_mib", "time"} as JSON."""
    inputs = make_inputs(a)
    with open("/proc/self/statm") as f:
        rss_before = int(f.read().split()[1]) * resource.getpagesize()
    t0 = time.perf_counter()
    run_variant(a.child, inputs, a.divergence)
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps(dict(peak_mib=(peak - rss_before) / 2**20, time=elapsed)))


def cpu_parent(a):
    """Rounds of naive, chunked, ours, one fresh process each, so that load from other
    processes on a shared machine hits all variants alike."""
    results = {}
    for _ in range(a.repeats):
        for name in a.variants:
            argv = [sys.executable, __file__, "--child", name] + [
                f"--{k}={getattr(a, k)}" for k in ("device", "T", "V", "D", "heads", "dtype", "divergence", "repeats")]
            out = subprocess.run(argv, capture_output=True, text=True)
            if out.returncode != 0:  # e.g. naive killed for memory: report, keep going
                print(f"{name}: failed ({out.returncode}): {out.stderr.strip()[-300:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            prev = results.setdefault(name, dict(peak_mib=0.0, times=[]))
            prev["peak_mib"] = max(prev["peak_mib"], r["peak_mib"])
            prev["times"].append(r["time"])
    return results


def cuda_seconds(fn, n=1):
    """Mean seconds of n calls of fn, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def cuda_run(a):
    inputs = make_inputs(a)
    results = {}
    for name in a.variants:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            t0 = time.perf_counter()
            run_variant(name, inputs, a.divergence)  # warm-up: Triton compiles here
            torch.cuda.synchronize()
            warm = time.perf_counter() - t0
            print(f"{name}: warm-up (compile + 1 call) {warm:.1f} s", flush=True)
            # a slow variant gets one timed call
            times = [cuda_seconds(lambda: run_variant(name, inputs, a.divergence))
                     for _ in range(a.repeats if warm < 30 else 1)]
        except torch.cuda.OutOfMemoryError:
            print(f"{name}: out of memory")
            continue
        finally:
            inputs[0].grad = inputs[1].grad = None
        results[name] = dict(peak_mib=(torch.cuda.max_memory_allocated() - base) / 2**20, times=times)
    return results


def accuracy(a):
    """Relative error of each variant's loss and gradients against a float64 reference."""
    x, w, xt, wt, labels = make_inputs(a)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    loss64 = divergence_reference(x64, w64, xt.double(), wt.double(), labels=labels, divergence=a.divergence)
    loss64.backward()
    ref = (loss64.detach(), x64.grad, w64.grad)
    del x64, w64
    print(f"accuracy vs float64: H={a.heads} T={a.T} V={a.V} D={a.D} dtype={a.dtype} divergence={a.divergence}")
    print(f"{'variant':<10}{'loss':>12}{'grad_input':>12}{'grad_weight':>12}")
    for name in a.variants:
        loss = run_variant(name, (x, w, xt, wt, labels), a.divergence)
        errs = [float((got.double() - r).norm() / r.norm()) for got, r in zip((loss.detach(), x.grad, w.grad), ref)]
        print(f"{name:<10}" + "".join(f"{e:>12.2e}" for e in errs), flush=True)
        x.grad = w.grad = None


TUNE_CONFIGS = [  # BLOCK_T, BLOCK_V, BLOCK_D, num_warps, num_stages
    (64, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4), (128, 128, 32, 8, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 3),
    (64, 256, 64, 8, 3), (128, 256, 64, 8, 3)]


def tune(a):
    x, w, xt, wt, labels = make_inputs(a)

    def full():
        x.grad = w.grad = None
        fused_linear_divergence(x, w, xt, wt, labels=labels, divergence=a.divergence).backward()

    def forward_only():  # inputs that need no gradient: the statistics pass alone
        fused_linear_divergence(x.detach(), w.detach(), xt, wt, labels=labels, divergence=a.divergence)

    print(f"tune: H={a.heads} T={a.T} V={a.V} D={a.D} dtype={a.dtype} divergence={a.divergence}")
    chunked = lambda: per_head_chunked(x, w, xt, wt, labels, a.divergence)  # noqa: E731
    chunked()
    print(f"chunked (baseline, same run): {cuda_seconds(chunked, 2):.3f} s", flush=True)
    print(f"{'BT':>4}{'BV':>5}{'BD':>4}{'warps':>6}{'stages':>7}{'full s':>9}{'stats s':>9}{'grad s':>9}")
    for bt, bv, bd, nw, ns in TUNE_CONFIGS:
        fld._GPU_BLOCKS = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_D=bd)
        fld._GPU_LAUNCH = dict(num_warps=nw, num_stages=ns)
        try:
            full()  # compile
            t_full, t_fwd = cuda_seconds(full, 2), cuda_seconds(forward_only, 2)
            print(f"{bt:>4}{bv:>5}{bd:>4}{nw:>6}{ns:>7}{t_full:>9.3f}{t_fwd:>9.3f}{t_full - t_fwd:>9.3f}", flush=True)
        except Exception as e:  # e.g. out of shared memory for this tile
            print(f"{bt:>4}{bv:>5}{bd:>4}{nw:>6}{ns:>7}  failed: {type(e).__name__}: {str(e)[:80]}", flush=True)


def bf16_matmul_tflops(n=8192, reps=20):
    """Ceiling: a large bf16 torch.matmul, timed in the same run."""
    p, q = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    p @ q
    return 2 * n**3 / cuda_seconds(lambda: p @ q, reps) / 1e12


def report(a, results):
    print(f"device={a.device} H={a.heads} T={a.T} V={a.V} D={a.D} dtype={a.dtype} "
          f"divergence={a.divergence} repeats={a.repeats} chunked: {liger_chunk(a.T, a.V, a.D)} rows/chunk")
    # Minimum over repeats: the least disturbed run on a machine shared with other jobs.
    print(f"{'variant':<10}{'peak extra MiB':>16}{'time s (min)':>14}  all times s")
    best = {k: min(r["times"]) for k, r in results.items()}
    for k, r in results.items():
        print(f"{k:<10}{r['peak_mib']:>16.1f}{best[k]:>14.3f}  {' '.join(f'{t:.2f}' for t in r['times'])}")
    if "ours" in results and "naive" in results:
        print(f"memory naive/ours  {results['naive']['peak_mib'] / results['ours']['peak_mib']:.1f}x lower")
        print(f"time   ours/naive  {best['ours'] / best['naive']:.2f}x")
    if "ours" in results and "chunked" in results:
        print(f"time   ours/chunked {best['ours'] / best['chunked']:.2f}x "
              f"(ours {best['chunked'] / best['ours']:.2f}x faster than chunked)")
    if a.device == "cuda" and "ours" in results:
        # Useful FLOPs: the matmuls of the materialized formulation (student logits, teacher
        # logits unless ce, dX, dW). Ours executes more (logit recomputation; see its docstring).
        flops = 2 * a.heads * a.T * a.V * a.D * (3 if a.divergence == "ce" else 4)
        ceiling = bf16_matmul_tflops()
        achieved = flops / best["ours"] / 1e12
        print(f"ours: {achieved:.1f} useful TFLOP/s; bf16 matmul ceiling {ceiling:.1f} TFLOP/s "
              f"({100 * achieved / ceiling:.0f}%)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    for k in ("T", "V", "D", "heads"):
        ap.add_argument(f"--{k}", type=int)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--divergence", default="fkl", choices=("ce", "fkl", "rkl", "jsd", "tvd"))
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                    help="the variants to run (default: all)")
    ap.add_argument("--accuracy", action="store_true", help="errors against float64 instead of timings")
    ap.add_argument("--tune", action="store_true", help="CUDA: time ours over tile configurations")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.variants = a.variants or list(VARIANTS)
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.child:
        return cpu_child(a)
    if a.accuracy:
        return accuracy(a)
    if a.tune:
        return tune(a)
    report(a, cpu_parent(a) if a.device == "cpu" else cuda_run(a))


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
