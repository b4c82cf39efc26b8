"""Distill an MLP speculator or Medusa heads from a frozen target, with Accelerate.

The target runs online: each micro-batch goes through it once, giving the
post-final-norm hidden states the heads read and (through its lm head) the
teacher distribution. Head i at position t predicts token t+i+2, so its teacher
is the target's prediction at position t+i+1. The loss is the fused multi-head
linear + divergence op: no [tokens, vocab] logits are ever held.

Data parallelism is exact: every optimizer step takes the same `batch_size`
sequences however many processes share them, and the loss is normalised by the
global count of loss tokens, so N processes reproduce one process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator, DistributedType
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from datasets import Dataset, load_from_disk
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .config import ConfigError, Stage, TrainConfig
from .data import build_dataset, chat_ids, check_source, collate, prompts_from
from .draft import build_draft
from .generation import VLLMGenerator, generate_rows, stop_ids, uses_vllm
from .kernels.fused_linear_divergence import fused_linear_divergence
from .models import Medusa, MedusaConfig, MLPSpeculator, MLPSpeculatorConfig
from .models.base import atomic_write_dir, atomic_write_file, fault_point, recover_writes
from .optim import AdamW8bit
from .target import Target, resolve_model_path

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_precision(name: str) -> str:
    """A recipe's dtype choice ('auto', 'bf16' or 'fp32') as 'bf16' or 'fp32' on this machine."""
    if name != "auto":
        return name
    fast_bf16 = torch.cuda.is_available() or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bf16" if fast_bf16 else "fp32"


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


@torch.no_grad()
def regression_init(model: MLPSpeculator, target: Target, dataset, cfg: TrainConfig, acc: Accelerator) -> None:
    """init: regression. Fit by least squares the linear map from (h_t, embedding of x_{t+1}) to
    h_{t+1} — the target's next post-norm hidden state, whose lm-head readout is its prediction of
    x_{t+2} — over the first `init_samples` rows, and start every stage as that predictor
    (MLPSpeculator.init_regression). On SmolLM2-135M this puts head 0 near 25% greedy acceptance
    before any gradient step, where a random start needs hundreds of KL steps to reach 15%; the KL
    stages then refine it. The normal equations are summed over processes, so every rank solves the
    same system and DDP stays exact.

    init_token_bias = λ > 0 adds a free offset per next token (a bigram correction the linear map from
    the embedding cannot express), ridge-shrunk by λ occurrences, solved jointly with the map in the
    same pass (solve_with_token_bias). On SmolLM2-135M it raised the start's head-0 acceptance from
    0.24 to 0.28."""
    D = target.hidden_size
    embed = target.model.get_input_embeddings().weight
    n = 2 * D + 1  # [h_t, embed(x_{t+1}), 1]
    xtx = torch.zeros(n, n, dtype=torch.float64, device=acc.device)
    xty = torch.zeros(n, D, dtype=torch.float64, device=acc.device)
    stats = torch.zeros(2, dtype=torch.float64, device=acc.device)  # sum of |h|^2 / D, positions
    if cfg.init_token_bias:  # per next token: sums of h_t and of h_{t+1}, and its count
        tok_h, tok_y = (torch.zeros(embed.shape[0], D, dtype=torch.float64, device=acc.device) for _ in range(2))
        tok_c = torch.zeros(embed.shape[0], dtype=torch.float64, device=acc.device)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    mine = order[: cfg.init_samples]
    if cfg.shard_target and not cfg.cache_hidden:  # the same number of sharded target forwards everywhere
        mine = mine[: len(mine) - len(mine) % acc.num_processes]
    mine = mine[acc.process_index :: acc.num_processes]
    micro = cfg.micro_batch_size
    for start in tqdm(range(0, len(mine), micro), desc="init: regression", disable=not acc.is_main_process,
                      unit="batch"):
        batch = collate([dataset[i] for i in mine[start : start + micro]], target.tokenizer.pad_token_id)
        ids, attn = batch["input_ids"].to(acc.device), batch["attention_mask"].to(acc.device)
        hidden = (batch["hidden"].to(acc.device) if "hidden" in batch else target(ids, attn, logits=False).hidden).double()
        keep = (attn[:, 1:] * batch["loss_mask"][:, 1:].to(acc.device)).bool()
        feats = torch.cat([hidden[:, :-1], embed[ids[:, 1:]].double(), torch.ones_like(hidden[:, :-1, :1])], -1)[keep]
        nxt = hidden[:, 1:][keep]
        xtx += feats.T @ feats
        xty += feats.T @ nxt
        if cfg.init_token_bias:
            x = ids[:, 1:][keep]
            tok_h.index_add_(0, x, feats[:, :D])
            tok_y.index_add_(0, x, nxt)
            tok_c.index_add_(0, x, torch.ones_like(x, dtype=torch.float64))
        stats += torch.stack([nxt.pow(2).sum() / D, torch.tensor(float(len(nxt)), dtype=torch.float64, device=acc.device)])
    xtx, xty, stats = (acc.reduce(t, reduction="sum") for t in (xtx, xty, stats))
    if stats[1] < n:
        raise ConfigError(f"init: regression read {int(stats[1])} positions, fewer than its {n} unknowns; "
                          f"raise init_samples")
    # A touch of ridge (relative to the mean feature power) keeps the solve stable.
    ridge = 1e-4 * xtx.diagonal().mean()
    if cfg.init_token_bias:
        tok_h, tok_y, tok_c = (acc.reduce(t, reduction="sum") for t in (tok_h, tok_y, tok_c))
        sol, offsets = solve_with_token_bias(xtx, xty, tok_h, tok_y, tok_c, embed.double(), cfg.init_token_bias, ridge)
    else:
        sol = torch.linalg.solve(xtx + ridge * torch.eye(n, dtype=xtx.dtype, device=xtx.device), xty)
        offsets = 0.0
    sol = sol.float()
    token_vectors = embed.float() @ sol[D : 2 * D] + sol[2 * D] + offsets
    model.init_regression(sol[:D].T.contiguous(), token_vectors, target.lm_head.weight.float(),
                          scale=float((stats[0] / stats[1]).sqrt()))


def solve_with_token_bias(xtx, xty, tok_h, tok_y, tok_c, embed, lam: float, ridge: float):
    """The ridge regression y ≈ [h, e(x), 1]·β + b[x] with a free offset b[x] per next token x (penalty
    λ|b[x]|², ridge on β), from sufficient statistics: (β, offsets [V, D] float).

    Per token x the offset's normal equation is (c_x + λ) b[x] = Y_x - S_x·β, with S_x = [H_x, c_x e(x),
    c_x] the sum of its positions' features (H_x: of h_t) and Y_x of their targets; eliminating the
    offsets (a Schur complement) leaves one (2D+1)-square system for β. Only tokens that occur enter."""
    seen = tok_c.nonzero().squeeze(1)
    c = tok_c[seen, None]
    S = torch.cat([tok_h[seen], c * embed[seen], c], 1)
    w = 1.0 / (c + lam)
    eye = torch.eye(len(xtx), dtype=xtx.dtype, device=xtx.device)
    beta = torch.linalg.solve(xtx - S.T @ (w * S) + ridge * eye, xty - S.T @ (w * tok_y[seen]))
    offsets = torch.zeros_like(tok_y)
    offsets[seen] = w * (tok_y[seen] - S @ beta)
    return beta, offsets.float()


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


def frequent_tokens(dataset: Dataset, n: int, vocab_size: int) -> torch.Tensor:
    """Ascending ids of the n tokens most frequent among the data set's loss tokens (ties: lower id),
    the draft vocabulary of `draft_vocab`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in dataset:
        ids = torch.tensor(row["input_ids"])
        counts += torch.bincount(ids[torch.tensor(row["loss_mask"], dtype=torch.bool)], minlength=vocab_size)
    return counts.sort(descending=True, stable=True).indices[:n].sort().values


def label_shifts(model, cfg: TrainConfig) -> list[int]:
    """Per head, how far ahead its label lies: a draft model predicts token t+1, like the target (its
    teacher is the target at the same position t); speculator head i predicts token t+i+2 (its
    teacher is the target at t+i+1, after the token the target itself samples at t)."""
    if cfg.kind == "draft_model":
        return [1]
    c = model.config
    return [i + 2 for i in range(c.n_predict if hasattr(c, "n_predict") else c.num_heads)]


def speculator_loss(model, target: Target, batch: dict, cfg: TrainConfig, normalizer: float,
                    vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(loss / normalizer, number of loss tokens) for one micro-batch, for every proposer kind;
    `vocab_ids`: the draft vocabulary the heads are restricted to (MLPSpeculator.draft_vocab)."""
    ids, attn, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    use_teacher = cfg.divergence != "ce"
    teacher_mode = cfg.teacher if cfg.teacher != "auto" else ("hidden" if ids.is_cuda else "logits")
    # a draft reads its own states, so on hard labels alone (no teacher) the target need not run at all
    needs_target = use_teacher or cfg.kind != "draft_model"
    hidden = (batch["hidden"] if "hidden" in batch else target(ids, attn, logits=False).hidden) if needs_target else None
    if cfg.kind == "draft_model":
        states = model(ids, attn)  # [1, B, T, D]: the draft's own final hidden states
    else:
        states = model(hidden.to(torch.float32), ids)  # [H, B, T, inner]
    unwrapped = getattr(model, "module", model)  # DDP wraps the model in .module
    shifts = label_shifts(unwrapped, cfg)
    head = unwrapped.head_weights()
    if cfg.kind == "mlp_speculator" and cfg.init == "regression":
        # The head stays [W, -W] with W the target's lm head (frozen), so logits = W·(s[:D] - s[D:]):
        # half the GEMM width, and no weight gradient.
        d = states.shape[-1] // 2
        states, head = states[..., :d] - states[..., d:], target.lm_head.weight
    if vocab_ids is not None:  # only the draft vocabulary's rows, the student's and the teacher's
        head = head.index_select(-2, vocab_ids)
    n_heads, (bsz, seq) = states.shape[0], ids.shape
    labels = []
    for shift in shifts:
        lab = torch.full_like(ids, -100)
        ok = (mask[:, shift:] * attn[:, shift:]).bool()
        lab[:, : seq - shift] = torch.where(ok, ids[:, shift:], -100)
        labels.append(lab)
    labels = torch.stack(labels).view(n_heads, bsz * seq)
    if vocab_ids is not None:
        labels = draft_vocab_labels(labels, vocab_ids, target.vocab_size, keep_others=cfg.divergence != "ce")
    # Only rows some head learns from go into the loss: padding and prompt tokens cost nothing.
    rows = (labels != -100).any(0).nonzero().squeeze(1)
    labels = labels[:, rows]
    student = states.reshape(n_heads, bsz * seq, -1)[:, rows].float()
    teacher = {}
    if use_teacher:
        # flat index of the teacher's position t+shift-1 in the same sequence; never read where the label is ignored
        ahead = torch.tensor(shifts, device=rows.device)[:, None] - 1
        src = (rows[None] + ahead).clamp(max=bsz * seq - 1)
        teacher_head = target.lm_head.weight if vocab_ids is None else target.lm_head.weight[vocab_ids]
        if teacher_mode == "logits":
            logits = (target.lm_head(hidden) if vocab_ids is None else F.linear(hidden, teacher_head)).float()
            teacher["teacher_logits"] = logits.view(bsz * seq, -1)[src]
        else:
            teacher["teacher_input"] = hidden.reshape(bsz * seq, -1)[src]
            teacher["teacher_weight"] = teacher_head
    with torch.autocast(student.device.type, enabled=False):  # the op accumulates in fp32 itself
        loss = fused_linear_divergence(
            student,
            head.float(),
            labels=labels,
            divergence=cfg.divergence,
            beta=cfg.beta,
            temperature=cfg.temperature,
            head_weights=[cfg.head_weight_decay**i for i in range(n_heads)],
            reduction="sum",
            **teacher,
        )
    return loss / normalizer, int((labels != -100).sum())


def draft_vocab_labels(labels: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int, keep_others: bool) -> torch.Tensor:
    """Labels as head-row indices of the draft vocabulary. A label outside it cannot be a CE target and
    is ignored; for the divergences, whose labels only mark the positions trained, it stays a position
    (row 0), where the student matches the teacher's distribution over the draft vocabulary."""
    lut = torch.full((vocab_size,), 0 if keep_others else -100, dtype=labels.dtype, device=labels.device)
    lut[vocab_ids] = torch.arange(len(vocab_ids), dtype=labels.dtype, device=labels.device)
    return torch.where(labels == -100, labels, lut[labels.clamp(min=0)])


def lr_at(step_in_stage: int, stage: Stage, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% — within each stage, scaled by the stage's lr_scale."""
    base = cfg.lr * stage.lr_scale
    warm = min(cfg.warmup_steps, max(stage.steps // 10, 1))
    if step_in_stage < warm:
        return base * (step_in_stage + 1) / warm
    progress = (step_in_stage - warm) / max(stage.steps - warm, 1)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


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


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg, self.resume = cfg, resume
        self.out = Path(cfg.output_dir)
        autocast = "bf16" if resolve_precision(cfg.mixed_precision) == "bf16" else "no"
        self.acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=autocast,
                               log_with=None if cfg.report_to == "none" else cfg.report_to,
                               project_dir=str(self.out))
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
        self._check_output_dir()
        set_seed(cfg.seed)
        target_dtype = DTYPES[resolve_precision(cfg.target_dtype)]
        if cfg.shard_target:
            self.target = Target.load_sharded(cfg.target, target_dtype, self.acc.device, self.acc.num_processes)
            if self.acc.is_main_process:
                print("shard_target: each process holds {:,} of the target's {:,} decoder-layer parameters"
                      .format(*self.target.layer_parameters()), flush=True)
        else:
            self.target = Target.load(cfg.target, target_dtype).to(self.acc.device)
        self.tokenizer = self.target.tokenizer
        self.dataset = build_dataset(cfg.data, self.tokenizer, cfg.seq_len, cfg.max_samples, cfg.seed) \
            if self.acc.is_main_process else None
        self.acc.wait_for_everyone()
        if self.dataset is None:
            self.dataset = build_dataset(cfg.data, self.tokenizer, cfg.seq_len, cfg.max_samples, cfg.seed)
        model = build_draft(cfg, self.target) if cfg.kind == "draft_model" else build_speculator(cfg, self.target)
        # dataset stages read these rows: the data set's, with the target's hidden states when cache_hidden
        self.rows = (cache_target_hidden(self.target, self.dataset, cfg.micro_batch_size, self.acc.device,
                                         self.acc.is_main_process) if cfg.cache_hidden else self.dataset)
        if self.acc.is_main_process:  # only now: bad input above (a draft's vocabulary too) leaves no directory behind
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            if cfg.kind == "draft_model" and not resume:
                model.save_pretrained(self.out / "initial")  # the undistilled draft, eval's baseline
        self.shifts = label_shifts(model, cfg)
        if cfg.kind == "mlp_speculator" and cfg.init == "regression":
            model.head_weight.requires_grad_(False)
            if not resume:  # a resumed run loads its checkpoint instead
                regression_init(model, self.target, self.rows, cfg, self.acc)
        if cfg.draft_vocab and not resume:
            model.keep_vocab_(frequent_tokens(self.dataset, cfg.draft_vocab, self.target.vocab_size))
        params = [p for p in model.parameters() if p.requires_grad]
        optim = (AdamW8bit if cfg.optimizer == "adamw8bit" else torch.optim.AdamW)(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        self.model, self.optim = self.acc.prepare(model, optim)
        self.step = 0
        self._vllm = None  # the on-policy draft's vLLM engine, started at its first use (generation.py)
        if resume:
            self._load_checkpoint()
        self.vocab_ids = self.unwrapped.draft_vocab() if cfg.draft_vocab else None

    def _check_output_dir(self):
        ckpts = self.out / "checkpoints"
        if self.resume:
            if self.acc.is_main_process:  # what a killed run's atomic writes left behind
                for parent in (self.out, ckpts, self.out / "generated"):
                    recover_writes(parent)
            self.acc.wait_for_everyone()
            if self._newest_checkpoint() is None:
                raise ConfigError(f"--resume: no checkpoint in {ckpts}; start without --resume"
                                  + (" in an empty output_dir" if self.out.exists() else ""))
        elif self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(f"output_dir {self.out} is not empty; pass --resume to continue it or choose another")
        self.acc.wait_for_everyone()

    @property
    def unwrapped(self):
        return self.acc.unwrap_model(self.model)

    def stage_at(self, step: int) -> tuple[int, Stage, int]:
        start = 0
        for idx, stage in enumerate(self.cfg.stages):
            if step < start + stage.steps:
                return idx, stage, step - start
            start += stage.steps
        raise IndexError(step)

    def stage_data(self, idx: int, stage: Stage) -> Dataset | None:
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

    def onpolicy_rows(self, idx: int, stage: Stage, step_in_stage: int) -> list[dict]:
        """This process's share of one step's on-policy rows: the stage's prompts in a seeded order, each
        continued by the draft as it is now (sampled at gen_temperature); the target scores them in the
        loss of this same step."""
        if getattr(self, "_prompts_idx", None) != idx:
            self._prompts_idx = idx
            self._prompts = [{"input_ids": p} for p in stage_prompts(self.tokenizer, self.dataset, stage, self.cfg)]
            if not self._prompts:
                raise ConfigError(f"stage {stage.name}: no prompt of at most prompt_tokens={stage.prompt_tokens} tokens")
        prompts = [r["input_ids"] for r in self.step_rows(self._prompts, stage, step_in_stage, per_process=False)]
        draft = self.unwrapped.lm
        if not uses_vllm(stage):
            return generate_rows(draft, self.tokenizer, prompts, stage,
                                 onpolicy_seed(self.cfg, self.step, self.acc.process_index))
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
            shares = [self._vllm.generate(p, stage, onpolicy_seed(self.cfg, self.step, r)) for r, p in enumerate(everyone)]
        return broadcast_object_list([shares])[0][self.acc.process_index]

    def step_rows(self, data: Dataset, stage: Stage, step_in_stage: int, per_process: bool) -> list[dict]:
        """This process's rows for one optimizer step: a seeded permutation per epoch, the global
        batch split by rank (dataset stages) or drawn from this process's own generated set."""
        cfg, world, rank = self.cfg, self.acc.num_processes, self.acc.process_index
        bsz = cfg.batch_size // world if per_process else cfg.batch_size
        epoch, offset = divmod(step_in_stage * bsz, len(data))
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        idx = (perm + perm)[offset : offset + bsz]
        if not per_process:
            idx = idx[rank::world]
        return [data[i] for i in idx]

    def train(self) -> Path:
        cfg, acc = self.cfg, self.acc
        if cfg.report_to != "none":
            if cfg.report_to == "wandb" and not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")
            acc.init_trackers("speculators", config=cfg.to_dict())
        micro = cfg.micro_batch_size
        bar = tqdm(total=cfg.total_steps, initial=self.step, disable=not acc.is_main_process, unit="step",
                   desc="distill")
        tokens_seen, t0 = 0, time.perf_counter()
        # steps on the draft's own samples (this session); the draw per step is seeded, see takes_onpolicy_batch
        self.onpolicy_steps = 0
        data_idx, data = -1, None
        while self.step < cfg.total_steps:
            idx, stage, in_stage = self.stage_at(self.step)
            if idx != data_idx:
                data_idx, data = idx, self.stage_data(idx, stage)
            onpolicy = takes_onpolicy_batch(cfg, stage, self.step)
            if onpolicy:
                self.onpolicy_steps += 1
                rows = self.onpolicy_rows(idx, stage, in_stage)
            else:
                rows = self.step_rows(data, stage, in_stage, per_process=stage.data == "target")
            batches = [collate(rows[i : i + micro], self.tokenizer.pad_token_id) for i in range(0, len(rows), micro)]
            # global loss-token count, so every process divides by the same number
            local = sum(_loss_tokens(b, self.shifts) for b in batches)
            total = acc.reduce(torch.tensor(float(local), device=acc.device), reduction="sum").item()
            lr = lr_at(in_stage, stage, cfg)
            for group in self.optim.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            for j, batch in enumerate(batches):
                batch = {k: v.to(acc.device) for k, v in batch.items()}
                sync = j == len(batches) - 1
                ctx = acc.no_sync(self.model) if not sync else contextlib.nullcontext()
                with ctx, acc.autocast():
                    # DDP averages gradients over processes; scaling by world size turns that into a sum.
                    loss, _ = speculator_loss(self.model, self.target, batch, cfg, max(total, 1.0) / acc.num_processes,
                                              self.vocab_ids)
                    acc.backward(loss)
                loss_sum += loss.item() / acc.num_processes
                tokens_seen += int(batch["attention_mask"].sum()) * acc.num_processes
            grad_norm = acc.clip_grad_norm_(self.model.parameters(), cfg.grad_clip) if cfg.grad_clip else None
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)
            loss_global = acc.reduce(torch.tensor(loss_sum, device=acc.device), reduction="sum").item()
            self.step += 1
            self.last_loss = loss_global
            rate = tokens_seen / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss_global:.3f}", tok_s=f"{rate:.0f}", lr=f"{lr:.1e}", stage=stage.name)
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == cfg.total_steps:
                metrics = {"loss": loss_global, "lr": lr, "tokens_per_s": rate, "stage": idx,
                           "onpolicy": onpolicy, "onpolicy_steps": self.onpolicy_steps,
                           "peak_mem_gib": peak_memory_gib(acc.device)}
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                acc.log(metrics, step=self.step)
                self._history(metrics)
            if self.step % cfg.save_every == 0 or self.step == cfg.total_steps:
                self.save_checkpoint()
        bar.close()
        if self._vllm is not None:
            self._vllm.close()
        final = self.out / "final"
        if acc.is_main_process:
            self.unwrapped.save_pretrained(final)
        acc.wait_for_everyone()
        acc.end_training()
        return final

    def _history(self, metrics: dict):
        if self.acc.is_main_process:
            with open(self.out / "history.jsonl", "a") as f:
                f.write(json.dumps({"step": self.step, **metrics}) + "\n")
            fault_point(f"history_appended:step-{self.step:07d}")

    def _truncate_history(self):
        """history.jsonl up to the resumed step: a step's line is written before its checkpoint, so a
        run killed between the two has a line for a step it trains again. A line the kill cut short is
        dropped too."""
        path = self.out / "history.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= self.step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                pass
        atomic_write_file(path, "".join(kept))

    # Checkpoints: model (vLLM layout), optimizer state and RNG, all safetensors, written to a
    # temporary directory and renamed into place (atomic_write_dir); `latest` is replaced atomically
    # last. A step directory exists only once complete, so --resume reads the newest one: `latest`
    # lags it in a run killed between the two.
    def save_checkpoint(self):
        acc = self.acc
        acc.wait_for_everyone()
        if acc.is_main_process:
            path = self.out / "checkpoints" / f"step-{self.step:07d}"

            def write(tmp: Path):
                self.unwrapped.save_pretrained(tmp / "model")
                tensors, meta = _flatten_optimizer(self.optim.state_dict())
                tensors["rng.torch"] = torch.get_rng_state()
                save_file(tensors, str(tmp / "optimizer.safetensors"))
                (tmp / "trainer_state.json").write_text(json.dumps({"step": self.step, "optimizer": meta}))

            atomic_write_dir(path, write)
            atomic_write_file(self.out / "checkpoints" / "latest", path.name)
            fault_point(f"latest_updated:{path.name}")
        acc.wait_for_everyone()

    def _newest_checkpoint(self) -> Path | None:
        steps = [p for p in (self.out / "checkpoints").glob("step-*") if p.name[5:].isdigit() and p.is_dir()]
        return max(steps, key=lambda p: int(p.name[5:]), default=None)

    def _load_checkpoint(self):
        path = self._newest_checkpoint()
        from .models.base import read_safetensors

        model = self.unwrapped
        model.load_weights(read_safetensors(path / "model" / "model.safetensors"))
        state = json.loads((path / "trainer_state.json").read_text())
        tensors = load_file(str(path / "optimizer.safetensors"))
        torch.set_rng_state(tensors.pop("rng.torch"))
        self.optim.load_state_dict(_unflatten_optimizer(tensors, state["optimizer"]))
        self.step = state["step"]
        if self.acc.is_main_process:
            latest = self.out / "checkpoints" / "latest"
            if not latest.exists() or latest.read_text().strip() != path.name:
                atomic_write_file(latest, path.name)
            self._truncate_history()


def _loss_tokens(batch: dict, shifts: list[int]) -> int:
    """Loss positions summed over heads (a label `shift` tokens ahead must lie inside the sequence)."""
    mask = batch["loss_mask"] * batch["attention_mask"]
    return sum(int(mask[:, shift:].sum()) for shift in shifts)


def _flatten_optimizer(sd: dict) -> tuple[dict, dict]:
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


def peak_memory_gib(device: torch.device) -> float:
    """This process's peak memory so far: allocated CUDA memory on a GPU, resident set size on a CPU
    (what decides whether a run fits the machine, so the recipes' memory figures are read from it)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
