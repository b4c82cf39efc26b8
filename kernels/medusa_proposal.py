"""Medusa heads proposal: per-head top-k of ``lm_head_h(ResBlocks_h(hidden))``.

The op runs Triton on CUDA tensors and the reference elsewhere; ``_impl="triton" | "reference"``
forces one (see :mod:`speculators.kernels.triton_utils`).  Weights follow ``nn.Linear`` layout
(``[out, in]``).

``x = hidden; x = x + silu(x @ W[h, l]^T + b[h, l])`` per layer, ``logits_h = x @ lm_head_h^T``
(per-head ``[H, V, D]`` or shared ``[V, D]``).  ``_resblock_kernel`` runs one layer for all heads
in one launch (grid over output tiles x row blocks x heads, the residual and SiLU fused into the
GEMM epilogue); then one ``_head_topk_kernel`` launch covers all heads and one merge launch
writes ``[B, H, k]`` (:mod:`speculators.kernels.lm_head_topk`).  ``L + 2`` launches in total.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculators.kernels.lm_head_topk import head_topk_launch, ref_dtype, stable_topk, to_vocab
from speculators.kernels.triton_utils import (
    HAS_TRITON,
    contiguous_last,
    dot_mode,
    interpreting,
    sm_count,
    tl,
    triton,
    use_triton,
)

__all__ = ["medusa_propose", "medusa_propose_reference", "medusa_propose_triton"]

# GPU launch configuration of the ResBlock kernel (the interpreter takes tiny tiles instead).
RESBLOCK_CONFIG = {"block_n": 64, "block_d": 64, "num_warps": 4, "num_stages": 4}


# ----------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------
def medusa_propose_reference(hidden, block_weights, block_bias, lm_head, top_k: int = 1, *, logprobs: bool = False,
                             _impl=None):
    """``(values [B, H, k], indices [B, H, k])`` of Medusa heads; see :func:`medusa_propose`."""
    H, L = block_weights.shape[:2]
    dt = ref_dtype(hidden, block_weights, lm_head)
    vals, idxs = [], []
    for h in range(H):
        x = hidden.to(dt)
        for l in range(L):
            y = x @ block_weights[h, l].to(dt).t()
            if block_bias is not None:
                y = y + block_bias[h, l].to(dt)
            x = x + F.silu(y)
        w = lm_head if lm_head.dim() == 2 else lm_head[h]
        logits = x @ w.to(dt).t()
        if logprobs:
            logits = torch.log_softmax(logits, dim=-1)
        v, i = stable_topk(logits, top_k)
        vals.append(v.float())
        idxs.append(i)
    return torch.stack(vals, 1), torch.stack(idxs, 1)


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _resblock_kernel(
        x_ptr,
        stride_xh,
        stride_xb,
        w_ptr,  # W[:, l]: [H, D, D] view
        stride_wh,
        stride_wn,
        b_ptr,  # bias[:, l]: [H, D] view
        stride_bh,
        y_ptr,  # [H, B, D] fp32
        B,
        D,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        h = tl.program_id(2)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        rmask = rows < B
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < D
        offs_d = tl.arange(0, BLOCK_D)
        x_rows = x_ptr + h.to(tl.int64) * stride_xh + rows.to(tl.int64)[:, None] * stride_xb
        w_rows = w_ptr + h.to(tl.int64) * stride_wh + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            dmask = dd < D
            xt = tl.load(x_rows + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            wt = tl.load(w_rows + dd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            else:
                xt = xt.to(wt.dtype)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)
        if HAS_BIAS:
            acc += tl.load(b_ptr + h.to(tl.int64) * stride_bh + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        xres = tl.load(x_rows + cols[None, :], mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        y = xres + acc * tl.sigmoid(acc)
        y_base = y_ptr + (h * B + rows).to(tl.int64)[:, None] * D
        tl.store(y_base + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def medusa_propose_triton(hidden, block_weights, block_bias, lm_head, top_k: int = 1, *, logprobs: bool = False,
                          _impl=None, _num_programs=None):
    """Triton Medusa heads: L ResBlock launches (all heads each) + 1 head/top-k launch + 1 merge."""
    B, D = hidden.shape
    H, L = block_weights.shape[:2]
    dev = hidden.device
    if block_weights.stride(-1) != 1:
        block_weights = block_weights.contiguous()
    if block_bias is not None and block_bias.stride(-1) != 1:
        block_bias = block_bias.contiguous()
    lm = contiguous_last(lm_head)
    x = contiguous_last(hidden)
    stride_xh, stride_xb = 0, x.stride(0)
    interp = interpreting()
    cfg = RESBLOCK_CONFIG
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(max(B, 1))))
        bn, bd, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(64, triton.next_power_of_2(max(B, 1))))
        bn, bd, warps, stages = cfg["block_n"], cfg["block_d"], cfg["num_warps"], cfg["num_stages"]
        if triton.cdiv(B, block_b) * triton.cdiv(D, bn) * H < sm_count(dev):
            bn = max(16, bn // 2)
        if block_weights.dtype in (torch.float32, torch.float64):
            bd, stages = 32, 3
    upcast, prec = dot_mode(block_weights)
    y_dtype = torch.float32 if (interp or block_weights.dtype in (torch.float32, torch.float64)) else block_weights.dtype
    out_v = torch.empty(B, H, top_k, dtype=torch.float32, device=dev)
    out_i = torch.empty(B, H, top_k, dtype=torch.int64, device=dev)
    if B == 0:
        return out_v, out_i
    for l in range(L):
        W = block_weights[:, l]
        bias = block_bias[:, l] if block_bias is not None else None
        y = torch.empty(H, B, D, dtype=y_dtype, device=dev)
        _resblock_kernel[(triton.cdiv(B, block_b), triton.cdiv(D, bn), H)](
            x, stride_xh, stride_xb, W, W.stride(0), W.stride(1),
            bias if bias is not None else W, bias.stride(0) if bias is not None else 0,
            y, B, D,
            HAS_BIAS=bias is not None, UPCAST=upcast, DOT_PREC=prec,
            BLOCK_B=block_b, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages,
        )
        x, stride_xh, stride_xb = y, y.stride(0), y.stride(1)
    stride_wh = 0 if lm.dim() == 2 else lm.stride(0)
    head_topk_launch(x, lm, top_k, logprobs=logprobs, H=H, B=B, stride_xh=stride_xh, stride_xb=stride_xb,
                      stride_wh=stride_wh, out_v=out_v, out_i=out_i, stride_ob=H * top_k, stride_oh=top_k,
                      num_programs=_num_programs)
    return out_v, out_i


def medusa_propose(hidden, block_weights, block_bias, lm_head, top_k: int = 1, *, logprobs: bool = False,
                   vocab_ids=None, _impl=None):
    """Medusa heads: per-head top-k of ``lm_head_h(ResBlocks_h(hidden))``.

    Args:
        hidden: [B, D]; block_weights: [H, L, D, D]; block_bias: [H, L, D] or None;
        lm_head: [V, D] shared or [H, V, D] per head; top_k: candidates per head.
        logprobs: return log-softmax values instead of raw logits.
        vocab_ids: [N] int64, ascending: lm_head holds only these vocabulary rows (a draft vocabulary);
            the returned indices are then mapped back to vocabulary ids.
    Returns:
        ``(values [B, H, k] fp32, indices [B, H, k] int64)``; ties -> lowest index.
    """
    if use_triton(hidden, _impl):
        vals, idx = medusa_propose_triton(hidden, block_weights, block_bias, lm_head, top_k, logprobs=logprobs)
    else:
        vals, idx = medusa_propose_reference(hidden, block_weights, block_bias, lm_head, top_k, logprobs=logprobs)
    return vals, to_vocab(idx, vocab_ids)
