"""A training run's directory: its checkpoints, history.jsonl, and what --resume reads back.

A checkpoint holds the model (vLLM layout), the optimizer state and the RNG, all safetensors, written
to a temporary directory and renamed into place (atomic_write_dir); `latest` is replaced atomically
last. A step directory exists only once complete, so --resume reads the newest one: `latest` lags it
in a run killed between the two. The fault_points name the moments between writes where
tests/test_checkpoint_faults.py kills a run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from .config import ConfigError
from .models.base import atomic_write_dir, atomic_write_file, fault_point, read_safetensors, recover_writes


class RunDirectory:
    """output_dir, as every process of a run sees it; only the main process writes."""

    def __init__(self, out: Path, acc: Accelerator):
        self.out, self.acc = out, acc
        self.checkpoints = out / "checkpoints"

    def check(self, resume: bool) -> None:
        """A fresh run needs an empty (or new) output_dir; --resume needs a checkpoint in it, and first
        finishes what a killed run's atomic writes left behind (recover_writes)."""
        if resume:
            if self.acc.is_main_process:
                for parent in (self.out, self.checkpoints, self.out / "generated"):
                    recover_writes(parent)
            self.acc.wait_for_everyone()
            if self.newest_checkpoint() is None:
                raise ConfigError(f"--resume: no checkpoint in {self.checkpoints}; start without --resume"
                                  + (" in an empty output_dir" if self.out.exists() else ""))
        elif self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"output_dir {self.out} is not empty; pass --resume to continue it or choose another")
        self.acc.wait_for_everyone()

    def append_history(self, step: int, metrics: dict) -> None:
        if self.acc.is_main_process:
            with open(self.out / "history.jsonl", "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
            fault_point(f"history_appended:step-{step:07d}")

    def save(self, step: int, model, optim: torch.optim.Optimizer) -> None:
        acc = self.acc
        acc.wait_for_everyone()
        if acc.is_main_process:
            path = self.checkpoints / f"step-{step:07d}"

            def write(tmp: Path):
                model.save_pretrained(tmp / "model")
                tensors, meta = _flatten_optimizer(optim.state_dict())
                tensors["rng.torch"] = torch.get_rng_state()
                save_file(tensors, str(tmp / "optimizer.safetensors"))
                (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "optimizer": meta}))

            atomic_write_dir(path, write)
            atomic_write_file(self.checkpoints / "latest", path.name)
            fault_point(f"latest_updated:{path.name}")
        acc.wait_for_everyone()

    def newest_checkpoint(self) -> Path | None:
        steps = [p for p in self.checkpoints.glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
        return max(steps, key=lambda p: int(p.name[5:]), default=None)

    def load(self, model, optim: torch.optim.Optimizer) -> int:
        """The newest checkpoint into `model`, `optim` and torch's RNG; its step. `latest` and the
        history are brought in line with it."""
        path = self.newest_checkpoint()
        model.load_weights(read_safetensors(path / "model" / "model.safetensors"))
        state = json.loads((path / "trainer_state.json").read_text())
        tensors = load_file(str(path / "optimizer.safetensors"))
        torch.set_rng_state(tensors.pop("rng.torch"))
        optim.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
        step = state["step"]
        if self.acc.is_main_process:
            latest = self.checkpoints / "latest"
            if not latest.exists() or latest.read_text().strip() != path.name:
                atomic_write_file(latest, path.name)
            self._truncate_history(step)
        return step

    def _truncate_history(self, step: int) -> None:
        """history.jsonl up to the resumed step: a step's line is written before its checkpoint, so a
        run killed between the two has a line for a step it trains again. A line the kill cut short is
        dropped too."""
        path = self.out / "history.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        atomic_write_file(path, "".join(kept))


def _flatten_optimizer(sd: dict) -> tuple[dict, dict]:
    """An optimizer state dict as (tensors for safetensors, JSON-able rest)."""
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, st in sd["state"].items():
        meta["state"][str(pid)] = {}
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state.{pid}.{key}"] = val.contiguous()
                meta["state"][str(pid)][key] = "tensor"
            else:
                meta["state"][str(pid)][key] = val
    return tensors, meta


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {}
    for pid, st in meta["state"].items():
        state[int(pid)] = {k: tensors[f"state.{pid}.{k}"] if v == "tensor" else v for k, v in st.items()}
    return {"state": state, "param_groups": meta["param_groups"]}
