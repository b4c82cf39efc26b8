"""IBM MLP speculator proposal (vLLM loader semantics): a greedy chain of draft tokens, or IBM's tree expansion.

The op runs Triton on CUDA tensors and the reference elsewhere; ``_impl="triton" | "reference"``
forces one (see :mod:`speculators.kernels.triton_utils`).  Weights follow ``nn.Linear`` layout
(``[out, in]``).

``state_weight = 0.5 ** (0.5 / n_predict)``, ``emb_weight = sqrt((1 - state_weight**2) *
inner / 2)``; optional input scaling ``h = rmsnorm(h) / sqrt(2)`` (no affine, eps 1e-6); stage
``i``: ``s = h @ proj[i]^T + emb[i][tok] * emb_weight / state_weight``, ``s = gelu(rmsnorm(s) *
ln_w[i] + ln_b[i])``, ``logits = s @ head[i]^T``.  Per stage the Triton path launches

1. ``_mlp_proj_kernel`` — projection GEMM tile + embedding gather-add (+ the input RMS scale
   for stage 0, applied to the accumulator since it is a per-row scalar);
2. ``_norm_gelu_kernel`` — RMS norm + affine + exact GELU per row (needs the whole row, so it
   cannot live in the tiled GEMM without a grid-wide barrier; it is a tiny pass over
   ``[rows, inner]``);
3. ``_head_topk_kernel`` + 4. ``_topk_merge_kernel`` (:mod:`speculators.kernels.lm_head_topk`) —
   fused head GEMM + top-k/log-softmax; the merge kernel also writes the chosen token into the
   draft tensor, which the next stage's projection kernel reads directly (no host round trip,
   no sync).

Tree drafting (``mlp_speculator_propose_topk``): IBM's expansion.  Stage ``i`` has ``R_i``
branch rows per request (``R_0 = 1``, ``R_{i+1} = R_i * k_i``); row ``r`` of stage ``i+1`` is
child ``c = r % k_i`` of row ``p = r // k_i`` of stage ``i`` and is fed token
``indices_i[p, c]`` and state ``s_i[p]`` (the state depends on the chosen token, so every
branch needs its own state).  Each stage returns ``(log-probs [B*R_i, k_i], indices [B*R_i,
k_i])``; :func:`speculators.kernels.tree.mlp_candidate_paths` sums log-probs along branches
and keeps the ``n_candidates`` best leaves; :func:`speculators.kernels.tree.paths_to_tree`
turns them into a tree for :func:`speculators.kernels.tree_verification.tree_verify`.  The
projection kernel reads parent rows through ``r // k_i`` — no expanded copy of the state is made.
"""

from __future__ import annotations

import math
from typing import Sequence

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

__all__ = [
    "mlp_speculator_propose",
    "mlp_speculator_propose_reference",
    "mlp_speculator_propose_topk",
    "mlp_speculator_propose_topk_reference",
    "mlp_speculator_propose_topk_triton",
    "mlp_speculator_propose_triton",
    "mlp_speculator_scales",
]

EPS = 1e-6

# GPU launch configuration of the projection kernel (the interpreter takes tiny tiles instead).
MLP_PROJ_CONFIG = {"block_n": 64, "block_d": 64, "num_warps": 4, "num_stages": 4}


def mlp_speculator_scales(n_predict: int, inner_dim: int) -> tuple[float, float, float]:
    """(state_weight, emb_weight, emb_scale = emb_weight / state_weight) as vLLM computes them."""
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner_dim / 2))
    return state_weight, emb_weight, emb_weight / state_weight


# ----------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------
def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _mlp_stage_reference(i, state, toks, emb, proj, ln_weight, ln_bias, scale_input, emb_scale, dt):
    if i == 0 and scale_input:
        state = _rms(state) / math.sqrt(2)
    s = state @ proj[i].to(dt).t() + emb[i].to(dt)[toks] * emb_scale
    return F.gelu(_rms(s) * ln_weight[i].to(dt) + ln_bias[i].to(dt))


def _readout(state, signed_head: bool):
    """What the head reads: the state, or its signed difference s[:half] - s[half:] (see signed_head)."""
    if not signed_head:
        return state
    half = state.shape[-1] // 2
    return state[..., :half] - state[..., half:]


def mlp_speculator_propose_reference(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool = False, top_k: int = 1,
    num_tokens: int | None = None, *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """Greedy chain of the IBM MLP speculator; see :func:`mlp_speculator_propose`."""
    n_predict = len(head)
    steps = n_predict if num_tokens is None else int(num_tokens)
    dt = ref_dtype(hidden, head[0])
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    state = hidden.to(dt)
    toks = tokens.to(torch.int64)
    drafts, vals, idxs = [], [], []
    for i in range(steps):
        state = _mlp_stage_reference(i, state, toks, emb, proj, ln_weight, ln_bias, scale_input, emb_scale, dt)
        logits = _readout(state, signed_head) @ head[i].to(dt).t()
        # the greedy chain needs only the argmax, which log-softmax does not move
        v, ix = stable_topk(torch.log_softmax(logits, dim=-1) if top_k > 1 else logits, top_k)
        ix = to_vocab(ix, vocab_ids)
        toks = ix[:, 0]
        drafts.append(toks)
        vals.append(v.float())
        idxs.append(ix)
    tok = torch.stack(drafts, 1) if drafts else torch.empty(hidden.shape[0], 0, dtype=torch.int64)
    if top_k == 1:
        return tok
    return tok, torch.stack(vals, 1), torch.stack(idxs, 1)


def mlp_speculator_propose_topk_reference(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool, top_k_per_head: Sequence[int],
    *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """IBM tree expansion; see :func:`mlp_speculator_propose_topk`."""
    n_predict = len(head)
    dt = ref_dtype(hidden, head[0])
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    state = hidden.to(dt)
    toks = tokens.to(torch.int64)
    out = []
    for i, k in enumerate(top_k_per_head):
        state = _mlp_stage_reference(i, state, toks, emb, proj, ln_weight, ln_bias, scale_input, emb_scale, dt)
        lp = torch.log_softmax(_readout(state, signed_head) @ head[i].to(dt).t(), dim=-1)
        v, ix = stable_topk(lp, int(k))
        ix = to_vocab(ix, vocab_ids)
        out.append((v.float(), ix))
        state = state.repeat_interleave(int(k), dim=0)  # row r -> parent r // k
        toks = ix.reshape(-1)
    return out


# ----------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _mlp_proj_kernel(
        x_ptr,
        stride_xb,
        p_ptr,
        stride_pn,
        emb_ptr,
        stride_ev,
        tok_ptr,
        stride_tok,
        s_ptr,  # fp32 [Bt, N] pre-norm state
        Bt,
        N,
        D,
        ROWS_PER_PARENT,
        emb_scale,
        SCALE_INPUT: tl.constexpr,
        UPCAST: tl.constexpr,
        DOT_PREC: tl.constexpr,
        BLOCK_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid_b = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
        rmask = rows < Bt
        parent = rows // ROWS_PER_PARENT
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        offs_d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        ss = tl.zeros([BLOCK_B], dtype=tl.float32)
        x_rows = x_ptr + parent.to(tl.int64)[:, None] * stride_xb
        p_rows = p_ptr + cols.to(tl.int64)[:, None] * stride_pn
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            dmask = dd < D
            xt = tl.load(x_rows + dd[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            pt = tl.load(p_rows + dd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
            if SCALE_INPUT:
                xf = xt.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            if UPCAST:
                xt = xt.to(tl.float32)
                pt = pt.to(tl.float32)
            else:
                xt = xt.to(pt.dtype)
            acc = tl.dot(xt, tl.trans(pt), acc, input_precision=DOT_PREC)
        if SCALE_INPUT:
            # rmsnorm(h) / sqrt(2) is a per-row scalar times h: apply it to the accumulator
            acc = acc * (tl.rsqrt(ss / D + 1e-6) * 0.7071067811865476)[:, None]
        tok = tl.load(tok_ptr + rows.to(tl.int64) * stride_tok, mask=rmask, other=0)
        e = tl.load(emb_ptr + tok.to(tl.int64)[:, None] * stride_ev + cols[None, :],
                    mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        acc += e * emb_scale
        tl.store(s_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc, mask=rmask[:, None] & nmask[None, :])

    @triton.jit
    def _norm_gelu_kernel(s_ptr, w_ptr, b_ptr, h_ptr, N, BLOCK_N: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + offs
            v = tl.load(s_ptr + row * N + c, mask=c < N, other=0.0)
            acc += v * v
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + 1e-6)
        for n0 in range(0, N, BLOCK_N):
            c = n0 + offs
            cm = c < N
            v = tl.load(s_ptr + row * N + c, mask=cm, other=0.0)
            w = tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
            bb = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
            y = v * rstd * w + bb
            y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
            tl.store(h_ptr + row * N + c, y.to(h_ptr.dtype.element_ty), mask=cm)


def _mlp_stage_triton(i, x, rows_per_parent, toks, stride_tok, Bt, emb, proj, ln_weight, ln_bias, scale_input,
                      emb_scale, h_dtype):
    P = contiguous_last(proj[i])
    E = contiguous_last(emb[i])
    N, D = P.shape
    dev = x.device
    s = torch.empty(Bt, N, dtype=torch.float32, device=dev)
    interp = interpreting()
    cfg = MLP_PROJ_CONFIG
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(Bt)))
        bn, bd, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(64, triton.next_power_of_2(Bt)))
        bn, bd, warps, stages = cfg["block_n"], cfg["block_d"], cfg["num_warps"], cfg["num_stages"]
        if triton.cdiv(Bt, block_b) * triton.cdiv(N, bn) < sm_count(dev):
            bn = max(16, bn // 2)  # more programs for small batches
        if P.dtype in (torch.float32, torch.float64):
            bd, stages = 32, 3
    upcast, prec = dot_mode(P)
    _mlp_proj_kernel[(triton.cdiv(Bt, block_b), triton.cdiv(N, bn))](
        x, x.stride(0), P, P.stride(0), E, E.stride(0), toks, stride_tok, s,
        Bt, N, D, rows_per_parent, float(emb_scale),
        SCALE_INPUT=bool(scale_input and i == 0), UPCAST=upcast, DOT_PREC=prec,
        BLOCK_B=block_b, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages,
    )
    h = torch.empty(Bt, N, dtype=h_dtype, device=dev)
    bnn = min(triton.next_power_of_2(N), 32 if interp else 1024)
    _norm_gelu_kernel[(Bt,)](s, ln_weight[i], ln_bias[i], h, N, BLOCK_N=bnn, num_warps=1 if interp else 4)
    return h


def _state_dtype(head):
    return torch.float32 if (interpreting() or head.dtype in (torch.float32, torch.float64)) else head.dtype


def mlp_speculator_propose_triton(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool = False, top_k: int = 1,
    num_tokens: int | None = None, *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """Triton greedy chain (4 launches per stage, no host syncs); see :func:`mlp_speculator_propose`."""
    n_predict = len(head)
    steps = n_predict if num_tokens is None else int(num_tokens)
    B = hidden.shape[0]
    dev = hidden.device
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    drafts = torch.empty(B, steps, dtype=torch.int64, device=dev)
    vals = torch.empty(B, steps, top_k, dtype=torch.float32, device=dev)
    idxs = torch.empty(B, steps, top_k, dtype=torch.int64, device=dev)
    x = contiguous_last(hidden)
    toks = tokens.to(device=dev, dtype=torch.int64).contiguous()
    tok_ptr, stride_tok = toks, 1
    for i in range(steps):
        if B == 0:
            break
        h = _mlp_stage_triton(i, x, 1, tok_ptr, stride_tok, B, emb, proj, ln_weight, ln_bias, scale_input,
                              emb_scale, _state_dtype(head[i]))
        W = contiguous_last(head[i])
        r = _readout(h, signed_head)  # a [B, inner/2] difference: negligible next to the head's GEMV
        head_topk_launch(r, W, top_k, logprobs=True, H=1, B=B, stride_xh=0, stride_xb=r.stride(0), stride_wh=0,
                          out_v=vals[:, i], out_i=idxs[:, i], stride_ob=steps * top_k, stride_oh=0,
                          tok_out=drafts[:, i], stride_tok=steps)
        if vocab_ids is not None:  # two tiny gathers, still no host sync
            drafts[:, i] = vocab_ids[drafts[:, i]]
            idxs[:, i] = vocab_ids[idxs[:, i]]
        x = h
        tok_ptr, stride_tok = drafts[:, i], steps
    if top_k == 1:
        return drafts
    return drafts, vals, idxs


def mlp_speculator_propose(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool = False, top_k: int = 1,
    num_tokens: int | None = None, *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """Greedy chain of IBM MLP-speculator draft tokens.

    Args:
        hidden: [B, emb_dim] target hidden state (post final norm) at the last accepted position.
        tokens: [B] int64 the token sampled at that position.
        emb, proj, ln_weight, ln_bias, head: lists (length n_predict) of tensors —
            emb[i] [V, inner], proj[0] [inner, emb_dim], proj[i>0] [inner, inner],
            ln_weight[i]/ln_bias[i] [inner], head[i] [V, inner]; with tie_weights, repeat the
            same tensor.  n_predict = len(head) (it sets state_weight / emb_weight).
        scale_input: apply ``rmsnorm(h) / sqrt(2)`` to the input (vLLM ``scale_input``).
        top_k: per-stage top-k to also return (the chain always follows the top-1 token).
        num_tokens: stages to run (default n_predict).
        signed_head: every stored head is ``[W, -W]`` (what ``init: regression`` trains); pass ``W``
            ``[V, inner/2]`` as head[i] and the op reads out ``W @ (s[:half] - s[half:])``, the same
            logits from half the head's bytes, which are most of a proposal's cost.
        vocab_ids: [N] int64, ascending: head[i] holds only these vocabulary rows (a draft vocabulary,
            see MLPSpeculator.draft_vocab); returned indices and the tokens fed to the next stage are
            vocabulary ids. Tie-breaking is unchanged, as the rows keep their order.
    Returns:
        ``drafts [B, num_tokens] int64`` if ``top_k == 1``, else ``(drafts, logprobs [B, n, k]
        fp32, indices [B, n, k] int64)``.
    """
    args = (hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input, top_k, num_tokens)
    if use_triton(hidden, _impl):
        return mlp_speculator_propose_triton(*args, signed_head=signed_head, vocab_ids=vocab_ids)
    return mlp_speculator_propose_reference(*args, signed_head=signed_head, vocab_ids=vocab_ids)


def mlp_speculator_propose_topk_triton(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool, top_k_per_head: Sequence[int],
    *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """Triton IBM tree expansion; see :func:`mlp_speculator_propose_topk`."""
    n_predict = len(head)
    B = hidden.shape[0]
    dev = hidden.device
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    x = contiguous_last(hidden)
    toks = tokens.to(device=dev, dtype=torch.int64).contiguous()
    rows_per_parent = 1
    Bt = B
    out = []
    for i, k in enumerate(top_k_per_head):
        k = int(k)
        h = _mlp_stage_triton(i, x, rows_per_parent, toks, 1, Bt, emb, proj, ln_weight, ln_bias, scale_input,
                              emb_scale, _state_dtype(head[i]))
        v = torch.empty(Bt, k, dtype=torch.float32, device=dev)
        ix = torch.empty(Bt, k, dtype=torch.int64, device=dev)
        if Bt > 0:
            r = _readout(h, signed_head)
            head_topk_launch(r, contiguous_last(head[i]), k, logprobs=True, H=1, B=Bt, stride_xh=0,
                              stride_xb=r.stride(0), stride_wh=0, out_v=v, out_i=ix, stride_ob=k, stride_oh=0)
        ix = to_vocab(ix, vocab_ids)
        out.append((v, ix))
        x, toks, rows_per_parent, Bt = h, ix.reshape(-1), k, Bt * k
    return out


def mlp_speculator_propose_topk(
    hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input: bool, top_k_per_head: Sequence[int],
    *, signed_head: bool = False, vocab_ids=None, _impl=None,
):
    """IBM tree drafting: per-stage top-k over every branch of the expansion tree.

    Stage ``i`` runs on ``B * R_i`` branch rows (``R_0 = 1``, ``R_{i+1} = R_i * k_i``, rows of a
    request contiguous); branch row ``r`` of stage ``i+1`` continues row ``r // k_i`` of stage
    ``i`` with token ``indices_i.view(-1)[r]``.

    Returns:
        list over stages of ``(logprobs [B * R_i, k_i] fp32, indices [B * R_i, k_i] int64)``,
        descending, ties -> lowest index.  Feed it to
        :func:`speculators.kernels.tree.mlp_candidate_paths` (``n_candidates``) and
        :func:`speculators.kernels.tree.paths_to_tree`.

    ``signed_head`` and ``vocab_ids`` as in :func:`mlp_speculator_propose`.
    """
    args = (hidden, tokens, emb, proj, ln_weight, ln_bias, head, scale_input, top_k_per_head)
    if use_triton(hidden, _impl):
        return mlp_speculator_propose_topk_triton(*args, signed_head=signed_head, vocab_ids=vocab_ids)
    return mlp_speculator_propose_topk_reference(*args, signed_head=signed_head, vocab_ids=vocab_ids)
