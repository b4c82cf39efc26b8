"""Bad input at every door. Each case runs the real command (`python train/distill.py`, `python -m
speculators.cli`) in a subprocess and must end with exit code 2, one line on stderr that names the
offending setting or file, no traceback, and every file that was there before byte-identical after
(nothing new either: no half-written run or export). Most cases fail before any model loads."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
DISTILL = REPO / "train" / "distill.py"
PYTHON = sys.executable


def tree(root: Path) -> dict:
    """Every file under `root` (symlinks not followed) by relative path: its SHA-256, or its link."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def save_mlp(out: Path, target: str, vocab: int = 49152) -> Path:
    from speculators.models import MLPSpeculator, MLPSpeculatorConfig

    torch.manual_seed(0)
    MLPSpeculator(MLPSpeculatorConfig(vocab_size=vocab, emb_dim=64, n_predict=2, speculators_target={
        "name": target, "architecture": "LlamaForCausalLM"})).save_pretrained(out)
    return out


def set_dtype(weights: Path, tensor: str, dtype: str) -> None:
    """Rewrite one tensor's dtype in a safetensors header, as a damaged header would name it: the
    header keeps its length (padded with spaces, as the format allows), the data stays as it was."""
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header[tensor]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    weights.write_bytes(data[:8] + text.ljust(n) + data[8 + n :])


@pytest.fixture(scope="module")
def inputs(module_dir, tiny_target_dir, chat_file):
    """Every input the cases read, made once: checkpoints (good and damaged), data files, a masked-LM
    model, a training run. No case may change any of it."""
    from transformers import BertConfig, BertForMaskedLM

    from speculators.export.vllm_format import load_speculator

    root = module_dir / "inputs"
    root.mkdir()
    target = str(tiny_target_dir)
    f = SimpleNamespace(root=root, target=target, chats=str(chat_file))
    f.ckpt = save_mlp(root / "ckpt", target)
    f.flipped = Path(shutil.copytree(f.ckpt, root / "flipped"))
    set_dtype(f.flipped / "model.safetensors", "head.0.weight", "I32")  # F32 and I32 are both 4 bytes
    f.mixed = root / "mixed"  # a bf16 export with one tensor's header naming float16, also 2 bytes
    load_speculator(f.ckpt).to(torch.bfloat16).save_pretrained(f.mixed)
    set_dtype(f.mixed / "model.safetensors", "proj.1.weight", "F16")
    f.corrupt = Path(shutil.copytree(f.ckpt, root / "corrupt"))
    weights = (f.corrupt / "model.safetensors").read_bytes()
    (f.corrupt / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    f.pickled = Path(shutil.copytree(f.ckpt, root / "pickled"))
    torch.save(load_file(f.pickled / "model.safetensors"), f.pickled / "pytorch_model.bin")
    (f.pickled / "model.safetensors").unlink()
    f.other_vocab = save_mlp(root / "other-vocab", target, vocab=1000)
    # a training run as the trainer leaves it: its export must never be written over it
    f.run = root / "run"
    shutil.copytree(f.ckpt, f.run / "final")
    shutil.copytree(f.ckpt, f.run / "checkpoints" / "step-0000002" / "model")
    (f.run / "checkpoints" / "latest").write_text("step-0000002")
    (f.run / "history.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    f.bert = root / "bert"
    BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(f.bert)
    f.empty = root / "empty.jsonl"
    f.empty.write_text("")
    f.malformed = root / "malformed.jsonl"
    f.malformed.write_text(Path(chat_file).read_text().splitlines()[0] + "\n{\"conversations\": [oops]}\n")
    f.bad_yaml = root / "bad.yaml"
    f.bad_yaml.write_text("lr: 1e-3\nstages: [{steps: 10}\nseq_len: 96\n")
    f.binary = root / "prompts.bin"
    f.binary.write_bytes(bytes(range(256)) * 4)
    f.long_prompt = root / "long.txt"
    f.long_prompt.write_text("word " * 1100 + "\n")  # past the tiny target's window of 1024 positions
    f.text_file = root / "notes.txt"
    f.text_file.write_text("not a directory\n")
    f.full_dir = root / "full"
    f.full_dir.mkdir()
    (f.full_dir / "notes.txt").write_text("mine\n")
    return f


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private speculators cache (models and assets shared read-only), so a case that wrongly
    tokenized and cached a data set would show up in the hashes."""
    from speculators import assets

    real = assets.cache_dir()
    cache = tmp_path_factory.mktemp("cache")
    for name in ("models", "assets", "wheels"):
        (cache / name).symlink_to(real / name)
    return cache


def train_args(f, out, **extra):
    args = {"target": f.target, "data": f.chats, "output_dir": out, "max_samples": 24, "seq_len": 96,
            "batch_size": 4, "micro_batch_size": 2, "stages": "[{steps: 2}]", "mixed_precision": "fp32",
            "target_dtype": "fp32", "n_predict": 2, **extra}
    return [f"--{k}={v}" for k, v in args.items()]


def expand(word: str, f, out) -> str:
    if word.startswith("@"):
        name, _, rest = word[1:].partition("/")
        return str(getattr(f, name)) + (f"/{rest}" if rest else "")
    return word.replace("{out}", str(out))


def distill(**extra):
    """`python train/distill.py` with the base settings and `extra` (a value "@name" is that input's path)."""
    return lambda f, out: [PYTHON, str(DISTILL),
                           *train_args(f, out / "run", **{k: expand(str(v), f, out) for k, v in extra.items()})]


def cli(*args):
    """`python -m speculators.cli ARGS` ("@name" is that input's path, "{out}" the case's own directory)."""
    return lambda f, out: [PYTHON, "-m", "speculators.cli", *(expand(a, f, out) for a in args)]


# (command, the words the one error line must contain: "@name" is that input's path, "{out}" the case's output)
CASES = {
    # training settings, refused before anything loads
    "steps-0": (distill(stages="[{steps: 0}]"), ["steps=0", ">= 1"]),
    "steps-negative": (distill(stages="[{steps: -5}]"), ["steps=-5", ">= 1"]),
    "no-stages": (distill(stages="[]"), ["stages=[]"]),
    "stages-not-a-list": (distill(stages="{steps: 3}"), ["stages=", "type list"]),
    "batch-size-0": (distill(batch_size=0), ["batch_size=0", ">= 1"]),
    "micro-batch-size-0": (distill(micro_batch_size=0), ["micro_batch_size=0", ">= 1"]),
    "batch-not-multiple": (distill(batch_size=5), ["batch_size=5", "micro_batch_size=2"]),
    "seq-len-0": (distill(seq_len=0), ["seq_len=0", ">= 16"]),
    "lr-negative": (distill(lr=-1e-3), ["lr=-0.001", "> 0"]),
    "lr-nan": (distill(lr=".nan"), ["lr=nan", "> 0"]),
    "n-predict-0": (distill(n_predict=0), ["n_predict=0", ">= 1"]),
    "loss-temperature-0": (distill(temperature=0), ["temperature=0.0", "> 0"]),
    "onpolicy-fraction": (distill(kind="draft_model", draft_layers="[0]",
                                  stages="[{steps: 2, onpolicy_fraction: 1.5}]"), ["onpolicy_fraction=1.5", "[0, 1]"]),
    "gen-temperature-negative": (distill(stages="[{data: target, steps: 2, gen_temperature: -1}]"),
                                 ["gen_temperature=-1.0", ">= 0"]),
    "warmup-negative": (distill(warmup_steps=-1), ["warmup_steps=-1", ">= 0"]),
    "seed-negative": (distill(seed=-1), ["seed=-1"]),
    "jsd-beta-1": (distill(divergence="jsd", beta=1), ["beta=1.0", "jsd"]),
    "unknown-key": (distill(lerning_rate=1), ["lerning_rate"]),
    "override-not-yaml": (distill(stages="[{steps:"), ["--stages", "YAML"]),
    "recipe-not-yaml": (lambda f, out: [PYTHON, str(DISTILL), "--config", str(f.bad_yaml)],
                        ["@bad_yaml", ":3:", "YAML"]),
    # training inputs: the target's config is read, or the run stops before the first write
    "missing-model": (distill(target="/nonexistent/model"), ["/nonexistent/model", "not found"]),
    "masked-lm-target": (distill(target="@bert"), ["@bert", "BertForMaskedLM", "causal"]),
    "seq-len-past-window": (distill(seq_len=2048), ["seq_len=2048", "1024"]),
    "missing-data": (distill(data="/nonexistent/chats.jsonl"), ["/nonexistent/chats.jsonl", "not found"]),
    "empty-data": (distill(data="@empty"), ["@empty", "no usable"]),
    "malformed-jsonl": (distill(data="@malformed"), ["@malformed", ":2:", "not valid JSON"]),
    "output-dir-not-empty": (distill(output_dir="@full_dir"), ["@full_dir", "not empty", "--resume"]),
    # eval / generate flags, refused before anything loads
    "eval-k-0": (cli("eval", "@ckpt", "--k", "0"), ["--k 0", ">= 1"]),
    "eval-k-negative": (cli("eval", "@ckpt", "--k", "-1"), ["--k -1", ">= 1"]),
    "generate-k-0-ngram": (cli("generate", "--ngram", "--k", "0", "--prompt", "hi"), ["--k 0"]),
    "temperature-negative": (cli("generate", "--temperature", "-1", "--prompt", "hi"), ["--temperature -1.0", ">= 0"]),
    "top-p-above-1": (cli("generate", "--top-p", "1.5", "--prompt", "hi"), ["--top-p 1.5", "(0, 1]"]),
    "top-p-0": (cli("generate", "--top-p", "0", "--prompt", "hi"), ["--top-p 0.0", "(0, 1]"]),
    "top-k-negative": (cli("generate", "--top-k", "-1", "--prompt", "hi"), ["--top-k -1", ">= 0"]),
    "max-new-tokens-0": (cli("generate", "--max-new-tokens", "0", "--prompt", "hi"), ["--max-new-tokens 0", ">= 1"]),
    "max-new-tokens-negative": (cli("generate", "--max-new-tokens", "-5", "--prompt", "hi"), ["--max-new-tokens -5"]),
    "num-prompts-0": (cli("eval", "--ngram", "--num-prompts", "0"), ["--num-prompts 0", ">= 1"]),
    "threads-0": (cli("generate", "--threads", "0", "--prompt", "hi"), ["--threads 0", ">= 1"]),
    "empty-raw-prompt": (cli("generate", "--raw", "--prompt", ""), ["--prompt", "empty"]),
    "binary-prompt-file": (cli("generate", "--prompt-file", "@binary"), ["@binary", "not UTF-8"]),
    "missing-prompt-file": (cli("generate", "--prompt-file", "/nonexistent/prompts.txt"), ["/nonexistent/prompts.txt"]),
    "eval-out-is-a-file": (cli("eval", "@ckpt", "--out", "@text_file"), ["@text_file", "is a file"]),
    # generate against the target's tokenizer and config
    "prompt-past-window": (cli("generate", "--target", "@target", "--raw", "--prompt-file", "@long_prompt"),
                           ["1101 tokens", "window of 1024"]),
    # export
    "export-flipped-dtype": (cli("export", "@flipped", "--out", "{out}/export"), ["head.0.weight", "int32", "float32"]),
    "export-mixed-float-dtypes": (cli("export", "@mixed", "--out", "{out}/export"),
                                  ["proj.1.weight", "float16", "bfloat16"]),
    "export-other-vocab": (cli("export", "@other_vocab", "--out", "{out}/export"), ["vocab size 1000", "49152"]),
    "export-corrupt-safetensors": (cli("export", "@corrupt", "--out", "{out}/export"), ["@corrupt", "safetensors"]),
    "export-pickle": (cli("export", "@pickled", "--out", "{out}/export"), ["pickle", "--allow-pickle"]),
    "export-missing-checkpoint": (cli("export", "/nonexistent/ckpt", "--out", "{out}/export"), ["no checkpoint"]),
    "export-masked-lm-target": (cli("export", "@ckpt", "--target", "@bert", "--out", "{out}/export"),
                                ["@bert", "BertForMaskedLM"]),
    "export-out-is-a-file": (cli("export", "@ckpt", "--out", "@text_file"), ["@text_file", "is a file"]),
    "export-out-not-empty": (cli("export", "@ckpt", "--out", "@full_dir"), ["@full_dir", "not empty", "--force"]),
    "export-into-its-run": (cli("export", "@run", "--out", "@run", "--force"), ["@run"]),
    "export-into-its-final": (cli("export", "@run", "--out", "@run/final", "--force"), ["@run"]),
}


def run(argv, cache):
    env = {**os.environ, "SPECULATORS_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)


def one_line_error(proc, needles):
    """Exit 2, no traceback, exactly one error line (library warnings may come before it), naming each needle."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(("distill: error: ", "speculators ")), errors[0]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_changes_nothing(case, inputs, cache, tmp_path):
    command, needles = CASES[case]
    argv = command(inputs, tmp_path)
    roots = [Path(inputs.root), Path(inputs.target), Path(inputs.chats).parent, cache, tmp_path]
    before = [tree(r) for r in roots]
    one_line_error(run(argv, cache), [expand(n, inputs, tmp_path) for n in needles])
    assert [tree(r) for r in roots] == before


@pytest.mark.parametrize("command", ["eval", "generate"])
@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "allowed: >= 0"),
    (["--top-p", "1.5"], "allowed: (0, 1]"),
    (["--top-p", "0"], "allowed: (0, 1]"),
    (["--k", "0"], "allowed: >= 1"),
])
def test_sampling_flags_are_validated(command, flags, needle, inputs, cache):
    """Each sampling flag outside its range is refused with that range, with a checkpoint given (so
    --k 0 would otherwise decode plainly under the speculator's name)."""
    proc = run([PYTHON, "-m", "speculators.cli", command, str(inputs.ckpt), *flags]
               + (["--prompt", "hi"] if command == "generate" else []), cache)
    line = one_line_error(proc, [flags[0], needle])
    assert line.startswith(f"speculators {command}: error:")


def test_every_range_boundary_is_allowed():
    """The lowest and highest values each range allows load: the checks are not off by one."""
    from speculators.config import load_config

    cfg = load_config(None, ["--stages=[{steps: 1, num_prompts: 1, gen_temperature: 0, gen_top_k: 0, "
                             "onpolicy_fraction: 0, lr_scale: 1e-9}]", "--max_samples=0", "--seq_len=16",
                             "--batch_size=1", "--micro_batch_size=1", "--grad_clip=0", "--warmup_steps=0",
                             "--seed=4294967295", "--beta=1", "--medusa_layers=0", "--inner_dim=0"])
    assert cfg.total_steps == 1 and cfg.seed == 2**32 - 1


def test_accelerate_launch_exit_code(tmp_path, inputs, cache):
    """Under `accelerate launch` our one line still reaches stderr, but the launcher exits 1 for any
    failed process (it raises CalledProcessError rather than passing the code on); with -q it prints
    no traceback of its own. Run directly, the same input exits 2."""
    bad = train_args(inputs, tmp_path / "run", batch_size=0)
    direct = run([PYTHON, str(DISTILL), *bad], cache)
    one_line_error(direct, ["batch_size=0"])
    launch = [PYTHON, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"]
    quiet = run([*launch[:3], "-q", *launch[3:], str(DISTILL), *bad], cache)
    assert quiet.returncode == 1, quiet.stderr[-3000:]
    assert "Traceback" not in quiet.stderr, quiet.stderr[-3000:]
    assert [line for line in quiet.stderr.splitlines() if "error" in line.lower()] == \
        ["distill: error: batch_size=0 is out of range; allowed: >= 1"]
    loud = run([*launch, str(DISTILL), *bad], cache)
    assert loud.returncode == 1 and "distill: error: batch_size=0" in loud.stderr
    assert not (tmp_path / "run").exists()
