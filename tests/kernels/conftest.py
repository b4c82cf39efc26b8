"""SPECULATORS_TEST_DEVICE=cuda (with TRITON_INTERPRET=0) runs these kernel tests against the
compiled kernels on a GPU instead of the interpreter: every Triton entry point gets its tensor
arguments moved to the GPU and its results moved back, so each test keeps its CPU references
and assertions unchanged.

    TRITON_INTERPRET=0 SPECULATORS_TEST_DEVICE=cuda python -m pytest tests/kernels
"""

import importlib
import os

import pytest
import torch

DEVICE = os.environ.get("SPECULATORS_TEST_DEVICE", "cpu")

# The Triton entry points, by module.
TRITON_ENTRY_POINTS = {
    "speculators.kernels.chain_verification": ["rejection_sample_triton"],
    "speculators.kernels.fused_linear_divergence": ["_triton_forward"],
    "speculators.kernels.medusa_proposal": ["medusa_propose_triton"],
    "speculators.kernels.mlp_proposal": ["mlp_speculator_propose_triton", "mlp_speculator_propose_topk_triton"],
    "speculators.kernels.tree_verification": ["tree_verify_triton"],
}


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple results
        return type(x)(*(_move(y, device) for y in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_move(y, device) for y in x)
    return x


def _on_device(fn, device):
    def wrapped(*args, **kwargs):
        home = next((a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        out = fn(*_move(args, device), **{k: _move(v, device) for k, v in kwargs.items()})
        torch.cuda.synchronize()  # a kernel fault surfaces in this test, not a later one
        return _move(out, home) if home is not None else out

    return wrapped


@pytest.fixture(autouse=True)
def kernels_on_test_device(monkeypatch, request):
    if DEVICE == "cpu":
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.exit("SPECULATORS_TEST_DEVICE=cuda needs TRITON_INTERPRET=0", returncode=2)
    for module_name, names in TRITON_ENTRY_POINTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            wrapped = _on_device(getattr(module, name), DEVICE)
            monkeypatch.setattr(module, name, wrapped)
            if getattr(request.module, name, None) is not None:  # imported by name into the test
                monkeypatch.setattr(request.module, name, wrapped)
