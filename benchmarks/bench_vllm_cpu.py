"""vLLM with each speculator against vLLM without one, on MT-Bench prompts, greedy, batch 1 and batch 8.

Runs under the vLLM venv (`bash scripts/setup_vllm.sh`; on a GPU see scripts/gpu_vllm_033.sh); every speculator goes through the way a user
would load it: our exports as `speculative_config={"model": DIR, "num_speculative_tokens": k}` (the
speculators plugin), a draft model as `method: "draft_model"`, Medusa natively with --medusa-native.

    .venv-vllm/bin/python benchmarks/bench_vllm_cpu.py --mlp runs/x/export --medusa runs/y/export \\
        [--draft DIR] [--k 3] [--num-prompts 16] [--max-tokens 128] [--batch-sizes 1 8] [--threads 2]

For each configuration one engine is started (one at a time), warmed up on one prompt, then timed at each
batch size: batch B sends the prompts B at a time, one `generate()` call per group. Reported per
configuration and batch size: output tokens/s, vLLM's mean acceptance length (1 + accepted / drafts,
from its spec-decode counters over the timed calls), per-position acceptance, the speedup over the
plain run at the same batch size measured in this same run, and whether the greedy outputs equal the
plain run's. `--json OUT` writes everything.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from speculators.vllm_plugin.metrics import spec_decode_metrics


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model directory (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("--mlp", help="an MLP-speculator export (speculators export)")
    p.add_argument("--medusa", help="a Medusa export (speculators export)")
    p.add_argument("--medusa-native", action="store_true",
                   help="also run the Medusa export through vLLM's own method='medusa' (vLLM <= 0.32)")
    p.add_argument("--draft", help="a draft model directory (HF causal LM sharing the target's vocabulary)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count(),
                   help="OpenMP threads for vLLM's CPU worker (default: OMP_NUM_THREADS, else all cores)")
    p.add_argument("--in-process", action="store_true",
                   help="engine core and worker in this process (faster start; default: vLLM's multi-process layout)")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM enforce_eager (default: on for CPU, where torch.compile takes minutes; off on CUDA)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def run_config(args, name: str, speculative_config: dict | None, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    kwargs = dict(model=args.target, dtype=args.dtype, seed=0, enforce_eager=args.eager, max_model_len=2048,
                  disable_log_stats=False, kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False)
    if args.in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if speculative_config:
        kwargs["speculative_config"] = speculative_config
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result = {"name": name, "speculative_config": speculative_config, "startup_s": time.perf_counter() - t0,
              "method": getattr(llm.llm_engine.vllm_config.speculative_config, "method", None), "batches": {}}
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(tp[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # warm-up
    for bs in args.batch_sizes:
        before = spec_decode_metrics(llm)
        outputs, seconds = [], 0.0
        for i in range(0, len(tp), bs):
            t0 = time.perf_counter()
            res = llm.generate(tp[i : i + bs], sp, use_tqdm=False)
            seconds += time.perf_counter() - t0
            outputs += [list(r.outputs[0].token_ids) for r in res]
        after = spec_decode_metrics(llm)
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"]))]
        n_tokens = sum(map(len, outputs))
        result["batches"][bs] = {
            "seconds": seconds, "tokens": n_tokens, "tokens_per_s": n_tokens / seconds, "outputs": outputs,
            "drafts": drafts, "accepted": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_pos": [a / drafts for a in per_pos] if drafts else [],
        }
        print(f"  {name:>14} batch {bs}: {n_tokens / seconds:7.1f} tok/s"
              + (f"  mean acceptance length {1 + accepted / drafts:.3f}" if drafts else ""), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from speculators.assets import default_target_dir
    from speculators.data import chat_ids, eval_prompts

    args.target = args.target or str(default_target_dir())
    if args.eager is None:
        import torch

        args.eager = not torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(args.target)
    prompts = [chat_ids(tok, m) for m in eval_prompts("mt-bench", args.num_prompts)]
    configs = [("plain", None)]
    if args.mlp:
        configs.append(("mlp_speculator", {"model": str(Path(args.mlp).resolve()), "num_speculative_tokens": args.k}))
    if args.medusa:
        configs.append(("medusa", {"model": str(Path(args.medusa).resolve()), "num_speculative_tokens": args.k}))
        if args.medusa_native:
            configs.append(("medusa_native", {"method": "medusa", "model": str(Path(args.medusa).resolve()),
                                              "num_speculative_tokens": args.k}))
    if args.draft:
        configs.append(("draft_model", {"method": "draft_model", "model": str(Path(args.draft).resolve()),
                                        "num_speculative_tokens": args.k}))
    import vllm

    print(f"vLLM {vllm.__version__}, {args.dtype}, {args.threads} thread(s), {len(prompts)} MT-Bench prompts, "
          f"{args.max_tokens} new tokens, k={args.k}, greedy", flush=True)
    results = [run_config(args, name, sc, prompts) for name, sc in configs]
    plain = results[0]["batches"]
    print()
    print(f"{'proposer':>14} | {'batch':>5} | {'tok/s':>7} | {'speedup':>7} | {'mean acc. len':>13} | "
          f"{'acceptance per position':<24} | lossless")
    print("-" * 96)
    for r in results:
        for bs, b in r["batches"].items():
            b["speedup"] = b["tokens_per_s"] / plain[bs]["tokens_per_s"]
            b["lossless"] = b["outputs"] == plain[bs]["outputs"]
            mal = f"{b['mean_acceptance_length']:.3f}" if b["mean_acceptance_length"] else "-"
            acc = " ".join(f"{a:.3f}" for a in b["acceptance_per_pos"]) or "-"
            print(f"{r['name']:>14} | {bs:>5} | {b['tokens_per_s']:7.1f} | {b['speedup']:6.2f}x | {mal:>13} | "
                  f"{acc:<24} | {'yes' if b['lossless'] else 'NO'}")
    if args.json:
        meta = {k: v for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps({"args": meta, "vllm": vllm.__version__, "results": results}, indent=1))
        print(f"wrote {args.json}")
    if not all(b["lossless"] for r in results for b in r["batches"].values()):
        print("note: a greedy output differs from the plain run at the same batch size (see 'lossless'); in fp32 "
              "at batch 1 that would be a bug, in a batch it can be a near-tie flipped by a different batch shape")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
