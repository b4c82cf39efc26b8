"""The trainer on a tiny random target: it learns, resumes exactly, matches one process with two
DDP processes at the same global batch, and refuses bad input in one line."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
DISTILL = REPO / "train" / "distill.py"


def overrides(target, data, out, steps=6, **extra):
    args = {"target": target, "data": data, "output_dir": out, "max_samples": 24, "seq_len": 96, "batch_size": 4,
            "micro_batch_size": 2, "stages": f"[{{steps: {steps}}}]", "save_every": 3, "log_every": 1,
            "mixed_precision": "fp32", "target_dtype": "fp32", "n_predict": 2, "warmup_steps": 1, **extra}
    return [f"--{k}={v}" for k, v in args.items()]


def run(args, launcher=None):
    cmd = (launcher or [sys.executable]) + [str(DISTILL), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)


def weights(run_dir):
    return load_file(Path(run_dir) / "final" / "model.safetensors")


def train_in_process(args):
    from speculators.config import load_config
    from speculators.trainer import Trainer

    return Trainer(load_config(None, args)).train()


@pytest.mark.parametrize("kind,divergence", [("mlp_speculator", "fkl"), ("medusa", "ce"), ("medusa", "rkl")])
def test_loss_decreases(tmp_path, tiny_target_dir, chat_file, isolated_cache, kind, divergence):
    out = tmp_path / "run"
    train_in_process(overrides(tiny_target_dir, chat_file, out, steps=12, kind=kind, divergence=divergence, lr=3e-3))
    hist = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < 0.97 * hist[0]["loss"], hist
    assert (out / "final" / "config.json").exists()


@pytest.mark.parametrize("extra", [{}, {"optimizer": "adamw8bit"}, {"cache_hidden": True}])
def test_resume_is_exact(tmp_path, tiny_target_dir, chat_file, isolated_cache, extra):
    full = tmp_path / "full"
    train_in_process(overrides(tiny_target_dir, chat_file, full, **extra))
    # Rewind a copy of the run to its step-3 checkpoint, as if it had been killed there.
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "final")
    shutil.rmtree(part / "checkpoints" / "step-0000006")
    (part / "checkpoints" / "latest").write_text("step-0000003")
    from speculators.config import load_config
    from speculators.trainer import Trainer

    Trainer(load_config(None, overrides(tiny_target_dir, chat_file, part, **extra)), resume=True).train()
    a, b = weights(full), weights(part)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("kind", ["mlp_speculator", "medusa"])
def test_cached_hidden_states_give_the_same_training(tmp_path, tiny_target_dir, chat_file, isolated_cache, kind):
    """cache_hidden only moves the target's forward to the start: the same losses, step by step (up to
    the rounding of batching the target's rows differently), and weights that match."""
    runs = {}
    for cache in (False, True):
        out = tmp_path / f"cache{cache}"
        train_in_process(overrides(tiny_target_dir, chat_file, out, kind=kind, cache_hidden=cache, lr=3e-3))
        runs[cache] = [json.loads(line)["loss"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)
    a, b = weights(tmp_path / "cacheFalse"), weights(tmp_path / "cacheTrue")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4)


def test_cached_run_frees_the_target_layers(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    """A cache_hidden run whose stages all read the data set frees the target's decoder layers after
    caching, trains from the cache alone, and refuses a later target forward in one line."""
    from speculators.config import load_config
    from speculators.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(tiny_target_dir, chat_file, tmp_path / "run", steps=2,
                                                  cache_hidden=True)))
    layers = trainer.target.decoder_layers()
    assert layers and all(p.is_meta for layer in layers for p in layer.parameters())
    assert not trainer.target.lm_head.weight.is_meta
    assert (trainer.train() / "config.json").exists()
    with pytest.raises(RuntimeError, match="released after caching"):
        trainer.target(torch.tensor([[1, 2, 3]]))


def test_regression_init_learns_with_the_target_head_frozen(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    out = tmp_path / "run"
    train_in_process(overrides(tiny_target_dir, chat_file, out, steps=8, init="regression", scale_input=False,
                               tie_weights=True, lr=3e-3))
    hist = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < 0.97 * hist[0]["loss"], hist
    from speculators.target import Target

    lm_head = Target.load(str(tiny_target_dir)).lm_head.weight
    assert torch.equal(weights(out)["head.0.weight"], torch.cat([lm_head, -lm_head], 1))


@pytest.mark.parametrize("init", ["target", "regression", "medusa"])
def test_draft_vocab_trains_only_its_rows(tmp_path, tiny_target_dir, chat_file, isolated_cache, init):
    """draft_vocab: N: the loss reads only the N most frequent loss tokens' head rows; every other row of
    every head is exactly zero in the export, so vLLM computes what the built-in engine proposes."""
    out = tmp_path / "run"
    extra = {"init": init, "draft_vocab": 40, "lr": 3e-3}
    if init == "regression":
        extra.update(scale_input=False, tie_weights=True)
    if init == "medusa":
        extra.update(kind="medusa", init="target")
    train_in_process(overrides(tiny_target_dir, chat_file, out, steps=8, **extra))
    hist = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < 0.97 * hist[0]["loss"], hist
    from speculators.data import build_dataset
    from speculators.target import Target
    from speculators.trainer import frequent_tokens

    target = Target.load(str(tiny_target_dir))
    expected = frequent_tokens(build_dataset(str(chat_file), target.tokenizer, 96, 24, 0), 40, target.vocab_size)
    heads = [w for name, w in weights(out).items() if name.startswith(("head.", "lm_heads."))]
    assert heads
    for w in heads:
        assert torch.equal(w.ne(0).any(1).nonzero().squeeze(1), expected)
    if init == "regression":  # the live rows are still the target's frozen lm head, signed
        lm_head = target.lm_head.weight
        assert torch.equal(heads[0][expected], torch.cat([lm_head, -lm_head], 1)[expected])


@pytest.mark.parametrize("init", ["target", "regression", "regression+cache_hidden+token_bias"])
def test_ddp_matches_single_process(tmp_path, tiny_target_dir, chat_file, isolated_cache, init):
    # regression: each process sums its rows' normal equations, so the fit must still match;
    # cache_hidden: every process caches every row, in the same fixed batches; token_bias: the per-token
    # sums are reduced too.
    extra = {"init": "regression", "scale_input": False} if init.startswith("regression") else {}
    if init.endswith("token_bias"):
        extra.update(cache_hidden=True, init_token_bias=1.0)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    p1 = run(overrides(tiny_target_dir, chat_file, single, steps=4, **extra),
             [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"])
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = run(overrides(tiny_target_dir, chat_file, ddp, steps=4, **extra),
             [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", "29531"])
    assert p2.returncode == 0, p2.stderr[-3000:]
    a, b = weights(single), weights(ddp)
    for name in a:  # only the order of fp32 reductions differs
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)
    la = [json.loads(x)["loss"] for x in (single / "history.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (ddp / "history.jsonl").read_text().splitlines()]
    assert la == pytest.approx(lb, rel=1e-4)


SHARDED_LOAD = """
import sys, torch, torch.distributed as dist
from speculators.target import Target
dist.init_process_group("gloo")
whole = Target.load(sys.argv[1], torch.float32)
sharded = Target.load_sharded(sys.argv[1], torch.float32, torch.device("cpu"), dist.get_world_size())
ids = torch.arange(1, 24)[None]
for _ in range(2):  # the layers must be sharded again after every forward, not only before the first
    torch.testing.assert_close(sharded(ids).logits, whole(ids).logits, rtol=1e-5, atol=1e-5)
    print("held %d of %d" % sharded.layer_parameters(), flush=True)
"""


def test_sharded_load_reads_only_own_rows(tmp_path, tiny_target_dir):
    """Target.load_sharded in two gloo processes: the same logits as the whole target, forward after
    forward, while each process holds half of every decoder layer (the rest is never loaded)."""
    script = tmp_path / "sharded_load.py"
    script.write_text(SHARDED_LOAD)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29535", str(script), str(tiny_target_dir)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    held = [tuple(map(int, m)) for m in re.findall(r"held (\d+) of (\d+)", proc.stdout)]
    assert len(held) == 4, proc.stdout
    for local, total in held:
        assert local <= total // 2 + 64, (local, total)  # half, give or take FSDP's padding of odd rows


@pytest.mark.parametrize("kind", ["mlp_speculator", "draft_model"])
def test_sharded_target_matches_single_process(tmp_path, tiny_target_dir, chat_file, isolated_cache, kind):
    """shard_target: two processes each holding half of every target layer (FSDP2 over gloo) train the
    same weights as one process with the whole target. The MLP case runs the target in its least-squares
    start too (no cache), the draft case in every KL step."""
    extra = {"init": "regression", "scale_input": False} if kind == "mlp_speculator" else \
        {"kind": kind, "draft_layers": "[0]", "divergence": "fkl"}
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    p1 = run(overrides(tiny_target_dir, chat_file, single, steps=3, **extra),
             [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu"])
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = run(overrides(tiny_target_dir, chat_file, sharded, steps=3, shard_target=True, **extra),
             [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", "29533"])
    assert p2.returncode == 0, p2.stderr[-3000:]
    held, total = (int(n.replace(",", "")) for n in
                   re.search(r"holds ([\d,]+) of the target's ([\d,]+)", p2.stdout).groups())
    assert held <= total // 2 + 64, (held, total)  # half, give or take FSDP's padding of odd rows
    a, b = weights(single), weights(sharded)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("distill: error:"), proc.stderr[-2000:]
    for n in needles:
        assert n in errors[0], errors[0]


def test_bad_input(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    out = tmp_path / "run"
    one_line_error(run(overrides(tiny_target_dir, chat_file, out, lerning_rate=1)), "lerning_rate")
    one_line_error(run(overrides(tiny_target_dir, tmp_path / "missing.jsonl", out)), "not found")
    one_line_error(run(overrides(tmp_path / "no-model", chat_file, out)), "model not found")
    one_line_error(run(["--config", tmp_path / "nope.yaml"]), "config file not found")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_line_error(run(overrides(tiny_target_dir, empty, out)), "no usable")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "hi"}) + "\n")
    one_line_error(run(overrides(tiny_target_dir, short, out)), "empty")
    for eval_set in ("mt-bench", "humaneval"):
        one_line_error(run(overrides(tiny_target_dir, eval_set, out)), "evaluation set")
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    one_line_error(run(overrides(tiny_target_dir, chat_file, out)), "not empty")
    assert (out / "notes.txt").read_text() == "mine"
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh") + ["--resume"]), "no checkpoint")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", init="regression")), "scale_input")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", init="regression",
                                 scale_input=False, inner_dim=10)), "inner_dim")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", kind="draft_model", draft_vocab=8)),
                   "draft_vocab")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", draft_vocab=10**6)), "exceeds")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", lr="fast")), "not a number")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", n_predict=2.5)), "type int")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh",
                                 stages="[{data: target, steps: 2, generator: vlm}]")), "generator='vlm'")
    one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh", shard_target=True)),
                   "several processes")
    if importlib.util.find_spec("vllm") is None:  # the main venv: a vLLM stage stops before anything runs
        one_line_error(run(overrides(tiny_target_dir, chat_file, tmp_path / "fresh",
                                     stages="[{data: target, steps: 2, generator: vllm}]")), "vLLM is not installed")
    assert not (tmp_path / "fresh").exists()


def test_overrides_take_yaml_1_1_floats():
    """YAML 1.1 reads 1e-3 (no dot) as a string; the README's own `--lr=3e-4` must be the number."""
    from speculators.config import load_config

    assert load_config(None, ["--lr=3e-4", "--beta", "1"]).lr == 3e-4
    assert load_config(None, ["--beta", "1"]).beta == 1.0


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "train" / "configs").glob("*.yaml")))
def test_every_shipped_recipe_loads(recipe):
    """A shipped recipe with a misspelt key or value would fail only when a user launches it."""
    from speculators.config import load_config
    from speculators.precision import resolve_precision

    cfg = load_config(str(REPO / "train" / "configs" / recipe), [])
    assert {resolve_precision(cfg.target_dtype), resolve_precision(cfg.mixed_precision)} <= {"bf16", "fp32"}


def test_token_bias_solve_is_the_joint_ridge_regression():
    """solve_with_token_bias (offsets eliminated from sufficient statistics) equals the ridge solve
    with explicit one-hot token features, tokens that never occur keeping a zero offset."""
    from speculators.lstsq_init import solve_with_token_bias

    torch.manual_seed(0)
    N, D, V, lam, ridge = 300, 3, 12, 2.0, 1e-3
    embed = torch.randn(V, D, dtype=torch.float64)
    x = torch.randint(0, V - 2, (N,))  # the last two tokens never occur
    h = torch.randn(N, D, dtype=torch.float64)
    feats = torch.cat([h, embed[x], torch.ones(N, 1, dtype=torch.float64)], 1)
    y = feats @ torch.randn(2 * D + 1, D, dtype=torch.float64) + torch.randn(V, D, dtype=torch.float64)[x]
    y += 0.1 * torch.randn(N, D, dtype=torch.float64)
    sums = [torch.zeros(V, D, dtype=torch.float64).index_add_(0, x, t) for t in (h, y)]
    counts = torch.zeros(V, dtype=torch.float64).index_add_(0, x, torch.ones(N, dtype=torch.float64))
    beta, offsets = solve_with_token_bias(feats.T @ feats, feats.T @ y, *sums, counts, embed, lam, ridge)

    full = torch.cat([feats, torch.nn.functional.one_hot(x, V).double()], 1)
    penalty = torch.diag(torch.cat([torch.full((2 * D + 1,), ridge), torch.full((V,), lam)])).double()
    theta = torch.linalg.solve(full.T @ full + penalty, full.T @ y)
    torch.testing.assert_close(beta, theta[: 2 * D + 1])
    torch.testing.assert_close(offsets.double(), theta[2 * D + 1 :], rtol=1e-5, atol=1e-6)
    assert offsets[-2:].abs().max() == 0
