"""Tree verification for speculative decoding: the longest acceptable root path of a candidate tree.

The op runs Triton on CUDA tensors and the reference elsewhere; ``_impl="triton" | "reference"``
forces one (see :mod:`speculators.kernels.triton_utils`).  The trees themselves (Medusa choices,
MLP-speculator expansions, attention masks, KV compaction) are built by
:mod:`speculators.kernels.tree`.

Semantics (``tree_verify``)
---------------------------
Node 0 is the root (the last accepted token); ``parents[b, i] < i`` for ``i > 0`` (topological
order), ``parents[b, i] < 0`` for ``i > 0`` marks padding.  Row ``i`` of ``target_logits``
scores the children of node ``i``.  Node ``i`` is *acceptable* if (greedy) its token equals the
argmax of its parent's row, or (typical, Medusa-2) ``p_parent(token) > min(epsilon, delta *
exp(-H(p_parent)))`` with ``p = softmax(logits / T)`` and exact entropy ``H``.  The accepted
path is the longest root path whose nodes are all acceptable (ties: lowest leaf index; for
greedy on a tree without duplicate sibling tokens this is the usual walk down).  The bonus
token comes from the leaf's row: argmax (greedy, or typical without ``seeds``) or a sample of
``p`` (typical with ``seeds``; an exponential race with the counter-based noise of
:mod:`speculators.kernels.sampling`, ties to the lowest index).  Triton computes the per-node
row statistics (the heavy part: argmax, softmax normaliser, entropy — one pass over
``[B, N, V]`` by :mod:`speculators.kernels.row_stats`); the path search over the ``[B, N]``
statistics is a few vectorised torch ops (pointer jumping, ``O(log N)`` gathers).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from speculators.kernels.row_stats import launch_row_stats, merge_row_stats
from speculators.kernels.sampling import counter_uniforms
from speculators.kernels.triton_utils import use_triton

__all__ = ["TreeVerifyOutput", "tree_verify", "tree_verify_reference", "tree_verify_triton"]


class TreeVerifyOutput(NamedTuple):
    accepted_nodes: torch.Tensor  # [B, N] int64: node indices of the accepted path, root (0) first, -1 padded
    output_tokens: torch.Tensor  # [B, N] int64: accepted tokens (root excluded) then the bonus token, -1 padded
    num_accepted: torch.Tensor  # [B] int64: accepted tree tokens (path length without the root)
    bonus_tokens: torch.Tensor  # [B] int64


def _check_tree_inputs(target_logits, tree_tokens, parents, mode):
    if target_logits.dim() != 3:
        raise ValueError("target_logits must be [B, N, V]")
    B, N, V = target_logits.shape
    if tree_tokens.shape != (B, N) or parents.shape != (B, N):
        raise ValueError("tree_tokens and parents must be [B, N]")
    if mode not in ("greedy", "typical"):
        raise ValueError(f"mode must be 'greedy' or 'typical', got {mode!r}")
    return B, N, V


def _tree_temperature(B, device, temperature, mode, check=True):
    if mode == "greedy":
        return None
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError("typical acceptance needs temperature > 0")
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1).expand(B).contiguous()
    if check and bool((t <= 0).any()):  # host sync; skipped by the Triton path
        raise ValueError("typical acceptance needs temperature > 0")
    return t


def tree_verify_reference(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
):
    """Plain-PyTorch (fp64, node-by-node loop) tree verification; see :func:`tree_verify`."""
    B, N, V = _check_tree_inputs(target_logits, tree_tokens, parents, mode)
    dev = target_logits.device
    temp = _tree_temperature(B, dev, temperature, mode)
    logits = target_logits.double()
    acc_nodes = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    n_acc = torch.zeros(B, dtype=torch.int64, device=dev)
    bonus = torch.zeros(B, dtype=torch.int64, device=dev)
    par = parents.tolist()
    toks = tree_tokens.tolist()
    for b in range(B):
        am = logits[b].argmax(-1).tolist()
        if mode == "typical":
            p = torch.softmax(logits[b] / float(temp[b]), dim=-1)
            lp = torch.log_softmax(logits[b] / float(temp[b]), dim=-1)
            ent = -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)
            thr = torch.clamp(typical_delta * torch.exp(-ent), max=typical_epsilon).tolist()
        depth = [0] * N
        good = [False] * N
        good[0] = True
        best, best_d = 0, 0
        for i in range(1, N):
            pa = par[b][i]
            if pa < 0 or not good[pa]:
                continue
            t = toks[b][i]
            if mode == "greedy":
                ok = t == am[pa]
            else:
                ok = 0 <= t < V and float(p[pa, t]) > thr[pa]
            if ok:
                good[i] = True
                depth[i] = depth[pa] + 1
                if depth[i] > best_d:
                    best, best_d = i, depth[i]
        path = [best]
        while path[-1] != 0:
            path.append(par[b][path[-1]])
        path.reverse()
        acc_nodes[b, : len(path)] = torch.tensor(path, device=dev)
        if mode == "typical" and seeds is not None:
            E = -torch.log(counter_uniforms(seeds[b : b + 1].to(dev), torch.tensor([[best]], device=dev), 0, V)[0, 0].double())
            bt = int((p[best] / E).argmax())
        else:
            bt = am[best]
        for d, node in enumerate(path[1:]):
            out_tokens[b, d] = toks[b][node]
        out_tokens[b, len(path) - 1] = bt
        n_acc[b] = len(path) - 1
        bonus[b] = bt
    return TreeVerifyOutput(acc_nodes, out_tokens, n_acc, bonus)


def tree_verify_triton(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
    _splits=None,
):
    """Triton row statistics (:mod:`speculators.kernels.row_stats`) + vectorised torch path search; see
    :func:`tree_verify`."""
    B, N, V = _check_tree_inputs(target_logits, tree_tokens, parents, mode)
    dev = target_logits.device
    temp = _tree_temperature(B, dev, temperature, mode, check=False)  # tensors must hold T > 0
    typical = mode == "typical"
    sample_bonus = typical and seeds is not None
    seeds_t = torch.as_tensor(seeds, device=dev).to(torch.int64).contiguous() if sample_bonus else None
    row_limit = torch.full((B,), N - 1, dtype=torch.int64, device=dev)
    part_f, part_i, S, logits = launch_row_stats(
        target_logits, row_limit, temp, None, seeds_t, always_argmax=True, need_entropy=typical, has_temp=typical,
        splits=_splits,
    )
    st = merge_row_stats(part_f, part_i, B * N, S)
    gidx = st["gidx"].view(B, N)
    ar = torch.arange(N, device=dev)
    par = parents.to(device=dev, dtype=torch.int64)
    toks = tree_tokens.to(device=dev, dtype=torch.int64)
    valid = (par >= 0) & (par < ar) & (ar > 0)
    par_c = torch.where(valid, par, torch.zeros_like(par))
    par_c[:, 0] = 0
    if typical:
        Z = st["z"].view(B, N)
        M = st["m"].view(B, N)
        H = torch.log(Z) - st["h1"].view(B, N) / Z
        thr = torch.clamp(typical_delta * torch.exp(-H), max=typical_epsilon)
        bidx = torch.arange(B, device=dev).unsqueeze(1)
        lx = logits[bidx, par_c, toks.clamp(0, V - 1)].float()
        px = torch.exp(lx / temp.unsqueeze(1) - M.gather(1, par_c)) / Z.gather(1, par_c)
        ok = valid & (toks >= 0) & (toks < V) & (px > thr.gather(1, par_c))
    else:
        ok = valid & (toks == gidx.gather(1, par_c))
    ok[:, 0] = True
    # pointer jumping: good = all ancestors ok, depth = distance to the root
    good = ok.clone()
    depth = (ar > 0).to(torch.int64).expand(B, N).clone()
    anc = par_c.clone()
    jumps = [anc]
    for _ in range(max(1, math.ceil(math.log2(max(N, 2))))):
        good = good & good.gather(1, anc)
        depth = depth + depth.gather(1, anc)
        anc = anc.gather(1, anc)
        jumps.append(anc)
    score = torch.where(good, depth * N + (N - 1 - ar), torch.full_like(depth, -1))
    best = score.argmax(1)  # deepest, then lowest index
    D = depth.gather(1, best.unsqueeze(1))  # [B, 1]
    dist = (D - ar.unsqueeze(0)).clamp(min=0)  # distance of the ancestor at path position t
    node = best.unsqueeze(1).expand(B, N).clone()
    for k, table in enumerate(jumps[:-1]):
        bit = ((dist >> k) & 1).bool()
        node = torch.where(bit, table.gather(1, node), node)
    on_path = ar.unsqueeze(0) <= D
    acc_nodes = torch.where(on_path, node, torch.full_like(node, -1))
    rowsel = best + torch.arange(B, device=dev) * N
    bonus = (st["sidx"] if sample_bonus else st["gidx"])[rowsel]
    path_tok = toks.gather(1, acc_nodes[:, 1:].clamp(min=0))
    out_tokens = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    out_tokens[:, : N - 1] = torch.where(ar[1:].unsqueeze(0) <= D, path_tok, out_tokens[:, : N - 1])
    n_acc = D.squeeze(1)
    out_tokens.scatter_(1, n_acc.unsqueeze(1), bonus.unsqueeze(1))
    return TreeVerifyOutput(acc_nodes, out_tokens, n_acc, bonus)


def tree_verify(
    target_logits,
    tree_tokens,
    parents,
    *,
    mode="greedy",
    temperature=None,
    typical_epsilon=0.09,
    typical_delta=0.3,
    seeds=None,
    _impl=None,
):
    """Verify candidate trees in one target forward.

    Args:
        target_logits: [B, N, V] target logits at the tree nodes (row i scores node i's children).
        tree_tokens: [B, N] int64 tokens; node 0 is the root (last accepted token).
        parents: [B, N] int64 parent index (< own index); -1 for the root and for padding nodes.
        mode: "greedy" (token == argmax of the parent's row) or "typical" (Medusa-2:
            ``p(x) > min(typical_epsilon, typical_delta * exp(-H(p)))``, p = softmax(logits/T)).
        temperature: float or [B] (typical only; default 1.0).
        seeds: [B] int64 — typical mode only: sample the bonus token from p with the
            counter-based generator (otherwise the bonus is the argmax).
    Returns:
        :class:`TreeVerifyOutput` ``(accepted_nodes [B, N], output_tokens [B, N], num_accepted [B],
        bonus_tokens [B])``.
    """
    kw = dict(mode=mode, temperature=temperature, typical_epsilon=typical_epsilon, typical_delta=typical_delta,
              seeds=seeds)
    if use_triton(target_logits, _impl):
        return tree_verify_triton(target_logits, tree_tokens, parents, **kw)
    return tree_verify_reference(target_logits, tree_tokens, parents, **kw)
