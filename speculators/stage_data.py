"""What every optimizer step trains on, stage by stage (`data:` of a stage):

- dataset: the data set's rows, with the target's hidden states under cache_hidden;
- target: the target's continuations of the stage's prompts (SeqKD), generated once per stage and
  kept beside the checkpoints, so --resume reuses them;
- draft: the draft's own continuations, generated afresh every step (on-policy); `onpolicy_fraction`
  mixes such steps into the other stages (GKD).

Generation goes through generation.py (transformers or vLLM, the same rows either way). Every choice
is seeded from the recipe's seed and the step, so a resumed run draws the same rows.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from datasets import Dataset, load_from_disk
from tqdm.auto import tqdm

from .config import ConfigError, Stage, TrainConfig
from .data import chat_ids, collate, prompts_from
from .generation import VLLMGenerator, generate_rows, stop_ids, uses_vllm
from .models.base import atomic_write_dir
from .precision import DTYPES, resolve_precision
from .target import Target, resolve_model_path


def stage_at(stages: list[Stage], step: int) -> tuple[int, Stage, int]:
    """(index, stage, step within it) of a run's optimizer step."""
    start = 0
    for idx, stage in enumerate(stages):
        if step < start + stage.steps:
            return idx, stage, step - start
        start += stage.steps
    raise IndexError(step)


class StageData:
    """This process's rows for each optimizer step of a run in `out`."""

    def __init__(self, cfg: TrainConfig, acc: Accelerator, target: Target, dataset: Dataset, out: Path):
        self.cfg, self.acc, self.target, self.dataset, self.out = cfg, acc, target, dataset, out
        self.tokenizer = target.tokenizer
        # dataset stages read these rows: the data set's, with the target's hidden states when cache_hidden
        self.rows = (cache_target_hidden(target, dataset, cfg.micro_batch_size, acc.device, acc.is_main_process)
                     if cfg.cache_hidden else dataset)
        if cfg.cache_hidden and all(s.data == "dataset" and not s.onpolicy_fraction for s in cfg.stages):
            target.release_layers()  # nothing runs the target again: its memory goes to the training state
        self._data_idx, self._data = -1, None  # the current stage's index and rows
        self._prompts_idx, self._prompts = None, None  # the on-policy stage's index and prompts
        self._vllm = None  # the on-policy draft's vLLM engine, started at its first use

    def step_rows(self, model, step: int) -> tuple[list[dict], bool]:
        """This process's rows for optimizer step `step` of the proposer `model`, and whether they are
        the draft's own samples."""
        idx, stage, in_stage = stage_at(self.cfg.stages, step)
        if idx != self._data_idx:
            self._data_idx, self._data = idx, self._stage_data(stage)
        if takes_onpolicy_batch(self.cfg, stage, step):
            return self.onpolicy_rows(model, step), True
        return self._draw(self._data, stage, in_stage, per_process=stage.data == "target"), False

    def _stage_data(self, stage: Stage) -> Dataset | None:
        if stage.data == "dataset":
            return self.rows
        if stage.data == "draft":
            return None  # generated step by step
        # Generated once per process and kept beside the checkpoints, so --resume reuses it.
        path = self.out / "generated" / f"{stage.name}-rank{self.acc.process_index}"
        if path.exists():
            return load_from_disk(str(path))
        ds = target_generated_dataset(self.target, self.dataset, stage, self.cfg, self.acc)
        atomic_write_dir(path, lambda tmp: ds.save_to_disk(str(tmp)))
        return ds

    def onpolicy_rows(self, model, step: int) -> list[dict]:
        """This process's share of one step's on-policy rows: the stage's prompts in a seeded order, each
        continued by the draft `model` as it is now (sampled at gen_temperature); the target scores them
        in the loss of this same step."""
        idx, stage, in_stage = stage_at(self.cfg.stages, step)
        if self._prompts_idx != idx:
            self._prompts_idx = idx
            self._prompts = [{"input_ids": p} for p in stage_prompts(self.tokenizer, self.dataset, stage, self.cfg)]
            if not self._prompts:
                raise ConfigError(f"stage {stage.name}: no prompt of at most prompt_tokens={stage.prompt_tokens} tokens")
        prompts = [r["input_ids"] for r in self._draw(self._prompts, stage, in_stage, per_process=False)]
        draft = model.lm
        if not uses_vllm(stage):
            return generate_rows(draft, self.tokenizer, prompts, stage,
                                 onpolicy_seed(self.cfg, step, self.acc.process_index))
        # vLLM: the main process generates every process's prompts in one engine, started once from the
        # undistilled draft's directory and given the draft's current weights before every step.
        everyone = gather_object([prompts])
        shares = None
        if self.acc.is_main_process:
            if self._vllm is None:
                longest = max(len(r["input_ids"]) for r in self._prompts)
                self._vllm = VLLMGenerator(str(self.out / "initial"), stop_ids(draft, self.tokenizer),
                                           DTYPES[resolve_precision(self.cfg.mixed_precision)],
                                           longest + stage.gen_tokens, self.cfg.vllm_kv_cache_gib, self.cfg.seed)
            self._vllm.sync([(name, t.detach()) for name, t in draft.state_dict().items()])
            shares = [self._vllm.generate(p, stage, onpolicy_seed(self.cfg, step, r)) for r, p in enumerate(everyone)]
        return broadcast_object_list([shares])[0][self.acc.process_index]

    def _draw(self, data: Dataset, stage: Stage, step_in_stage: int, per_process: bool) -> list[dict]:
        """This process's rows of `data` for one optimizer step: a seeded permutation per epoch, the
        global batch split by rank (dataset stages) or drawn from this process's own generated set."""
        cfg, world, rank = self.cfg, self.acc.num_processes, self.acc.process_index
        bsz = cfg.batch_size // world if per_process else cfg.batch_size
        epoch, offset = divmod(step_in_stage * bsz, len(data))
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        idx = (perm + perm)[offset : offset + bsz]
        if not per_process:
            idx = idx[rank::world]
        return [data[i] for i in idx]

    def close(self) -> None:
        if self._vllm is not None:
            self._vllm.close()


@torch.no_grad()
def cache_target_hidden(target: Target, dataset: Dataset, micro: int, device, show: bool) -> list[dict]:
    """cache_hidden: every row of the data set with "hidden", the target's post-norm hidden states
    [tokens, D] on the CPU. Rows are run in data-set order in fixed groups of `micro`, the same on
    every process and after a resume, so the values never depend on how a run was split or restarted."""
    rows = [dataset[i] for i in range(len(dataset))]
    for start in tqdm(range(0, len(rows), micro), desc="cache: target hidden states", disable=not show, unit="batch"):
        group = rows[start : start + micro]
        batch = collate(group, target.tokenizer.pad_token_id)
        hidden = target(batch["input_ids"].to(device), batch["attention_mask"].to(device), logits=False).hidden.cpu()
        for row, h in zip(group, hidden):
            row["hidden"] = h[: len(row["input_ids"])].clone()
    return rows


def stage_prompts(tokenizer, source: Dataset, stage: Stage, cfg: TrainConfig) -> list[list[int]]:
    """A generating stage's prompts: the data set's first user turns, chat-templated (the model
    answers), or prefixes of data-set rows (IBM stage 2)."""
    if stage.prompts == "chat":
        chats = (chat_ids(tokenizer, m) for m in prompts_from(cfg.data, None, cfg.seed))
        return list(itertools.islice((ids for ids in chats if len(ids) <= stage.prompt_tokens), stage.num_prompts))
    g = torch.Generator().manual_seed(cfg.seed)
    picks = torch.randperm(len(source), generator=g)[: stage.num_prompts].tolist()
    return [source[i]["input_ids"][: stage.prompt_tokens] for i in picks]


def target_generated_dataset(target: Target, source: Dataset, stage: Stage, cfg: TrainConfig, acc: Accelerator) -> Dataset:
    """This process's share of the target's continuations of the stage's prompts (SeqKD). With vLLM
    the main process generates every share in one engine and hands them out; otherwise each process
    generates its own with the built-in generator."""
    rank, world = acc.process_index, acc.num_processes
    prompts = stage_prompts(target.tokenizer, source, stage, cfg)
    if uses_vllm(stage):
        path, _ = resolve_model_path(cfg.target)  # a directory: Trainer refuses a GGUF target for vLLM
        shares = None
        if acc.is_main_process:
            print(f"[{stage.name}] the target generates {len(prompts)} continuations with vLLM", flush=True)
            gen = VLLMGenerator(path, stop_ids(target.model, target.tokenizer),
                                DTYPES[resolve_precision(cfg.target_dtype)],
                                max(map(len, prompts), default=1) + stage.gen_tokens, cfg.vllm_kv_cache_gib, cfg.seed)
            shares = [gen.generate(prompts[r::world], stage, cfg.seed + 1000 * r) for r in range(world)]
            gen.close()
        return Dataset.from_list(broadcast_object_list([shares])[0][rank])
    mine = prompts[rank::world]
    bar = tqdm(total=len(mine), desc=f"[{stage.name}] target generates", disable=rank != 0, unit="prompt")
    rows = generate_rows(target.model, target.tokenizer, mine, stage, cfg.seed + 1000 * rank, bar)
    bar.close()
    return Dataset.from_list(rows)


def onpolicy_seed(cfg: TrainConfig, step: int, rank: int) -> int:
    """Seed of the draft's samples at one optimizer step on one process (resume regenerates them exactly)."""
    return (cfg.seed * 1_000_003 + step) * 1_000_003 + rank * 65_536


def takes_onpolicy_batch(cfg: TrainConfig, stage: Stage, step: int) -> bool:
    """GKD's mixture: on-policy with probability lambda, one seeded draw per optimizer step, the same on
    every process (a 'draft' stage is on-policy always)."""
    if stage.data == "draft":
        return True
    if not stage.onpolicy_fraction:
        return False
    coin = torch.rand(1, generator=torch.Generator().manual_seed(cfg.seed * 7919 + step)).item()
    return coin < stage.onpolicy_fraction
