"""`speculators train RECIPE`: the shipped recipes by name, checked before anything launches, then a
real run under accelerate launch."""

import json
import subprocess
import sys

from test_train import REPO, overrides, weights

RECIPES = sorted(p.stem for p in (REPO / "train" / "configs").glob("*.yaml"))


def train(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "speculators.cli", "train", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def test_help_lists_the_shipped_recipes():
    proc = train("--help")
    assert proc.returncode == 0 and len(RECIPES) >= 6
    for name in RECIPES:
        assert name in proc.stdout, name


def test_a_recipe_name_is_the_shipped_file(tmp_path):
    from speculators.cli import _recipe_path

    for name in ("mlp_quick", "mlp_quick.yaml"):
        assert _recipe_path(name).resolve() == REPO / "train" / "configs" / "mlp_quick.yaml"
    mine = tmp_path / "mine.yaml"
    mine.write_text("kind: medusa\n")
    assert _recipe_path(str(mine)) == mine


def test_bad_input_is_one_line_and_exit_2_before_any_launch(tmp_path):
    out = tmp_path / "run"
    for args, needle in ((["mlp_quick", "--bogus_key=1"], "bogus_key"), (["no_such_recipe"], "no_such_recipe"),
                         (["mlp_quick", "--lr=-1"], "lr")):
        proc = train(*args, f"--output_dir={out}", cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("speculators train: error:") and needle in lines[0], lines
        assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_shipped_recipe_trains_through_accelerate_launch(tmp_path, tiny_target_dir, chat_file, isolated_cache):
    """mlp_quick with the tiny target and data, launched from an empty directory (no checkout needed):
    the overrides reach the run and it writes the final speculator."""
    out = tmp_path / "run"
    args = overrides(tiny_target_dir, chat_file, out, steps=2, init_samples=24, draft_vocab=0, save_every=2)
    (tmp_path / "cwd").mkdir()
    proc = train("mlp_quick", *args, cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"final speculator: {out / 'final'}" in proc.stdout
    assert json.loads((out / "final" / "config.json").read_text())["n_predict"] == 2  # the overrides reached it
    assert {"head.0.weight", "proj.1.weight"} <= set(weights(out))
    again = train("mlp_quick", *args, cwd=tmp_path / "cwd")  # a non-empty output_dir: refused before the launch
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"speculators train: error: output_dir {out} is not empty; pass --resume to continue it or choose another"]
