"""Row statistics of target logits: the one full pass over ``[B, R, V]`` of both verification ops.

``_row_stats_kernel`` — grid ``(B*R, splits)``; each program streams its vocab chunk of one row
once: greedy rows ``(max, argmax)``; stochastic rows the online-softmax ``(max, sum exp)`` of
``logit / T`` over the kept set (lane-wise, base 2, no cross-warp reduction in the loop), plus on
request the argmax, the entropy accumulator and an exponential race with the counter-based noise
(a sample of the softmax).  Rows past ``row_limit[b]`` are skipped.  The consumer merges the
partials of the splits: chain verification in its finalize kernel
(:mod:`speculators.kernels.chain_verification`), tree verification with :func:`merge_row_stats`
(:mod:`speculators.kernels.tree_verification`).  The PyTorch references of those two ops are the
reference of these statistics.
"""

from __future__ import annotations

import torch

from speculators.kernels.triton_utils import HAS_TRITON, interpreting, tl, triton

__all__ = ["ROW_STATS_CONFIG", "launch_row_stats", "merge_row_stats"]

_INT32_BIG = 2**31 - 1

# Launch configuration of the row-statistics kernel (tunable: benchmarks/bench_inference_kernels.py --tune).
ROW_STATS_CONFIG = {"block_v": 4096, "num_warps": 16, "programs_per_sm": 4}

if HAS_TRITON:
    from speculators.kernels.sampling import race_noise_tl, stream_key_tl

    @triton.jit
    def _row_stats_kernel(
        logits_ptr,
        stride_lb,
        stride_lr,
        row_limit_ptr,
        temp_ptr,
        thr_ptr,
        seed_ptr,
        part_f_ptr,  # fp32 [5, P]: gmax, m (natural log units), z, h (entropy accumulator), race score
        part_i_ptr,  # int32 [2, P]: argmax, race winner
        P,
        R,
        V,
        S,
        CHUNK,
        HAS_TEMP: tl.constexpr,
        HAS_THR: tl.constexpr,
        RACE: tl.constexpr,  # also sample the row: exponential race with the counter-based noise
        ALWAYS_ARGMAX: tl.constexpr,
        NEED_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Partial statistics of one vocab chunk of one row (see launch_row_stats).

        Stochastic rows work in base 2 (z2 = logit * log2(e) / T) so that the softmax needs one
        ex2 per element, and run the exponential race argmax_v e_v / E_v with e_v = 2^(z2 - m2)
        (online-rescaled like the softmax sum) by cross-multiplication — no division, no second
        log; E_v = -log2(u_v) is proportional to an Exp(1) variable, which leaves the argmax
        unchanged.
        """
        row = tl.program_id(0)
        split = tl.program_id(1)
        b = row // R
        r = row % R
        limit = tl.load(row_limit_ptr + b)
        if r <= limit:
            out = row * S + split
            start = split * CHUNK
            end = tl.minimum(start + CHUNK, V)
            offs = tl.arange(0, BLOCK_V)
            lrow = logits_ptr + b.to(tl.int64) * stride_lb + r.to(tl.int64) * stride_lr
            if HAS_TEMP:
                T = tl.load(temp_ptr + b)
            else:
                T = 0.0
            if T > 0.0:
                scale = 1.4426950408889634 / T
                if HAS_THR:
                    thr = tl.load(thr_ptr + row)
                else:
                    thr = float("-inf")
                if RACE:
                    skey = stream_key_tl(tl.load(seed_ptr + b), r, 0)
                # lane-wise online softmax (no cross-warp reduction inside the loop)
                m_l = tl.full([BLOCK_V], float("-inf"), tl.float32)
                z_l = tl.zeros([BLOCK_V], dtype=tl.float32)
                h_l = tl.zeros([BLOCK_V], dtype=tl.float32)
                s_e = tl.zeros([BLOCK_V], dtype=tl.float32)
                s_x = tl.full([BLOCK_V], 1.0, tl.float32)
                s_i = tl.full([BLOCK_V], 2147483647, tl.int32)
                g_b = tl.full([BLOCK_V], float("-inf"), tl.float32)
                g_i = tl.full([BLOCK_V], 2147483647, tl.int32)
                for off in range(start, end, BLOCK_V):
                    idx = off + offs
                    msk = idx < end
                    lg = tl.load(lrow + idx, mask=msk, other=float("-inf")).to(tl.float32)
                    keep = msk & (lg >= thr)
                    z = tl.where(keep, lg * scale, float("-inf"))
                    new_m = tl.maximum(m_l, z)
                    safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
                    alpha = tl.exp2(m_l - safe_m)
                    e = tl.where(keep, tl.exp2(z - safe_m), 0.0)
                    if NEED_ENTROPY:
                        h_l = alpha * (h_l + tl.where(z_l > 0.0, m_l - safe_m, 0.0) * z_l)
                        h_l += e * tl.where(keep, z - safe_m, 0.0)
                    z_l = z_l * alpha + e
                    m_l = new_m
                    if RACE:
                        ex = race_noise_tl(skey, idx, False)
                        s_e = s_e * alpha
                        upd = e * s_x > s_e * ex
                        s_e = tl.where(upd, e, s_e)
                        s_x = tl.where(upd, ex, s_x)
                        s_i = tl.where(upd, idx, s_i)
                    if ALWAYS_ARGMAX:
                        lm = tl.where(msk, lg, float("-inf"))
                        updg = lm > g_b
                        g_b = tl.where(updg, lm, g_b)
                        g_i = tl.where(updg, idx, g_i)
                m_run = tl.max(m_l, axis=0)
                safe_run = tl.where(m_run == float("-inf"), 0.0, m_run)
                w = tl.where(m_l == float("-inf"), 0.0, tl.exp2(m_l - safe_run))
                tl.store(part_f_ptr + 1 * P + out, m_run * 0.6931471805599453)
                tl.store(part_f_ptr + 2 * P + out, tl.sum(z_l * w, axis=0))
                if NEED_ENTROPY:
                    dm = tl.where(m_l == float("-inf"), 0.0, m_l - safe_run)
                    h_tot = (h_l + dm * z_l) * w
                    tl.store(part_f_ptr + 3 * P + out, tl.sum(h_tot, axis=0) * 0.6931471805599453)
                if RACE:
                    sc = s_e / s_x * w
                    sm = tl.max(sc, axis=0)
                    tl.store(part_f_ptr + 4 * P + out, sm)
                    tl.store(part_i_ptr + 1 * P + out, tl.min(tl.where(sc == sm, s_i, 2147483647), axis=0))
                if ALWAYS_ARGMAX:
                    gm = tl.max(g_b, axis=0)
                    tl.store(part_f_ptr + out, gm)
                    tl.store(part_i_ptr + out, tl.min(tl.where(g_b == gm, g_i, 2147483647), axis=0))
            else:
                g_b = tl.full([BLOCK_V], float("-inf"), tl.float32)
                g_i = tl.full([BLOCK_V], 2147483647, tl.int32)
                for off in range(start, end, BLOCK_V):
                    idx = off + offs
                    msk = idx < end
                    lg = tl.load(lrow + idx, mask=msk, other=float("-inf")).to(tl.float32)
                    updg = lg > g_b
                    g_b = tl.where(updg, lg, g_b)
                    g_i = tl.where(updg, idx, g_i)
                gm = tl.max(g_b, axis=0)
                tl.store(part_f_ptr + out, gm)
                tl.store(part_i_ptr + out, tl.min(tl.where(g_b == gm, g_i, 2147483647), axis=0))


def launch_row_stats(
    logits, row_limit, temp, thr, seeds, *, always_argmax, need_entropy, has_temp, splits=None, block_v=None,
    num_warps=None,
):
    """Launch _row_stats_kernel over logits [B, R, V]: rows ``r <= row_limit[b]`` of request ``b``, at
    temperature ``temp`` [B] (when ``has_temp``; greedy rows otherwise), above the thresholds ``thr``
    [B, R] (or None), racing with the counter-based noise of ``seeds`` [B] (or None: no sample).

    Returns ``(part_f [5, P], part_i [2, P], S, logits)``: the partials of ``S`` vocab splits per row
    (see :func:`merge_row_stats`) and the logits the kernel read (made contiguous if they were not).
    """
    B, R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if interpreting():
        block_v = block_v or min(triton.next_power_of_2(V), 64)
        num_warps = num_warps or 1
    else:
        block_v = block_v or ROW_STATS_CONFIG["block_v"]
        num_warps = num_warps or ROW_STATS_CONFIG["num_warps"]
    block_v = min(block_v, max(triton.next_power_of_2(V), 16))
    rows = B * R
    n_blocks = triton.cdiv(V, block_v)
    if splits is None:
        if logits.is_cuda:
            sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
            splits = max(1, min(n_blocks, triton.cdiv(ROW_STATS_CONFIG["programs_per_sm"] * sms, max(rows, 1))))
        else:
            splits = 1
    splits = max(1, min(int(splits), n_blocks))
    chunk = triton.cdiv(n_blocks, splits) * block_v
    S = triton.cdiv(V, chunk)
    P = rows * S
    part_f = torch.empty(5, max(P, 1), dtype=torch.float32, device=logits.device)
    part_i = torch.empty(2, max(P, 1), dtype=torch.int32, device=logits.device)
    dummy = part_f
    if rows == 0:
        return part_f, part_i, S, logits
    _row_stats_kernel[(rows, S)](
        logits, logits.stride(0), logits.stride(1),
        row_limit,
        temp if temp is not None else dummy,
        thr if thr is not None else dummy,
        seeds if seeds is not None else row_limit,
        part_f, part_i,
        P, R, V, S, chunk,
        HAS_TEMP=has_temp,
        HAS_THR=thr is not None,
        RACE=seeds is not None,
        ALWAYS_ARGMAX=always_argmax,
        NEED_ENTROPY=need_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return part_f, part_i, S, logits


def merge_row_stats(part_f, part_i, rows, S):
    """Merge the per-split partials of launch_row_stats -> dict of [rows] tensors (torch; tiny): ``gidx``
    argmax, ``m`` softmax max and ``z`` normaliser (natural log units), ``h1`` entropy accumulator
    (``H = log z - h1 / z``), ``sidx`` race winner (a sample of the softmax)."""
    f = part_f[:, : rows * S].view(5, rows, S)
    i = part_i[:, : rows * S].view(2, rows, S)
    big = torch.full_like(i[0], _INT32_BIG)
    gmax = f[0].max(-1).values
    gidx = torch.where(f[0] == gmax.unsqueeze(-1), i[0], big).min(-1).values
    m = f[1].max(-1).values
    safe_m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    dead = torch.isinf(f[1])
    w = torch.where(dead, torch.zeros_like(f[2]), torch.exp(f[1] - safe_m.unsqueeze(-1)))
    Z = (f[2] * w).sum(-1)
    H1 = (torch.where(dead, torch.zeros_like(f[3]), f[3] + (f[1] - safe_m.unsqueeze(-1)) * f[2]) * w).sum(-1)
    sc = torch.where(dead, torch.zeros_like(f[4]), f[4] * w)
    smax = sc.max(-1).values
    sidx = torch.where(sc == smax.unsqueeze(-1), i[1], big).min(-1).values
    return {"gidx": gidx.long(), "m": safe_m, "z": Z, "h1": H1, "sidx": sidx.long()}
