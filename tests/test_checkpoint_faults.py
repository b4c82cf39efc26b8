"""Atomic directory replacement, and a tiny training run killed (SPECULATORS_FAULT_AT, exit 137 as
kill -9 gives) at every step of its checkpoint writes, then resumed: the same weights and history as
a run never interrupted, and nothing left behind by the interrupted writes."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from speculators.models.base import atomic_write_dir, recover_writes
from test_train import DISTILL, REPO, overrides, train_in_process, weights

LEFTOVER = re.compile(r"\..+\.(tmp|old)-\d+")


def leftovers(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if LEFTOVER.fullmatch(p.name))


def tree(root):
    """{relative path: file bytes, or None for a directory} of everything under root."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def files(root):
    """{relative path: text} of the files under root."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def make_tree(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


OLD = {"a.txt": "old", "sub/b.txt": "old b", "sub/deeper/c.txt": "old c"}
NEW = {"x.txt": "new", "sub/y.txt": "new y", "other/deeper/z.txt": "new z"}


def test_replaces_a_directory_with_subdirectories(tmp_path):
    out = tmp_path / "out"
    make_tree(out, OLD)
    atomic_write_dir(out, lambda tmp: make_tree(tmp, NEW))
    assert files(out) == NEW
    assert os.listdir(tmp_path) == ["out"]


def test_failing_write_keeps_the_old_directory(tmp_path):
    out = tmp_path / "out"
    make_tree(out, OLD)
    before = tree(tmp_path)

    def write(tmp):
        make_tree(tmp, NEW)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write_dir(out, write)
    assert tree(tmp_path) == before


def test_leftovers_are_resolved_and_nothing_else_touched(tmp_path):
    out = tmp_path / "out"
    make_tree(out, OLD)
    make_tree(tmp_path / ".out.tmp-11", NEW)  # a killed write's copy
    make_tree(tmp_path / ".out.old-12", OLD)  # a version already replaced
    others = {".other.tmp-13/keep.txt": "another name's", ".out.tmp-x/keep.txt": "not a leftover's name",
              "notes.txt": "the user's"}
    make_tree(tmp_path, others)
    atomic_write_dir(out, lambda tmp: make_tree(tmp, NEW))
    assert sorted(os.listdir(tmp_path)) == sorted([".other.tmp-13", ".out.tmp-x", "notes.txt", "out"])
    assert all((tmp_path / rel).read_text() == text for rel, text in others.items())
    # killed between the two renames: the replaced version is the only complete one, and comes back
    (tmp_path / "out").rename(tmp_path / ".out.old-14")
    recover_writes(tmp_path)
    assert files(out) == NEW
    assert leftovers(tmp_path) == []  # recover_writes(parent), with no name, resolves every name's


# Replaces <root>/<stage>/out once per stage, each time in a fork killed at that stage (the forks
# spare a process start and its imports per stage).
KILLED_WRITES = """
import os, sys
from pathlib import Path
from speculators.models.base import atomic_write_dir

def write(tmp):
    (tmp / "sub").mkdir()
    (tmp / "sub" / "new.txt").write_text("new")

for stage in sys.argv[2:]:
    if os.fork() == 0:
        os.environ["SPECULATORS_FAULT_AT"] = stage + ":out"
        atomic_write_dir(Path(sys.argv[1]) / stage / "out", write)
        os._exit(0)
    print(os.waitstatus_to_exitcode(os.wait()[1]))
"""


def test_killed_at_each_stage_of_a_replacement(tmp_path):
    """Whatever the stage a replacement is killed at, the next start finds the old version or the new
    one, whole, and no leftover."""
    stages = {"dir_written": "old", "old_moved": "old", "dir_renamed": "new"}
    for stage in stages:
        make_tree(tmp_path / stage / "out", OLD)
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITES, str(tmp_path), *stages], capture_output=True,
                          text=True)
    assert proc.stdout.split() == ["137"] * len(stages), proc.stderr[-3000:]
    for stage, version in stages.items():
        assert leftovers(tmp_path / stage), stage  # the kill left the write unfinished
        recover_writes(tmp_path / stage)
        assert files(tmp_path / stage / "out") == (OLD if version == "old" else {"sub/new.txt": "new"}), stage
        assert leftovers(tmp_path / stage) == [], stage


# Each case: the stages a run is killed at, one run per stage, each resuming the last (a stage is
# "<point>:<name>", see speculators.models.base.fault_point). The run has 2 steps and saves every step.
KILLS = {
    "history appended": ["history_appended:step-0000002"],
    "checkpoint written, not renamed": ["dir_written:step-0000002"],
    "checkpoint renamed, latest stale": ["dir_renamed:step-0000002"],
    "latest's new copy written, not renamed": ["file_written:latest"],  # at step 1: no latest yet
    "latest updated": ["latest_updated:step-0000002"],
    "final written, not renamed": ["dir_written:final"],
    "final replaced between its renames": ["dir_renamed:final", "old_moved:final"],
}
LEAVE_LEFTOVERS = {"checkpoint written, not renamed", "latest's new copy written, not renamed",
                   "final written, not renamed", "final replaced between its renames"}

# Runs train/distill.py once per job (log file, SPECULATORS_FAULT_AT, arguments), each in a fork of
# this process, which has done the imports (most of a tiny run's time) and nothing else: every run
# is still a process of its own, ended by the fault hook as kill -9 would end it.
FORKING_LAUNCHER = """
import json, os, runpy, sys, traceback
import speculators.trainer
import transformers.models.llama.modeling_llama  # transformers imports its models lazily

def run(log, stage, args):
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.environ["SPECULATORS_FAULT_AT"] = stage
    sys.argv = args
    code = 1
    try:
        runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

print(json.dumps([run(*job) for job in json.loads(sys.argv[1])]))
"""


def _history(run_dir):
    """(step, loss) of every history line: what the run learned, without its timings."""
    return [(h["step"], h["loss"]) for h in map(json.loads, (run_dir / "history.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def runs(module_dir, tiny_target_dir, chat_file):
    """An uninterrupted run's weights and history, and for each case a run directory killed at its
    stages."""
    from speculators import assets

    cache = module_dir / "cache"  # as the isolated_cache fixture, for the whole module
    cache.mkdir()
    for name in ("models", "assets", "wheels"):
        (cache / name).symlink_to(assets.cache_dir() / name)
    root = module_dir / "runs"
    root.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECULATORS_CACHE", str(cache))

        def args(out):
            return overrides(tiny_target_dir, chat_file, out, steps=2, save_every=1, batch_size=2, seq_len=64)

        train_in_process(args(root / "full"))  # also tokenizes the data set once, for every run below
        runs = {case: root / re.sub(r"\W+", "-", case) for case in KILLS}
        jobs = [(str(runs[case].with_suffix(".log")), stage,
                 [str(DISTILL), *args(runs[case])] + ["--resume"] * (i > 0))
                for case, stages in KILLS.items() for i, stage in enumerate(stages)]
        proc = subprocess.run([sys.executable, "-c", FORKING_LAUNCHER, json.dumps(jobs)], capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for (log, stage, _), code in zip(jobs, json.loads(proc.stdout.splitlines()[-1])):
            with open(log) as f:
                assert code == 137, (stage, f.read()[-3000:])  # the run reached the stage and ended there
        yield weights(root / "full"), _history(root / "full"), runs, args


@pytest.mark.parametrize("case", KILLS)
def test_resume_after_a_kill(runs, case):
    """--resume after the kill trains the weights and history of the run never killed, bit for bit,
    and finishes the interrupted writes."""
    full_weights, full_history, killed, args = runs
    out = killed[case]
    from speculators.config import load_config
    from speculators.trainer import Trainer

    assert bool(leftovers(out)) == (case in LEAVE_LEFTOVERS), leftovers(out)
    Trainer(load_config(None, args(out)), resume=True).train()
    got = weights(out)
    assert set(got) == set(full_weights)
    for name in got:
        assert torch.equal(got[name], full_weights[name]), name
    assert _history(out) == full_history  # each step once, with the same loss
    assert (out / "checkpoints" / "latest").read_text() == "step-0000002"
    assert leftovers(out) == []
