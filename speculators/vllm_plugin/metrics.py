"""vLLM's speculative-decoding counters, summed over its metric readers (engine processes)."""

from __future__ import annotations


def spec_decode_metrics(llm) -> dict:
    """Cumulative drafts, drafted tokens, accepted tokens and accepted tokens per position of an `LLM`."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = out["accepted_per_pos"]
            vals.extend([0] * (len(m.values) - len(vals)))
            for i, v in enumerate(m.values):
                vals[i] += v
    return out
