"""speculators: distill speculative-decoding proposers from a target LLM and serve them with vLLM."""

import os

# MKL (torch's CPU BLAS) picks a slow fp32 GEMM path for a few rows on AMD CPUs unless its
# conditional-numerical-reproducibility mode is set: on this project's 2-core EPYC, a 4-token
# verification forward of SmolLM2-135M took 1.6-1.9x a 1-token forward by default and 1.1-1.3x with
# MKL_CBWR=AUTO (benchmarks/bench_cpu_gemm.py, BENCHMARKS.md). MKL reads the variable at its first
# GEMM, so it is set here, before this package imports torch; a value the user set wins.
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
