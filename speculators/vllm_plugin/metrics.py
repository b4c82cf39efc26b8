"""vLLM's speculative-decoding counters: V1's metric readers (summed over engine processes) or, on the
V0 engine (vLLM <= 0.9 with VLLM_USE_V1=0), the counters of its spec-decode sampler."""

from __future__ import annotations


def spec_decode_metrics(llm) -> dict:
    """Cumulative drafts, drafted tokens, accepted tokens and accepted tokens per position of an `LLM`."""
    if not hasattr(llm.llm_engine, "engine_core"):
        return _v0_metrics(llm)
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


def _v0_metrics(llm) -> dict:
    """V0 counts per sequence and step, in its sampler on the driver worker: drafted tokens (every draft
    is k long), emitted tokens (the accepted prefix plus one target token) and, under the name
    num_accepted_tokens, every draft position the target agreed with, after a rejection too. What V1
    calls accepted, the accepted prefix, is emitted minus one per draft. No per-position counts."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase -> SpecDecodeWorker
    sampler = getattr(worker, "spec_decode_sampler", None)
    if sampler is None:  # no speculation configured
        return out
    k = llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens
    drafts = int(sampler.num_draft_tokens) // k
    out.update(num_drafts=drafts, num_draft_tokens=drafts * k,
               num_accepted_tokens=int(sampler.num_emitted_tokens) - drafts)
    return out
