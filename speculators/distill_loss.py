"""The distillation loss of one micro-batch, for every proposer kind (MLP speculator, Medusa heads,
draft model): the heads' labels, the teacher's inputs where a divergence needs them, and the fused
multi-head linear + divergence op, so no [tokens, vocab] logits are ever held.

Head i of a speculator at position t predicts token t+i+2, so its teacher is the target's prediction
at position t+i+1; a draft model predicts token t+1, like the target at the same position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import TrainConfig
from .kernels.fused_linear_divergence import fused_linear_divergence
from .target import Target


def label_shifts(model, cfg: TrainConfig) -> list[int]:
    """Per head, how far ahead its label lies: a draft model predicts token t+1, like the target (its
    teacher is the target at the same position t); speculator head i predicts token t+i+2 (its
    teacher is the target at t+i+1, after the token the target itself samples at t)."""
    if cfg.kind == "draft_model":
        return [1]
    c = model.config
    return [i + 2 for i in range(c.n_predict if hasattr(c, "n_predict") else c.num_heads)]


def distillation_loss(model, target: Target, batch: dict, cfg: TrainConfig, normalizer: float,
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


def loss_tokens(batch: dict, shifts: list[int]) -> int:
    """Loss positions summed over heads (a label `shift` tokens ahead must lie inside the sequence)."""
    mask = batch["loss_mask"] * batch["attention_mask"]
    return sum(int(mask[:, shift:].sum()) for shift in shifts)
