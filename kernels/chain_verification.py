"""Chain verification for speculative decoding: rejection sampling of K draft tokens per request.

The op runs Triton on CUDA tensors and the reference elsewhere; ``_impl="triton" | "reference"``
forces one (see :mod:`speculators.kernels.triton_utils`).

Semantics (``rejection_sample``)
--------------------------------
Row ``j`` of ``target_logits[b]`` scores draft token ``j``; row ``num_draft[b]`` yields the
bonus token.  Per request:

* greedy (``temperature[b] == 0`` or ``temperature is None``): accept while the draft equals
  ``argmax(target)``; emit ``argmax`` at the first mismatch (or the bonus row).
* stochastic: ``p`` = softmax(logits / T) restricted to the top-k / top-p set, ``q`` = the draft
  distribution (one-hot at the draft token when ``draft_probs is None``).  Accept ``x`` iff
  ``q(x) > 0 and p(x) / q(x) >= u``; at the first rejection emit a sample of
  ``norm(max(p - q, 0))``; if everything was accepted emit a sample of ``p`` at the bonus row.
  Categorical samples use the exponential race ``argmax_v w_v / E_v`` (``E_v ~ Exp(1)``), i.e.
  ``argmax_v log w_v + Gumbel_v``, which needs no normalisation of ``w`` and can be evaluated
  tile by tile over the vocabulary.  If ``max(p - q, 0)`` is identically zero (possible only
  through rounding) the sample is drawn from ``p`` instead.

Ties (greedy argmax, exponential race) go to the lowest vocabulary index in both
implementations.  The uniforms ``u`` and the noise ``E`` come from the counter-based generator
of :mod:`speculators.kernels.sampling` (stream 1: the accept test of position j; stream 0: the
vocabulary noise of row j), bit-identical in both implementations; the top-k / top-p set is a
per-row threshold from :func:`~speculators.kernels.sampling.compute_filter_thresholds`.

Fused Triton pipeline
---------------------
1. ``_row_stats_kernel`` (:mod:`speculators.kernels.row_stats`) — grid ``(B*(K+1), splits)``;
   each program streams its vocab chunk of one row once: greedy rows ``(max, argmax)``;
   stochastic rows the online-softmax ``(max, sum exp)`` of ``logit / T`` over the kept set
   (lane-wise, base 2, no cross-warp reduction in the loop).  Rows past ``num_draft[b]`` are
   skipped.  This is the only full pass over the logits.
2. ``_chain_finalize_kernel`` — grid ``(B,)``; merges the split partials and walks the chain:
   accept tests (one gathered logit, one draft prob and one uniform per position), accepted
   tokens, ``-1`` padding, ``num_accepted``; greedy requests get their last token here.
3. stochastic requests only: ``_recover_kernel`` — grid ``(B, splits)``; samples the *single*
   row per request that needs a sample (first rejection: ``norm(max(p - q, 0))``; all accepted:
   ``p`` at the bonus row) by an exponential race evaluated by cross-multiplication (no
   division); ``_recover_decode_kernel`` merges the splits and writes the token.  The noise work
   (hash + log per element) is thus spent on ``B`` rows instead of ``B*(K+1)``, at the price of
   re-reading one row per request (+ its draft-prob row).
2 launches for greedy batches, 4 otherwise; no host synchronisation unless top-k/top-p is used.
"""

from __future__ import annotations

import torch

from speculators.kernels.row_stats import launch_row_stats
from speculators.kernels.sampling import compute_filter_thresholds, counter_uniforms, normalize_sampling_params
from speculators.kernels.triton_utils import HAS_TRITON, interpreting, tl, triton, use_triton

__all__ = ["rejection_sample", "rejection_sample_reference", "rejection_sample_triton"]

# GPU launch configuration of the recovery kernel (the interpreter takes tiny tiles instead).
RECOVER_CONFIG = {"block_v": 2048, "num_warps": 8, "programs_per_sm": 4}

_NEEDS_SEEDS = "stochastic verification (a temperature > 0) needs seeds: one int64 per request"


def _check_chain_inputs(target_logits, draft_tokens, num_draft):
    if target_logits.dim() != 3:
        raise ValueError("target_logits must be [B, K+1, V]")
    B, R, V = target_logits.shape
    if draft_tokens.shape != (B, R - 1):
        raise ValueError(f"draft_tokens must be [B, K] = {(B, R - 1)}, got {tuple(draft_tokens.shape)}")
    if num_draft.shape != (B,):
        raise ValueError("num_draft must be [B]")
    return B, R - 1, V


# ----------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------
def rejection_sample_reference(
    target_logits,
    draft_tokens,
    num_draft,
    draft_probs=None,
    temperature=None,
    top_k=None,
    top_p=None,
    *,
    seeds=None,
    _impl=None,
):
    """Plain-PyTorch (fp64) chain rejection sampling; see :func:`rejection_sample`."""
    B, K, V = _check_chain_inputs(target_logits, draft_tokens, num_draft)
    dev = target_logits.device
    temp, _, _ = normalize_sampling_params(B, dev, temperature, top_k, top_p)
    greedy = temp <= 0
    nd = num_draft.to(torch.int64).clamp(0, K)
    logits = target_logits.double()
    argmax = logits.argmax(-1)  # [B, K+1]; first maximum wins
    x = draft_tokens.to(torch.int64).clamp(0, V - 1)
    valid = torch.arange(K, device=dev).unsqueeze(0) < nd.unsqueeze(1)
    accept = draft_tokens.to(torch.int64) == argmax[:, :K]
    stochastic_any = bool((~greedy).any())
    if stochastic_any:
        thr = compute_filter_thresholds(target_logits, temp, top_k, top_p)
        T = torch.where(greedy, torch.ones_like(temp), temp).double().view(B, 1, 1)
        z = logits / T
        if thr is not None:
            z = z.masked_fill(logits < thr.double().unsqueeze(-1), float("-inf"))
        p = torch.softmax(z, dim=-1)  # [B, K+1, V]
        if draft_probs is None:
            q = torch.zeros(B, K, V, dtype=torch.float64, device=dev).scatter_(-1, x.unsqueeze(-1), 1.0)
        else:
            q = draft_probs.double()
        px = p[:, :K].gather(-1, x.unsqueeze(-1)).squeeze(-1)
        qx = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        if seeds is None:
            raise ValueError(_NEEDS_SEEDS)
        u = counter_uniforms(seeds.to(dev), torch.arange(K, device=dev).expand(B, K), 1, 1).squeeze(-1)
        ratio = px / torch.where(qx > 0, qx, torch.ones_like(qx))
        acc_s = (qx > 0) & (ratio >= u.double())
        accept = torch.where(greedy.unsqueeze(1), accept, acc_s)
    accept = accept & valid
    n_acc = torch.cumprod(accept.to(torch.int64), dim=1).sum(1)  # leading run of accepts
    bidx = torch.arange(B, device=dev)
    final = argmax[bidx, n_acc]
    if stochastic_any:
        p_row = p[bidx, n_acc]  # [B, V]
        is_bonus = n_acc >= nd
        q_row = q[bidx, n_acc.clamp(max=max(K - 1, 0))] if K > 0 else torch.zeros_like(p_row)
        q_row = torch.where(is_bonus.unsqueeze(1), torch.zeros_like(q_row), q_row)
        E = -torch.log(counter_uniforms(seeds.to(dev), n_acc.view(B, 1), 0, V).squeeze(1).double())
        resid = (p_row - q_row).clamp(min=0)
        score = torch.where((resid.max(-1, keepdim=True).values > 0), resid, p_row) / E
        final = torch.where(greedy, final, score.argmax(-1))
    out = torch.full((B, K + 1), -1, dtype=torch.int64, device=dev)
    pos = torch.arange(K + 1, device=dev).unsqueeze(0)
    if K > 0:
        out[:, :K] = torch.where(pos[:, :K] < n_acc.unsqueeze(1), draft_tokens.to(torch.int64), out[:, :K])
    out.scatter_(1, n_acc.unsqueeze(1), final.unsqueeze(1))
    return out, n_acc


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------
if HAS_TRITON:
    from speculators.kernels.sampling import race_noise_tl, stream_key_tl, uniform_tl

    @triton.jit
    def _chain_finalize_kernel(
        logits_ptr,
        stride_lb,
        stride_lr,
        draft_ptr,
        stride_db,
        nd_ptr,
        temp_ptr,
        thr_ptr,
        dprob_ptr,
        stride_qb,
        stride_qr,
        seed_ptr,
        part_f_ptr,
        part_i_ptr,
        out_ptr,
        nacc_ptr,
        rec_i_ptr,  # int32 [B, 2]: row to sample (-1: none), excluded token (one-hot drafts)
        rec_f_ptr,  # fp32 [B, 2]: softmax max (natural log units) and normaliser of that row
        P,
        K,
        S,
        HAS_TEMP: tl.constexpr,
        HAS_THR: tl.constexpr,
        HAS_DPROBS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """One program per request: merge split partials, walk the chain, write accepted tokens.

        Greedy requests get their final token here; stochastic requests record the row to sample
        (first rejection or bonus row) for _recover_kernel.
        """
        b = tl.program_id(0)
        R = K + 1
        nd = tl.load(nd_ptr + b).to(tl.int32)
        nd = tl.minimum(tl.maximum(nd, 0), K)
        if HAS_TEMP:
            T = tl.load(temp_ptr + b)
        else:
            T = tl.zeros((), tl.float32)
        # (.to(int32) != 0: the interpreter mislabels 0-d float comparisons, which then break on broadcast)
        sto = (T > 0.0).to(tl.int32) != 0
        gre = (T <= 0.0).to(tl.int32) != 0
        Ts = tl.where(sto, T, 1.0)
        offs_s = tl.arange(0, BLOCK_S)
        alive = tl.full((), 1, tl.int32)
        nacc = tl.zeros((), tl.int32)
        rec_pos = tl.full((), -1, tl.int32)
        rec_x = tl.full((), -1, tl.int32)
        rec_m = tl.zeros((), tl.float32)
        rec_z = tl.zeros((), tl.float32)
        if HAS_TEMP:
            seed = tl.load(seed_ptr + b)
        for j in range(0, R):
            row = b * R + j
            active = (alive != 0) & (j <= nd)
            is_draft = active & (j < nd)
            # vector masks via integer bounds (the interpreter cannot broadcast 0-d booleans)
            mg = offs_s < tl.where(active & gre, S, 0)
            ms = offs_s < tl.where(active & sto, S, 0)
            pbase = row * S + offs_s
            # greedy partials
            gmx = tl.load(part_f_ptr + pbase, mask=mg, other=float("-inf"))
            gix = tl.load(part_i_ptr + pbase, mask=mg, other=2147483647)
            gm = tl.max(gmx, axis=0)
            gi = tl.min(tl.where(gmx == gm, gix, 2147483647), axis=0)
            # stochastic partials: softmax max / normaliser
            mm = tl.load(part_f_ptr + 1 * P + pbase, mask=ms, other=float("-inf"))
            zz = tl.load(part_f_ptr + 2 * P + pbase, mask=ms, other=0.0)
            M = tl.max(mm, axis=0)
            safe_M = tl.where(M == float("-inf"), 0.0, M)
            Z = tl.sum(tl.where(mm == float("-inf"), 0.0, zz * tl.exp(mm - safe_M)), axis=0)
            x = tl.load(draft_ptr + b.to(tl.int64) * stride_db + j, mask=is_draft, other=0).to(tl.int32)
            # accept tests
            acc_g = x == gi
            lx = tl.load(logits_ptr + b.to(tl.int64) * stride_lb + j * stride_lr + x,
                         mask=is_draft & sto, other=float("-inf")).to(tl.float32)
            if HAS_THR:
                thr = tl.load(thr_ptr + row, mask=is_draft & sto, other=float("-inf"))
                lx = tl.where(lx >= thr, lx, float("-inf"))
            px = tl.exp(lx * (1.0 / Ts) - safe_M) / tl.where(Z > 0.0, Z, 1.0)
            if HAS_TEMP:
                u = uniform_tl(stream_key_tl(seed, j, 1), 0)
            else:
                u = 0.5
            if HAS_DPROBS:
                qx = tl.load(dprob_ptr + b.to(tl.int64) * stride_qb + j * stride_qr + x,
                             mask=is_draft & sto, other=1.0).to(tl.float32)
                acc_s = (qx > 0.0) & (px / tl.where(qx > 0.0, qx, 1.0) >= u)
            else:
                acc_s = px >= u
            acc = is_draft & tl.where(sto, acc_s, acc_g)
            stop = active & (acc == 0)
            # token emitted when stopping here (-1: sampled by _recover_kernel)
            tok = tl.where(acc, x, tl.where(stop, tl.where(sto, -1, gi), -1))
            tl.store(out_ptr + b.to(tl.int64) * R + j, tok.to(tl.int64))
            samp = stop & sto
            rec_pos = tl.where(samp, j, rec_pos)
            rec_x = tl.where(samp & is_draft, x, rec_x)
            rec_m = tl.where(samp, safe_M, rec_m)
            rec_z = tl.where(samp, Z, rec_z)
            nacc += acc.to(tl.int32)
            alive = tl.where(stop, 0, alive)
        tl.store(nacc_ptr + b, nacc.to(tl.int64))
        tl.store(rec_i_ptr + 2 * b, rec_pos)
        tl.store(rec_i_ptr + 2 * b + 1, rec_x)
        tl.store(rec_f_ptr + 2 * b, rec_m)
        tl.store(rec_f_ptr + 2 * b + 1, rec_z)

    @triton.jit
    def _recover_kernel(
        logits_ptr,
        stride_lb,
        stride_lr,
        dprob_ptr,
        stride_qb,
        stride_qr,
        nd_ptr,
        temp_ptr,
        thr_ptr,
        seed_ptr,
        rec_i_ptr,
        rec_f_ptr,
        part_f_ptr,  # fp32 [2, B, S]: best residual score, best p score (fallback)
        part_i_ptr,  # int32 [2, B, S]
        K,
        V,
        S,
        CHUNK,
        HAS_THR: tl.constexpr,
        HAS_DPROBS: tl.constexpr,
        FAST: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Sample norm(max(p - q, 0)) (or p on the bonus row) on the one row per request that needs
        it, split over vocab chunks: exponential race argmax_v r_v / E_v by cross-multiplication,
        with r = max(p - q, 0) and a second race on p as the fallback when r == 0 everywhere."""
        b = tl.program_id(0)
        split = tl.program_id(1)
        j = tl.load(rec_i_ptr + 2 * b)
        out = b * S + split
        if j >= 0:
            R = K + 1
            x = tl.load(rec_i_ptr + 2 * b + 1)
            is_draft = j < tl.load(nd_ptr + b).to(tl.int32)
            T = tl.load(temp_ptr + b)
            M = tl.load(rec_f_ptr + 2 * b)
            Z = tl.load(rec_f_ptr + 2 * b + 1)
            invZ = 1.0 / tl.where(Z > 0.0, Z, 1.0)
            invT = 1.0 / T
            if HAS_THR:
                thr = tl.load(thr_ptr + b * R + j)
            else:
                thr = float("-inf")
            skey = stream_key_tl(tl.load(seed_ptr + b), j, 0)
            lrow = logits_ptr + b.to(tl.int64) * stride_lb + j.to(tl.int64) * stride_lr
            qrow = dprob_ptr + b.to(tl.int64) * stride_qb + j.to(tl.int64) * stride_qr
            q_lim = tl.where(is_draft, V, 0)  # no draft distribution on the bonus row
            offs = tl.arange(0, BLOCK_V)
            r_s = tl.zeros([BLOCK_V], dtype=tl.float32)
            r_x = tl.full([BLOCK_V], 1.0, tl.float32)
            r_i = tl.full([BLOCK_V], 2147483647, tl.int32)
            if HAS_DPROBS:
                p_s = tl.zeros([BLOCK_V], dtype=tl.float32)
                p_x = tl.full([BLOCK_V], 1.0, tl.float32)
                p_i = tl.full([BLOCK_V], 2147483647, tl.int32)
            start = split * CHUNK
            end = tl.minimum(start + CHUNK, V)
            for off in range(start, end, BLOCK_V):
                idx = off + offs
                msk = idx < end
                lg = tl.load(lrow + idx, mask=msk, other=float("-inf")).to(tl.float32)
                keep = msk & (lg >= thr)
                p = tl.where(keep, tl.exp(lg * invT - M) * invZ, 0.0)
                ex = race_noise_tl(skey, idx, FAST)
                if HAS_DPROBS:
                    q = tl.load(qrow + idx, mask=idx < q_lim, other=0.0).to(tl.float32)
                    res = tl.maximum(p - q, 0.0)
                    u2 = p * p_x > p_s * ex
                    p_s = tl.where(u2, p, p_s)
                    p_x = tl.where(u2, ex, p_x)
                    p_i = tl.where(u2, idx, p_i)
                else:
                    res = tl.where(idx == x, 0.0, p)  # one-hot q: max(p - 1, 0) = 0 at the draft token
                u1 = res * r_x > r_s * ex
                r_s = tl.where(u1, res, r_s)
                r_x = tl.where(u1, ex, r_x)
                r_i = tl.where(u1, idx, r_i)
            rs = r_s / r_x
            rm = tl.max(rs, axis=0)
            tl.store(part_f_ptr + out, rm)
            tl.store(part_i_ptr + out, tl.min(tl.where(rs == rm, r_i, 2147483647), axis=0))
            if HAS_DPROBS:
                ps = p_s / p_x
                pm = tl.max(ps, axis=0)
                tl.store(part_f_ptr + tl.num_programs(0) * S + out, pm)
                tl.store(part_i_ptr + tl.num_programs(0) * S + out, tl.min(tl.where(ps == pm, p_i, 2147483647), axis=0))

    @triton.jit
    def _recover_decode_kernel(rec_i_ptr, part_f_ptr, part_i_ptr, out_ptr, K, S, HAS_DPROBS: tl.constexpr,
                               BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        B = tl.num_programs(0)
        j = tl.load(rec_i_ptr + 2 * b)
        if j >= 0:
            x = tl.load(rec_i_ptr + 2 * b + 1)
            offs = tl.arange(0, BLOCK_S)
            m = offs < S
            rs = tl.load(part_f_ptr + b * S + offs, mask=m, other=-1.0)
            ri = tl.load(part_i_ptr + b * S + offs, mask=m, other=2147483647)
            rm = tl.max(rs, axis=0)
            tok = tl.min(tl.where(rs == rm, ri, 2147483647), axis=0)
            if HAS_DPROBS:
                ps = tl.load(part_f_ptr + B * S + b * S + offs, mask=m, other=-1.0)
                pi = tl.load(part_i_ptr + B * S + b * S + offs, mask=m, other=2147483647)
                pm = tl.max(ps, axis=0)
                fb = tl.min(tl.where(ps == pm, pi, 2147483647), axis=0)
            else:
                fb = x  # p is one-hot at the draft token
            tok = tl.where(rm > 0.0, tok, fb)
            tl.store(out_ptr + b.to(tl.int64) * (K + 1) + j, tok.to(tl.int64))


def rejection_sample_triton(
    target_logits,
    draft_tokens,
    num_draft,
    draft_probs=None,
    temperature=None,
    top_k=None,
    top_p=None,
    *,
    seeds=None,
    _impl=None,
    _splits=None,
    _block_v=None,
    _num_warps=None,
):
    """Fused Triton chain rejection sampling (2 launches when all greedy, 4 otherwise)."""
    B, K, V = _check_chain_inputs(target_logits, draft_tokens, num_draft)
    dev = target_logits.device
    R = K + 1
    out = torch.empty(B, R, dtype=torch.int64, device=dev)
    n_acc = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return out, n_acc
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    nd = num_draft.to(device=dev, dtype=torch.int64).clamp(0, K).contiguous()
    drafts = draft_tokens.to(device=dev, dtype=torch.int64).contiguous()
    # No host syncs on the common paths (CUDA-graph friendly): ``temperature=None`` means all
    # greedy; with a temperature tensor every row decides greedy/stochastic on the device.
    # Only top-k/top-p (threshold computation) and a missing-seeds check synchronise.
    has_temp = temperature is not None
    temp, _, _ = normalize_sampling_params(B, dev, temperature, top_k, top_p)
    if has_temp and seeds is None:
        if bool((temp > 0).any()):
            raise ValueError(_NEEDS_SEEDS)
        has_temp = False
    any_sto = has_temp
    thr = None
    if any_sto and (top_k is not None or top_p is not None):
        thr = compute_filter_thresholds(logits, temp, top_k, top_p)
    thr = thr.contiguous() if thr is not None else None
    seeds_t = torch.as_tensor(seeds, device=dev).to(torch.int64).contiguous() if any_sto else None
    has_dprobs = any_sto and draft_probs is not None
    part_f, part_i, S, logits = launch_row_stats(
        logits, nd, temp if has_temp else None, thr, None, always_argmax=False, need_entropy=False, has_temp=has_temp,
        splits=_splits, block_v=_block_v, num_warps=_num_warps,
    )
    P = B * R * S
    dp = None
    if has_dprobs:
        dp = draft_probs.to(dev)
        if dp.stride(-1) != 1:
            dp = dp.contiguous()
    rec_i = torch.empty(B, 2, dtype=torch.int32, device=dev)
    rec_f = torch.empty(B, 2, dtype=torch.float32, device=dev)
    dummy = part_f
    _chain_finalize_kernel[(B,)](
        logits, logits.stride(0), logits.stride(1),
        drafts, drafts.stride(0),
        nd,
        temp if has_temp else dummy,
        thr if thr is not None else dummy,
        dp if dp is not None else dummy,
        dp.stride(0) if dp is not None else 0,
        dp.stride(1) if dp is not None else 0,
        seeds_t if seeds_t is not None else nd,
        part_f, part_i,
        out, n_acc, rec_i, rec_f,
        P, K, S,
        HAS_TEMP=has_temp,
        HAS_THR=thr is not None,
        HAS_DPROBS=has_dprobs,
        BLOCK_S=max(2, triton.next_power_of_2(S)),
        num_warps=1,
    )
    if any_sto:
        interp = interpreting()
        block_v = _block_v or (min(triton.next_power_of_2(V), 64) if interp else RECOVER_CONFIG["block_v"])
        block_v = min(block_v, max(triton.next_power_of_2(V), 16))
        n_blocks = triton.cdiv(V, block_v)
        if _splits is not None:
            s2 = _splits
        elif dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            s2 = triton.cdiv(RECOVER_CONFIG["programs_per_sm"] * sms, B)
        else:
            s2 = 1
        s2 = max(1, min(int(s2), n_blocks))
        chunk = triton.cdiv(n_blocks, s2) * block_v
        S2 = triton.cdiv(V, chunk)
        rpart_f = torch.empty(2, B, S2, dtype=torch.float32, device=dev)
        rpart_i = torch.empty(2, B, S2, dtype=torch.int32, device=dev)
        _recover_kernel[(B, S2)](
            logits, logits.stride(0), logits.stride(1),
            dp if dp is not None else dummy,
            dp.stride(0) if dp is not None else 0,
            dp.stride(1) if dp is not None else 0,
            nd, temp,
            thr if thr is not None else dummy,
            seeds_t,
            rec_i, rec_f, rpart_f, rpart_i,
            K, V, S2, chunk,
            HAS_THR=thr is not None,
            HAS_DPROBS=has_dprobs,
            FAST=not interp,
            BLOCK_V=block_v,
            num_warps=1 if interp else RECOVER_CONFIG["num_warps"],
        )
        _recover_decode_kernel[(B,)](
            rec_i, rpart_f, rpart_i, out, K, S2, HAS_DPROBS=has_dprobs,
            BLOCK_S=max(2, triton.next_power_of_2(S2)), num_warps=1,
        )
    return out, n_acc


def rejection_sample(
    target_logits,
    draft_tokens,
    num_draft,
    draft_probs=None,
    temperature=None,
    top_k=None,
    top_p=None,
    *,
    seeds=None,
    _impl=None,
):
    """Chain speculative-decoding verification (greedy and stochastic, variable draft lengths).

    Args:
        target_logits: [B, K+1, V] fp32/bf16/fp16 raw target logits; row j scores draft token j,
            row ``num_draft[b]`` gives the bonus token.
        draft_tokens: [B, K] int64, padded beyond ``num_draft[b]`` (any value).
        num_draft: [B] int64 in ``0..K``.
        draft_probs: [B, K, V] draft probabilities (already processed by the caller) or None for
            one-hot drafts (greedy drafters, n-grams).
        temperature: [B] fp32 (0 -> greedy for that request) or None (all greedy).
        top_k: [B] int64 (0 = off) or None.  top_p: [B] fp32 (1.0 = off) or None.
        seeds: [B] int64, needed when any temperature is > 0: the randomness of request ``b`` is
            a function of ``seeds[b]`` alone (counter-based generator, see
            :mod:`speculators.kernels.sampling`), so the result does not depend on the
            implementation or on the other requests of the batch.
    Returns:
        ``(output_tokens [B, K+1] int64, num_accepted [B] int64)``: ``output_tokens[b]`` holds
        the ``num_accepted[b]`` accepted drafts followed by one recovered-or-bonus token, padded
        with -1.
    """
    args = (target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p)
    if use_triton(target_logits, _impl):
        return rejection_sample_triton(*args, seeds=seeds)
    return rejection_sample_reference(*args, seeds=seeds)
