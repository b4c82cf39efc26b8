"""Benchmark the fused speculative-decoding inference kernels against their baselines.

    python benchmarks/bench_inference_kernels.py                 # CPU: small shapes, torch paths
    python benchmarks/bench_inference_kernels.py --interpret     # CPU: + Triton paths in the interpreter (smoke test)
    python benchmarks/bench_inference_kernels.py --device cuda   # GPU: the real shapes (< 5 min on one GPU)

Verification (CUDA shapes: B=256, K=4, V=128256, fp32 logits):
  * ``fused``  — :func:`speculators.kernels.chain_verification.rejection_sample` (Triton).
  * ``vllm-style`` — our own re-implementation of the structure of vLLM's Triton rejection
    sampler: probabilities from a separate torch softmax pass, ``argmax`` in torch for greedy
    requests, one program per request for the greedy and the random accept kernels, recovered
    tokens by ``argmax(max(p - q, 0) / Exp(1))`` over vocab blocks of 8192 (grid (B, K)), and
    the bonus token drawn by the regular sampler (softmax + exponential race in torch).
  * ``reference`` — the fp64 torch reference.
  * ``floor`` — logits (+ draft probs when given) read once at the device-copy bandwidth
    measured in the same run; ``%floor`` = floor time / kernel time.
Proposal (CUDA shapes: B=64, bf16; Llama-3-8B-like D=4096 V=128256, SmolLM2 D=576 V=49152, 4 heads):
  * ``fused`` Triton ops vs ``eager`` PyTorch heads + argmax (what vLLM's Medusa / MLP speculator
    modules do).  ``floor`` = weights read once.
On CUDA both are timed with ``triton.testing.do_bench`` (L2 flushed between reps) and, where the
op can be captured, as CUDA-graph replays (launch overhead removed — what a serving engine sees).
On CPU the ops dispatch to the torch references; the timings only show that the code runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--interpret", action="store_true", help="CPU only: also run the Triton paths (interpreter)")
    ap.add_argument("--only", choices=["verify", "propose"], default=None)
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: skip CUDA-graph timings")
    ap.add_argument("--no-reference", action="store_true", help="skip the (slow) fp64 references")
    ap.add_argument("--tune", action="store_true", help="CUDA: sweep a few launch configurations")
    return ap.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu" and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:  # noqa: E402
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover
    HAS_TRITON = False

from speculators.kernels import chain_verification as Vf  # noqa: E402
from speculators.kernels import medusa_proposal as Med  # noqa: E402
from speculators.kernels import mlp_proposal as Mlp  # noqa: E402
from speculators.kernels import row_stats as RS  # noqa: E402


# ----------------------------------------------------------------------------------------
# vLLM-style baseline (our re-implementation of the structure of vLLM's rejection sampler)
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _vl_greedy_kernel(out_ptr, nd_ptr, draft_ptr, argmax_ptr, bonus_ptr, K):
        req = tl.program_id(0)
        n = tl.load(nd_ptr + req).to(tl.int32)
        start = req * K
        rejected = tl.zeros((), tl.int32)
        for pos in range(0, n):
            if rejected == 0:
                d = tl.load(draft_ptr + start + pos)
                t = tl.load(argmax_ptr + start + pos)
                tl.store(out_ptr + req * (K + 1) + pos, t)
                rejected = (d != t).to(tl.int32)
        if rejected == 0:
            tl.store(out_ptr + req * (K + 1) + n, tl.load(bonus_ptr + req))

    @triton.jit
    def _vl_random_kernel(out_ptr, nd_ptr, draft_ptr, dprob_ptr, tprob_ptr, bonus_ptr, rec_ptr, unif_ptr, K, V,
                          NO_DRAFT_PROBS: tl.constexpr):
        req = tl.program_id(0)
        n = tl.load(nd_ptr + req).to(tl.int32)
        start = req * K
        rejected = tl.zeros((), tl.int32)
        for pos in range(0, n):
            if rejected == 0:
                d = tl.load(draft_ptr + start + pos)
                tp = tl.load(tprob_ptr + (start + pos).to(tl.int64) * V + d)
                u = tl.load(unif_ptr + start + pos)
                if NO_DRAFT_PROBS:
                    accept = tp >= u
                else:
                    dp = tl.load(dprob_ptr + (start + pos).to(tl.int64) * V + d)
                    accept = (dp > 0) & (tp / dp >= u)
                if accept:
                    tok = d
                else:
                    rejected = tl.full((), 1, tl.int32)
                    tok = tl.load(rec_ptr + start + pos)
                tl.store(out_ptr + req * (K + 1) + pos, tok)
        if rejected == 0:
            tl.store(out_ptr + req * (K + 1) + n, tl.load(bonus_ptr + req))

    @triton.jit
    def _vl_recovered_kernel(rec_ptr, nd_ptr, draft_ptr, dprob_ptr, tprob_ptr, q_ptr, K, V,
                             NO_DRAFT_PROBS: tl.constexpr, BLOCK: tl.constexpr):
        req = tl.program_id(0)
        pos = tl.program_id(1)
        n = tl.load(nd_ptr + req)
        if pos < n:
            row = (req * K + pos).to(tl.int64)
            d = tl.load(draft_ptr + row)
            best = tl.full((), float("-inf"), tl.float32)
            best_i = tl.zeros((), tl.int32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                m = offs < V
                tp = tl.load(tprob_ptr + row * V + offs, mask=m, other=0.0)
                if NO_DRAFT_PROBS:
                    prob = tl.where(offs == d, 0.0, tp)
                else:
                    dp = tl.load(dprob_ptr + row * V + offs, mask=m, other=0.0)
                    prob = tl.maximum(tp - dp, 0.0)
                q = tl.load(q_ptr + req.to(tl.int64) * V + offs, mask=m, other=1.0)
                score = tl.where(m, prob / q, float("-inf"))
                bm = tl.max(score, axis=0)
                bi = tl.argmax(score, axis=0).to(tl.int32) + v0
                upd = bm > best
                best = tl.where(upd, bm, best)
                best_i = tl.where(upd, bi, best_i)
            tl.store(rec_ptr + row, best_i.to(tl.int64))


def vllm_style_rejection_sample(logits, drafts, nd, draft_probs=None, temperature=None):
    """Baseline: torch softmax pass + vLLM-structured Triton kernels (fresh, unseeded randomness)."""
    B, R, V = logits.shape
    K = R - 1
    out = torch.full((B, R), -1, dtype=torch.int64, device=logits.device)
    drafts = drafts.contiguous()
    if temperature is None:  # all greedy
        target_argmax = logits[:, :K].argmax(-1).contiguous()
        bonus = logits[:, K].argmax(-1)
        _vl_greedy_kernel[(B,)](out, nd, drafts, target_argmax, bonus, K, num_warps=1)
        return out
    T = temperature.view(B, 1, 1)
    tprobs = torch.softmax(logits[:, :K] / T, dim=-1, dtype=torch.float32).contiguous()  # [B, K, V]
    bprobs = torch.softmax(logits[:, K] / T.view(B, 1), dim=-1, dtype=torch.float32)
    bonus = (bprobs / torch.empty_like(bprobs).exponential_()).argmax(-1)  # regular sampler: bonus token
    q = torch.empty(B, V, dtype=torch.float32, device=logits.device).exponential_()
    unif = torch.rand(B, K, dtype=torch.float32, device=logits.device)
    rec = torch.empty(B, K, dtype=torch.int64, device=logits.device)
    dp = draft_probs.contiguous() if draft_probs is not None else tprobs
    _vl_recovered_kernel[(B, K)](rec, nd, drafts, dp, tprobs, q, K, V, NO_DRAFT_PROBS=draft_probs is None,
                                 BLOCK=8192 if not os.environ.get("TRITON_INTERPRET") == "1" else 64, num_warps=8)
    _vl_random_kernel[(B,)](out, nd, drafts, dp, tprobs, bonus, rec, unif, K, V,
                            NO_DRAFT_PROBS=draft_probs is None, num_warps=1)
    return out


# ----------------------------------------------------------------------------------------
# Eager proposal baselines (PyTorch heads + argmax)
# ----------------------------------------------------------------------------------------
def eager_medusa(hidden, bw, bb, lm):
    toks = []
    for h in range(bw.shape[0]):
        x = hidden
        for layer in range(bw.shape[1]):
            x = x + F.silu(F.linear(x, bw[h, layer], None if bb is None else bb[h, layer]))
        toks.append(F.linear(x, lm[h] if lm.dim() == 3 else lm).argmax(-1))
    return torch.stack(toks, 1)


def eager_mlp(hidden, tokens, emb, proj, lw, lb, head):
    n = len(head)
    _, _, es = Mlp.mlp_speculator_scales(n, proj[0].shape[0])
    state, tok, out = hidden, tokens, []
    for i in range(n):
        s = F.linear(state, proj[i])
        s.add_(F.embedding(tok, emb[i]), alpha=es)
        s = s * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(s.dtype)
        s = F.gelu(s * lw[i] + lb[i])
        tok = F.linear(s, head[i]).argmax(-1)
        out.append(tok)
        state = s
    return torch.stack(out, 1)


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------
def _time_cpu(fn, budget_s=1.0, max_iter=20):
    fn()
    ts, t_end = [], time.perf_counter() + budget_s
    while len(ts) < max_iter and (len(ts) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _time_cuda(fn, graph=False):
    from triton.testing import do_bench

    if not graph:
        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=50, return_mode="median")


class Table:
    def __init__(self, title):
        self.title, self.rows = title, []

    def add(self, case, impl, ms, nbytes=None, floor_ms=None, base_ms=None, note=""):
        self.rows.append((case, impl, ms, nbytes, floor_ms, base_ms, note))

    def show(self):
        print(f"\n## {self.title}")
        hdr = f"{'case':<34} {'impl':<22} {'time ms':>10} {'GB/s':>9} {'%floor':>7} {'vs base':>8}  note"
        print(hdr)
        print("-" * len(hdr))
        for case, impl, ms, nbytes, floor_ms, base_ms, note in self.rows:
            if ms is None:
                print(f"{case:<34} {impl:<22} {'n/a':>10} {'':>9} {'':>7} {'':>8}  {note}")
                continue
            gbs = f"{nbytes / ms / 1e6:9.1f}" if nbytes else f"{'':>9}"
            fl = f"{100 * floor_ms / ms:6.1f}%" if floor_ms else f"{'':>7}"
            sp = f"{base_ms / ms:7.2f}x" if base_ms else f"{'':>8}"
            print(f"{case:<34} {impl:<22} {ms:10.4f} {gbs} {fl} {sp}  {note}")
        sys.stdout.flush()


def _graph_pair(tab, case, graph_timer, base_fn, ours_fn, nbytes, floor_ms, base_name="eager"):
    try:
        gb = graph_timer(base_fn)
        tab.add(case, f"{base_name} [graph]", gb, nbytes, floor_ms)
    except Exception as e:  # pragma: no cover - depends on the torch build
        gb = None
        tab.add(case, f"{base_name} [graph]", None, note=f"capture failed: {type(e).__name__}: {str(e)[:60]}")
    try:
        tab.add(case, "fused [graph]", graph_timer(ours_fn), nbytes, floor_ms, gb)
    except Exception as e:  # pragma: no cover
        tab.add(case, "fused [graph]", None, note=f"capture failed: {type(e).__name__}: {str(e)[:60]}")


def _measure_copy_bw(nbytes, device, timer):
    n = max(1, nbytes // 4)
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    del a, b
    return 2 * n * 4 / (ms * 1e-3)  # bytes/s (read + write)


# ----------------------------------------------------------------------------------------
# Benchmarks
# ----------------------------------------------------------------------------------------
def bench_verify(dev, cuda, interp, timer, graph_timer, with_ref):
    if cuda:
        B, K, V = 256, 4, 128256
    elif interp:
        B, K, V = 2, 2, 300
    else:
        B, K, V = 8, 4, 4096
    torch.manual_seed(0)
    logits = torch.randn(B, K + 1, V, device=dev) * 3
    am = logits.argmax(-1)
    drafts = am[:, :K].clone()
    drafts[B // 2 :, K // 2] = (drafts[B // 2 :, K // 2] + 1) % V  # half the batch rejects mid-way
    nd = torch.full((B,), K, dtype=torch.int64, device=dev)
    dprobs = torch.softmax(torch.randn(B, K, V, device=dev) * 3, -1)
    temp = torch.ones(B, device=dev)
    seeds = torch.arange(B, device=dev)
    lbytes = logits.numel() * 4
    bw = _measure_copy_bw(lbytes, dev, timer)
    tab = Table(f"verification B={B} K={K} V={V} fp32 logits ({lbytes / 1e6:.0f} MB); copy bw {bw / 1e9:.0f} GB/s")
    run_triton = cuda or interp
    cases = [
        ("greedy", dict(), lbytes),
        ("stochastic one-hot drafts", dict(temperature=temp, seeds=seeds), lbytes),
        ("stochastic + draft probs", dict(draft_probs=dprobs, temperature=temp, seeds=seeds), lbytes + dprobs.numel() * 4),
    ]
    for name, kw, nbytes in cases:
        floor_ms = nbytes / bw * 1e3
        base = None
        if run_triton:
            base_kw = dict(draft_probs=kw.get("draft_probs"), temperature=kw.get("temperature"))
            if name == "greedy":
                ref_out = Vf.rejection_sample_reference(logits, drafts, nd)[0]
                assert torch.equal(vllm_style_rejection_sample(logits, drafts, nd), ref_out), "baseline mismatch"
                assert torch.equal(Vf.rejection_sample_triton(logits, drafts, nd)[0], ref_out), "fused mismatch"
            base = timer(lambda: vllm_style_rejection_sample(logits, drafts, nd, **base_kw))
            tab.add(name, "vllm-style", base, nbytes, floor_ms)
            ms = timer(lambda: Vf.rejection_sample_triton(logits, drafts, nd, **kw))
            tab.add(name, "fused (triton)", ms, nbytes, floor_ms, base)
            if cuda and graph_timer is not None:
                _graph_pair(tab, name, graph_timer, lambda: vllm_style_rejection_sample(logits, drafts, nd, **base_kw),
                            lambda: Vf.rejection_sample_triton(logits, drafts, nd, **kw), nbytes, floor_ms,
                            base_name="vllm-style")
        if with_ref:
            ms = timer(lambda: Vf.rejection_sample_reference(logits, drafts, nd, **kw))
            tab.add(name, "torch reference (fp64)", ms, nbytes, floor_ms, base)
        if not cuda:
            ms = timer(lambda: Vf.rejection_sample(logits, drafts, nd, **kw))
            tab.add(name, "op() on CPU", ms, nbytes, floor_ms, base, "dispatches to the reference")
    tab.add("floor (logits read once)", "device copy", lbytes / bw * 1e3, lbytes, lbytes / bw * 1e3)
    tab.show()
    if cuda and ARGS is not None and ARGS.tune:
        tun = Table("verification stats kernel configs (stochastic one-hot)")
        for bv, nw in [(2048, 8), (4096, 8), (4096, 16), (8192, 16)]:
            for pps in (2, 4, 8):
                RS.ROW_STATS_CONFIG.update(block_v=bv, num_warps=nw, programs_per_sm=pps)
                ms = timer(lambda: Vf.rejection_sample_triton(logits, drafts, nd, temperature=temp, seeds=seeds))
                tun.add(f"block_v={bv} warps={nw} pps={pps}", "fused", ms, lbytes, lbytes / bw * 1e3)
        RS.ROW_STATS_CONFIG.update(block_v=4096, num_warps=16, programs_per_sm=4)
        tun.show()


def bench_propose(dev, cuda, interp, timer, graph_timer, with_ref):
    if cuda:
        B, dt = 64, torch.bfloat16
        shapes = [("llama3-8b-like", 4096, 128256), ("smollm2", 576, 49152)]
    elif interp:
        B, dt = 2, torch.float32
        shapes = [("tiny", 32, 256)]
    else:
        B, dt = 4, torch.float32
        shapes = [("llama-like/16", 256, 8192), ("smollm2-like/4", 144, 12288)]
    H = 4
    run_triton = cuda or interp
    for name, D, V in shapes:
        torch.manual_seed(1)
        r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
        hidden = r(B, D)
        tab = Table(f"proposal {name}: B={B} D={D} V={V} heads={H} {str(dt).replace('torch.', '')}")
        el = torch.empty((), dtype=dt).element_size()
        # Medusa: H heads, 1 ResBlock, per-head lm heads
        bwt, bb, lm = r(H, 1, D, D) / D**0.5, r(H, 1, D) * 0.1, r(H, V, D) / D**0.5
        mbytes = (H * D * D + H * V * D) * el
        bw = _measure_copy_bw(mbytes, dev, timer)
        floor = mbytes / bw * 1e3
        base = timer(lambda: eager_medusa(hidden, bwt, bb, lm))
        tab.add(f"medusa {H} heads (argmax)", "eager", base, mbytes, floor)
        if run_triton:
            ref = eager_medusa(hidden, bwt, bb, lm)
            got = Med.medusa_propose_triton(hidden, bwt, bb, lm, 1)[1][..., 0]
            agree = float((ref == got).float().mean())
            tab.add(f"medusa {H} heads (argmax)", "fused (triton)",
                    timer(lambda: Med.medusa_propose_triton(hidden, bwt, bb, lm, 1)), mbytes, floor, base,
                    f"token agreement with eager {agree:.3f}")
            if cuda and graph_timer is not None:
                _graph_pair(tab, f"medusa {H} heads (argmax)", graph_timer,
                            lambda: eager_medusa(hidden, bwt, bb, lm),
                            lambda: Med.medusa_propose_triton(hidden, bwt, bb, lm, 1), mbytes, floor)
        if with_ref and not cuda:
            tab.add(f"medusa {H} heads (argmax)", "op() on CPU",
                    timer(lambda: Med.medusa_propose(hidden, bwt, bb, lm, 1)), mbytes, floor, base, "reference")
        del bwt, bb, lm
        # MLP speculator, n_predict = H, inner = D
        emb = [r(V, D) for _ in range(H)]
        proj = [r(D, D) / D**0.5 for _ in range(H)]
        lw = [torch.ones(D, device=dev, dtype=dt) for _ in range(H)]
        lb = [torch.zeros(D, device=dev, dtype=dt) for _ in range(H)]
        head = [r(V, D) / D**0.5 for _ in range(H)]
        tokens = torch.randint(0, V, (B,), device=dev)
        pbytes = (H * D * D + H * V * D) * el
        floor = pbytes / bw * 1e3
        base = timer(lambda: eager_mlp(hidden, tokens, emb, proj, lw, lb, head))
        tab.add(f"mlp speculator {H} stages", "eager", base, pbytes, floor)
        if run_triton:
            ref = eager_mlp(hidden, tokens, emb, proj, lw, lb, head)
            got = Mlp.mlp_speculator_propose_triton(hidden, tokens, emb, proj, lw, lb, head, False)
            agree = float((ref == got).float().mean())
            tab.add(f"mlp speculator {H} stages", "fused (triton)",
                    timer(lambda: Mlp.mlp_speculator_propose_triton(hidden, tokens, emb, proj, lw, lb, head, False)),
                    pbytes, floor, base, f"token agreement with eager {agree:.3f}")
            if cuda and graph_timer is not None:
                _graph_pair(tab, f"mlp speculator {H} stages", graph_timer,
                            lambda: eager_mlp(hidden, tokens, emb, proj, lw, lb, head),
                            lambda: Mlp.mlp_speculator_propose_triton(hidden, tokens, emb, proj, lw, lb, head, False),
                            pbytes, floor)
        if with_ref and not cuda:
            tab.add(f"mlp speculator {H} stages", "op() on CPU",
                    timer(lambda: Mlp.mlp_speculator_propose(hidden, tokens, emb, proj, lw, lb, head, False)), pbytes,
                    floor, base, "reference")
        tab.show()
        del emb, proj, head
        if cuda:
            torch.cuda.empty_cache()


def main():
    args = ARGS or _parse()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda requested but CUDA is not available")
    if cuda and not HAS_TRITON:
        sys.exit("triton is required for --device cuda")
    interp = (not cuda) and args.interpret
    dev = torch.device(args.device)
    timer = _time_cuda if cuda else (lambda fn: _time_cpu(fn, budget_s=0.5 if not interp else 0.1, max_iter=5 if interp else 20))
    graph_timer = (lambda fn: _time_cuda(fn, graph=True)) if (cuda and not args.no_graphs) else None
    if not cuda:
        torch.set_num_threads(1)  # shared 2-core box: OpenMP barriers under load cost milliseconds per op
    print(f"device={dev} torch={torch.__version__} triton={triton.__version__ if HAS_TRITON else None} "
          f"{'(interpreter: timings are NOT performance numbers)' if interp else ''}")
    if cuda:
        print(torch.cuda.get_device_name(dev))
    t0 = time.time()
    with torch.no_grad():
        if args.only in (None, "verify"):
            bench_verify(dev, cuda, interp, timer, graph_timer, not args.no_reference)
        if args.only in (None, "propose"):
            bench_propose(dev, cuda, interp, timer, graph_timer, not args.no_reference)
    print(f"\ntotal {time.time() - t0:.1f}s")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
