"""Fused LM head + top-k without materialised logits: the last stage of both proposal ops.

Weights follow ``nn.Linear`` layout (``[out, in]``).  :func:`head_topk_launch` serves the MLP
speculator (:mod:`speculators.kernels.mlp_proposal`, one head per stage) and the Medusa heads
(:mod:`speculators.kernels.medusa_proposal`, all heads in one launch); their references use
:func:`stable_topk`, which the kernels equal index for index.

``_head_topk_kernel``: grid ``(row blocks, vocab programs, heads)``.  Each program owns a
contiguous range of vocab tiles, computes ``x @ W_tile^T`` for a block of rows with ``tl.dot``
(fp32 accumulation) and folds the tile into a running per-row top-k (plus an online
log-sum-exp when log-probs are requested) held in registers; only ``[rows, programs, k]``
partials reach global memory.  ``_topk_merge_kernel`` (one program per row) merges the
partials.  The ``[B, V]`` logits are never written.  Ties: the lowest vocabulary index wins
(the references sort stably), so results are deterministic.  Row blocks are the fastest grid
dimension, so programs that share a weight tile run together and share it through L2.

Precision: fp32 accumulation everywhere.  bf16/fp16 weights use native tensor-core dots on GPU
(the activation is cast to the weight dtype, as a bf16 model would compute); fp32 weights use
IEEE fp32 dots; under ``TRITON_INTERPRET=1`` both operands are upcast to fp32 (the interpreter
mis-computes bf16 ``tl.dot``).
"""

from __future__ import annotations

import torch

from speculators.kernels.triton_utils import HAS_TRITON, dot_mode, interpreting, sm_count, tl, triton

__all__ = ["HEAD_TOPK_CONFIG", "head_topk_launch", "ref_dtype", "stable_topk", "to_vocab"]

# GPU launch configuration (the interpreter takes tiny tiles instead; fp32 weights smaller tiles).
HEAD_TOPK_CONFIG = {
    "block_b": 64, "block_v": 128, "block_d": 64, "num_warps": 8, "num_stages": 4, "programs_per_sm": 2,
}


# ----------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------
def ref_dtype(*tensors) -> torch.dtype:
    """References compute in fp32, or fp64 when given fp64 inputs."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def stable_topk(logits: torch.Tensor, k: int):
    """Top-k along the last dim with ties broken towards the lowest index: the reference of the kernels."""
    if k == 1:  # argmax returns the first maximal index
        idx = logits.argmax(-1, keepdim=True)
        return logits.gather(-1, idx), idx
    # A full stable sort of the vocabulary cost ~30 ms per [20, 49152] call on a CPU (most of a tree
    # proposal); torch.topk does not promise which of tied values it returns. So: the k-th largest value
    # bounds the candidates, the C lowest-index candidates are taken (C = most candidates in any row;
    # k unless values tie at the bound), and only those C are stably sorted.
    V = logits.shape[-1]
    k = min(k, V)
    cand = logits >= torch.topk(logits, k, dim=-1).values[..., -1:]
    C = int(cand.sum(-1).max())
    lowest_first = torch.where(cand, V - torch.arange(V, device=logits.device), 0)
    ci = torch.topk(lowest_first, C, dim=-1).indices  # candidates by index; rows with fewer pad with non-candidates
    vals, order = torch.sort(logits.gather(-1, ci), dim=-1, descending=True, stable=True)
    return vals[..., :k], ci.gather(-1, order)[..., :k]


def to_vocab(ix, vocab_ids):
    """Head-row indices -> vocabulary ids when the heads hold only a draft vocabulary's rows."""
    return ix if vocab_ids is None else vocab_ids[ix]


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _head_topk_kernel(
        x_ptr,
        stride_xh,
        stride_xb,
        w_ptr,
        stride_wh,
        stride_wv,
        pv_ptr,  # fp32 [H, B, NP, KPAD]
        pi_ptr,  # int32 [H, B, NP, KPAD]
        pl_ptr,  # fp32 [2, H, B, NP]: running max, running sum exp
        B,
        V,
        D,
        NP,
        TILES_PER_PROG,
        K: tl.constexpr,
        KPAD: tl.constexpr,
        LSE: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_v = tl.program_id(1)
        h = tl.program_id(2)
        H = tl.num_programs(2)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        rmask = rows < B
        kcols = tl.arange(0, KPAD)
        offs_v = tl.arange(0, BLOCK_V)
        offs_d = tl.arange(0, BLOCK_D)
        x_base = x_ptr + h.to(tl.int64) * stride_xh + rows.to(tl.int64)[:, None] * stride_xb
        w_base = w_ptr + h.to(tl.int64) * stride_wh
        run_v = tl.full([BLOCK_B, KPAD], float("-inf"), tl.float32)
        run_i = tl.full([BLOCK_B, KPAD], 2147483647, tl.int32)
        m_run = tl.full([BLOCK_B], float("-inf"), tl.float32)
        s_run = tl.zeros([BLOCK_B], dtype=tl.float32)
        for t in range(0, TILES_PER_PROG):
            cols = (pid_v * TILES_PER_PROG + t) * BLOCK_V + offs_v
            cmask = cols < V
            acc = tl.zeros([BLOCK_B, BLOCK_V], dtype=tl.float32)
            w_rows = w_base + cols.to(tl.int64)[:, None] * stride_wv
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                dmask = dd < D
                xt = tl.load(x_base + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
                wt = tl.load(w_rows + dd[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
                if UPCAST:
                    xt = xt.to(tl.float32)
                    wt = wt.to(tl.float32)
                else:
                    xt = xt.to(wt.dtype)
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)
            logit = tl.where(cmask[None, :], acc, float("-inf"))
            if LSE:
                new_m = tl.maximum(m_run, tl.max(logit, axis=1))
                safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
                s_run = s_run * tl.exp(m_run - safe_m) + tl.sum(tl.exp(logit - safe_m[:, None]), axis=1)
                m_run = new_m
            if K == 1:
                tm = tl.max(logit, axis=1)
                ti = tl.min(tl.where(logit == tm[:, None], cols[None, :], 2147483647), axis=1)
                rv = tl.max(run_v, axis=1)
                better = tm > rv  # earlier tiles hold lower indices: keep them on ties
                run_v = tl.where(better[:, None], tm[:, None], run_v)
                run_i = tl.where(better[:, None], ti[:, None], run_i)
            else:
                new_v = tl.full([BLOCK_B, KPAD], float("-inf"), tl.float32)
                new_i = tl.full([BLOCK_B, KPAD], 2147483647, tl.int32)
                cand_t = logit
                cand_r = run_v
                for kk in tl.static_range(K):
                    mt = tl.max(cand_t, axis=1)
                    it = tl.min(tl.where(cand_t == mt[:, None], cols[None, :], 2147483647), axis=1)
                    mr = tl.max(cand_r, axis=1)
                    ir = tl.min(tl.where(cand_r == mr[:, None], run_i, 2147483647), axis=1)
                    take_t = (mt > mr) | ((mt == mr) & (it < ir))
                    bv = tl.where(take_t, mt, mr)
                    bi = tl.where(take_t, it, ir)
                    new_v = tl.where(kcols[None, :] == kk, bv[:, None], new_v)
                    new_i = tl.where(kcols[None, :] == kk, bi[:, None], new_i)
                    cand_t = tl.where(take_t[:, None] & (cols[None, :] == it[:, None]), float("-inf"), cand_t)
                    cand_r = tl.where((take_t == 0)[:, None] & (run_i == ir[:, None]), float("-inf"), cand_r)
                run_v = new_v
                run_i = new_i
        prow = (h * B + rows).to(tl.int64) * NP + pid_v
        tl.store(pv_ptr + prow[:, None] * KPAD + kcols[None, :], run_v, mask=rmask[:, None])
        tl.store(pi_ptr + prow[:, None] * KPAD + kcols[None, :], run_i, mask=rmask[:, None])
        if LSE:
            tl.store(pl_ptr + prow, m_run, mask=rmask)
            tl.store(pl_ptr + H * B * NP + prow, s_run, mask=rmask)

    @triton.jit
    def _topk_merge_kernel(
        pv_ptr,
        pi_ptr,
        pl_ptr,
        ov_ptr,
        oi_ptr,
        stride_ob,
        stride_oh,
        tok_ptr,
        stride_tok,
        B,
        NP,
        K: tl.constexpr,
        KPAD: tl.constexpr,
        LSE: tl.constexpr,
        WRITE_TOK: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        row = tl.program_id(0)  # = h * B + b
        H = tl.num_programs(0) // B
        h = row // B
        b = row % B
        offs = tl.arange(0, BLOCK_C)
        cmask = offs < NP * KPAD
        base = row.to(tl.int64) * NP * KPAD
        cv = tl.load(pv_ptr + base + offs, mask=cmask, other=float("-inf"))
        ci = tl.load(pi_ptr + base + offs, mask=cmask, other=2147483647)
        if LSE:
            offp = tl.arange(0, BLOCK_P)
            pmask = offp < NP
            pm = tl.load(pl_ptr + row.to(tl.int64) * NP + offp, mask=pmask, other=float("-inf"))
            ps = tl.load(pl_ptr + H * B * NP + row.to(tl.int64) * NP + offp, mask=pmask, other=0.0)
            M = tl.max(pm, axis=0)
            Ssum = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - M)), axis=0)
            lse = M + tl.log(Ssum)
        else:
            lse = 0.0
        obase = b.to(tl.int64) * stride_ob + h * stride_oh
        for kk in tl.static_range(K):
            m = tl.max(cv, axis=0)
            i = tl.min(tl.where(cv == m, ci, 2147483647), axis=0)
            tl.store(ov_ptr + obase + kk, m - lse)
            tl.store(oi_ptr + obase + kk, i.to(tl.int64))
            if kk == 0:
                if WRITE_TOK:
                    tl.store(tok_ptr + row.to(tl.int64) * stride_tok, i.to(tl.int64))
            cv = tl.where(ci == i, float("-inf"), cv)


def head_topk_launch(x, w, k, *, logprobs, H, B, stride_xh, stride_xb, stride_wh, out_v, out_i, stride_ob,
                      stride_oh, tok_out=None, stride_tok=0, num_programs=None):
    """Launch head GEMM + top-k over H heads (x: [H?, B, D] via strides, w: [H?, V, D]).

    Writes the descending top-k of head ``h``, row ``b`` (log-softmax values if ``logprobs``, raw
    logits otherwise; ties -> lowest index) to ``out_v`` / ``out_i`` at ``b * stride_ob + h *
    stride_oh``, and the top-1 index to ``tok_out`` at ``row * stride_tok`` when given.  Equals
    :func:`stable_topk` of the (log-softmaxed) logits ``x_h @ w_h^T``.
    """
    V, D = w.shape[-2], w.shape[-1]
    if k < 1 or k > V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    cfg = HEAD_TOPK_CONFIG
    interp = interpreting()
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(max(B, 1))))
        block_v, block_d, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(cfg["block_b"], triton.next_power_of_2(max(B, 1))))
        block_v, block_d, warps, stages = cfg["block_v"], cfg["block_d"], cfg["num_warps"], cfg["num_stages"]
        if w.dtype in (torch.float32, torch.float64):  # IEEE fp32 dots: smaller tiles (no spills)
            block_v, block_d, stages = 64, 32, 3
    kpad = max(2, triton.next_power_of_2(k))
    n_tiles = triton.cdiv(V, block_v)
    n_bblocks = triton.cdiv(B, block_b)
    if num_programs is None:
        if interp:
            num_programs = min(n_tiles, 3)
        else:
            target = cfg["programs_per_sm"] * sm_count(x.device)
            num_programs = max(1, min(n_tiles, triton.cdiv(target, n_bblocks * H)))
    tiles_per_prog = triton.cdiv(n_tiles, max(1, min(int(num_programs), n_tiles)))
    NP = triton.cdiv(n_tiles, tiles_per_prog)
    dev = x.device
    pv = torch.empty(H * B * NP * kpad, dtype=torch.float32, device=dev)
    pi = torch.empty(H * B * NP * kpad, dtype=torch.int32, device=dev)
    pl = torch.empty(2 * H * B * NP if logprobs else 1, dtype=torch.float32, device=dev)
    upcast, prec = dot_mode(w)
    _head_topk_kernel[(n_bblocks, NP, H)](
        x, stride_xh, stride_xb, w, stride_wh, w.stride(-2),
        pv, pi, pl,
        B, V, D, NP, tiles_per_prog,
        K=k, KPAD=kpad, LSE=logprobs, UPCAST=upcast, DOT_PREC=prec,
        BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_D=block_d,
        num_warps=warps, num_stages=stages,
    )
    block_c = triton.next_power_of_2(NP * kpad)
    _topk_merge_kernel[(H * B,)](
        pv, pi, pl, out_v, out_i, stride_ob, stride_oh,
        tok_out if tok_out is not None else out_i, stride_tok,
        B, NP,
        K=k, KPAD=kpad, LSE=logprobs, WRITE_TOK=tok_out is not None,
        BLOCK_C=block_c, BLOCK_P=max(2, triton.next_power_of_2(NP)),
        num_warps=1 if interp else (4 if block_c <= 4096 else 8),
    )
