"""Distill an MLP speculator, Medusa heads or a draft model from a frozen target, with Accelerate.

The target runs online: each micro-batch goes through it once, giving the post-final-norm hidden
states the heads read and (through its lm head) the teacher distribution; the loss is
distill_loss.distillation_loss. A run is a list of stages, each reading its own rows (stage_data.py);
output_dir holds the checkpoints and history that --resume continues from (checkpoint.py).

Data parallelism is exact: every optimizer step takes the same `batch_size` sequences however many
processes share them, and the loss is normalised by the global count of loss tokens, so N processes
reproduce one process.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator, DistributedType
from accelerate.utils import set_seed
from datasets import Dataset
from tqdm.auto import tqdm

from .checkpoint import RunDirectory
from .config import ConfigError, Stage, TrainConfig
from .data import build_dataset, check_source, collate
from .distill_loss import distillation_loss, label_shifts, loss_tokens
from .draft import build_draft
from .generation import uses_vllm
from .lstsq_init import regression_init
from .models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig
from .optim import AdamW8bit
from .precision import DTYPES, resolve_precision
from .stage_data import StageData, stage_at
from .target import Target, resolve_model_path


def build_speculator(cfg: TrainConfig, target: Target):
    info = {"name": target.name, "architecture": target.architecture, "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size}
    if cfg.draft_vocab > target.vocab_size:
        raise ConfigError(f"draft_vocab={cfg.draft_vocab} exceeds the target's vocabulary ({target.vocab_size}); "
                          f"lower it, or set 0 for the whole vocabulary")
    if cfg.kind == "mlp_speculator":
        inner = cfg.inner_dim
        if cfg.init == "regression":
            if inner not in (0, 2 * target.hidden_size):
                raise ConfigError(f"init: regression needs inner_dim = 2 x the target's hidden size "
                                  f"({2 * target.hidden_size}) or 0; got {inner}")
            inner = 2 * target.hidden_size
        model = MLPSpeculator(MLPSpeculatorConfig(
            vocab_size=target.vocab_size, emb_dim=target.hidden_size, inner_dim=inner,
            n_predict=cfg.n_predict, tie_weights=cfg.tie_weights, scale_input=cfg.scale_input,
            speculators_target=info))
    else:
        model = Medusa(MedusaConfig(
            hidden_size=target.hidden_size, vocab_size=target.vocab_size, num_heads=cfg.n_predict,
            num_hidden_layers=cfg.medusa_layers, original_lm_head=cfg.medusa_shared_lm_head,
            speculators_target=info))
    if cfg.init == "target" or cfg.medusa_shared_lm_head:
        embed = target.model.get_input_embeddings().weight.float()
        model.init_from_target(embed, target.lm_head.weight.float())
    return model


def frequent_tokens(dataset: Dataset, n: int, vocab_size: int) -> torch.Tensor:
    """Ascending ids of the n tokens most frequent among the data set's loss tokens (ties: lower id),
    the draft vocabulary of `draft_vocab`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in dataset:
        ids = torch.tensor(row["input_ids"])
        counts += torch.bincount(ids[torch.tensor(row["loss_mask"], dtype=torch.bool)], minlength=vocab_size)
    return counts.sort(descending=True, stable=True).indices[:n].sort().values


def lr_at(step_in_stage: int, stage: Stage, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% — within each stage, scaled by the stage's lr_scale."""
    base = cfg.lr * stage.lr_scale
    warm = min(cfg.warmup_steps, max(stage.steps // 10, 1))
    if step_in_stage < warm:
        return base * (step_in_stage + 1) / warm
    progress = (step_in_stage - warm) / max(stage.steps - warm, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class Trainer:
    """One run of a recipe: `Trainer(cfg, resume).train()` returns the final proposer's directory."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg, self.resume = cfg, resume
        self.out = Path(cfg.output_dir)
        self.acc = self._accelerator()
        self._check_setup()
        self.run_dir = RunDirectory(self.out, self.acc)
        self.run_dir.check(resume)
        set_seed(cfg.seed)
        self.target = self._load_target()
        self.tokenizer = self.target.tokenizer
        self.dataset = self._load_dataset()
        model = build_draft(cfg, self.target) if cfg.kind == "draft_model" else build_speculator(cfg, self.target)
        self.data = StageData(cfg, self.acc, self.target, self.dataset, self.out)  # caches hidden states here
        self._create_output_dir(model)
        self.shifts = label_shifts(model, cfg)
        self._init_weights(model)
        self.model, self.optim = self.acc.prepare(model, self._optimizer(model))
        self.step = self.run_dir.load(self.unwrapped, self.optim) if resume else 0
        self.vocab_ids = self.unwrapped.draft_vocab() if cfg.draft_vocab else None

    def _accelerator(self) -> Accelerator:
        cfg = self.cfg
        autocast = "bf16" if resolve_precision(cfg.mixed_precision) == "bf16" else "no"
        return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=autocast,
                           log_with=None if cfg.report_to == "none" else cfg.report_to, project_dir=str(self.out))

    def _check_setup(self) -> None:
        """Refuses a launch, data source or stage generator that cannot work, before anything loads."""
        cfg = self.cfg
        if self.acc.distributed_type == DistributedType.FSDP:
            # Accelerate's FSDP would shard the small speculator, whose heads the loss reads outside its
            # wrapped forward, and leave the large frozen target whole: the wrong way round.
            raise ConfigError("an accelerate FSDP config shards the speculator, not the target; launch with "
                              "--multi_gpu and shard_target: true to shard the target with FSDP")
        if cfg.shard_target and self.acc.num_processes < 2:
            raise ConfigError("shard_target: true needs several processes (accelerate launch --multi_gpu "
                              "--num_processes N)")
        _, target_gguf = resolve_model_path(cfg.target)
        check_source(cfg.data)
        for stage in cfg.stages:  # a stage that generates with vLLM must be able to, found now and not hours in
            generates = stage.data != "dataset" or stage.onpolicy_fraction
            with_vllm = generates and uses_vllm(stage)  # raises here where vLLM is asked for and missing
            if stage.data == "target" and with_vllm and target_gguf:
                raise ConfigError(f"stage {stage.name}: vLLM generation reads the target's model directory, not "
                                  f"the GGUF file {cfg.target}; use generator: builtin")
            if stage.data == "target" and cfg.shard_target and not with_vllm:
                # each process would generate its own share: different numbers of sharded forwards
                raise ConfigError(f"stage {stage.name}: with shard_target the target's continuations need "
                                  f"generator: vllm (the built-in generator would put the processes out of step)")

    def _load_target(self) -> Target:
        cfg, acc = self.cfg, self.acc
        target_dtype = DTYPES[resolve_precision(cfg.target_dtype)]
        if not cfg.shard_target:
            return Target.load(cfg.target, target_dtype).to(acc.device)
        target = Target.load_sharded(cfg.target, target_dtype, acc.device, acc.num_processes)
        if acc.is_main_process:
            print("shard_target: each process holds {:,} of the target's {:,} decoder-layer parameters"
                  .format(*target.layer_parameters()), flush=True)
        return target

    def _load_dataset(self) -> Dataset:
        """The tokenized data set, built by the main process first so that the others read its cache."""
        cfg = self.cfg
        dataset = build_dataset(cfg.data, self.tokenizer, cfg.seq_len, cfg.max_samples, cfg.seed) \
            if self.acc.is_main_process else None
        self.acc.wait_for_everyone()
        if dataset is None:
            dataset = build_dataset(cfg.data, self.tokenizer, cfg.seq_len, cfg.max_samples, cfg.seed)
        return dataset

    def _create_output_dir(self, model) -> None:
        if self.acc.is_main_process:  # only now: bad input above (a draft's vocabulary too) leaves no directory behind
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
            if self.cfg.kind == "draft_model" and not self.resume:
                model.save_pretrained(self.out / "initial")  # the undistilled draft, eval's baseline

    def _init_weights(self, model) -> None:
        """init: regression and draft_vocab, which a resumed run takes from its checkpoint instead."""
        cfg = self.cfg
        if cfg.kind == "mlp_speculator" and cfg.init == "regression":
            model.head_weight.requires_grad_(False)
            if not self.resume:
                regression_init(model, self.target, self.data.rows, cfg, self.acc)
        if cfg.draft_vocab and not self.resume:
            model.keep_vocab_(frequent_tokens(self.dataset, cfg.draft_vocab, self.target.vocab_size))

    def _optimizer(self, model) -> torch.optim.Optimizer:
        cfg = self.cfg
        params = [p for p in model.parameters() if p.requires_grad]
        return (AdamW8bit if cfg.optimizer == "adamw8bit" else torch.optim.AdamW)(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    @property
    def unwrapped(self):
        return self.acc.unwrap_model(self.model)

    def train(self) -> Path:
        cfg, acc = self.cfg, self.acc
        if cfg.report_to != "none":
            if cfg.report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")
            acc.init_trackers("speculators", config=cfg.to_dict())
        bar = tqdm(total=cfg.total_steps, initial=self.step, disable=not acc.is_main_process, unit="step",
                   desc="distill")
        tokens_seen, t0 = 0, time.perf_counter()
        # steps on the draft's own samples since this process started; the draw per step is seeded
        # (stage_data.takes_onpolicy_batch)
        onpolicy_steps = 0
        while self.step < cfg.total_steps:
            idx, stage, in_stage = stage_at(cfg.stages, self.step)
            rows, onpolicy = self.data.step_rows(self.unwrapped, self.step)
            onpolicy_steps += onpolicy
            lr = lr_at(in_stage, stage, cfg)
            loss_global, grad_norm, tokens = self._optimizer_step(rows, lr)
            tokens_seen += tokens
            self.step += 1
            rate = tokens_seen / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss_global:.3f}", tok_s=f"{rate:.0f}", lr=f"{lr:.1e}", stage=stage.name)
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == cfg.total_steps:
                metrics = {"loss": loss_global, "lr": lr, "tokens_per_s": rate, "stage": idx,
                           "onpolicy": onpolicy, "onpolicy_steps": onpolicy_steps,
                           "peak_mem_gib": peak_memory_gib(acc.device)}
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                acc.log(metrics, step=self.step)
                self.run_dir.append_history(self.step, metrics)
            if self.step % cfg.save_every == 0 or self.step == cfg.total_steps:
                self.run_dir.save(self.step, self.unwrapped, self.optim)
        bar.close()
        self.data.close()
        final = self.out / "final"
        if acc.is_main_process:
            self.unwrapped.save_pretrained(final)
        acc.wait_for_everyone()
        acc.end_training()
        return final

    def _optimizer_step(self, rows: list[dict], lr: float) -> tuple[float, torch.Tensor | None, int]:
        """One optimizer step on this process's rows, in micro-batches: (the loss summed over processes,
        the gradient norm before clipping, the tokens all processes read)."""
        cfg, acc, micro = self.cfg, self.acc, self.cfg.micro_batch_size
        batches = [collate(rows[i : i + micro], self.tokenizer.pad_token_id) for i in range(0, len(rows), micro)]
        # global loss-token count, so every process divides by the same number
        local = sum(loss_tokens(b, self.shifts) for b in batches)
        total = acc.reduce(torch.tensor(float(local), device=acc.device), reduction="sum").item()
        for group in self.optim.param_groups:
            group["lr"] = lr
        loss_sum, tokens = 0.0, 0
        for j, batch in enumerate(batches):
            batch = {k: v.to(acc.device) for k, v in batch.items()}
            sync = j == len(batches) - 1
            ctx = acc.no_sync(self.model) if not sync else contextlib.nullcontext()
            with ctx, acc.autocast():
                # DDP averages gradients over processes; scaling by world size turns that into a sum.
                loss, _ = distillation_loss(self.model, self.target, batch, cfg, max(total, 1.0) / acc.num_processes,
                                            self.vocab_ids)
                acc.backward(loss)
            loss_sum += loss.item() / acc.num_processes
            tokens += int(batch["attention_mask"].sum()) * acc.num_processes
        grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        loss_global = acc.reduce(torch.tensor(loss_sum, device=acc.device), reduction="sum").item()
        return loss_global, grad_norm, tokens


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: allocated CUDA memory on a GPU, resident set size on a CPU
    (what decides whether a run fits the machine, so the recipes' memory figures are read from it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
