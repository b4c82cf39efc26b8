"""Without triton (a Linux-only dependency) every kernel module imports, the trainer and the engine
import, and every op runs its PyTorch path: triton is imported in one guarded place,
speculators.kernels.triton_utils."""

import subprocess
import sys

_WITHOUT_TRITON = r'''
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as where triton is not installed

import torch

import speculators.engine
import speculators.trainer
from speculators.kernels import triton_utils
from speculators.kernels.chain_verification import rejection_sample, rejection_sample_reference
from speculators.kernels.fused_linear_divergence import divergence_reference, fused_linear_divergence
from speculators.kernels.medusa_proposal import medusa_propose, medusa_propose_reference
from speculators.kernels.mlp_proposal import mlp_speculator_propose, mlp_speculator_propose_reference
from speculators.kernels.tree_verification import tree_verify, tree_verify_reference

assert not triton_utils.HAS_TRITON and triton_utils.triton is None
assert not [m for m in sys.modules if m.startswith("triton.")], "a module imported triton around the guard"

g = torch.Generator().manual_seed(0)
B, K, V, D = 3, 2, 50, 16
logits = torch.randn(B, K + 1, V, generator=g)
drafts = torch.randint(0, V, (B, K), generator=g)
nd = torch.tensor([2, 1, 0])
kw = dict(temperature=torch.tensor([0.0, 1.0, 0.7]), top_k=torch.tensor([0, 5, 0]), seeds=torch.tensor([1, 2, 3]))
out, n_acc = rejection_sample(logits, drafts, nd, **kw)
ref = rejection_sample_reference(logits, drafts, nd, **kw)
assert torch.equal(out, ref[0]) and torch.equal(n_acc, ref[1])

parents = torch.tensor([[-1, 0, 0, 1]]).expand(B, 4)
tokens = torch.randint(0, V, (B, 4), generator=g)
tree_logits = torch.randn(B, 4, V, generator=g)
res = tree_verify(tree_logits, tokens, parents, mode="typical", seeds=torch.tensor([4, 5, 6]))
assert all(torch.equal(a, b) for a, b in zip(res, tree_verify_reference(tree_logits, tokens, parents, mode="typical",
                                                                        seeds=torch.tensor([4, 5, 6]))))

hidden = torch.randn(B, D, generator=g)
mlp = ([torch.randn(V, D, generator=g)] * 2, [torch.randn(D, D, generator=g)] * 2, [torch.ones(D)] * 2,
       [torch.zeros(D)] * 2, [torch.randn(V, D, generator=g)] * 2)
assert torch.equal(mlp_speculator_propose(hidden, drafts[:, 0], *mlp),
                   mlp_speculator_propose_reference(hidden, drafts[:, 0], *mlp))
medusa = (torch.randn(2, 1, D, D, generator=g) / 4, None, torch.randn(V, D, generator=g))
assert torch.equal(medusa_propose(hidden, *medusa, 3)[1], medusa_propose_reference(hidden, *medusa, 3)[1])

x = torch.randn(2, 5, D, generator=g, dtype=torch.float64, requires_grad=True)
w = torch.randn(V, D, generator=g, dtype=torch.float64)
teacher = dict(teacher_input=torch.randn(2, 5, D, generator=g, dtype=torch.float64), teacher_weight=w.clone())
loss = fused_linear_divergence(x, w, **teacher, divergence="jsd")
(grad,) = torch.autograd.grad(loss, x)
ref_loss = divergence_reference(x, w, **teacher, divergence="jsd")
(ref_grad,) = torch.autograd.grad(ref_loss, x)
torch.testing.assert_close(loss, ref_loss.float(), rtol=1e-4, atol=1e-5)  # fp32 arithmetic
torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)

for call in (lambda: rejection_sample(logits, drafts, nd, _impl="triton"),
             lambda: fused_linear_divergence(x, w, **teacher, _impl="triton")):
    try:
        call()
    except RuntimeError as e:
        assert "triton is not installed" in str(e), e
    else:
        raise AssertionError("_impl='triton' ran without triton")
print("WITHOUT-TRITON-OK")
'''


def test_kernels_import_and_run_without_triton():
    r = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "WITHOUT-TRITON-OK" in r.stdout, r.stderr[-4000:]
