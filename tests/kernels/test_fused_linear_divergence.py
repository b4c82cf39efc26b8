"""fused_linear_divergence (Triton kernels in the interpreter, and the chunked CPU path)
against the float64 reference that materializes the logits: losses and gradients."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / the kernel module are imported

import pytest
import torch

import speculators.kernels.fused_linear_divergence as fld
from speculators.kernels.fused_linear_divergence import divergence_reference, fused_linear_divergence

# Odd sizes: with the interpreter's 4 x 16 x 8 tiles, T=5 spans 2 row blocks (one partial),
# V=37 three vocab tiles (one partial), D=16 two D blocks, Dt=12 a partial D block.
H, T, D, DT, V = 2, 5, 16, 12, 37
FP32_TOL = 2e-5  # relative; fp32 runs reach ~3e-6 against float64
IMPLS = ["triton", "torch"]


def make_case(per_head=False, T=T, logit_std=1.0, seed=0):
    """float64 inputs; logit_std sets the spread of student and teacher logits."""
    g = torch.Generator().manual_seed(seed)
    w_shape = (H, V, D) if per_head else (V, D)
    labels = torch.randint(0, V, (H, T), generator=g)
    labels[0, T // 2] = labels[1, 0] = -100
    return dict(
        student_input=torch.randn(H, T, D, generator=g, dtype=torch.float64),
        student_weight=torch.randn(*w_shape, generator=g, dtype=torch.float64) * logit_std / D**0.5,
        teacher_input=torch.randn(H, T, DT, generator=g, dtype=torch.float64),
        teacher_weight=torch.randn(V, DT, generator=g, dtype=torch.float64) * 1.5 * logit_std / DT**0.5,
        teacher_logits=torch.randn(H, T, V, generator=g, dtype=torch.float64) * 1.5 * logit_std,
        labels=labels,
    )


def run(fn, case, dtype, **kwargs):
    """Loss, grad of student_input, grad of student_weight (None when frozen)."""
    inputs = {k: v.to(dtype, copy=True) if v.is_floating_point() else v for k, v in case.items()}
    x = inputs.pop("student_input").requires_grad_()
    w = inputs.pop("student_weight").requires_grad_(kwargs.pop("train_weight", True))
    loss = fn(x, w, **inputs, **kwargs)
    loss.backward()
    return loss, x.grad, w.grad


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(ours, ref, tol=FP32_TOL):
    for name, a, b in zip(("loss", "grad_input", "grad_weight"), ours, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == (torch.float32 if name == "loss" else ours[1].dtype)
            assert rel_err(a, b) < tol, f"{name}: relative error {rel_err(a, b):.2e} > {tol:.0e}"


def pick_teacher(case, teacher):
    """Keep only one teacher source; teacher logits get non-contiguous strides."""
    if teacher != "hidden":
        del case["teacher_input"], case["teacher_weight"]
    if teacher != "logits":
        del case["teacher_logits"]
    else:
        case["teacher_logits"] = case["teacher_logits"].transpose(0, 1).contiguous().transpose(0, 1)
    return case


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 3 rows, so that T=5 takes two chunks (one partial) on the CPU path; dz
    chunks of 16 vocab columns, so that V=37 takes three (one partial) on the Triton path."""
    monkeypatch.setattr(fld, "_CHUNK_BYTES", 3 * 4 * V)
    monkeypatch.setattr(fld, "_DZ_CHUNK_BYTES", 16 * H * T * 4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared_w", "per_head_w"])
@pytest.mark.parametrize("divergence,teacher", [("ce", None)] + [
    (d, t) for d in ("fkl", "rkl", "jsd", "tvd") for t in ("hidden", "logits")])
def test_matches_reference(impl, per_head, divergence, teacher):
    case = pick_teacher(make_case(per_head), teacher)
    if teacher == "logits":  # no labels: every token counts
        del case["labels"]
        options = dict(reduction="sum")
    else:  # labels as mask (and ce targets), mean, temperature, head weights
        options = dict(reduction="mean", temperature=1.7, head_weights=[1.0, 0.25], beta=0.3)
    options["divergence"] = divergence
    ref = run(divergence_reference, case, torch.float64, **options)
    assert_close(run(fused_linear_divergence, case, torch.float32, _impl=impl, **options), ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("divergence", ["fkl", "jsd"])
def test_single_token(impl, divergence):
    case = pick_teacher(make_case(T=1), "hidden")
    del case["labels"]
    ref = run(divergence_reference, case, torch.float64, divergence=divergence)
    assert_close(run(fused_linear_divergence, case, torch.float32, _impl=impl, divergence=divergence), ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("divergence", ["fkl", "ce"])
def test_bf16_far_better_than_bf16_logits(impl, divergence):
    """bf16 inputs, logits of LLM-like spread: fp32 logits leave only bf16 roundings of the
    gradient operand dz (as in any bf16 backward) and of the returned gradients, several
    times below the error of rounding the logits to bf16."""
    case = pick_teacher(make_case(logit_std=16.0), "hidden")
    bf16 = {k: v.to(torch.bfloat16).double() if v.is_floating_point() else v for k, v in case.items()}
    ref = run(divergence_reference, bf16, torch.float64, divergence=divergence)
    ours = run(fused_linear_divergence, bf16, torch.bfloat16, _impl=impl, divergence=divergence)
    naive = run(divergence_reference, bf16, torch.bfloat16, divergence=divergence)  # bf16 logits
    assert_close(ours, ref, tol=5e-3)
    for a, n, r in zip(ours, naive, ref):
        assert rel_err(a, r) < 4 * rel_err(r.to(a.dtype), r) + 1e-6  # the two roundings only
        assert rel_err(a, r) < rel_err(n, r) / 4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_beta_edges_are_zero(impl, beta):
    case = pick_teacher(make_case(), "logits")
    loss, gx, gw = run(fused_linear_divergence, case, torch.float32, _impl=impl, divergence="jsd", beta=beta)
    assert loss.item() == 0.0 and not gx.any() and not gw.any()


@pytest.mark.parametrize("impl", IMPLS)
def test_mean_with_a_fully_ignored_head(impl):
    case = pick_teacher(make_case(), "hidden")
    case["labels"][1] = -100
    options = dict(divergence="rkl", reduction="mean", head_weights=torch.tensor([0.5, 2.0]))
    ref = run(divergence_reference, case, torch.float64, **options)
    assert_close(run(fused_linear_divergence, case, torch.float32, _impl=impl, **options), ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_weight_and_no_grad(impl):
    case = pick_teacher(make_case(), "logits")
    ref = run(divergence_reference, case, torch.float64, train_weight=False)
    ours = run(fused_linear_divergence, case, torch.float32, _impl=impl, train_weight=False)
    assert_close(ours, ref)
    with torch.no_grad():
        loss = fused_linear_divergence(**{k: v.float() if v.is_floating_point() else v
                                          for k, v in case.items()}, _impl=impl)
    assert rel_err(loss, ref[0]) < FP32_TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_left_untouched(impl):
    case = {k: v.float() if v.is_floating_point() else v for k, v in make_case().items()}
    del case["teacher_input"], case["teacher_weight"]
    before = {k: v.clone() for k, v in case.items()}
    fused_linear_divergence(**case, divergence="jsd", temperature=2.0, _impl=impl)
    for k, v in case.items():
        assert torch.equal(v, before[k]), k


def test_tolerance_is_meaningful():
    """A temperature off by 0.03% must fail every comparison by a wide margin."""
    case = pick_teacher(make_case(), "logits")
    ours = run(fused_linear_divergence, case, torch.float32, _impl="torch")
    ref = run(divergence_reference, case, torch.float64, temperature=1.0003)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) > 5 * FP32_TOL


@pytest.mark.parametrize("change,message", [
    (dict(divergence="kl"), "unknown divergence"),
    (dict(reduction="avg"), "unknown reduction"),
    (dict(teacher_input=None, teacher_weight=None), "needs a teacher"),
    (dict(teacher_logits=torch.zeros(H, T, V)), "needs a teacher"),
    (dict(teacher_weight=torch.zeros(V + 1, DT)), "vocab"),
    (dict(teacher_weight=torch.zeros(V, DT + 1)), "Dt="),
    (dict(student_weight=torch.zeros(V, D + 1)), "student_weight must be"),
    (dict(student_weight=torch.zeros(H + 1, V, D)), "student_weight must be"),
    (dict(student_input=torch.zeros(T, D)), r"\[H, T, D\]"),
    (dict(labels=torch.zeros(H, T + 1, dtype=torch.long)), "labels must be"),
    (dict(divergence="ce", labels=None), "needs labels"),
    (dict(head_weights=[1.0]), "head_weights"),
    (dict(divergence="jsd", beta=1.5), "beta"),
    (dict(temperature=0.0), "temperature"),
    (dict(teacher_weight=torch.zeros(V, DT, device="meta")), "is on meta"),
])
def test_errors(change, message):
    args = dict(student_input=torch.zeros(H, T, D), student_weight=torch.zeros(V, D),
                teacher_input=torch.zeros(H, T, DT), teacher_weight=torch.zeros(V, DT),
                labels=torch.zeros(H, T, dtype=torch.long))
    with pytest.raises(ValueError, match=message):
        fused_linear_divergence(**{**args, **change})
