"""The recipe's dtype choices ('auto', 'bf16', 'fp32'), resolved for this machine."""

from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_precision(name: str) -> str:
    """A recipe's dtype choice ('auto', 'bf16' or 'fp32') as 'bf16' or 'fp32' on this machine."""
    if name != "auto":
        return name
    fast_bf16 = torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bf16" if fast_bf16 else "fp32"
