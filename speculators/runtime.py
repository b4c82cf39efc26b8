"""Process-wide settings for the entry points (`speculators ...`, `speculators train`,
`train/distill.py`, the vLLM plugin). Importing the package sets nothing; a Python caller who wants
these sets them in its own environment before importing torch."""

from __future__ import annotations

import os


def configure_process(hub_offline: bool = True) -> None:
    """Set MKL_CBWR=AUTO and (with hub_offline) HF_HUB_OFFLINE=1 unless the user set them.

    Call it before torch runs a matrix product and before huggingface_hub is imported: both read
    their variable once, at that point."""
    # MKL (torch's CPU BLAS) picks a slow fp32 GEMM path for a few rows on AMD CPUs unless its
    # conditional-numerical-reproducibility mode is set: on a 2-core EPYC, a 4-token verification
    # forward of SmolLM2-135M took 1.6-1.9x a 1-token forward by default and 1.1-1.3x with
    # MKL_CBWR=AUTO (benchmarks/bench_cpu_gemm.py, BENCHMARKS.md).
    os.environ.setdefault("MKL_CBWR", "AUTO")
    if hub_offline:
        # Offline by default: nothing reaches the Hub unless the user says HF_HUB_OFFLINE=0. The code
        # that resolves models and data sets (target.py, data.py) also reads an unset variable as offline.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
