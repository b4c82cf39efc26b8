"""What every op in speculators.kernels shares: the one triton import, the dispatch rule and launch helpers.

triton is a Linux-only dependency and the PyTorch references work without it, so it is imported
here, guarded, and nowhere else: without it ``HAS_TRITON`` is False, ``triton`` and ``tl`` are
None, the op modules skip their ``@triton.jit`` definitions and every op runs its PyTorch path.

Every op takes ``_impl``: None runs Triton on CUDA tensors (when triton is installed) and the
PyTorch path elsewhere; ``"triton"`` forces the Triton path (the tests use it together with
``TRITON_INTERPRET=1`` to run the kernels on CPU in triton's interpreter); the op's own name for
its PyTorch path (``"reference"``, or ``"torch"`` for the chunked loss) forces that one.
"""

from __future__ import annotations

import os

import torch

try:  # triton is a Linux-only dependency; the references work without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "contiguous_last", "dot_mode", "interpreting", "sm_count", "tl", "triton", "use_triton"]


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run on CPU tensors, one program at a time, so the
    launchers pick tiny tiles (test shapes then span several tiles) and fp32 dots."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor, impl: str | None, other: str = "reference") -> bool:
    """Whether an op runs its Triton path for input ``t`` and ``_impl=impl`` (``other``: the name of the
    op's PyTorch path)."""
    if impl == other:
        return False
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("triton is not installed: pip install triton (Linux), or pass _impl=None")
        return True
    if impl is not None:
        raise ValueError(f"_impl must be None, 'triton' or {other!r}, got {impl!r}")
    return t.is_cuda and HAS_TRITON


def contiguous_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dimension, which the kernels' row pointers assume."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_mode(*weights) -> tuple[bool, str]:
    """(UPCAST, DOT_PREC) for tl.dot given the weight dtypes."""
    if interpreting() or any(w.dtype == torch.float32 or w.dtype == torch.float64 for w in weights):
        return True, "ieee"
    return False, "tf32"  # native bf16/fp16 dot; input_precision is ignored for them


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (grid sizing); 4 stands in elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
