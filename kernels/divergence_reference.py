"""Plain PyTorch reference for fused_linear_divergence: materializes the logits.

Same signature and definitions as ``fused_linear_divergence``; autograd provides the
gradients. Tests run it in float64; benchmarks run it in the input dtype as the naive
baseline: logits in the input dtype, upcast to fp32 for the loss, as most trainers do, one
head at a time as multi-head trainers usually loop (each head's [T, V] log-probabilities are
still kept for backward).
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def per_token_divergence(log_q: Tensor, log_p: Tensor, divergence: str, beta: float = 0.5) -> Tensor:
    """[..., V] student / teacher log-probabilities -> [...] divergence per token."""
    if divergence == "fkl":  # KL(p || q); kl_div(input, target) = KL(target || input)
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if divergence == "rkl":  # KL(q || p)
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    if divergence == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    if divergence == "jsd":
        p, q = log_p.exp(), log_q.exp()
        log_m = (beta * p + (1 - beta) * q).log()
        return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}")


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) in at least fp32."""
    return (logits if logits.dtype == torch.float64 else logits.float()).div(temperature).log_softmax(-1)


def divergence_reference(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor | None = None,
    teacher_weight: Tensor | None = None,
    teacher_logits: Tensor | None = None,
    labels: Tensor | None = None,
    divergence: str = "fkl",
    beta: float = 0.5,
    temperature: float = 1.0,
    head_weights: Sequence[float] | Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "sum",
) -> Tensor:
    """Reference loss; see fused_linear_divergence for the arguments."""
    H, T, _ = student_input.shape
    per_head = []
    for h in range(H):
        w = student_weight[h] if student_weight.dim() == 3 else student_weight
        log_q = _log_probs(student_input[h] @ w.T, temperature)
        if divergence == "ce":
            loss = F.nll_loss(log_q, labels[h], ignore_index=ignore_index, reduction="none")
        else:
            z_t = teacher_logits[h] if teacher_logits is not None else teacher_input[h] @ teacher_weight.T
            loss = per_token_divergence(log_q, _log_probs(z_t.detach(), temperature).to(log_q.dtype),
                                        divergence, beta)
        valid = labels[h] != ignore_index if labels is not None else torch.ones_like(loss, dtype=torch.bool)
        loss = torch.where(valid, loss, 0).sum()
        per_head.append(loss / valid.sum().clamp(min=1) if reduction == "mean" else loss)
    w = torch.as_tensor(head_weights if head_weights is not None else [1.0] * H,
                        dtype=per_head[0].dtype, device=student_input.device)
    return (w * torch.stack(per_head)).sum()
