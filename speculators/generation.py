"""Continuations for the generating stages (SeqKD / self-distillation / IBM stage 2 from the target,
on-policy from the draft), by one of two generators with the same output:

- the built-in one, transformers' `generate` on the model the trainer already holds;
- vLLM, where it is installed (`generator: auto` picks it on CUDA), so that data generation scales:
  continuous batching and paged attention instead of padded 16-prompt chunks.

Rows hold prompt + continuation (through the EOS, when one is reached) with the loss on the
continuation, and are a function of the model, the prompts and the seed."""

from __future__ import annotations

import gc
import importlib.util
import os

import torch

from .config import ConfigError, Stage


def stop_ids(model, tokenizer) -> set[int]:
    """The ids generation stops at: the tokenizer's EOS and every EOS of the model's generation config
    (Qwen2.5 lists two), as both generators honour them."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return {tokenizer.eos_token_id, *ids} - {None}


def _row(prompt: list[int], generated: list[int], stops: set[int]) -> dict:
    """Prompt + continuation up to and including the first stop id (what follows it is padding)."""
    gen = generated[: next((j + 1 for j, t in enumerate(generated) if t in stops), len(generated))]
    return {"input_ids": prompt + gen, "loss_mask": [0] * len(prompt) + [1] * len(gen)}


@torch.no_grad()
def generate_rows(model, tokenizer, prompts: list[list[int]], stage: Stage, seed: int, bar=None) -> list[dict]:
    """The built-in generator: continuations `model` generates (sampled, or greedy when gen_temperature
    is 0), 16 prompts at a time; the chunk at offset `start` is seeded with seed + start."""
    pad, stops = tokenizer.pad_token_id, stop_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    rows = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start : start + 16]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left-pad for generation
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        torch.manual_seed(seed + start)
        sample = stage.gen_temperature > 0
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=attn.to(model.device), max_new_tokens=stage.gen_tokens,
            do_sample=sample, temperature=stage.gen_temperature if sample else None,
            # top_p pinned: a model's generation_config (upstream Qwen2.5 ships 0.8) must not narrow the stage's sampling
            top_k=stage.gen_top_k if sample else None, top_p=1.0 if sample else None, pad_token_id=pad)
        rows += [_row(p, seq, stops) for p, seq in zip(chunk, out[:, width:].tolist())]
        if bar is not None:
            bar.update(len(chunk))
    model.train(was_training)
    return rows


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def uses_vllm(stage: Stage) -> bool:
    """Whether a stage generates with vLLM: `vllm` always (an error without it), `auto` where vLLM is
    installed and a GPU is present, `builtin` never."""
    if stage.generator == "vllm" and not vllm_available():
        raise ConfigError(f"stage {stage.name}: generator: vllm, but vLLM is not installed "
                          f"(pip install 'speculators[vllm]', or use generator: builtin)")
    return stage.generator == "vllm" or (stage.generator == "auto" and vllm_available() and torch.cuda.is_available())


class VLLMGenerator:
    """One vLLM engine over a model directory, in this process (no engine-core subprocess: the trainer
    keeps the GPU context and can hand weights over without serialising them).

    `sync(named_tensors)` loads new weights into the running engine in place (vLLM's own
    `reload_weights` worker call), so the on-policy draft is re-read after every optimizer step without
    restarting the engine; prefix caching is off, so no KV computed with old weights is ever reused."""

    def __init__(self, model_dir: str, stops: set[int], dtype: torch.dtype, max_model_len: int, kv_cache_gib: float,
                 seed: int):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(model=str(model_dir), dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
                       seed=seed, max_model_len=max_model_len, kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
                       enable_prefix_caching=False, distributed_executor_backend="uni",
                       # CUDA graphs pay off for serving, not for a few generation rounds per stage
                       enforce_eager=True)
        self.stops = stops

    def generate(self, prompts: list[list[int]], stage: Stage, seed: int) -> list[dict]:
        """Rows like generate_rows'; request i is seeded with seed + i (vLLM's per-request generator)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        greedy = stage.gen_temperature == 0
        params = [SamplingParams(max_tokens=stage.gen_tokens, temperature=stage.gen_temperature,
                                 top_k=0 if greedy else stage.gen_top_k, top_p=1.0, seed=seed + i, detokenize=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [_row(p, list(o.outputs[0].token_ids), self.stops) for p, o in zip(prompts, outs)]

    def sync(self, named_tensors) -> None:
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
        except AttributeError as err:  # vLLM < 0.11 has no in-place reload
            raise RuntimeError(f"this vLLM cannot reload weights in place ({err}); on-policy generation with "
                               f"vLLM needs vLLM >= 0.11, or use generator: builtin") from None

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
