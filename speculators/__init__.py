"""speculators: distill speculative-decoding proposers from a target LLM and serve them with vLLM."""

__version__ = "0.1.0"
