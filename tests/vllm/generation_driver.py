"""vLLM as the trainer's generator (speculators.generation.VLLMGenerator), outside the trainer: run in
the vLLM venv by tests/vllm/test_vllm_generation.py.

    .venv-vllm/bin/python tests/vllm/generation_driver.py SPEC.json OUT.json

SPEC.json: {"drafts": [DIR_A, DIR_B], "prompts": [[token ids], ...], "gen_tokens": 24}; two drafts of the
same shapes and different weights. One engine starts on A; OUT.json holds its continuations (token ids
after the prompt) for: greedy on A; greedy after loading B's weights in place (sync); greedy after
loading A's back; two sampled runs with one seed and one with another."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from speculators.config import Stage
from speculators.generation import VLLMGenerator


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    a, b = spec["drafts"]
    prompts = spec["prompts"]
    greedy = Stage(gen_tokens=spec["gen_tokens"], gen_temperature=0.0)
    sampled = Stage(gen_tokens=spec["gen_tokens"], gen_temperature=1.0, gen_top_k=0)
    weights = {d: sorted(load_file(str(Path(d) / "model.safetensors")).items()) for d in (a, b)}
    stops = {AutoTokenizer.from_pretrained(a).eos_token_id}
    gen = VLLMGenerator(a, stops=stops, dtype=torch.float32, max_model_len=max(map(len, prompts)) + spec["gen_tokens"],
                        kv_cache_gib=0.25, seed=0)

    def continuations(stage: Stage, seed: int = 0) -> list[list[int]]:
        return [r["input_ids"][len(p):] for p, r in zip(prompts, gen.generate(prompts, stage, seed))]

    out = {"a": continuations(greedy)}
    gen.sync(weights[b])
    out["b"] = continuations(greedy)
    gen.sync(weights[a])
    out["a_again"] = continuations(greedy)
    out["sampled_seed7"], out["sampled_seed7_again"] = continuations(sampled, 7), continuations(sampled, 7)
    out["sampled_seed8"] = continuations(sampled, 8)
    gen.close()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
