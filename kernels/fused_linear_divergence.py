"""Fused multi-head linear + divergence loss that never materializes [T, V] logits.

Each of H speculator heads maps hidden states x_h [T, D] to logits x_h @ W_h.T [T, V]; the
teacher's logits come either from its hidden states and lm-head (recomputed tile by tile) or
are given. With z_s = student logits / temperature, z_t = teacher logits / temperature,
q = softmax(z_s) (student) and p = softmax(z_t) (teacher), the per-token losses are

    "ce"   -log q[label]                              (hard labels, no teacher)
    "fkl"  KL(p || q) = sum p (log p - log q)
    "rkl"  KL(q || p) = sum q (log q - log p)
    "jsd"  beta * KL(p || m) + (1 - beta) * KL(q || m),   m = beta * p + (1 - beta) * q
           (beta = 0 or 1 gives m = q or m = p and a loss of exactly 0)
    "tvd"  0.5 * sum |p - q|

all computed in fp32 whatever the input dtype. There is no temperature**2 factor: multiply the
loss yourself if you want the Hinton scaling. Tokens whose label is ``ignore_index`` are
skipped by every divergence. The loss is ``sum_h w_h * sum_t loss[h, t]`` ("sum") or
``sum_h w_h * mean_{valid t} loss[h, t]`` ("mean"; a head without valid tokens adds 0).

Gradients (Liger-style) are computed during the forward pass, so the op keeps only
grad_input [H, T, D] and grad_weight; backward scales them by grad_output. With
dz = d loss / d z_s per row (d logits = dz / temperature):

    ce   q - onehot(label)
    fkl  q - p
    rkl  q * ((log q - log p) - loss_row)
    tvd  q * (g - sum(q g)),  g = 0.5 * sign(q - p)
    jsd  q * (g - sum(q g)),  g = (1 - beta) * (log q - log m)

CUDA tensors run the Triton kernels: vocab tiles of the logits live only on chip.
  * pass 1 (stats kernel, one program per block of rows of one head): online log-sum-exp of
    student and teacher over all vocab tiles. fkl/rkl/ce also get their loss from this pass by
    accumulating sum e^(z - max) (z_t - z_s) with the same rescaling as the LSE sum.
  * pass 2 (stats kernel, jsd/tvd only): these losses and sum(q g) need both LSEs per element,
    so the tiles are recomputed once more.
  * gradient pass, per range of vocab columns (dz kernel, one program per (row block, vocab
    tile) of one head): recompute the tile, form dz and write it to a bounded [H*T, columns]
    buffer; cuBLAS then writes grad_weight[columns] = dz.T @ x and adds dz @ W[columns] into an
    fp32 grad_input.
  Dots take the input dtype (bf16 tensor cores) with fp32 accumulation, so logits are never
  rounded to bf16; dz is rounded to bf16 only as the operand of the gradient GEMMs, as in any
  bf16 backward (fp16 inputs keep dz in fp32: it would underflow fp16).
  Each pass recomputes the student logits (and the teacher's when given as hidden + weight), a
  2*T*V*D-FLOP matmul each. Counting matmuls of that size, with a teacher from hidden states:
  fkl/rkl run 6 (2 stats + 2 recompute + 2 grad) where materialized logits need 4; jsd/tvd
  run 8; ce runs 4 against 3. That is the price of O(T*D + V*D) memory.
CPU tensors run a chunked PyTorch path (same API and formulas): chunks of tokens whose full
[rows, V] logits fit a fixed budget, so nothing is recomputed there.
divergence_reference is the plain PyTorch reference (same arguments, logits materialized,
autograd gradients).
"""

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from speculators.kernels.triton_utils import HAS_TRITON, interpreting, tl, triton, use_triton

__all__ = ["divergence_reference", "fused_linear_divergence", "per_token_divergence"]

_DIVERGENCES = ("ce", "fkl", "rkl", "jsd", "tvd")

# Teacher source, a kernel constexpr.
_NO_TEACHER = 0
_TEACHER_HIDDEN = 1
_TEACHER_LOGITS = 2

# CPU path: a token chunk holds its full [rows, V] fp32 logits. The formulas keep about four
# such buffers alive (student, teacher, probabilities, one temporary), so 32 MiB per buffer
# bounds the transient memory near 128 MiB, whatever T and H are: rows = 32 MiB / (4 * V)
# (170 rows at V = 49k, 54 at V = 152k), at least 1. Measured on a 2-core CPU, 32 MiB was as
# fast as 64 MiB and faster than 8-16 MiB, whose matmuls re-read W for fewer rows.
_CHUNK_BYTES = 32 * 2**20

# Triton tiles. GPU: swept on an H200 at T=16384, V=128256, D=4096, 4 heads, bf16, fkl
# (bench_fused_linear_divergence.py --tune, BENCHMARKS.md): 128 x 128 tiles at 8 warps and 4
# stages took 0.93 s for loss + gradients, 64 x 64 (the most that compiles without register
# spills) 1.40 s; the larger dot tiles re-read x and W half as often, which outweighs the spills.
# Interpreter: tiny tiles so that test shapes span several tiles in every dimension.
_GPU_BLOCKS = dict(BLOCK_T=128, BLOCK_V=128, BLOCK_D=64)
_GPU_LAUNCH = dict(num_warps=8, num_stages=4)

# Gradients: dz for a range of vocab columns (all heads and tokens, at most this many bytes),
# then two cuBLAS GEMMs. Adding dz @ W and dz.T @ x with fp32 atomics inside the kernel
# instead, with no dz buffer at all, took 3.28 s against 1.34 s on the same H200 (64 x 64 tiles):
# 2*T*V*D/64 atomics per head swamp the tensor cores. 256 MiB is ~1% of what the naive loss
# holds at that shape; smaller chunks only add GEMM launches.
_DZ_CHUNK_BYTES = 256 * 2**20
_INTERPRET_BLOCKS = dict(BLOCK_T=4, BLOCK_V=16, BLOCK_D=8)


# ----------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------
def per_token_divergence(log_q: Tensor, log_p: Tensor, divergence: str, beta: float = 0.5) -> Tensor:
    """[..., V] student / teacher log-probabilities -> [...] divergence per token."""
    if divergence == "fkl":  # KL(p || q); kl_div(input, target) = KL(target || input)
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if divergence == "rkl":  # KL(q || p)
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    if divergence == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    if divergence == "jsd":
        p, q = log_p.exp(), log_q.exp()
        log_m = (beta * p + (1 - beta) * q).log()
        return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}")


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) in at least fp32."""
    return (logits if logits.dtype == torch.float64 else logits.float()).div(temperature).log_softmax(-1)


def divergence_reference(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    labels: Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    head_weights: Sequence[float] | Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> Tensor:
    """Plain PyTorch reference of fused_linear_divergence (same arguments): materializes the logits.

    Autograd provides the gradients. Tests run it in float64; benchmarks run it in the input dtype
    as the naive baseline: logits in the input dtype, upcast to fp32 for the loss, as most trainers
    do, one head at a time as multi-head trainers usually loop (each head's [T, V]
    log-probabilities are still kept for backward).
    """
    H, T, _ = student_input.shape
    per_head = []
    for h in range(H):
        w = student_weight[h] if student_weight.dim() == 3 else student_weight
        log_q = _log_probs(student_input[h] @ w.T, temperature)
        if divergence == "ce":
            loss = F.nll_loss(log_q, labels[h], ignore_index=ignore_index, reduction="none")
        else:
            z_t = teacher_logits[h] if teacher_logits is not None else teacher_input[h] @ teacher_weight.T
            loss = per_token_divergence(log_q, _log_probs(z_t.detach(), temperature).to(log_q.dtype),
                                        divergence, beta)
        valid = labels[h] != ignore_index if labels is not None else torch.ones_like(loss, dtype=torch.bool)
        loss = torch.where(valid, loss, 0).sum()
        per_head.append(loss / valid.sum().clamp(min=1) if reduction == "mean" else loss)
    w = torch.as_tensor(head_weights if head_weights is not None else [1.0] * H,
                        dtype=per_head[0].dtype, device=student_input.device)
    return (w * torch.stack(per_head)).sum()


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------
if HAS_TRITON:
    _CE = tl.constexpr(0)
    _FKL = tl.constexpr(1)
    _RKL = tl.constexpr(2)
    _JSD = tl.constexpr(3)
    _TVD = tl.constexpr(4)

    # Logit of the columns past the vocab end: exp() of it is exactly 0 and, unlike -inf, the
    # difference of two of them is 0, not NaN, so padded columns add exactly 0 to every sum.
    _PAD = tl.constexpr(-1e30)

    @triton.jit
    def _logits_tile(x_ptr, w_ptr, rows, cols, row_mask, col_mask, D, inv_temp,
                     BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """fp32 tile (x[rows] @ w[cols].T) / temperature, _PAD past the end of the vocab."""
        acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            x = tl.load(x_ptr + rows[:, None] * D + d[None, :],
                        mask=row_mask[:, None] & (d[None, :] < D), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * D + d[None, :],
                        mask=col_mask[:, None] & (d[None, :] < D), other=0.0)
            if UPCAST:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            # fp32 accumulation straight from the input dtype: the logits are never rounded to
            # bf16 (rounding them first costs several percent of gradient accuracy).
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        return tl.where(col_mask[None, :], acc * inv_temp, _PAD)


    @triton.jit
    def _teacher_tile(xt_ptr, wt_ptr, zt_ptr, rows, cols, row_mask, col_mask, Dt,
                      stride_zt, stride_zv, inv_temp, TEACHER: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """Teacher logits tile / temperature (fp32), from hidden states + lm-head or given logits."""
        if TEACHER == 1:
            zt = _logits_tile(xt_ptr, wt_ptr, rows, cols, row_mask, col_mask, Dt, inv_temp,
                              BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION)
        else:
            zt = tl.load(zt_ptr + rows[:, None] * stride_zt + cols[None, :] * stride_zv,
                         mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            zt = tl.where(col_mask[None, :], zt.to(tl.float32) * inv_temp, _PAD)
        return zt


    @triton.jit
    def _log_mix(log_p, log_q, log_beta, log_1mbeta):
        """log(beta p + (1 - beta) q) without underflow; log_beta = -inf (beta = 0) is fine."""
        a = log_beta + log_p
        b = log_1mbeta + log_q
        mx = tl.maximum(a, b)
        return mx + tl.log(tl.exp(a - mx) + tl.exp(b - mx))


    @triton.jit
    def _row_stats_kernel(xs_ptr, ws_ptr, xt_ptr, wt_ptr, zt_ptr, labels_ptr,
                          lse_s_ptr, lse_t_ptr, loss_ptr, sqg_ptr,
                          T, V, D, Dt, stride_zh, stride_zt, stride_zv,
                          inv_temp, beta, log_beta, log_1mbeta,
                          DIV: tl.constexpr, TEACHER: tl.constexpr, PER_HEAD_W: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """Per row: student/teacher LSE, the loss, and sum(q g) for jsd/tvd. Grid (T blocks, H)."""
        h = tl.program_id(1).to(tl.int64)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < T
        xs_ptr += h * T * D
        if PER_HEAD_W:
            ws_ptr += h * V * D
        xt_ptr += h * T * Dt
        zt_ptr += h * stride_zh
        if DIV == _CE:
            label = tl.load(labels_ptr + h * T + rows, mask=row_mask, other=0)

        # Pass 1: online LSE. acc is the label logit (ce) or sum e^(z - m)(z_t - z_s) kept on the
        # same running max m as the teacher (fkl) or student (rkl) sum.
        m_s = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        m_t = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        s_s = tl.zeros((BLOCK_T,), tl.float32)
        s_t = tl.zeros((BLOCK_T,), tl.float32)
        acc = tl.zeros((BLOCK_T,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            col_mask = cols < V
            zs = _logits_tile(xs_ptr, ws_ptr, rows, cols, row_mask, col_mask, D, inv_temp,
                              BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION)
            m_s_new = tl.maximum(m_s, tl.max(zs, 1))
            alpha_s = tl.exp(m_s - m_s_new)
            e_s = tl.exp(zs - m_s_new[:, None])
            s_s = s_s * alpha_s + tl.sum(e_s, 1)
            m_s = m_s_new
            if DIV == _CE:
                acc += tl.sum(tl.where(cols[None, :] == label[:, None], zs, 0.0), 1)
            else:
                zt = _teacher_tile(xt_ptr, wt_ptr, zt_ptr, rows, cols, row_mask, col_mask, Dt,
                                   stride_zt, stride_zv, inv_temp, TEACHER,
                                   BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION)
                m_t_new = tl.maximum(m_t, tl.max(zt, 1))
                alpha_t = tl.exp(m_t - m_t_new)
                e_t = tl.exp(zt - m_t_new[:, None])
                s_t = s_t * alpha_t + tl.sum(e_t, 1)
                m_t = m_t_new
                if DIV == _FKL:
                    acc = acc * alpha_t + tl.sum(e_t * (zt - zs), 1)
                if DIV == _RKL:
                    acc = acc * alpha_s + tl.sum(e_s * (zs - zt), 1)
        lse_s = m_s + tl.log(s_s)
        tl.store(lse_s_ptr + h * T + rows, lse_s, mask=row_mask)
        if DIV == _CE:
            loss = lse_s - acc
        else:
            lse_t = m_t + tl.log(s_t)
            tl.store(lse_t_ptr + h * T + rows, lse_t, mask=row_mask)
        if DIV == _FKL:
            loss = acc / s_t + lse_s - lse_t
        if DIV == _RKL:
            loss = acc / s_s + lse_t - lse_s
        if DIV >= _JSD:
            # Pass 2: |p - q| and log m need both normalized distributions elementwise.
            loss = tl.zeros((BLOCK_T,), tl.float32)
            sqg = tl.zeros((BLOCK_T,), tl.float32)
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
                col_mask = cols < V
                log_q = _logits_tile(xs_ptr, ws_ptr, rows, cols, row_mask, col_mask, D, inv_temp,
                                     BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION) - lse_s[:, None]
                log_p = _teacher_tile(xt_ptr, wt_ptr, zt_ptr, rows, cols, row_mask, col_mask, Dt,
                                      stride_zt, stride_zv, inv_temp, TEACHER,
                                      BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION) - lse_t[:, None]
                q = tl.exp(log_q)
                p = tl.exp(log_p)
                if DIV == _TVD:
                    term = 0.5 * tl.abs(p - q)
                    g = tl.where(q > p, 0.5, tl.where(q < p, -0.5, 0.0))
                else:
                    log_m = _log_mix(log_p, log_q, log_beta, log_1mbeta)
                    term = beta * p * (log_p - log_m) + (1.0 - beta) * q * (log_q - log_m)
                    g = (1.0 - beta) * (log_q - log_m)
                loss += tl.sum(term, 1)
                sqg += tl.sum(q * g, 1)
            tl.store(sqg_ptr + h * T + rows, sqg, mask=row_mask)
        tl.store(loss_ptr + h * T + rows, loss, mask=row_mask)


    @triton.jit
    def _dz_kernel(xs_ptr, ws_ptr, xt_ptr, wt_ptr, zt_ptr, labels_ptr,
                   lse_s_ptr, lse_t_ptr, loss_ptr, sqg_ptr, scale_ptr, dz_ptr,
                   T, V, D, Dt, stride_zh, stride_zt, stride_zv, v_lo, v_hi,
                   inv_temp, beta, log_beta, log_1mbeta,
                   DIV: tl.constexpr, TEACHER: tl.constexpr, PER_HEAD_W: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """dz = d loss / d logits for one (row block, vocab tile) of one head, vocab columns
        [v_lo, v_hi), written into a [H, T, v_hi - v_lo] buffer. Grid (T blocks * vocab tiles of
        the range, H)."""
        pid = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        num_v = tl.cdiv(v_hi - v_lo, BLOCK_V)
        rows = (pid // num_v).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = v_lo + (pid % num_v).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        row_mask = rows < T
        col_mask = cols < v_hi
        n_cols = v_hi - v_lo
        dz_ptrs = dz_ptr + (h * T + rows[:, None]) * n_cols + (cols[None, :] - v_lo)
        dz_mask = row_mask[:, None] & col_mask[None, :]
        # Row weight: head weight * valid / n_valid (mean) / temperature; 0 for ignored tokens.
        scale = tl.load(scale_ptr + h * T + rows, mask=row_mask, other=0.0)
        if tl.max(tl.abs(scale), 0) == 0.0:  # every row ignored (padding, zero head weight)
            tl.store(dz_ptrs, tl.zeros((BLOCK_T, BLOCK_V), tl.float32).to(dz_ptr.dtype.element_ty), mask=dz_mask)
            return
        xs_ptr += h * T * D
        if PER_HEAD_W:
            ws_ptr += h * V * D
        xt_ptr += h * T * Dt
        zt_ptr += h * stride_zh

        lse_s = tl.load(lse_s_ptr + h * T + rows, mask=row_mask, other=0.0)
        log_q = _logits_tile(xs_ptr, ws_ptr, rows, cols, row_mask, col_mask, D, inv_temp,
                             BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION) - lse_s[:, None]
        q = tl.exp(log_q)
        if DIV == _CE:
            label = tl.load(labels_ptr + h * T + rows, mask=row_mask, other=0)
            dz = q - tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
        else:
            lse_t = tl.load(lse_t_ptr + h * T + rows, mask=row_mask, other=0.0)
            log_p = _teacher_tile(xt_ptr, wt_ptr, zt_ptr, rows, cols, row_mask, col_mask, Dt,
                                  stride_zt, stride_zv, inv_temp, TEACHER,
                                  BLOCK_T, BLOCK_V, BLOCK_D, UPCAST, PRECISION) - lse_t[:, None]
            if DIV == _FKL:
                dz = q - tl.exp(log_p)
            if DIV == _RKL:
                loss = tl.load(loss_ptr + h * T + rows, mask=row_mask, other=0.0)
                dz = q * (log_q - log_p - loss[:, None])
            if DIV >= _JSD:
                sqg = tl.load(sqg_ptr + h * T + rows, mask=row_mask, other=0.0)
                if DIV == _TVD:
                    p = tl.exp(log_p)
                    g = tl.where(q > p, 0.5, tl.where(q < p, -0.5, 0.0))
                else:
                    g = (1.0 - beta) * (log_q - _log_mix(log_p, log_q, log_beta, log_1mbeta))
                dz = q * (g - sqg[:, None])
        dz = dz * scale[:, None]  # q = p = 0 on padded columns, so dz is 0 there
        # The gradient GEMMs' operand: dz in the input dtype (as any bf16 backward does); fp32
        # for fp32 and fp16 inputs (fp16 dz would underflow).
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=dz_mask)


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as fp32: grad_input sums one product per vocab chunk, and rounding each to bf16
    would add an error of its own. cuBLAS takes bf16 operands with an fp32 output; elsewhere
    (the interpreter's CPU tensors) the operands are upcast."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _triton_forward(xs, ws, teacher, zt, labels, scale, div, beta, temperature, need_gx, need_gw):
    """Per-row loss [H, T] (fp32) and the fp32 gradients (None where not needed)."""
    H, T, D = xs.shape
    V = ws.shape[-2]
    xt, wt = teacher if teacher is not None else (xs, ws)  # dummies when unused
    Dt = xt.shape[-1]
    zt_arg, z_strides = (zt, zt.stride()) if zt is not None else (xs, (0, 0, 0))
    interpret = interpreting()
    blocks = _INTERPRET_BLOCKS if interpret else _GPU_BLOCKS
    launch = dict(blocks, **_GPU_LAUNCH) if not interpret else blocks
    common = dict(
        T=T, V=V, D=D, Dt=Dt, stride_zh=z_strides[0], stride_zt=z_strides[1],
        stride_zv=z_strides[2], inv_temp=1.0 / temperature, beta=beta,
        log_beta=math.log(beta) if beta > 0 else float("-inf"),
        log_1mbeta=math.log(1.0 - beta) if beta < 1 else float("-inf"),
        DIV=_DIVERGENCES.index(div),
        TEACHER=_NO_TEACHER if div == "ce" else (_TEACHER_LOGITS if zt is not None else _TEACHER_HIDDEN),
        PER_HEAD_W=ws.dim() == 3,
        # fp32 dots under the interpreter (its bf16 dot is wrong) and for fp16 (dz would
        # underflow fp16); fp32 on GPU follows torch's TF32 switch.
        UPCAST=interpret or xs.dtype == torch.float16,
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
    )
    labels_arg = labels if labels is not None else xs
    stats = torch.empty(4, H, T, dtype=torch.float32, device=xs.device)  # lse_s, lse_t, loss, sum(q g)
    t_blocks = triton.cdiv(T, blocks["BLOCK_T"])
    _row_stats_kernel[(t_blocks, H)](xs, ws, xt, wt, zt_arg, labels_arg, *stats, **common, **launch)
    if not (need_gx or need_gw):
        return stats[2], None, None
    args = (xs, ws, xt, wt, zt_arg, labels_arg, *stats, scale)
    # dz for a range of vocab columns at a time, for all heads and tokens, then
    # grad_weight[cols] = dz.T @ x in one GEMM (written once, no accumulation) and
    # grad_input += dz @ W[cols]. The [H*T, cols] dz buffer is the only vocab-sized tensor.
    op_dtype = torch.float32 if xs.dtype == torch.float16 else xs.dtype
    cols = max(blocks["BLOCK_V"], _DZ_CHUNK_BYTES // (H * T * op_dtype.itemsize)
               // blocks["BLOCK_V"] * blocks["BLOCK_V"])
    cols = min(cols, triton.cdiv(V, blocks["BLOCK_V"]) * blocks["BLOCK_V"])
    dz_buf = torch.empty(H * T * cols, dtype=op_dtype, device=xs.device)
    gx = torch.zeros(H, T, D, dtype=torch.float32, device=xs.device) if need_gx else None
    gw = torch.empty(ws.shape, dtype=op_dtype, device=ws.device) if need_gw else None
    x_op = xs.to(op_dtype) if need_gw else None  # the dz.T @ x operand
    for v_lo in range(0, V, cols):
        v_hi = min(V, v_lo + cols)
        dz = dz_buf[:H * T * (v_hi - v_lo)].view(H, T, v_hi - v_lo)
        grid = (t_blocks * triton.cdiv(v_hi - v_lo, blocks["BLOCK_V"]), H)
        _dz_kernel[grid](*args, dz, **common, v_lo=v_lo, v_hi=v_hi, **launch)
        if ws.dim() == 2:  # shared lm-head: one GEMM over all heads' tokens
            w_c = ws[v_lo:v_hi].to(op_dtype)
            if need_gw:
                torch.mm(dz.view(H * T, -1).t(), x_op.view(H * T, D), out=gw[v_lo:v_hi])
            if need_gx:
                gx.view(H * T, D).add_(_mm_fp32(dz.view(H * T, -1), w_c))
            continue
        for h in range(H):
            w_c = ws[h, v_lo:v_hi].to(op_dtype)
            if need_gw:
                torch.mm(dz[h].t(), x_op[h], out=gw[h, v_lo:v_hi])
            if need_gx:
                gx[h].add_(_mm_fp32(dz[h], w_c))
    return stats[2], gx, gw


# ----------------------------------------------------------------------------------------
# Chunked PyTorch path (CPU)
# ----------------------------------------------------------------------------------------
def _log_softmax_(z: Tensor) -> Tensor:
    return z.sub_(torch.logsumexp(z, -1, keepdim=True))


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """sum(a * b, -1) without a [rows, V] temporary."""
    return torch.einsum("rv,rv->r", a, b)


def _chunk_loss_and_dz(zs, zt, label, div, beta):
    """Per-row loss and dz = d loss / d z_s for one chunk; overwrites zs and zt."""
    log_q = _log_softmax_(zs)
    if div == "ce":
        idx = label.clamp(min=0).unsqueeze(1)  # ignored rows get scale 0 later
        loss = -log_q.gather(1, idx).squeeze(1)
        return loss, log_q.exp_().scatter_add_(1, idx, torch.full_like(idx, -1, dtype=zs.dtype))
    log_p = _log_softmax_(zt)
    if div == "fkl":
        p = log_p.exp()
        loss = _rowdot(p, log_p.sub_(log_q))
        return loss, log_q.exp_().sub_(p)
    if div == "rkl":
        log_r = log_p.neg_().add_(log_q)  # log q - log p
        q = log_q.exp_()
        loss = _rowdot(q, log_r)
        return loss, log_r.sub_(loss[:, None]).mul_(q)
    if div == "tvd":
        q = log_q.exp_()
        diff = log_p.exp_().sub_(q).neg_()  # q - p
        loss = 0.5 * torch.linalg.vector_norm(diff, 1, dim=-1)
        g = diff.sign_().mul_(0.5)
    else:  # jsd
        log_m = torch.logaddexp(log_p + (math.log(beta) if beta > 0 else -math.inf),
                                log_q + (math.log(1 - beta) if beta < 1 else -math.inf))
        q, p = log_q.exp(), log_p.exp()
        g = log_q.sub_(log_m)  # log q - log m
        loss = (1 - beta) * _rowdot(q, g) + beta * _rowdot(p, log_p.sub_(log_m))
        g.mul_(1 - beta)
    return loss, g.sub_(_rowdot(q, g)[:, None]).mul_(q)


def _torch_forward(xs, ws, teacher, zt, labels, scale, div, beta, temperature, need_gx, need_gw):
    """CPU twin of _triton_forward: token chunks of full-vocab fp32 rows (see _CHUNK_BYTES)."""
    H, T, D = xs.shape
    V = ws.shape[-2]
    rows = max(1, _CHUNK_BYTES // (4 * V))
    rows = -(-T // -(-T // rows))  # same number of chunks, evened out: no tiny last chunk
    # fp32 weights (a no-op for fp32), one [V, D] copy at a time: logits never rounded to bf16.
    wt32 = teacher[1].float() if teacher is not None else None
    loss = torch.empty(H, T, dtype=torch.float32, device=xs.device)
    gx = torch.empty(H, T, D, dtype=torch.float32, device=xs.device) if need_gx else None
    gw = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if need_gw else None
    for h in range(H):
        w = (ws[h] if ws.dim() == 3 else ws).float()
        for t0 in range(0, T, rows):
            sl = slice(t0, t0 + rows)
            x = xs[h, sl].float()
            zs = torch.mm(x, w.t()).mul_(1.0 / temperature)
            zt_c = None
            if div != "ce":
                zt_c = (torch.mm(teacher[0][h, sl].float(), wt32.t()) if zt is None
                        else zt[h, sl].to(torch.float32, copy=True)).mul_(1.0 / temperature)
            loss[h, sl], dz = _chunk_loss_and_dz(
                zs, zt_c, labels[h, sl] if labels is not None else None, div, beta)
            dz.mul_(scale[h, sl, None])
            if need_gx:
                torch.mm(dz, w, out=gx[h, sl])
            if need_gw:
                (gw[h] if ws.dim() == 3 else gw).addmm_(dz.t(), x)
    return loss, gx, gw


# ----------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------
def _check(student_input, student_weight, teacher_input, teacher_weight, teacher_logits,
           labels, divergence, beta, temperature, head_weights, reduction):
    """Raise ValueError (one line) for inconsistent arguments."""
    if divergence not in _DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {_DIVERGENCES}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"unknown reduction {reduction!r}; expected 'sum' or 'mean'")
    if student_input.dim() != 3:
        raise ValueError(f"student_input must be [H, T, D], got shape {tuple(student_input.shape)}")
    H, T, D = student_input.shape
    for name, t in (("student_weight", student_weight), ("teacher_input", teacher_input),
                    ("teacher_weight", teacher_weight), ("teacher_logits", teacher_logits),
                    ("labels", labels)):
        if t is not None and t.device != student_input.device:
            raise ValueError(f"{name} is on {t.device} but student_input is on {student_input.device}")
    if student_weight.dim() not in (2, 3) or student_weight.shape[-1] != D or (
            student_weight.dim() == 3 and student_weight.shape[0] != H):
        raise ValueError(f"student_weight must be [V, {D}] or [{H}, V, {D}], got {tuple(student_weight.shape)}")
    if student_weight.dtype != student_input.dtype:
        raise ValueError(f"student_input is {student_input.dtype} but student_weight is {student_weight.dtype}")
    V = student_weight.shape[-2]
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels is not None and tuple(labels.shape) != (H, T):
        raise ValueError(f"labels must be [{H}, {T}], got {tuple(labels.shape)}")
    if head_weights is not None and len(head_weights) != H:
        raise ValueError(f"head_weights must have {H} entries, got {len(head_weights)}")
    if divergence == "ce":
        if labels is None:
            raise ValueError("divergence 'ce' needs labels")
        return
    if divergence == "jsd" and not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    hidden = teacher_input is not None or teacher_weight is not None
    if hidden == (teacher_logits is not None):
        raise ValueError(f"divergence {divergence!r} needs a teacher: teacher_input and "
                         "teacher_weight, or teacher_logits (not both)")
    if teacher_logits is not None:
        if tuple(teacher_logits.shape) != (H, T, V):
            raise ValueError(f"teacher_logits must be [{H}, {T}, {V}], got {tuple(teacher_logits.shape)}")
        return
    if teacher_input is None or teacher_weight is None:
        raise ValueError("teacher_input and teacher_weight must be given together")
    if teacher_input.dim() != 3 or tuple(teacher_input.shape[:2]) != (H, T):
        raise ValueError(f"teacher_input must be [{H}, {T}, Dt], got {tuple(teacher_input.shape)}")
    if teacher_weight.dim() != 2 or teacher_weight.shape[0] != V:
        raise ValueError(f"teacher_weight must be [{V}, Dt] (the student's vocab), got {tuple(teacher_weight.shape)}")
    if teacher_weight.shape[1] != teacher_input.shape[2]:
        raise ValueError(f"teacher_input has Dt={teacher_input.shape[2]} but teacher_weight has Dt={teacher_weight.shape[1]}")
    if teacher_weight.dtype != teacher_input.dtype:
        raise ValueError(f"teacher_input is {teacher_input.dtype} but teacher_weight is {teacher_weight.dtype}")


class FusedLinearDivergenceFunction(torch.autograd.Function):
    """Loss of all heads with gradients computed in forward (Liger-style).

    forward(student_input, student_weight, teacher_input, teacher_weight, teacher_logits,
            labels, token_weight, divergence, beta, temperature, impl) -> scalar fp32 loss,
    where token_weight [H, T] (fp32) is w_h * valid / n_valid_h. Only student_input and
    student_weight get gradients, and only when they require grad; backward multiplies the
    stored gradients by grad_output.
    """

    @staticmethod
    def forward(ctx, student_input, student_weight, teacher_input, teacher_weight, teacher_logits,
                labels, token_weight, divergence, beta, temperature, impl):
        need_gx, need_gw = ctx.needs_input_grad[:2]
        teacher = None
        if divergence != "ce" and teacher_logits is None:
            teacher = (teacher_input.contiguous(), teacher_weight.contiguous())
        forward = _triton_forward if impl == "triton" else _torch_forward
        row_loss, gx, gw = forward(
            student_input.contiguous(), student_weight.contiguous(), teacher,
            teacher_logits if divergence != "ce" else None,
            labels.contiguous() if labels is not None else None,
            token_weight / temperature, divergence, beta, temperature, need_gx, need_gw)
        # Ignored rows may hold garbage (e.g. a -100 label): select, don't multiply.
        loss = torch.where(token_weight != 0, row_loss * token_weight, 0.0).sum()
        ctx.save_for_backward(gx.to(student_input.dtype) if need_gx else None,
                              gw.to(student_weight.dtype) if need_gw else None)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        gx, gw = ctx.saved_tensors
        return (gx * grad_output if gx is not None else None,
                gw * grad_output if gw is not None else None) + (None,) * 9


def fused_linear_divergence(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    labels: Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    head_weights: Sequence[float] | Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
    *,
    _impl: str | None = None,
) -> Tensor:
    """Divergence loss of H heads' linear logits vs a teacher, without [T, V] tensors.

    Args:
        student_input: [H, T, D] hidden states, one per head.
        student_weight: [V, D] shared lm-head, or [H, V, D] one per head (same dtype as the input).
        teacher_input, teacher_weight: [H, T, Dt] teacher hidden states (already aligned with
            each head's targets by the caller) and the [V, Dt] teacher lm-head; the teacher
            logits are recomputed tile by tile, never stored.
        teacher_logits: [H, T, V] finite teacher logits, instead of teacher_input/weight.
        labels: [H, T] int64. Positions equal to ignore_index are skipped for every
            divergence; "ce" uses the others as targets (they must lie in [0, V)).
        divergence: "ce", "fkl" (KL(p||q)), "rkl" (KL(q||p)), "jsd" (see beta) or "tvd".
        beta: JSD weight: beta * KL(p||m) + (1-beta) * KL(q||m), m = beta p + (1-beta) q.
        temperature: divides both logits; the loss is not multiplied by temperature**2.
        head_weights: [H] loss weights, default 1. They get no gradient.
        ignore_index: label value of skipped positions.
        reduction: "sum" (sum_h w_h sum_t) or "mean" (sum_h w_h mean over valid t).
        _impl: "triton" or "torch"; default Triton for CUDA tensors (where triton is installed),
            the chunked PyTorch path otherwise.

    Returns:
        Scalar fp32 loss. Gradients flow to student_input and student_weight only; the
        teacher tensors get none. "ce" ignores the teacher arguments.
    """
    _check(student_input, student_weight, teacher_input, teacher_weight, teacher_logits,
           labels, divergence, beta, temperature, head_weights, reduction)
    H, T, _ = student_input.shape
    device = student_input.device
    valid = (labels != ignore_index) if labels is not None else torch.ones(H, T, dtype=torch.bool, device=device)
    w = (torch.as_tensor(head_weights, dtype=torch.float32, device=device)
         if head_weights is not None else torch.ones(H, dtype=torch.float32, device=device))
    if reduction == "mean":
        w = w / valid.sum(1).clamp(min=1)
    token_weight = valid * w[:, None]
    impl = "triton" if use_triton(student_input, _impl, other="torch") else "torch"
    return FusedLinearDivergenceFunction.apply(
        student_input, student_weight, teacher_input, teacher_weight, teacher_logits,
        labels, token_weight, divergence, float(beta), float(temperature), impl)

