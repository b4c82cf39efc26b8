"""The trainer's two generators side by side: transformers' `generate` (16 prompts per padded chunk,
speculators.generation.generate_rows) against vLLM (VLLMGenerator, continuous batching over all
prompts), on the same chat prompts from ShareGPT, as a SeqKD stage generates them.

Runs under the vLLM venv (`bash scripts/setup_vllm.sh`; on a GPU, any environment with vLLM):

    .venv-vllm/bin/python benchmarks/bench_generation.py [--model DIR] [--num-prompts 64] [--gen-tokens 128] \\
        [--temperature 0] [--dtype fp32] [--threads 2]

Prints generated tokens/s of each (vLLM's engine start reported apart: a stage pays it once), their
ratio, and for greedy generation the fraction of rows the two generate identically.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128, help="longest chat prompt kept")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from speculators.assets import default_target_dir
    from speculators.config import Stage, TrainConfig
    from speculators.generation import VLLMGenerator, generate_rows, stop_ids
    from speculators.stage_data import stage_prompts
    from speculators.target import load_causal_lm

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(default_target_dir())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_causal_lm(model_dir, dtype)
    model.to(device)
    stage = Stage(name="bench", data="target", num_prompts=args.num_prompts, prompts="chat",
                  prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, gen_temperature=args.temperature,
                  gen_top_k=0)
    prompts = stage_prompts(tok, None, stage, TrainConfig(data="sharegpt", seed=0))  # what a SeqKD stage would take

    def generated(rows):
        return sum(sum(r["loss_mask"]) for r in rows)

    t0 = time.perf_counter()
    builtin = generate_rows(model, tok, prompts, stage, seed=0)
    t_builtin = time.perf_counter() - t0
    stops = stop_ids(model, tok)
    del model
    t0 = time.perf_counter()
    gen = VLLMGenerator(model_dir, stops, dtype, max(map(len, prompts)) + args.gen_tokens, kv_cache_gib=1.0, seed=0)
    t_start = time.perf_counter() - t0
    t0 = time.perf_counter()
    with_vllm = gen.generate(prompts, stage, seed=0)
    t_vllm = time.perf_counter() - t0
    gen.close()
    rate_b, rate_v = generated(builtin) / t_builtin, generated(with_vllm) / t_vllm
    print(f"{len(prompts)} ShareGPT prompts, up to {args.gen_tokens} new tokens, {args.dtype}, "
          f"{'greedy' if args.temperature == 0 else f'T={args.temperature}'}, {device}, {args.threads} thread(s)")
    print(f"built-in (transformers generate): {generated(builtin)} tokens in {t_builtin:.1f} s = {rate_b:.1f} tok/s")
    print(f"vLLM: {generated(with_vllm)} tokens in {t_vllm:.1f} s = {rate_v:.1f} tok/s "
          f"(engine start {t_start:.1f} s apart)")
    print(f"vLLM / built-in: {rate_v / rate_b:.2f}x")
    if args.temperature == 0:
        same = sum(a == b for a, b in zip(builtin, with_vllm))
        print(f"greedy rows identical: {same}/{len(prompts)}")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
