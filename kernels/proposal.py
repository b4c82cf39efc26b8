"""Fused proposal ops: LM head + top-k without materialised logits, IBM MLP speculator and Medusa heads.

Every public op has a plain PyTorch reference of the same signature (``*_reference``); the op
runs Triton on CUDA tensors and the reference elsewhere (``_impl="triton" | "reference"``
forces one).  Weights follow ``nn.Linear`` layout (``[out, in]``).

LM head + top-k (``lm_head_topk``)
----------------------------------
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

IBM MLP speculator (vLLM loader semantics)
------------------------------------------
``state_weight = 0.5 ** (0.5 / n_predict)``, ``emb_weight = sqrt((1 - state_weight**2) *
inner / 2)``; optional input scaling ``h = rmsnorm(h) / sqrt(2)`` (no affine, eps 1e-6); stage
``i``: ``s = h @ proj[i]^T + emb[i][tok] * emb_weight / state_weight``, ``s = gelu(rmsnorm(s) *
ln_w[i] + ln_b[i])``, ``logits = s @ head[i]^T``.  Per stage the Triton path launches

1. ``_mlp_proj_kernel`` — projection GEMM tile + embedding gather-add (+ the input RMS scale
   for stage 0, applied to the accumulator since it is a per-row scalar);
2. ``_norm_gelu_kernel`` — RMS norm + affine + exact GELU per row (needs the whole row, so it
   cannot live in the tiled GEMM without a grid-wide barrier; it is a tiny pass over
   ``[rows, inner]``);
3. ``_head_topk_kernel`` + 4. ``_topk_merge_kernel`` — fused head GEMM + top-k/log-softmax; the
   merge kernel also writes the chosen token into the draft tensor, which the next stage's
   projection kernel reads directly (no host round trip, no sync).

Tree drafting (``mlp_speculator_propose_topk``): IBM's expansion.  Stage ``i`` has ``R_i``
branch rows per request (``R_0 = 1``, ``R_{i+1} = R_i * k_i``); row ``r`` of stage ``i+1`` is
child ``c = r % k_i`` of row ``p = r // k_i`` of stage ``i`` and is fed token
``indices_i[p, c]`` and state ``s_i[p]`` (the state depends on the chosen token, so every
branch needs its own state).  Each stage returns ``(log-probs [B*R_i, k_i], indices [B*R_i,
k_i])``; :func:`speculators.kernels.tree.mlp_candidate_paths` sums log-probs along branches
and keeps the ``n_candidates`` best leaves; :func:`speculators.kernels.tree.paths_to_tree`
turns them into a tree for :func:`speculators.kernels.verification.tree_verify`.  The projection
kernel reads parent rows through ``r // k_i`` — no expanded copy of the state is made.

Medusa heads
------------
``x = hidden; x = x + silu(x @ W[h, l]^T + b[h, l])`` per layer, ``logits_h = x @ lm_head_h^T``
(per-head ``[H, V, D]`` or shared ``[V, D]``).  ``_resblock_kernel`` runs one layer for all heads
in one launch (grid over output tiles x row blocks x heads, the residual and SiLU fused into the
GEMM epilogue); then one ``_head_topk_kernel`` launch covers all heads and one merge launch
writes ``[B, H, k]``.  ``L + 2`` launches in total.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = [
    "lm_head_topk",
    "lm_head_topk_reference",
    "lm_head_topk_triton",
    "medusa_propose",
    "medusa_propose_reference",
    "medusa_propose_triton",
    "mlp_speculator_propose",
    "mlp_speculator_propose_reference",
    "mlp_speculator_propose_topk",
    "mlp_speculator_propose_topk_reference",
    "mlp_speculator_propose_topk_triton",
    "mlp_speculator_propose_triton",
    "mlp_speculator_scales",
]

EPS = 1e-6
_INT32_BIG = 2**31 - 1

# Launch configuration (tunable from the benchmark).
PROPOSAL_CONFIG = {
    "head_block_b": 64,
    "head_block_v": 128,
    "head_block_d": 64,
    "head_warps": 8,
    "head_stages": 4,
    "head_programs_per_sm": 2,
    "proj_block_n": 64,
    "proj_block_d": 64,
    "proj_warps": 4,
    "proj_stages": 4,
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    if impl == "reference":
        return False
    if impl == "triton":
        if not _HAS_TRITON:
            raise RuntimeError("triton is not installed")
        return True
    if impl is not None:
        raise ValueError(f"_impl must be None, 'triton' or 'reference', got {impl!r}")
    return t.is_cuda and _HAS_TRITON


def _ref_dtype(*tensors) -> torch.dtype:
    """References compute in fp32, or fp64 when given fp64 inputs."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _stable_topk(logits: torch.Tensor, k: int):
    """Top-k along the last dim with ties broken towards the lowest index."""
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


def mlp_speculator_scales(n_predict: int, inner_dim: int) -> tuple[float, float, float]:
    """(state_weight, emb_weight, emb_scale = emb_weight / state_weight) as vLLM computes them."""
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner_dim / 2))
    return state_weight, emb_weight, emb_weight / state_weight


# ----------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------
def lm_head_topk_reference(x, weight, k: int, *, logprobs: bool = False, _impl=None):
    """``(values [B, k] fp32, indices [B, k] int64)`` of ``x @ weight^T`` (log-softmax if ``logprobs``)."""
    dt = _ref_dtype(x, weight)
    logits = x.to(dt) @ weight.to(dt).t()
    if logprobs:
        logits = torch.log_softmax(logits, dim=-1)
    v, i = _stable_topk(logits, k)
    return v.float(), i


def _to_vocab(ix, vocab_ids):
    """Head-row indices -> vocabulary ids when the heads hold only a draft vocabulary's rows."""
    return ix if vocab_ids is None else vocab_ids[ix]


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
    dt = _ref_dtype(hidden, head[0])
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    state = hidden.to(dt)
    toks = tokens.to(torch.int64)
    drafts, vals, idxs = [], [], []
    for i in range(steps):
        state = _mlp_stage_reference(i, state, toks, emb, proj, ln_weight, ln_bias, scale_input, emb_scale, dt)
        logits = _readout(state, signed_head) @ head[i].to(dt).t()
        # the greedy chain needs only the argmax, which log-softmax does not move
        v, ix = _stable_topk(torch.log_softmax(logits, dim=-1) if top_k > 1 else logits, top_k)
        ix = _to_vocab(ix, vocab_ids)
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
    dt = _ref_dtype(hidden, head[0])
    _, _, emb_scale = mlp_speculator_scales(n_predict, proj[0].shape[0])
    state = hidden.to(dt)
    toks = tokens.to(torch.int64)
    out = []
    for i, k in enumerate(top_k_per_head):
        state = _mlp_stage_reference(i, state, toks, emb, proj, ln_weight, ln_bias, scale_input, emb_scale, dt)
        lp = torch.log_softmax(_readout(state, signed_head) @ head[i].to(dt).t(), dim=-1)
        v, ix = _stable_topk(lp, int(k))
        ix = _to_vocab(ix, vocab_ids)
        out.append((v.float(), ix))
        state = state.repeat_interleave(int(k), dim=0)  # row r -> parent r // k
        toks = ix.reshape(-1)
    return out


def medusa_propose_reference(hidden, block_weights, block_bias, lm_head, top_k: int = 1, *, logprobs: bool = False,
                             _impl=None):
    """``(values [B, H, k], indices [B, H, k])`` of Medusa heads; see :func:`medusa_propose`."""
    H, L = block_weights.shape[:2]
    dt = _ref_dtype(hidden, block_weights, lm_head)
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
        v, i = _stable_topk(logits, top_k)
        vals.append(v.float())
        idxs.append(i)
    return torch.stack(vals, 1), torch.stack(idxs, 1)


# ----------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------
if _HAS_TRITON:

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


def _dot_mode(*weights):
    """(UPCAST, DOT_PREC) for tl.dot given the weight dtypes."""
    if _interpreting() or any(w.dtype == torch.float32 or w.dtype == torch.float64 for w in weights):
        return True, "ieee"
    return False, "tf32"  # native bf16/fp16 dot; input_precision is ignored for them


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _head_topk_launch(x, w, k, *, logprobs, H, B, stride_xh, stride_xb, stride_wh, out_v, out_i, stride_ob,
                      stride_oh, tok_out=None, stride_tok=0, num_programs=None):
    """Launch head GEMM + top-k over H heads (x: [H?, B, D] via strides, w: [H?, V, D])."""
    V, D = w.shape[-2], w.shape[-1]
    if k < 1 or k > V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    cfg = PROPOSAL_CONFIG
    interp = _interpreting()
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(max(B, 1))))
        block_v, block_d, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(cfg["head_block_b"], triton.next_power_of_2(max(B, 1))))
        block_v, block_d, warps, stages = cfg["head_block_v"], cfg["head_block_d"], cfg["head_warps"], cfg["head_stages"]
        if w.dtype in (torch.float32, torch.float64):  # IEEE fp32 dots: smaller tiles (no spills)
            block_v, block_d, stages = 64, 32, 3
    kpad = max(2, triton.next_power_of_2(k))
    n_tiles = triton.cdiv(V, block_v)
    n_bblocks = triton.cdiv(B, block_b)
    if num_programs is None:
        if interp:
            num_programs = min(n_tiles, 3)
        else:
            target = cfg["head_programs_per_sm"] * _sm_count(x.device)
            num_programs = max(1, min(n_tiles, triton.cdiv(target, n_bblocks * H)))
    tiles_per_prog = triton.cdiv(n_tiles, max(1, min(int(num_programs), n_tiles)))
    NP = triton.cdiv(n_tiles, tiles_per_prog)
    dev = x.device
    pv = torch.empty(H * B * NP * kpad, dtype=torch.float32, device=dev)
    pi = torch.empty(H * B * NP * kpad, dtype=torch.int32, device=dev)
    pl = torch.empty(2 * H * B * NP if logprobs else 1, dtype=torch.float32, device=dev)
    upcast, prec = _dot_mode(w)
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


def _contig_last(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def lm_head_topk_triton(x, weight, k: int, *, logprobs: bool = False, _impl=None, _num_programs=None):
    """Fused LM head GEMM + top-k (2 launches; no [B, V] logits in memory)."""
    x = _contig_last(x)
    weight = _contig_last(weight)
    B, D = x.shape
    if weight.shape[1] != D:
        raise ValueError("weight must be [V, D]")
    out_v = torch.empty(B, k, dtype=torch.float32, device=x.device)
    out_i = torch.empty(B, k, dtype=torch.int64, device=x.device)
    if B == 0:
        return out_v, out_i
    _head_topk_launch(x, weight, k, logprobs=logprobs, H=1, B=B, stride_xh=0, stride_xb=x.stride(0), stride_wh=0,
                      out_v=out_v, out_i=out_i, stride_ob=k, stride_oh=0, num_programs=_num_programs)
    return out_v, out_i


def lm_head_topk(x, weight, k: int, *, logprobs: bool = False, _impl=None):
    """Top-k of ``x @ weight^T`` without writing the logits.

    Args:
        x: [B, D] activations; weight: [V, D] LM head; k: 1 <= k <= V.
        logprobs: return ``log_softmax`` values instead of raw logits (online log-sum-exp, same pass).
    Returns:
        ``(values [B, k] fp32, indices [B, k] int64)``, descending; ties -> lowest index.
    """
    if _use_triton(x, _impl):
        return lm_head_topk_triton(x, weight, k, logprobs=logprobs)
    return lm_head_topk_reference(x, weight, k, logprobs=logprobs)


# ----------------------------------------------------------------------------------------
# MLP speculator (Triton)
# ----------------------------------------------------------------------------------------
def _mlp_stage_triton(i, x, rows_per_parent, toks, stride_tok, Bt, emb, proj, ln_weight, ln_bias, scale_input,
                      emb_scale, h_dtype):
    P = _contig_last(proj[i])
    E = _contig_last(emb[i])
    N, D = P.shape
    dev = x.device
    s = torch.empty(Bt, N, dtype=torch.float32, device=dev)
    interp = _interpreting()
    cfg = PROPOSAL_CONFIG
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(Bt)))
        bn, bd, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(64, triton.next_power_of_2(Bt)))
        bn, bd, warps, stages = cfg["proj_block_n"], cfg["proj_block_d"], cfg["proj_warps"], cfg["proj_stages"]
        if triton.cdiv(Bt, block_b) * triton.cdiv(N, bn) < _sm_count(dev):
            bn = max(16, bn // 2)  # more programs for small batches
        if P.dtype in (torch.float32, torch.float64):
            bd, stages = 32, 3
    upcast, prec = _dot_mode(P)
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
    return torch.float32 if (_interpreting() or head.dtype in (torch.float32, torch.float64)) else head.dtype


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
    x = _contig_last(hidden)
    toks = tokens.to(device=dev, dtype=torch.int64).contiguous()
    tok_ptr, stride_tok = toks, 1
    for i in range(steps):
        if B == 0:
            break
        h = _mlp_stage_triton(i, x, 1, tok_ptr, stride_tok, B, emb, proj, ln_weight, ln_bias, scale_input,
                              emb_scale, _state_dtype(head[i]))
        W = _contig_last(head[i])
        r = _readout(h, signed_head)  # a [B, inner/2] difference: negligible next to the head's GEMV
        _head_topk_launch(r, W, top_k, logprobs=True, H=1, B=B, stride_xh=0, stride_xb=r.stride(0), stride_wh=0,
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
    if _use_triton(hidden, _impl):
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
    x = _contig_last(hidden)
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
            _head_topk_launch(r, _contig_last(head[i]), k, logprobs=True, H=1, B=Bt, stride_xh=0,
                              stride_xb=r.stride(0), stride_wh=0, out_v=v, out_i=ix, stride_ob=k, stride_oh=0)
        ix = _to_vocab(ix, vocab_ids)
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
    if _use_triton(hidden, _impl):
        return mlp_speculator_propose_topk_triton(*args, signed_head=signed_head, vocab_ids=vocab_ids)
    return mlp_speculator_propose_topk_reference(*args, signed_head=signed_head, vocab_ids=vocab_ids)


# ----------------------------------------------------------------------------------------
# Medusa (Triton)
# ----------------------------------------------------------------------------------------
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
    lm = _contig_last(lm_head)
    x = _contig_last(hidden)
    stride_xh, stride_xb = 0, x.stride(0)
    interp = _interpreting()
    cfg = PROPOSAL_CONFIG
    if interp:
        block_b = max(16, min(32, triton.next_power_of_2(max(B, 1))))
        bn, bd, warps, stages = 32, 32, 1, 1
    else:
        block_b = max(16, min(64, triton.next_power_of_2(max(B, 1))))
        bn, bd, warps, stages = cfg["proj_block_n"], cfg["proj_block_d"], cfg["proj_warps"], cfg["proj_stages"]
        if triton.cdiv(B, block_b) * triton.cdiv(D, bn) * H < _sm_count(dev):
            bn = max(16, bn // 2)
        if block_weights.dtype in (torch.float32, torch.float64):
            bd, stages = 32, 3
    upcast, prec = _dot_mode(block_weights)
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
    _head_topk_launch(x, lm, top_k, logprobs=logprobs, H=H, B=B, stride_xh=stride_xh, stride_xb=stride_xb,
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
    if _use_triton(hidden, _impl):
        vals, idx = medusa_propose_triton(hidden, block_weights, block_bias, lm_head, top_k, logprobs=logprobs)
    else:
        vals, idx = medusa_propose_reference(hidden, block_weights, block_bias, lm_head, top_k, logprobs=logprobs)
    return vals, _to_vocab(idx, vocab_ids)
