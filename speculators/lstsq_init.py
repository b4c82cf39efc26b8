"""init: regression — every stage of an MLP speculator starts as the least-squares linear predictor
of the target's next hidden state, solved from the normal equations over a sample of the data set."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from .config import ConfigError, TrainConfig
from .data import collate
from .models import MLPSpeculator
from .target import Target


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
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    sample = order[: cfg.init_samples]
    if cfg.shard_target and not cfg.cache_hidden:  # the same number of sharded target forwards everywhere
        sample = sample[: len(sample) - len(sample) % acc.num_processes]
    mine = sample[acc.process_index :: acc.num_processes]
    if cfg.init_token_bias:
        # Per next token: sums of h_t and of h_{t+1}, and its count, over the tokens the sample holds (the
        # same on every process): vocabulary-sized float64 sums would take 3.7 GB for Qwen2.5's 151,936.
        present = torch.unique(torch.cat([torch.as_tensor(dataset[i]["input_ids"]) for i in sample])).to(acc.device)
        row_of = torch.full((embed.shape[0],), -1, dtype=torch.long, device=acc.device)
        row_of[present] = torch.arange(len(present), device=acc.device)
        tok_h, tok_y = (torch.zeros(len(present), D, dtype=torch.float64, device=acc.device) for _ in range(2))
        tok_c = torch.zeros(len(present), dtype=torch.float64, device=acc.device)
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
            x = row_of[ids[:, 1:][keep]]
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
        sol, offsets = solve_with_token_bias(xtx, xty, tok_h, tok_y, tok_c, embed[present].double(),
                                             cfg.init_token_bias, ridge)
    else:
        sol = torch.linalg.solve(xtx + ridge * torch.eye(n, dtype=xtx.dtype, device=xtx.device), xty)
    sol = sol.float()
    token_vectors = embed.float() @ sol[D : 2 * D] + sol[2 * D]
    if cfg.init_token_bias:
        token_vectors.index_add_(0, present, offsets)
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
