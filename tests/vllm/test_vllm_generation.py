"""vLLM as the trainer's generator (generator: vllm; speculators/generation.py), against the built-in
one, on the default target and drafts cut from it, in fp32 where both decode greedily alike.

- The trainer, run in the vLLM venv with a SeqKD stage and an on-policy stage both generating with
  vLLM, writes exactly the rows the built-in generator writes for the same greedy stage, and trains
  through the on-policy stage (the draft's weights loaded into the engine before every step).
- VLLMGenerator's in-place weight load: an engine started on draft A and given draft B's weights
  decodes exactly as B does with transformers, and as A again when given A's back; sampled
  continuations are a function of the seed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import yaml
from datasets import load_from_disk

from vllm_harness import ROOT, build_draft_model

THREADS_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def run_in_vllm_venv(vllm_python, args: list[str], log) -> None:
    env = {k: v for k, v in {**os.environ, **THREADS_ENV}.items() if k != "TRITON_INTERPRET"}
    with open(log, "w") as f:
        rc = subprocess.run([str(vllm_python), *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(open(log).readlines()[-30:])
        pytest.fail(f"{args[0]} exited with {rc} in the vLLM venv; log {log}:\n{tail}", pytrace=False)


def builtin_continuations(model_dir, prompts, gen_tokens) -> list[list[int]]:
    from speculators.config import Stage
    from speculators.generation import generate_rows
    from speculators.target import load_causal_lm

    model, tok = load_causal_lm(str(model_dir), torch.float32)
    rows = generate_rows(model, tok, prompts, Stage(gen_tokens=gen_tokens, gen_temperature=0.0), seed=0)
    return [r["input_ids"][len(p):] for p, r in zip(prompts, rows)]


def test_trainer_generates_with_vllm_like_the_builtin_generator(vllm_python, default_target_dir, tmp_path):
    recipe = {
        "kind": "draft_model", "target": str(default_target_dir), "target_dtype": "fp32", "mixed_precision": "fp32",
        "data": "sharegpt", "max_samples": 64, "seq_len": 128, "draft_init": "layers", "draft_layers": [0, 1, 3, 8],
        "stages": [
            {"name": "seqkd", "data": "target", "steps": 2, "num_prompts": 8, "prompt_tokens": 96, "gen_tokens": 24,
             "gen_temperature": 0.0, "generator": "vllm"},
            {"name": "onpolicy", "data": "draft", "steps": 2, "num_prompts": 8, "prompt_tokens": 96, "gen_tokens": 16,
             "gen_temperature": 1.0, "gen_top_k": 0, "generator": "vllm"},
        ],
        "lr": 1e-3, "warmup_steps": 1, "batch_size": 4, "micro_batch_size": 4, "vllm_kv_cache_gib": 0.25,
        "log_every": 1, "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run_in_vllm_venv(vllm_python, ["train/distill.py", "--config", str(tmp_path / "recipe.yaml")], tmp_path / "train.log")

    from speculators.config import load_config
    from speculators.data import build_dataset
    from speculators.generation import generate_rows
    from speculators.stage_data import stage_prompts
    from speculators.target import Target

    cfg = load_config(str(tmp_path / "recipe.yaml"), [])
    target = Target.load(cfg.target, torch.float32)
    source = build_dataset(cfg.data, target.tokenizer, cfg.seq_len, cfg.max_samples, cfg.seed)
    prompts = stage_prompts(target.tokenizer, source, cfg.stages[0], cfg)
    builtin = generate_rows(target.model, target.tokenizer, prompts, cfg.stages[0], cfg.seed)
    with_vllm = load_from_disk(str(tmp_path / "run" / "generated" / "seqkd-rank0")).to_list()
    assert len(with_vllm) == len(builtin) == 8
    assert with_vllm == builtin
    assert any(sum(r["loss_mask"]) < 24 for r in builtin), "no row stopped at the EOS: the stop rule goes untested"
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert history[-1]["onpolicy_steps"] == 2
    assert (tmp_path / "run" / "final").is_dir()


def test_weights_load_in_place_and_samples_follow_the_seed(vllm_python, default_target_dir, prompts, tmp_path):
    a = build_draft_model(default_target_dir, tmp_path / "draft-a", (0, 1, 3, 8))
    b = build_draft_model(default_target_dir, tmp_path / "draft-b", (0, 2, 5, 29))
    spec = {"drafts": [str(a), str(b)], "prompts": prompts[:4], "gen_tokens": 24}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_in_vllm_venv(vllm_python, ["tests/vllm/generation_driver.py", str(tmp_path / "spec.json"),
                                   str(tmp_path / "out.json")], tmp_path / "driver.log")
    out = json.loads((tmp_path / "out.json").read_text())
    want_a, want_b = (builtin_continuations(d, spec["prompts"], 24) for d in (a, b))
    assert want_a != want_b, "the two drafts decode alike: the weight load would go unchecked"
    assert out["a"] == want_a
    assert out["b"] == want_b
    assert out["a_again"] == want_a
    assert out["sampled_seed7"] == out["sampled_seed7_again"]
    assert out["sampled_seed7"] != out["sampled_seed8"]
