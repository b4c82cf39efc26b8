"""Verification ops for speculative decoding: chain rejection sampling and tree verification.

Every public op has a plain PyTorch reference of the same signature (``*_reference``) and a
Triton implementation (``*_triton``); the op itself runs Triton on CUDA tensors and the
reference elsewhere.  ``_impl="triton" | "reference"`` forces one (tests use it together with
``TRITON_INTERPRET=1`` to run the Triton path on CPU).

Chain verification (``rejection_sample``)
-----------------------------------------
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
implementations.

Randomness
----------
Results must not depend on the implementation or on batch composition, so all randomness is a
function of a per-request seed and is produced outside the arithmetic that differs between
implementations.  Two modes:

1. explicit tensors: ``uniforms [B, K]`` and ``exponentials [B, K+1, V]``, e.g. from
   :func:`make_randomness` (one ``torch.Generator`` per request, generated on the CPU so the
   numbers are the same on every device).  Simple, but a ``[B, K+1, V]`` fp32 noise tensor is as
   much memory traffic as the logits themselves.
2. counter-based hashing (``seeds=...``, the fast path): ``u = U(seed, position, stream, vocab
   index)`` from a Weyl sequence finalised by a 32-bit integer mixer (Wellons' "lowbias32"):
   ``key = mix(mix(seed_hi ^ c0) ^ seed_lo)``, ``skey = mix(key ^ mix(2 * position + stream +
   c1))``, ``u = (mix(v * 0x9E3779B1 + skey) >> 9 + 0.5) / 2**23``, all modulo 2**32 —
   implemented bit-identically in Triton (``uint32``) and torch (``int64`` masked to 32 bits,
   :func:`counter_uniforms`).  Nothing is materialised: the kernel derives the noise of a vocab
   tile in registers.  Stream 1 (vocab index 0) gives the accept-test uniform of position j,
   stream 0 the vocabulary noise ``E = -log u`` of row j.

   The uniforms lie in the open interval: 23 bits, offset by half a step, are exact in fp32 and
   span ``[2**-24, 1 - 2**-24]``.  (24 bits plus half a step would round the top value to 1.0 in
   fp32, giving ``E = 0`` and an infinite race score that lets a token of any probability win.)
   The GPU's approximate log2 can still round ``-log2(u)`` to 0 near ``u = 1``, so the kernels
   clamp the noise to its exact minimum, ``-log2(1 - 2**-24)``.

Both modes give bit-identical uniforms in torch and Triton; what remains is fp32 (kernel) vs fp64
(reference) rounding of logs/exps (and ``lg2.approx`` on GPU), which can only flip an outcome on
a near-tie (probability ~1e-7 per decision).

Top-k / top-p
-------------
The kept set of a row is always an upper set of the logits, so it is described exactly by one
threshold per row: a raw logit value taken from the row itself (tokens with ``logit >=
threshold`` are kept; ties at the boundary are kept).  Top-k keeps the k largest (plus ties);
top-p is applied to the top-k-renormalised distribution and keeps the smallest prefix (in
descending order) whose mass reaches ``top_p`` — token ``v`` is kept iff the mass of the
tokens sorted before it is ``< top_p``.  :func:`compute_filter_thresholds` (torch, sort based,
used by both implementations; it only touches rows of requests that enable top-k/top-p)
computes the thresholds; the kernel applies them on the fly, so no masked logits are written.

Fused Triton pipeline (chain)
-----------------------------
1. ``_row_stats_kernel`` — grid ``(B*(K+1), splits)``; each program streams its vocab chunk of
   one row once: greedy rows ``(max, argmax)``; stochastic rows the online-softmax
   ``(max, sum exp)`` of ``logit / T`` over the kept set (lane-wise, base 2, no cross-warp
   reduction in the loop).  Rows past ``num_draft[b]`` are skipped.  This is the only full pass
   over the logits.
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

Tree verification (``tree_verify``)
-----------------------------------
Node 0 is the root (the last accepted token); ``parents[b, i] < i`` for ``i > 0`` (topological
order), ``parents[b, i] < 0`` for ``i > 0`` marks padding.  Row ``i`` of ``target_logits``
scores the children of node ``i``.  Node ``i`` is *acceptable* if (greedy) its token equals the
argmax of its parent's row, or (typical, Medusa-2) ``p_parent(token) > min(epsilon, delta *
exp(-H(p_parent)))`` with ``p = softmax(logits / T)`` and exact entropy ``H``.  The accepted
path is the longest root path whose nodes are all acceptable (ties: lowest leaf index; for
greedy on a tree without duplicate sibling tokens this is the usual walk down).  The bonus
token comes from the leaf's row: argmax (greedy, or typical without ``seeds``) or a sample of
``p`` (typical with ``seeds``).  Triton computes the per-node row statistics (the heavy part:
argmax, softmax normaliser, entropy — one pass over ``[B, N, V]``); the path search over the
``[B, N]`` statistics is a few vectorised torch ops (pointer jumping, ``O(log N)`` gathers).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

try:  # triton is a Linux-only dependency; the references work without it
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    _HAS_TRITON = False

__all__ = [
    "TreeVerifyOutput",
    "compute_filter_thresholds",
    "counter_uniforms",
    "make_randomness",
    "rejection_sample",
    "rejection_sample_reference",
    "rejection_sample_triton",
    "tree_verify",
    "tree_verify_reference",
    "tree_verify_triton",
]

_INT32_BIG = 2**31 - 1

# Launch configuration of the row-statistics kernel (tunable from the benchmark).
VERIFY_CONFIG = {"block_v": 4096, "num_warps": 16, "programs_per_sm": 4, "recover_block_v": 2048, "recover_warps": 8}


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


# ----------------------------------------------------------------------------------------
# Counter-based randomness (torch side; the Triton side is _mix32/_seed_key/... below)
# ----------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_C_MUL1 = 0x7FEB352D
_C_MUL2 = 0x846CA68B
_C_SEED = 0x9E3779B9
_C_POS = 0x632BE5AB
_C_VOCAB = 0x9E3779B1  # odd: v -> v * C + key is a bijection


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding uint32 values. torch's int64 product wraps modulo
    2**64 (two's complement, CPU and CUDA alike), so its low 32 bits are the uint32 product; the
    exhaustive mapping tests check this path bit for bit against the Triton kernels."""
    return (x * c).bitwise_and_(_M32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C_MUL1)
    x.bitwise_xor_(x >> 15)
    x = _mul32(x, _C_MUL2)
    return x.bitwise_xor_(x >> 16)


def _seed_key(seeds: torch.Tensor) -> torch.Tensor:
    seeds = seeds.to(torch.int64)
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    return _mix32(lo ^ _mix32(hi ^ _C_SEED))


def _stream_key(key: torch.Tensor, pos: torch.Tensor, stream: int) -> torch.Tensor:
    return _mix32(key ^ _mix32((pos.to(torch.int64) * 2 + stream + _C_POS) & _M32))


def uniform_from_bits(x: torch.Tensor) -> torch.Tensor:
    """uint32 values (held in int64) -> fp32 uniforms in the open interval (0, 1): the top 23 bits
    plus half a step, so every value is exact in fp32 and the largest is 1 - 2**-24, never 1.0."""
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1) (fp32, multiples of 2**-23 offset by 2**-24) of the counter-based generator.

    seeds [B] int64, positions broadcastable to [B, P] (int) -> [B, P, vocab_size] fp32;
    element ``[b, p, v]`` = ``U(seed_b, positions[b, p], stream, v)``, bit-identical to the kernels.
    """
    seeds = seeds.reshape(-1, 1, 1).to(torch.int64)
    positions = torch.as_tensor(positions, device=seeds.device).to(torch.int64)
    if positions.dim() < 2:
        positions = positions.reshape(-1, 1) if positions.dim() == 1 else positions.reshape(1, 1)
    skey = _stream_key(_seed_key(seeds), positions.unsqueeze(-1), stream)
    v = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return uniform_from_bits(_mix32((_mul32(v, _C_VOCAB) + skey) & _M32))


def make_randomness(seeds, num_draft_positions: int, vocab_size: int, device=None):
    """Explicit randomness: ``(uniforms [B, K] fp32, exponentials [B, K+1, V] fp32)``.

    One ``torch.Generator`` per request, seeded with ``seeds[b]`` and run on the CPU (so the
    numbers are the same on every device and do not depend on the other requests), then moved to
    ``device``.  ``exponentials[b, j]`` is the Exp(1) noise of row ``j`` (recovered token at a
    rejection in position ``j`` or the bonus token when ``j == num_draft[b]``).
    """
    seeds = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    K, V = int(num_draft_positions), int(vocab_size)
    us, es = [], []
    for s in seeds:
        g = torch.Generator(device="cpu")
        g.manual_seed(s)
        us.append(torch.rand(K, generator=g, dtype=torch.float32))
        es.append(torch.empty(K + 1, V, dtype=torch.float32).exponential_(generator=g))
    u = torch.stack(us) if us else torch.empty(0, K)
    e = torch.stack(es) if es else torch.empty(0, K + 1, V)
    return u.to(device), e.to(device)


# ----------------------------------------------------------------------------------------
# Top-k / top-p thresholds (shared by both implementations)
# ----------------------------------------------------------------------------------------
def _normalize_sampling_params(B, device, temperature, top_k, top_p):
    if temperature is None:
        temp = torch.zeros(B, dtype=torch.float32, device=device)
    else:
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1).expand(B).contiguous()
    tk = None if top_k is None else torch.as_tensor(top_k, device=device).to(torch.int64).reshape(-1).expand(B)
    tp = None if top_p is None else torch.as_tensor(top_p, device=device).to(torch.float32).reshape(-1).expand(B)
    return temp, tk, tp


def compute_filter_thresholds(target_logits, temperature, top_k=None, top_p=None):
    """Per-row raw-logit thresholds ``[B, R]`` fp32 implementing top-k then top-p, or None.

    ``-inf`` means "keep everything".  Only requests with ``temperature > 0`` and an active
    ``top_k`` (``0 < k < V``) or ``top_p`` (``< 1``) are processed.  See the module docstring
    for the exact (tie-inclusive) semantics.
    """
    B, R, V = target_logits.shape
    temp, tk, tp = _normalize_sampling_params(B, target_logits.device, temperature, top_k, top_p)
    stochastic = temp > 0
    need_k = torch.zeros_like(stochastic) if tk is None else stochastic & (tk > 0) & (tk < V)
    need_p = torch.zeros_like(stochastic) if tp is None else stochastic & (tp < 1.0)
    need = need_k | need_p
    if not bool(need.any()):
        return None
    thr = torch.full((B, R), float("-inf"), dtype=torch.float32, device=target_logits.device)
    idx = need.nonzero().squeeze(1)
    logits = target_logits[idx].double()  # [n, R, V]
    n = idx.numel()
    k = tk[idx].clamp(1, V) if tk is not None else torch.full((n,), V, device=logits.device, dtype=torch.int64)
    k = torch.where(need_k[idx], k, torch.full_like(k, V))
    any_p = bool(need_p[idx].any())
    if any_p:
        vals, _ = logits.sort(dim=-1, descending=True)
    else:
        vals, _ = logits.topk(int(k.max()), dim=-1)
    kth = vals.gather(-1, (k - 1).view(n, 1, 1).expand(n, R, 1))  # [n, R, 1]
    t = torch.where(need_k[idx].view(n, 1), kth.squeeze(-1), torch.full_like(kth.squeeze(-1), float("-inf")))
    if any_p:
        Tn = temp[idx].double().view(n, 1, 1)
        z = torch.where(vals >= kth, vals / Tn, torch.full_like(vals, float("-inf")))
        probs = torch.softmax(z, dim=-1)
        excl = torch.cumsum(probs, dim=-1) - probs
        p = tp[idx].double().view(n, 1, 1)
        n_keep = (excl < p).sum(-1, keepdim=True).clamp(min=1)  # kept set is a prefix
        tpv = vals.gather(-1, n_keep - 1).squeeze(-1)
        t = torch.where(need_p[idx].view(n, 1), torch.maximum(t, tpv), t)
    thr[idx] = t.to(torch.float32)
    return thr


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
# Chain verification: reference
# ----------------------------------------------------------------------------------------
def rejection_sample_reference(
    target_logits,
    draft_tokens,
    num_draft,
    draft_probs=None,
    temperature=None,
    top_k=None,
    top_p=None,
    uniforms=None,
    exponentials=None,
    *,
    seeds=None,
    _impl=None,
):
    """Plain-PyTorch (fp64) chain rejection sampling; see :func:`rejection_sample`."""
    B, K, V = _check_chain_inputs(target_logits, draft_tokens, num_draft)
    dev = target_logits.device
    temp, _, _ = _normalize_sampling_params(B, dev, temperature, top_k, top_p)
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
        if uniforms is None:
            if seeds is None:
                raise ValueError("stochastic verification needs uniforms/exponentials or seeds")
            u = counter_uniforms(seeds.to(dev), torch.arange(K, device=dev).expand(B, K), 1, 1).squeeze(-1)
        else:
            u = uniforms.to(dev).float()
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
        if exponentials is not None:
            E = exponentials.to(dev)[bidx, n_acc].double()
        elif seeds is not None:
            E = -torch.log(counter_uniforms(seeds.to(dev), n_acc.view(B, 1), 0, V).squeeze(1).double())
        else:
            raise ValueError("stochastic verification needs exponentials or seeds")
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
# Triton kernels
# ----------------------------------------------------------------------------------------
if _HAS_TRITON:

    @triton.jit
    def _mix32_tl(x):
        x ^= x >> 16
        x *= tl.full((), 0x7FEB352D, tl.uint32)
        x ^= x >> 15
        x *= tl.full((), 0x846CA68B, tl.uint32)
        x ^= x >> 16
        return x

    @triton.jit
    def _stream_key_tl(seed, pos, stream: tl.constexpr):
        """seed: int64 scalar, pos: int scalar -> uint32 key of (seed, pos, stream)."""
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix32_tl(lo ^ _mix32_tl(hi ^ tl.full((), 0x9E3779B9, tl.uint32)))
        p = tl.cast(pos * 2 + stream, tl.uint32) + tl.full((), 0x632BE5AB, tl.uint32)
        return _mix32_tl(key ^ _mix32_tl(p))

    @triton.jit
    def _uniform_from_bits_tl(x):
        """uint32 -> fp32 uniform in the open interval (0, 1), bit-identical to uniform_from_bits."""
        return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _uniform_tl(skey, v):
        """Uniform in (0,1) for uint32 stream key and int vocab indices v (any shape)."""
        return _uniform_from_bits_tl(_mix32_tl(tl.cast(v, tl.uint32) * tl.full((), 0x9E3779B1, tl.uint32) + skey))

    @triton.jit
    def _fast_log2(x, FAST: tl.constexpr):
        if FAST:  # MUFU.LG2 (rel. error ~2^-22); libdevice's log2f is a ~10-FMA polynomial
            return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.log2(x)

    @triton.jit
    def _race_noise_tl(skey, v, FAST: tl.constexpr):
        """E = -log2(u), proportional to Exp(1), never 0: clamped to its exact minimum
        -log2(1 - 2**-24) because an approximate log2 can round it to 0 (or below) near u = 1,
        and a zero E would let a token of any probability win the race."""
        return tl.maximum(-_fast_log2(_uniform_tl(skey, v), FAST), 8.599e-08)

    @triton.jit
    def _row_stats_kernel(
        logits_ptr,
        stride_lb,
        stride_lr,
        row_limit_ptr,
        temp_ptr,
        thr_ptr,
        excl_ptr,
        stride_eb,
        noise_ptr,
        stride_nb,
        stride_nr,
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
        HAS_EXCL: tl.constexpr,
        NOISE: tl.constexpr,  # 0 none, 1 explicit exponentials, 2 counter hash
        ALWAYS_ARGMAX: tl.constexpr,
        NEED_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """Partial statistics of one vocab chunk of one row (see _launch_row_stats).

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
                if HAS_EXCL:
                    excl = tl.load(excl_ptr + b.to(tl.int64) * stride_eb + r, mask=r < limit, other=-1).to(tl.int32)
                else:
                    excl = -1
                if NOISE == 2:
                    skey = _stream_key_tl(tl.load(seed_ptr + b), r, 0)
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
                    if NOISE != 0:
                        if NOISE == 1:
                            ex = tl.load(noise_ptr + b.to(tl.int64) * stride_nb + r.to(tl.int64) * stride_nr + idx,
                                         mask=keep, other=1.0).to(tl.float32)
                        else:
                            ex = _race_noise_tl(skey, idx, False)
                        s_e = s_e * alpha
                        upd = (e * s_x > s_e * ex) & (idx != excl)
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
                if NOISE != 0:
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
        unif_ptr,
        stride_ub,
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
        U_MODE: tl.constexpr,  # 0 none (all greedy), 1 tensor, 2 counter hash
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
        if U_MODE == 2:
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
            if U_MODE == 1:
                u = tl.load(unif_ptr + b.to(tl.int64) * stride_ub + j, mask=is_draft & sto, other=0.5)
            elif U_MODE == 2:
                u = _uniform_tl(_stream_key_tl(seed, j, 1), 0)
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
        noise_ptr,
        stride_nb,
        stride_nr,
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
        NOISE: tl.constexpr,
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
            if NOISE == 2:
                skey = _stream_key_tl(tl.load(seed_ptr + b), j, 0)
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
                if NOISE == 1:
                    ex = tl.load(noise_ptr + b.to(tl.int64) * stride_nb + j.to(tl.int64) * stride_nr + idx,
                                 mask=msk, other=1.0).to(tl.float32)
                else:
                    ex = _race_noise_tl(skey, idx, FAST)
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


def _launch_row_stats(
    logits, row_limit, temp, thr, excl, noise, seeds, *, noise_mode, always_argmax, need_entropy, has_temp,
    splits=None, block_v=None, num_warps=None,
):
    """Launch _row_stats_kernel over logits [B, R, V]; returns (part_f [5, P], part_i [2, P], S, logits)."""
    B, R, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if _interpreting():
        block_v = block_v or min(triton.next_power_of_2(V), 64)
        num_warps = num_warps or 1
    else:
        block_v = block_v or VERIFY_CONFIG["block_v"]
        num_warps = num_warps or VERIFY_CONFIG["num_warps"]
    block_v = min(block_v, max(triton.next_power_of_2(V), 16))
    rows = B * R
    n_blocks = triton.cdiv(V, block_v)
    if splits is None:
        if logits.is_cuda:
            sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
            splits = max(1, min(n_blocks, triton.cdiv(VERIFY_CONFIG["programs_per_sm"] * sms, max(rows, 1))))
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
        excl if excl is not None else row_limit, excl.stride(0) if excl is not None else 0,
        noise if noise is not None else dummy,
        noise.stride(0) if noise is not None else 0,
        noise.stride(1) if noise is not None else 0,
        seeds if seeds is not None else row_limit,
        part_f, part_i,
        P, R, V, S, chunk,
        HAS_TEMP=has_temp,
        HAS_THR=thr is not None,
        HAS_EXCL=excl is not None,
        NOISE=noise_mode,
        ALWAYS_ARGMAX=always_argmax,
        NEED_ENTROPY=need_entropy,
        BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return part_f, part_i, S, logits


def rejection_sample_triton(
    target_logits,
    draft_tokens,
    num_draft,
    draft_probs=None,
    temperature=None,
    top_k=None,
    top_p=None,
    uniforms=None,
    exponentials=None,
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
    # Only top-k/top-p (threshold computation) and a missing-randomness check synchronise.
    has_temp = temperature is not None
    temp, _, _ = _normalize_sampling_params(B, dev, temperature, top_k, top_p)
    has_random = exponentials is not None or seeds is not None
    if has_temp and not has_random:
        if bool((temp > 0).any()):
            raise ValueError("stochastic verification needs exponentials or seeds")
        has_temp = False
    any_sto = has_temp
    thr = None
    if any_sto and (top_k is not None or top_p is not None):
        thr = compute_filter_thresholds(logits, temp, top_k, top_p)
    thr = thr.contiguous() if thr is not None else None
    noise_mode, u_mode = 0, 0
    noise = None
    seeds_t = None
    if any_sto:
        if exponentials is not None:
            noise_mode = 1
            noise = exponentials.to(dev)
            if noise.stride(-1) != 1:
                noise = noise.contiguous()
        elif seeds is not None:
            noise_mode = 2
        else:
            raise ValueError("stochastic verification needs exponentials or seeds")
        if uniforms is not None:
            u_mode = 1
        elif seeds is not None:
            u_mode = 2
        else:
            raise ValueError("stochastic verification needs uniforms or seeds")
        if seeds is not None:
            seeds_t = torch.as_tensor(seeds, device=dev).to(torch.int64).contiguous()
    has_dprobs = any_sto and draft_probs is not None
    part_f, part_i, S, logits = _launch_row_stats(
        logits, nd, temp if has_temp else None, thr, None, None, None,
        noise_mode=0, always_argmax=False, need_entropy=False, has_temp=has_temp,
        splits=_splits, block_v=_block_v, num_warps=_num_warps,
    )
    P = B * R * S
    dp = None
    if has_dprobs:
        dp = draft_probs.to(dev)
        if dp.stride(-1) != 1:
            dp = dp.contiguous()
    unif = uniforms.to(device=dev, dtype=torch.float32).contiguous() if u_mode == 1 else None
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
        unif if unif is not None else dummy,
        unif.stride(0) if unif is not None else 0,
        seeds_t if seeds_t is not None else nd,
        part_f, part_i,
        out, n_acc, rec_i, rec_f,
        P, K, S,
        HAS_TEMP=has_temp,
        HAS_THR=thr is not None,
        HAS_DPROBS=has_dprobs,
        U_MODE=u_mode,
        BLOCK_S=max(2, triton.next_power_of_2(S)),
        num_warps=1,
    )
    if any_sto:
        interp = _interpreting()
        block_v = _block_v or (min(triton.next_power_of_2(V), 64) if interp else VERIFY_CONFIG["recover_block_v"])
        block_v = min(block_v, max(triton.next_power_of_2(V), 16))
        n_blocks = triton.cdiv(V, block_v)
        if _splits is not None:
            s2 = _splits
        elif dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            s2 = triton.cdiv(VERIFY_CONFIG["programs_per_sm"] * sms, B)
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
            noise if noise is not None else dummy,
            noise.stride(0) if noise is not None else 0,
            noise.stride(1) if noise is not None else 0,
            seeds_t if seeds_t is not None else nd,
            rec_i, rec_f, rpart_f, rpart_i,
            K, V, S2, chunk,
            HAS_THR=thr is not None,
            HAS_DPROBS=has_dprobs,
            NOISE=noise_mode,
            FAST=not interp,
            BLOCK_V=block_v,
            num_warps=1 if interp else VERIFY_CONFIG["recover_warps"],
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
    uniforms=None,
    exponentials=None,
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
        uniforms: [B, K] fp32 U(0,1) for the accept tests; exponentials: [B, K+1, V] Exp(1) noise
            (see :func:`make_randomness`).  Alternatively ``seeds`` [B] int64 selects the
            counter-based generator (no noise tensors; the fast path).
    Returns:
        ``(output_tokens [B, K+1] int64, num_accepted [B] int64)``: ``output_tokens[b]`` holds
        the ``num_accepted[b]`` accepted drafts followed by one recovered-or-bonus token, padded
        with -1.
    """
    if _use_triton(target_logits, _impl):
        return rejection_sample_triton(
            target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p, uniforms,
            exponentials, seeds=seeds,
        )
    return rejection_sample_reference(
        target_logits, draft_tokens, num_draft, draft_probs, temperature, top_k, top_p, uniforms, exponentials,
        seeds=seeds,
    )


# ----------------------------------------------------------------------------------------
# Tree verification
# ----------------------------------------------------------------------------------------
class TreeVerifyOutput(NamedTuple):
    accepted_nodes: torch.Tensor  # [B, N] int64: node indices of the accepted path, root (0) first, -1 padded
    output_tokens: torch.Tensor  # [B, N] int64: accepted tokens (root excluded) then the bonus token, -1 padded
    num_accepted: torch.Tensor  # [B] int64: accepted tree tokens (path length without the root)
    bonus_tokens: torch.Tensor  # [B] int64


def _check_tree_inputs(target_logits, tree_tokens, parents, mode):
    if target_logits.dim() != 3:
        raise ValueError("target_logits must be [B, N, V]")
    B, N, V = target_logits.shape
    if tree_tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError("tree_tokens and parents must be [B, N]")
    if mode not in ("greedy", "typical"):
        raise ValueError(f"mode must be 'greedy' or 'typical', got {mode!r}")
    return B, N, V


def _tree_temperature(B, device, temperature, mode, check=True):
    if mode == "greedy":
        return None
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError("typical acceptance needs temperature > 0")
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1).expand(B).contiguous()
    if check and bool((t <= 0).any()):  # host sync; skipped by the Triton path
        raise ValueError("typical acceptance needs temperature > 0")
    return t


def tree_verify_reference(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
):
    """Plain-PyTorch (fp64, node-by-node loop) tree verification; see :func:`tree_verify`."""
    B, N, V = _check_tree_inputs(target_logits, tree_tokens, parents, mode)
    dev = target_logits.device
    temp = _tree_temperature(B, dev, temperature, mode)
    logits = target_logits.double()
    acc_nodes = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    n_acc = torch.zeros(B, dtype=torch.int64, device=dev)
    bonus = torch.zeros(B, dtype=torch.int64, device=dev)
    par = parents.tolist()
    toks = tree_tokens.tolist()
    for b in range(B):
        am = logits[b].argmax(-1).tolist()
        if mode == "typical":
            p = torch.softmax(logits[b] / float(temp[b]), dim=-1)
            lp = torch.log_softmax(logits[b] / float(temp[b]), dim=-1)
            ent = -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)
            thr = torch.clamp(typical_delta * torch.exp(-ent), max=typical_epsilon).tolist()
        depth = [0] * N
        good = [False] * N
        good[0] = True
        best, best_d = 0, 0
        for i in range(1, N):
            pa = par[b][i]
            if pa < 0 or not good[pa]:
                continue
            t = toks[b][i]
            if mode == "greedy":
                ok = t == am[pa]
            else:
                ok = 0 <= t < V and float(p[pa, t]) > thr[pa]
            if ok:
                good[i] = True
                depth[i] = depth[pa] + 1
                if depth[i] > best_d:
                    best, best_d = i, depth[i]
        path = [best]
        while path[-1] != 0:
            path.append(par[b][path[-1]])
        path.reverse()
        acc_nodes[b, : len(path)] = torch.tensor(path, device=dev)
        if mode == "typical" and seeds is not None:
            E = -torch.log(counter_uniforms(seeds[b : b + 1].to(dev), torch.tensor([[best]], device=dev), 0, V)[0, 0].double())
            bt = int((p[best] / E).argmax())
        else:
            bt = am[best]
        for d, node in enumerate(path[1:]):
            out_tokens[b, d] = toks[b][node]
        out_tokens[b, len(path) - 1] = bt
        n_acc[b] = len(path) - 1
        bonus[b] = bt
    return TreeVerifyOutput(acc_nodes, out_tokens, n_acc, bonus)


def _merge_partials(part_f, part_i, rows, S):
    """Merge per-split partial statistics -> dict of [rows] tensors (torch; tiny)."""
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


def tree_verify_triton(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
    _splits=None,
):
    """Triton row statistics + vectorised torch path search; see :func:`tree_verify`."""
    B, N, V = _check_tree_inputs(target_logits, tree_tokens, parents, mode)
    dev = target_logits.device
    temp = _tree_temperature(B, dev, temperature, mode, check=False)  # tensors must hold T > 0
    typical = mode == "typical"
    sample_bonus = typical and seeds is not None
    seeds_t = torch.as_tensor(seeds, device=dev).to(torch.int64).contiguous() if sample_bonus else None
    row_limit = torch.full((B,), N - 1, dtype=torch.int64, device=dev)
    part_f, part_i, S, logits = _launch_row_stats(
        target_logits, row_limit, temp, None, None, None, seeds_t,
        noise_mode=2 if sample_bonus else 0, always_argmax=True, need_entropy=typical, has_temp=typical,
        splits=_splits,
    )
    st = _merge_partials(part_f, part_i, B * N, S)
    gidx = st["gidx"].view(B, N)
    ar = torch.arange(N, device=dev)
    par = parents.to(device=dev, dtype=torch.int64)
    toks = tree_tokens.to(device=dev, dtype=torch.int64)
    valid = (par >= 0) & (par < ar) & (ar > 0)
    par_c = torch.where(valid, par, torch.zeros_like(par))
    par_c[:, 0] = 0
    if typical:
        Z = st["z"].view(B, N)
        M = st["m"].view(B, N)
        H = torch.log(Z) - st["h1"].view(B, N) / Z
        thr = torch.clamp(typical_delta * torch.exp(-H), max=typical_epsilon)
        bidx = torch.arange(B, device=dev).unsqueeze(1)
        lx = logits[bidx, par_c, toks.clamp(0, V - 1)].float()
        px = torch.exp(lx / temp.unsqueeze(1) - M.gather(1, par_c)) / Z.gather(1, par_c)
        ok = valid & (toks >= 0) & (toks < V) & (px > thr.gather(1, par_c))
    else:
        ok = valid & (toks == gidx.gather(1, par_c))
    ok[:, 0] = True
    # pointer jumping: good = all ancestors ok, depth = distance to the root
    good = ok.clone()
    depth = (ar > 0).to(torch.int64).expand(B, N).clone()
    anc = par_c.clone()
    jumps = [anc]
    for _ in range(max(1, math.ceil(math.log2(max(N, 2))))):
        good = good & good.gather(1, anc)
        depth = depth + depth.gather(1, anc)
        anc = anc.gather(1, anc)
        jumps.append(anc)
    score = torch.where(good, depth * N + (N - 1 - ar), torch.full_like(depth, -1))
    best = score.argmax(1)  # deepest, then lowest index
    D = depth.gather(1, best.unsqueeze(1))  # [B, 1]
    dist = (D - ar.unsqueeze(0)).clamp(min=0)  # distance of the ancestor at path position t
    node = best.unsqueeze(1).expand(B, N).clone()
    for k, table in enumerate(jumps[:-1]):
        bit = ((dist >> k) & 1).bool()
        node = torch.where(bit, table.gather(1, node), node)
    on_path = ar.unsqueeze(0) <= D
    acc_nodes = torch.where(on_path, node, torch.full_like(node, -1))
    rowsel = best + torch.arange(B, device=dev) * N
    bonus = (st["sidx"] if sample_bonus else st["gidx"])[rowsel]
    path_tok = toks.gather(1, acc_nodes[:, 1:].clamp(min=0))
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    out_tokens[:, : N - 1] = torch.where(ar[1:].unsqueeze(0) <= D, path_tok, out_tokens[:, : N - 1])
    n_acc = D.squeeze(1)
    out_tokens.scatter_(1, n_acc.unsqueeze(1), bonus.unsqueeze(1))
    return TreeVerifyOutput(acc_nodes, out_tokens, n_acc, bonus)


def tree_verify(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
):
    """Verify candidate trees in one target forward.

    Args:
        target_logits: [B, N, V] target logits at the tree nodes (row i scores node i's children).
        tree_tokens: [B, N] int64 tokens; node 0 is the root (last accepted token).
        parents: [B, N] int64 parent index (< own index); -1 for the root and for padding nodes.
        mode: "greedy" (token == argmax of the parent's row) or "typical" (Medusa-2:
            ``p(x) > min(typical_epsilon, typical_delta * exp(-H(p)))``, p = softmax(logits/T)).
        temperature: float or [B] (typical only; default 1.0).
        seeds: [B] int64 — typical mode only: sample the bonus token from p with the
            counter-based generator (otherwise the bonus is the argmax).
    Returns:
        :class:`TreeVerifyOutput` ``(accepted_nodes [B, N], output_tokens [B, N], num_accepted [B],
        bonus_tokens [B])``.
    """
    kw = dict(mode=mode, temperature=temperature, typical_epsilon=typical_epsilon, typical_delta=typical_delta,
              seeds=seeds)
    if _use_triton(target_logits, _impl):
        return tree_verify_triton(target_logits, tree_tokens, parents, **kw)
    return tree_verify_reference(target_logits, tree_tokens, parents, **kw)
