import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / the kernels are imported

import math

import pytest
import torch
import torch.nn.functional as F

from speculators.kernels.medusa_proposal import medusa_propose, medusa_propose_reference, medusa_propose_triton
from speculators.kernels.mlp_proposal import (
    mlp_speculator_propose,
    mlp_speculator_propose_reference,
    mlp_speculator_propose_topk,
    mlp_speculator_propose_topk_reference,
    mlp_speculator_propose_topk_triton,
    mlp_speculator_propose_triton,
    mlp_speculator_scales,
)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _d(ts):
    return [t.double() for t in ts]


# ----------------------------------------------------------------------------------------
# LM head + top-k alone: Medusa heads without ResBlocks
# ----------------------------------------------------------------------------------------
def _no_resblocks(D, dtype=torch.float32):
    return torch.empty(1, 0, D, D, dtype=dtype)


@needs_triton
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("num_programs", [1, 4])
def test_head_topk_exact_with_ties(k, B, num_programs):
    # small integer inputs: every logit is exact in fp32, and ties are frequent
    g = torch.Generator().manual_seed(k * 10 + B)
    D, V = 24, 150
    x = torch.randint(-2, 3, (B, D), generator=g).float()
    w = torch.randint(-1, 2, (V, D), generator=g).float()
    for logprobs in (False, True):
        ref = medusa_propose_reference(x.double(), _no_resblocks(D).double(), None, w.double(), k, logprobs=logprobs)
        tri = medusa_propose_triton(x, _no_resblocks(D), None, w, k, logprobs=logprobs, _num_programs=num_programs)
        assert torch.equal(tri[1], ref[1]), (tri[1], ref[1])
        torch.testing.assert_close(tri[0], ref[0], atol=1e-5, rtol=1e-5)
        assert tri[0].dtype == torch.float32 and tri[1].dtype == torch.int64
    # ties really occur and go to the lowest index
    full = (x.double() @ w.double().t())
    top = full.max(-1).values
    first = (full == top[:, None]).double().argmax(-1)
    assert torch.equal(ref[1][:, 0, 0], first)


@needs_triton
def test_head_topk_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    w = torch.randn(97, 40, generator=g).to(torch.bfloat16)
    ref = medusa_propose_reference(x.double(), _no_resblocks(40, torch.float64), None, w.double(), 4)
    tri = medusa_propose_triton(x, _no_resblocks(40, torch.bfloat16), None, w, 4)
    assert torch.equal(tri[1], ref[1])
    torch.testing.assert_close(tri[0], ref[0], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------
# MLP speculator
# ----------------------------------------------------------------------------------------
def _mlp_weights(n=3, D=24, inner=32, V=77, tie=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if tie:
        e, h, lw, lb = r(V, inner) * 0.5, r(V, inner) / inner**0.5, 1 + 0.1 * r(inner), 0.1 * r(inner)
        p0, p1 = r(inner, D) / D**0.5, r(inner, inner) / inner**0.5
        return [e] * n, [p0] + [p1] * (n - 1), [lw] * n, [lb] * n, [h] * n
    emb = [r(V, inner) * 0.5 for _ in range(n)]
    proj = [r(inner, D) / D**0.5] + [r(inner, inner) / inner**0.5 for _ in range(n - 1)]
    lw = [1 + 0.1 * r(inner) for _ in range(n)]
    lb = [0.1 * r(inner) for _ in range(n)]
    head = [r(V, inner) / inner**0.5 for _ in range(n)]
    return emb, proj, lw, lb, head


def _manual_mlp_chain(hidden, tokens, emb, proj, lw, lb, head, scale_input):
    """Straight transcription of the vLLM math (fp64)."""
    n = len(head)
    inner = proj[0].shape[0]
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight**2) * (inner / 2))
    h = hidden.double()
    if scale_input:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    tok = tokens
    out = []
    for i in range(n):
        s = h @ proj[i].double().T + emb[i].double()[tok] * (emb_weight / state_weight)
        s = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = F.gelu(s * lw[i].double() + lb[i].double())
        tok = (s @ head[i].double().T).argmax(-1)
        out.append(tok)
        h = s
    return torch.stack(out, 1)


def test_mlp_scales():
    sw, ew, es = mlp_speculator_scales(3, 32)
    assert sw == 0.5 ** (0.5 / 3) and ew == math.sqrt((1 - sw**2) * 16) and es == ew / sw


@pytest.mark.parametrize("scale_input", [False, True])
def test_mlp_reference_matches_manual(scale_input):
    emb, proj, lw, lb, head = _mlp_weights()
    g = torch.Generator().manual_seed(1)
    hidden, tokens = torch.randn(4, 24, generator=g) * 3, torch.randint(0, 77, (4,), generator=g)
    ref = mlp_speculator_propose_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb, _d(head), scale_input)
    assert torch.equal(ref, _manual_mlp_chain(hidden, tokens, emb, proj, lw, lb, head, scale_input))
    assert torch.equal(mlp_speculator_propose(hidden, tokens, emb, proj, lw, lb, head, scale_input), ref)


def test_mlp_reference_matches_model_class():
    models = pytest.importorskip("speculators.models.mlp_speculator")
    cfg = models.MLPSpeculatorConfig(vocab_size=77, emb_dim=24, inner_dim=32, n_predict=3, scale_input=True)
    torch.manual_seed(0)
    m = models.MLPSpeculator(cfg).double().eval()
    with torch.no_grad():
        for ln in m.ln:
            ln.weight.normal_(1, 0.1)
            ln.bias.normal_(0, 0.1)
    g = torch.Generator().manual_seed(2)
    hidden, tokens = torch.randn(3, 24, generator=g).double(), torch.randint(0, 77, (3,), generator=g)
    stages = [m.stage(i) for i in range(3)]
    ours = mlp_speculator_propose_reference(
        hidden, tokens, [s[0].weight for s in stages], [s[1].weight for s in stages], [s[2].weight for s in stages],
        [s[2].bias for s in stages], [s[3] for s in stages], True,
    )
    assert torch.equal(ours, m.propose(hidden, tokens, 3))


@needs_triton
@pytest.mark.parametrize("scale_input", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_mlp_chain_triton_matches_reference(scale_input, tie):
    emb, proj, lw, lb, head = _mlp_weights(tie=tie, seed=3)
    g = torch.Generator().manual_seed(4)
    B = 4
    hidden, tokens = torch.randn(B, 24, generator=g) * 2, torch.randint(0, 77, (B,), generator=g)
    ref = mlp_speculator_propose_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb, _d(head), scale_input, 3)
    tri = mlp_speculator_propose_triton(hidden, tokens, emb, proj, lw, lb, head, scale_input, 3)
    assert torch.equal(tri[0], ref[0]) and torch.equal(tri[2], ref[2])
    torch.testing.assert_close(tri[1], ref[1], atol=2e-5, rtol=1e-5)
    assert torch.equal(tri[0], tri[2][:, :, 0])  # the chain follows the top-1 token
    # fewer stages than n_predict, top_k = 1 returns the tensor only
    short = mlp_speculator_propose_triton(hidden, tokens, emb, proj, lw, lb, head, scale_input, 1, num_tokens=2)
    assert torch.equal(short, ref[0][:, :2])


def _signed_case():
    """MLP weights whose heads are W [V, inner/2] and the stored [W, -W] they stand for, plus inputs."""
    emb, proj, lw, lb, head = _mlp_weights(tie=False, seed=5)
    half = [w[:, :16] for w in head]
    stored = [torch.cat([w, -w], 1) for w in half]
    g = torch.Generator().manual_seed(6)
    hidden, tokens = torch.randn(3, 24, generator=g) * 2, torch.randint(0, 77, (3,), generator=g)
    return emb, proj, lw, lb, half, stored, hidden, tokens


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_mlp_chain_signed_head_equals_the_stored_head(impl):
    """signed_head: head[i] = W [V, inner/2] stands for the stored [W, -W]; same drafts and log-probs."""
    emb, proj, lw, lb, half, stored, hidden, tokens = _signed_case()
    ref = mlp_speculator_propose_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb, _d(stored), False, 3)
    out = mlp_speculator_propose(hidden, tokens, emb, proj, lw, lb, half, False, 3, signed_head=True, _impl=impl)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[1], ref[1], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_mlp_tree_signed_head_equals_the_stored_head(impl):
    """The top-k expansion with signed_head (head[i] = W for a stored [W, -W]) gives the same tree."""
    emb, proj, lw, lb, half, stored, hidden, tokens = _signed_case()
    ks = [3, 2, 2]
    ref = mlp_speculator_propose_topk_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb, _d(stored), False, ks)
    out = mlp_speculator_propose_topk(hidden, tokens, emb, proj, lw, lb, half, False, ks, signed_head=True, _impl=impl)
    for (rv, ri), (ov, oi) in zip(ref, out):
        assert torch.equal(oi, ri)
        torch.testing.assert_close(ov, rv, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_mlp_vocab_ids_map_head_rows_to_vocabulary_ids(impl):
    """vocab_ids: the heads hold only some vocabulary rows. Drafts, top-k indices and the tokens fed to
    the next stage's embedding are vocabulary ids: the same as reading full heads whose other rows can
    never win (a large negative bias stands in for them here), chain and tree."""
    emb, proj, lw, lb, head = _mlp_weights(tie=False, seed=8)
    g = torch.Generator().manual_seed(9)
    vocab_ids = torch.randperm(77, generator=g)[:40].sort().values
    hidden, tokens = torch.randn(4, 24, generator=g) * 2, torch.randint(0, 77, (4,), generator=g)
    rows = [w[vocab_ids] for w in head]
    drafts = mlp_speculator_propose(hidden, tokens, emb, proj, lw, lb, rows, False, 2, vocab_ids=vocab_ids, _impl=impl)
    assert bool(torch.isin(drafts[0], vocab_ids).all())
    # the full-head reference, with the left-out rows pushed below anything the kept rows reach
    cold = torch.ones(77, dtype=torch.bool)
    cold[vocab_ids] = False
    state, toks = hidden.double(), tokens
    _, _, emb_scale = mlp_speculator_scales(3, 32)
    for i in range(3):
        s = state @ proj[i].double().t() + emb[i].double()[toks] * emb_scale
        state = F.gelu(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * lw[i].double() + lb[i].double())
        logits = (state @ head[i].double().t()).masked_fill(cold, -1e9)
        toks = logits.argmax(-1)
        assert torch.equal(drafts[0][:, i], toks)
        assert torch.equal(drafts[2][:, i, 0], toks)
    tree = mlp_speculator_propose_topk(hidden, tokens, emb, proj, lw, lb, rows, False, [3, 2, 2], vocab_ids=vocab_ids,
                                       _impl=impl)
    ref = mlp_speculator_propose_topk_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb,
                                                [w.double() for w in rows], False, [3, 2, 2], vocab_ids=vocab_ids)
    for (rv, ri), (ov, oi) in zip(ref, tree):
        assert torch.equal(oi, ri) and bool(torch.isin(oi, vocab_ids).all())
        torch.testing.assert_close(ov, rv, atol=2e-5, rtol=1e-5)


@needs_triton
def test_mlp_tree_topk_triton_matches_reference():
    emb, proj, lw, lb, head = _mlp_weights(seed=5)
    g = torch.Generator().manual_seed(6)
    B = 2
    hidden, tokens = torch.randn(B, 24, generator=g), torch.randint(0, 77, (B,), generator=g)
    ks = [3, 2, 2]
    ref = mlp_speculator_propose_topk_reference(hidden.double(), tokens, _d(emb), _d(proj), lw, lb, _d(head), True, ks)
    tri = mlp_speculator_propose_topk_triton(hidden, tokens, emb, proj, lw, lb, head, True, ks)
    rows = B
    for (rv, ri), (tv, ti), k in zip(ref, tri, ks):
        assert ri.shape == (rows, k) and ti.shape == (rows, k)
        assert torch.equal(ri, ti)
        torch.testing.assert_close(tv, rv, atol=2e-5, rtol=1e-5)
        rows *= k
    # stage-1 branch r continues stage-0 row r // k0 with token indices0[r // k0, r % k0]
    i0 = ref[0][1]
    emb_d = _d(emb)
    sw, ew, es = mlp_speculator_scales(3, 32)
    h = hidden.double()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    s0 = h @ proj[0].double().T + emb_d[0][tokens] * es
    s0 = F.gelu(s0 * torch.rsqrt(s0.pow(2).mean(-1, keepdim=True) + 1e-6) * lw[0].double() + lb[0].double())
    r = 4  # request 1, child 1
    s1 = s0[r // 3] @ proj[1].double().T + emb_d[1][i0[r // 3, r % 3]] * es
    s1 = F.gelu(s1 * torch.rsqrt(s1.pow(2).mean() + 1e-6) * lw[1].double() + lb[1].double())
    lp = torch.log_softmax(s1 @ head[1].double().T, -1)
    assert torch.equal(lp.topk(2).indices, ref[1][1][r])
    # chain == first branch of the tree
    chain = mlp_speculator_propose_reference(hidden.double(), tokens, emb_d, _d(proj), lw, lb, _d(head), True)
    assert torch.equal(chain[:, 0], ref[0][1][:, 0])
    assert len(mlp_speculator_propose_topk(hidden, tokens, emb, proj, lw, lb, head, True, ks)) == 3


# ----------------------------------------------------------------------------------------
# Medusa
# ----------------------------------------------------------------------------------------
def _medusa_weights(H=3, L=1, D=32, V=90, seed=0, shared=False, bias=True):
    g = torch.Generator().manual_seed(seed)
    bw = torch.randn(H, L, D, D, generator=g) / D**0.5
    bb = torch.randn(H, L, D, generator=g) * 0.1 if bias else None
    lm = torch.randn(V, D, generator=g) / D**0.5 if shared else torch.randn(H, V, D, generator=g) / D**0.5
    return bw, bb, lm


def test_medusa_reference_matches_manual():
    bw, bb, lm = _medusa_weights(L=2)
    hidden = torch.randn(2, 32)
    v, i = medusa_propose_reference(hidden.double(), bw.double(), bb.double(), lm.double(), 2)
    for h in range(3):
        x = hidden.double()
        for l in range(2):
            x = x + F.silu(F.linear(x, bw[h, l].double(), bb[h, l].double()))
        logits = F.linear(x, lm[h].double())
        assert torch.equal(i[:, h], logits.topk(2).indices)
        torch.testing.assert_close(v[:, h], logits.topk(2).values.float())


@needs_triton
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("L", [1, 2])
def test_medusa_triton_matches_reference(shared, bias, L):
    bw, bb, lm = _medusa_weights(L=L, shared=shared, bias=bias, seed=L + 2 * bias)
    hidden = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)) * 2
    for k, logprobs in [(1, False), (4, True)]:
        ref = medusa_propose_reference(hidden.double(), bw.double(), None if bb is None else bb.double(), lm.double(), k,
                                       logprobs=logprobs)
        tri = medusa_propose_triton(hidden, bw, bb, lm, k, logprobs=logprobs)
        assert tri[1].shape == (4, 3, k)
        assert torch.equal(tri[1], ref[1])
        torch.testing.assert_close(tri[0], ref[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(medusa_propose(hidden, bw, bb, lm, 2)[1], medusa_propose_reference(hidden, bw, bb, lm, 2)[1])


# ----------------------------------------------------------------------------------------
# the CUDA code path compiles (sm_80 / sm_90) — no GPU needed, catches compile-only bugs
# ----------------------------------------------------------------------------------------
_AOT_HELPER = r'''
import inspect, sys, torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except Exception as e:
    print("AOT-UNAVAILABLE", e); sys.exit(0)
T = {torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32", torch.bfloat16: "*bf16"}
def aot(kernel, args, constexprs, num_warps=4, num_stages=3):
    names = list(inspect.signature(kernel.fn).parameters)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"; continue
        v = args[n]
        sig[n] = T[v.dtype] if isinstance(v, torch.Tensor) else ("fp32" if isinstance(v, float) else "i32")
        if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the JIT specialises on aligned inputs
    for arch in (80, 90):
        try:
            triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})
        except Exception as e:
            if "ptxas" in str(e).lower() and "not found" in str(e).lower():
                print("AOT-UNAVAILABLE", e); sys.exit(0)
            raise
f32, i64, i32 = torch.empty(1), torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int32)
bf = torch.empty(1, dtype=torch.bfloat16)
'''

_AOT_PROPOSAL = _AOT_HELPER + r'''
import speculators.kernels.lm_head_topk as hk
import speculators.kernels.medusa_proposal as md
import speculators.kernels.mlp_proposal as mp
C = hk.HEAD_TOPK_CONFIG
for w, up, prec, bv, bd, st in [(bf, False, "tf32", C["block_v"], C["block_d"], C["num_stages"]),
                                (f32, True, "ieee", 64, 32, 3)]:
    for k in (1, 8):
        args = dict(x_ptr=w, stride_xh=0, stride_xb=4096, w_ptr=w, stride_wh=0, stride_wv=4096, pv_ptr=f32, pi_ptr=i32,
                    pl_ptr=f32, B=64, V=128256, D=4096, NP=264, TILES_PER_PROG=4)
        aot(hk._head_topk_kernel, args, dict(K=k, KPAD=max(2, k), LSE=True, UPCAST=up, DOT_PREC=prec, BLOCK_B=64,
                                             BLOCK_V=bv, BLOCK_D=bd), C["num_warps"], st)
aot(hk._topk_merge_kernel, dict(pv_ptr=f32, pi_ptr=i32, pl_ptr=f32, ov_ptr=f32, oi_ptr=i64, stride_ob=4, stride_oh=1,
    tok_ptr=i64, stride_tok=4, B=64, NP=264), dict(K=8, KPAD=8, LSE=True, WRITE_TOK=True, BLOCK_C=4096, BLOCK_P=512), 8)
C = mp.MLP_PROJ_CONFIG
aot(mp._mlp_proj_kernel, dict(x_ptr=bf, stride_xb=4096, p_ptr=bf, stride_pn=4096, emb_ptr=bf, stride_ev=3072,
    tok_ptr=i64, stride_tok=1, s_ptr=f32, Bt=64, N=3072, D=4096, ROWS_PER_PARENT=1, emb_scale=1.0),
    dict(SCALE_INPUT=True, UPCAST=False, DOT_PREC="tf32", BLOCK_B=64, BLOCK_N=C["block_n"], BLOCK_D=C["block_d"]),
    C["num_warps"], C["num_stages"])
aot(mp._norm_gelu_kernel, dict(s_ptr=f32, w_ptr=bf, b_ptr=bf, h_ptr=bf, N=3072), dict(BLOCK_N=1024), 4)
C = md.RESBLOCK_CONFIG
aot(md._resblock_kernel, dict(x_ptr=bf, stride_xh=0, stride_xb=4096, w_ptr=bf, stride_wh=4096 * 4096, stride_wn=4096,
    b_ptr=bf, stride_bh=4096, y_ptr=bf, B=64, D=4096),
    dict(HAS_BIAS=True, UPCAST=False, DOT_PREC="tf32", BLOCK_B=64, BLOCK_N=C["block_n"], BLOCK_D=C["block_d"]),
    C["num_warps"], C["num_stages"])
print("AOT-OK")
'''


@needs_triton
def test_cuda_kernels_compile_without_gpu():
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", _AOT_PROPOSAL], env=env, capture_output=True, text=True, timeout=600)
    if "AOT-UNAVAILABLE" in r.stdout:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and "AOT-OK" in r.stdout, r.stderr[-4000:]


def test_stable_topk_equals_a_stable_sort_with_ties():
    """The references' top-k (ties -> lowest index) equals the first k of a stable descending sort."""
    from speculators.kernels.lm_head_topk import stable_topk

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        R, V = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 60, (1,), generator=g))
        k = int(torch.randint(2, min(V, 8) + 1, (1,), generator=g))
        # every other trial: a handful of distinct values, so ties straddle the k-th place
        x = torch.randint(0, 4, (R, V), generator=g).float() if trial % 2 else torch.randn(R, V, generator=g)
        vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        got = stable_topk(x, k)
        assert torch.equal(got[0], vals[:, :k]) and torch.equal(got[1], idx[:, :k]), trial
