"""vLLM with each proposer against vLLM without one, greedy, batch 1 and batch 8, on MT-Bench and HumanEval.

Runs under the vLLM venv (`bash scripts/setup_vllm.sh`; on a GPU see scripts/gpu_vllm_033.sh); every proposer
is loaded the way a user would load it: our exports as `speculative_config={"model": DIR,
"num_speculative_tokens": k}` (the speculators plugin; heads alone with `additional_config={"speculators":
{"hybrid": False}}`, the hybrid with suffix lookup with `{"hybrid": True}`), a draft model as
`method: "draft_model"`, Medusa natively with --medusa-native, and vLLM's own lookups: `method: "ngram"`
(n = 1..4) and `method: "suffix"` (needs the arctic-inference package; its row says so otherwise).

    .venv-vllm/bin/python benchmarks/bench_vllm_cpu.py --mlp runs/x/export [--hybrid] [--ngram] [--suffix] \
        [--medusa runs/y/export] [--draft DIR] [--k 3] [--data mt-bench humaneval] [--num-prompts 20] \
        [--max-tokens 128] [--batch-sizes 1 8] [--threads 2]

For each configuration one engine is started (one at a time; suffix and the hybrid get one per batch
size, since they also search finished requests' outputs), warmed up on a prompt outside the sets, then
timed on each data set at each batch size: batch B sends the prompts B at a time, one `generate()` call per
group. Reported per configuration, set and batch size: output tokens/s, vLLM's mean acceptance length
(1 + accepted / drafts, from its spec-decode counters over the timed calls), per-position acceptance,
the speedup over the plain run at the same set and batch size measured in this same run, and whether
the greedy outputs equal the plain run's. `--json OUT` writes everything.
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
    p.add_argument("--hybrid", action="store_true",
                   help="also run each export as the hybrid with suffix lookup (the plugin's {'hybrid': True})")
    p.add_argument("--draft", help="a draft model directory (HF causal LM sharing the target's vocabulary)")
    p.add_argument("--ngram", action="store_true", help="also run vLLM's own ngram method (n = 1..4)")
    p.add_argument("--suffix", action="store_true", help="also run vLLM's own suffix method (needs arctic-inference)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--data", nargs="+", default=["mt-bench"], help="built-in prompt sets or prompt files")
    p.add_argument("--num-prompts", type=int, default=20)
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


def run_config(args, name: str, speculative_config: dict | None, additional_config: dict | None,
               sets: dict[str, list[list[int]]], batch_sizes: list[int], warmup: list[int]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.in_process else "1"
    kwargs = dict(model=args.target, dtype=args.dtype, seed=0, enforce_eager=args.eager, max_model_len=2048,
                  disable_log_stats=False, kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False)
    if args.in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if speculative_config:
        kwargs["speculative_config"] = speculative_config
    if additional_config:
        kwargs["additional_config"] = additional_config
    result = {"name": name, "speculative_config": speculative_config, "additional_config": additional_config,
              "batches": {}}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as err:  # e.g. method "suffix" without arctic-inference: the row says why
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        print(f"  {name:>14}: {result['error']}", flush=True)
        gc.collect()
        return result
    result.update(startup_s=time.perf_counter() - t0,
                  method=getattr(llm.llm_engine.vllm_config.speculative_config, "method", None))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # warm-up on a prompt outside the sets: lookups that remember finished outputs must not see a timed one
    llm.generate([TokensPrompt(prompt_token_ids=warmup)], SamplingParams(temperature=0.0, max_tokens=16),
                 use_tqdm=False)
    for data, prompts in sets.items():
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for bs in batch_sizes:
            result["batches"][f"{data} {bs}"] = run_batches(llm, tp, bs, sp, f"{name:>14} {data} batch {bs}")
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def run_batches(llm, tp, bs: int, sp, label: str) -> dict:
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
    print(f"  {label}: {n_tokens / seconds:7.1f} tok/s"
          + (f"  mean acceptance length {1 + accepted / drafts:.3f}" if drafts else ""), flush=True)
    return {
        "seconds": seconds, "tokens": n_tokens, "tokens_per_s": n_tokens / seconds, "outputs": outputs,
        "drafts": drafts, "accepted": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_pos": [a / drafts for a in per_pos] if drafts else [],
    }


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
    sets = {data: [chat_ids(tok, m) for m in eval_prompts(data, args.num_prompts)] for data in args.data}
    k = args.k
    warmup = chat_ids(tok, [{"role": "user", "content": "Say hello."}])
    heads_only, hybrid = {"speculators": {"hybrid": False}}, {"speculators": {"hybrid": True}}
    # (name, speculative_config, additional_config, remembers): suffix decoding and the hybrid also search the
    # outputs of finished requests, which would hold another batch size's answers to the same prompts, so
    # they get a fresh engine for each batch size.
    configs = [("plain", None, None, False)]
    if args.suffix:
        configs.append(("suffix", {"method": "suffix", "num_speculative_tokens": k}, None, True))
    for kind, path in (("mlp_speculator", args.mlp), ("medusa", args.medusa)):
        if path:
            spec = {"model": str(Path(path).resolve()), "num_speculative_tokens": k}
            configs.append((kind, spec, heads_only, False))
            if args.hybrid:
                configs.append((f"hybrid-{kind}", spec, hybrid, True))
    if args.medusa and args.medusa_native:
        configs.append(("medusa_native", {"method": "medusa", "model": str(Path(args.medusa).resolve()),
                                          "num_speculative_tokens": k}, None, False))
    if args.draft:
        configs.append(("draft_model", {"method": "draft_model", "model": str(Path(args.draft).resolve()),
                                        "num_speculative_tokens": k}, None, False))
    if args.ngram:  # last: once its numba kernels loaded llvmlite, a later in-process engine fails to start
        configs.append(("ngram", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 4}, None, False))
    import vllm

    print(f"vLLM {vllm.__version__}, {args.dtype}, {args.threads} thread(s), {args.num_prompts} prompts of "
          f"{' and '.join(sets)}, {args.max_tokens} new tokens, k={k}, greedy", flush=True)
    results = []
    for name, sc, ac, remembers in configs:
        groups = [[bs] for bs in args.batch_sizes] if remembers else [args.batch_sizes]
        runs = [run_config(args, name, sc, ac, sets, group, warmup) for group in groups]
        result = runs[0]
        for later in runs[1:]:
            result["batches"].update(later["batches"])
        results.append(result)
    plain = results[0]["batches"]
    print()
    print(f"{'proposer':>22} | {'set':>10} | {'batch':>5} | {'tok/s':>7} | {'speedup':>7} | {'mean acc. len':>13} | "
          f"{'acceptance per position':<24} | lossless")
    print("-" * 122)
    for r in results:
        if "error" in r:
            print(f"{r['name']:>22} | {r['error']}")
            continue
        for key, b in r["batches"].items():
            data, bs = key.rsplit(" ", 1)
            b["speedup"] = b["tokens_per_s"] / plain[key]["tokens_per_s"]
            b["lossless"] = b["outputs"] == plain[key]["outputs"]
            mal = f"{b['mean_acceptance_length']:.3f}" if b["mean_acceptance_length"] else "-"
            acc = " ".join(f"{a:.3f}" for a in b["acceptance_per_pos"]) or "-"
            print(f"{r['name']:>22} | {data:>10} | {bs:>5} | {b['tokens_per_s']:7.1f} | {b['speedup']:6.2f}x | "
                  f"{mal:>13} | {acc:<24} | {'yes' if b['lossless'] else 'NO'}")
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
