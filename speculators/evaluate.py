"""Measure proposers with the built-in engine: τ, acceptance per draft position, tokens/s and
speedup over plain decoding of the same target in the same run. Writes JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from .data import chat_ids, eval_prompts
from .engine import SpeculativeDecoder
from .proposers import SamplingParams
from .target import check_fits


class LosslessnessError(AssertionError):
    """Greedy speculative output differed from plain greedy decoding: a bug, never a tolerance."""


def run_decoder(decoder: SpeculativeDecoder, prompts: list[list[int]], sp: SamplingParams, desc: str) -> dict:
    outputs, forwards, step_tokens, seconds, n_tokens = [], 0, 0, 0.0, 0
    drafted, accepted, sources = [0] * decoder.k, [0] * decoder.k, {}
    for i, ids in enumerate(tqdm(prompts, desc=desc, unit="prompt", leave=False)):
        st = decoder.generate(ids, SamplingParams(**{**sp.__dict__, "seed": sp.seed + i}))
        outputs.append(st.tokens)
        forwards += st.target_forwards
        step_tokens += st.steps_tokens
        seconds += st.seconds
        n_tokens += len(st.tokens)
        drafted = [a + b for a, b in zip(drafted, st.drafted)]
        accepted = [a + b for a, b in zip(accepted, st.accepted)]
        for source, steps in st.sources.items():
            sources[source] = sources.get(source, 0) + steps
    steps = sum(sources.values())
    return {
        "tau": step_tokens / max(forwards, 1),
        "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(accepted, drafted)],
        "tokens_per_s": n_tokens / seconds,
        "tokens": n_tokens,
        "target_forwards": forwards,
        "seconds": seconds,
        "outputs": outputs,
        # a hybrid's share of steps per draft source (a single proposer: one source at 1.0)
        "source_share": {name: n / steps for name, n in sorted(sources.items())} if steps else {},
    }


def evaluate(target, proposers: dict, datasets: list[str], k: int, sp: SamplingParams, n_prompts: int | None,
             out_dir: Path | None = None) -> dict:
    """Plain decoding, then each proposer, on the same prompts; greedy outputs must match exactly."""
    results = {"k": k, "temperature": sp.temperature, "top_p": sp.top_p, "max_new_tokens": sp.max_new_tokens,
               "datasets": {}}
    sets = {name: [chat_ids(target.tokenizer, m) for m in eval_prompts(name, n_prompts)] for name in datasets}
    for name, prompts in sets.items():  # every prompt, before the first is decoded
        for i, ids in enumerate(prompts):
            check_fits(target.window, len(ids), sp.max_new_tokens, f"{name} prompt {i + 1}")
    for name, prompts in sets.items():
        plain = run_decoder(SpeculativeDecoder(target, None, 0), prompts, sp, f"{name}: plain")
        rows = {"plain": _public(plain)}
        for pname, proposer in proposers.items():
            res = run_decoder(SpeculativeDecoder(target, proposer, k), prompts, sp, f"{name}: {pname}")
            if sp.temperature == 0:
                bad = [i for i, (a, b) in enumerate(zip(res["outputs"], plain["outputs"])) if a != b]
                if bad:
                    raise LosslessnessError(f"{pname} on {name}: greedy output differs from plain decoding on prompts {bad[:5]}")
            res["speedup"] = res["tokens_per_s"] / plain["tokens_per_s"]
            rows[pname] = _public(res)
        results["datasets"][name] = {"prompts": len(prompts), "results": rows}
    if out_dir is not None:
        write_report(results, Path(out_dir))
    return results


def _public(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "outputs"}


def write_report(results: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    sets = results["datasets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 3.6), squeeze=False)
    for ax, (name, d) in zip(axes[0], sets.items()):
        for pname, r in d["results"].items():
            if pname == "plain":
                continue
            acc = r["acceptance_per_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{pname} (τ={r['tau']:.2f}, {r['speedup']:.2f}×)")
        ax.set_xticks(range(1, results["k"] + 1))
        ax.set(title=f"{name} (k={results['k']}, T={results['temperature']})", xlabel="draft position",
               ylabel="acceptance rate", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance.png", dpi=120)
    plt.close(fig)


def summary_lines(results: dict) -> list[str]:
    lines = []
    for name, d in results["datasets"].items():
        plain = d["results"]["plain"]
        lines.append(f"{name} ({d['prompts']} prompts, k={results['k']}, T={results['temperature']}): "
                     f"plain {plain['tokens_per_s']:.1f} tok/s")
        for pname, r in d["results"].items():
            if pname != "plain":
                acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
                share = r.get("source_share", {})
                won = ("  steps won: " + ", ".join(f"{s} {v:.0%}" for s, v in share.items())) if len(share) > 1 else ""
                lines.append(f"  {pname:>16}: tau={r['tau']:.2f}  speedup={r['speedup']:.2f}x  "
                             f"{r['tokens_per_s']:.1f} tok/s  acceptance/pos=[{acc}]{won}")
    return lines
