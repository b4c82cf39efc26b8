"""Shared sampling helpers of the verification ops: counter-based randomness and top-k / top-p thresholds.

Randomness
----------
Results must not depend on the implementation or on batch composition, so all randomness is a
function of a per-request seed and is produced outside the arithmetic that differs between
implementations: counter-based hashing, ``u = U(seed, position, stream, vocab index)`` from a
Weyl sequence finalised by a 32-bit integer mixer (Wellons' "lowbias32"):
``key = mix(mix(seed_hi ^ c0) ^ seed_lo)``, ``skey = mix(key ^ mix(2 * position + stream +
c1))``, ``u = (mix(v * 0x9E3779B1 + skey) >> 9 + 0.5) / 2**23``, all modulo 2**32 —
implemented bit-identically in Triton (``uint32``, :func:`uniform_tl`) and torch (``int64``
masked to 32 bits, :func:`counter_uniforms`).  Nothing is materialised: a kernel derives the
noise of a vocab tile in registers.  Stream 1 (vocab index 0) gives the accept-test uniform of
position j, stream 0 the vocabulary noise ``E = -log u`` of row j.

The uniforms lie in the open interval: 23 bits, offset by half a step, are exact in fp32 and
span ``[2**-24, 1 - 2**-24]``.  (24 bits plus half a step would round the top value to 1.0 in
fp32, giving ``E = 0`` and an infinite race score that lets a token of any probability win.)
The GPU's approximate log2 can still round ``-log2(u)`` to 0 near ``u = 1``, so the kernels
clamp the noise to its exact minimum, ``-log2(1 - 2**-24)`` (:func:`race_noise_tl`).

torch and Triton give bit-identical uniforms; what remains is fp32 (kernel) vs fp64
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
used by both implementations of the verification ops; it only touches rows of requests that
enable top-k/top-p) computes the thresholds; the kernels apply them on the fly, so no masked
logits are written.
"""

from __future__ import annotations

import torch

from speculators.kernels.triton_utils import HAS_TRITON, tl, triton

__all__ = ["compute_filter_thresholds", "counter_uniforms", "normalize_sampling_params", "uniform_from_bits"]

# ----------------------------------------------------------------------------------------
# Counter-based randomness (torch side; the Triton side is mix32_tl/stream_key_tl/... below)
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


# ----------------------------------------------------------------------------------------
# Counter-based randomness (Triton side, called from the verification kernels)
# ----------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def mix32_tl(x):
        x ^= x >> 16
        x *= tl.full((), 0x7FEB352D, tl.uint32)
        x ^= x >> 15
        x *= tl.full((), 0x846CA68B, tl.uint32)
        x ^= x >> 16
        return x

    @triton.jit
    def stream_key_tl(seed, pos, stream: tl.constexpr):
        """seed: int64 scalar, pos: int scalar -> uint32 key of (seed, pos, stream)."""
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = mix32_tl(lo ^ mix32_tl(hi ^ tl.full((), 0x9E3779B9, tl.uint32)))
        p = tl.cast(pos * 2 + stream, tl.uint32) + tl.full((), 0x632BE5AB, tl.uint32)
        return mix32_tl(key ^ mix32_tl(p))

    @triton.jit
    def uniform_from_bits_tl(x):
        """uint32 -> fp32 uniform in the open interval (0, 1), bit-identical to uniform_from_bits."""
        return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def uniform_tl(skey, v):
        """Uniform in (0,1) for uint32 stream key and int vocab indices v (any shape)."""
        return uniform_from_bits_tl(mix32_tl(tl.cast(v, tl.uint32) * tl.full((), 0x9E3779B1, tl.uint32) + skey))

    @triton.jit
    def fast_log2(x, FAST: tl.constexpr):
        if FAST:  # MUFU.LG2 (rel. error ~2^-22); libdevice's log2f is a ~10-FMA polynomial
            return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.log2(x)

    @triton.jit
    def race_noise_tl(skey, v, FAST: tl.constexpr):
        """E = -log2(u), proportional to Exp(1), never 0: clamped to its exact minimum
        -log2(1 - 2**-24) because an approximate log2 can round it to 0 (or below) near u = 1,
        and a zero E would let a token of any probability win the race."""
        return tl.maximum(-fast_log2(uniform_tl(skey, v), FAST), 8.599e-08)


# ----------------------------------------------------------------------------------------
# Top-k / top-p thresholds (shared by the torch and Triton paths)
# ----------------------------------------------------------------------------------------
def normalize_sampling_params(B, device, temperature, top_k, top_p):
    """``(temperature [B] fp32, top_k [B] int64 or None, top_p [B] fp32 or None)`` on ``device``; a
    missing temperature means greedy (0) for every request."""
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
    temp, tk, tp = normalize_sampling_params(B, target_logits.device, temperature, top_k, top_p)
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

