"""DistillSpec's divergence comparison on the default target, at one training budget.

Five drafts start from the same layer cut of SmolLM2-135M-Instruct (`train/configs/draft_smollm2_layers.yaml`'s
`draft_layers`, same seed) and train for the same number of steps of 8 sequences: forward KL, reverse KL, JSD(0.5) and
total variation on on-policy data (every step the draft samples continuations of ShareGPT prompts at
T = 1 and the target scores them), and forward KL on the fixed ShareGPT data. Each is then measured with
`teacher_forced_tau.py`'s walk on the same MT-Bench and HumanEval prompts, beside the undistilled cut.
A variant whose `final/` exists is not retrained, so an interrupted run resumes.

    python benchmarks/compare_divergences.py --steps 40 --out runs/divergences
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from teacher_forced_tau import draft_chain_tau, greedy_outputs, target_probs

from speculators.draft import load_draft
from speculators.target import Target

RECIPE = "train/configs/draft_smollm2_layers.yaml"
VARIANTS = {  # name: (divergence, data)
    "fkl-onpolicy": ("fkl", "draft"),
    "rkl-onpolicy": ("rkl", "draft"),
    "jsd-onpolicy": ("jsd", "draft"),
    "tvd-onpolicy": ("tvd", "draft"),
    "fkl-fixed": ("fkl", "dataset"),
}


def train(name: str, divergence: str, data: str, steps: int, out: Path) -> Path:
    run = out / name
    if (run / "final").exists():
        return run / "final"
    stage = (f"[{{name: {name}, data: {data}, steps: {steps}, prompts: chat, prompt_tokens: 128, num_prompts: 2000, "
             f"gen_tokens: 96, gen_temperature: 1.0, gen_top_k: 0}}]")
    cmd = [sys.executable, "train/distill.py", "--config", RECIPE, f"--output_dir={run}", f"--divergence={divergence}",
           f"--stages={stage}", "--report_to=none", f"--save_every={steps}"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return run / "final"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="runs/divergences")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    out = Path(args.out)
    drafts = {name: train(name, div, data, args.steps, out) for name, (div, data) in VARIANTS.items()}
    drafts = {"undistilled": out / "fkl-onpolicy" / "initial", **drafts}
    target = Target.load("smollm2-135m-instruct", torch.float32)
    results = {}
    for data in ("mt-bench", "humaneval"):
        seqs = greedy_outputs(target, data, args.num_prompts, args.max_new_tokens)
        probs = target_probs(target, seqs)
        for name, path in drafts.items():
            tau, acc, alpha = draft_chain_tau(load_draft(path)[0], seqs, probs, args.k)
            results.setdefault(name, {})[data] = {"tau": tau, "acceptance_per_position": acc, "alpha": alpha}
    (out / "divergences.json").write_text(json.dumps({"steps": args.steps, "k": args.k, "results": results}, indent=2))
    print(f"\n{args.steps} steps each, k = {args.k}, {args.num_prompts} prompts per set, {args.max_new_tokens} new tokens")
    print("| draft | MT-Bench τ | MT-Bench α | HumanEval τ | HumanEval α |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        m, h = r["mt-bench"], r["humaneval"]
        print(f"| {name} | {m['tau']:.3f} | {m['alpha']:.3f} | {h['tau']:.3f} | {h['alpha']:.3f} |")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
