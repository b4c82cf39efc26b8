"""Candidate trees for speculative decoding (pure PyTorch).

Conventions shared with :func:`speculators.kernels.tree_verification.tree_verify`:

* node 0 is the root — the last accepted token, whose KV entry is written by the same target
  forward that verifies the tree;
* nodes are in topological order (``parents[i] < i``), ``parents[0] == -1``;
  padding nodes (trees of different sizes in one batch) have ``parents == -1`` and token
  ``pad_token``;
* ``depth[root] == 0``; node ``i`` sits at sequence position ``start + depth[i]``;
* ``attn_mask[i, j]`` is True iff ``j`` is ``i`` or an ancestor of ``i`` (padding nodes see only
  themselves, so no attention row is empty).  For the target forward the tree mask is the
  right-hand block of the full mask: every node also attends to the whole committed prefix.

Tree sources:

* Medusa "choices" (``[[0], [0, 0], [1], [0, 1], ...]``; choice ``c`` is the node reached by
  taking the ``c[d]``-th best token of head ``d`` at depth ``d``): a static structure,
  :func:`medusa_tree`, filled per request by :func:`medusa_tree_tokens`.
* IBM MLP speculator (``top_k_tokens_per_head=[5, 4, 3]``, ``n_candidates``): the per-stage
  top-k of :func:`~speculators.kernels.mlp_proposal.mlp_speculator_propose_topk` define a full
  expansion tree (each branch's state is advanced with each of its top-k tokens);
  :func:`mlp_candidate_paths` keeps the ``n_candidates`` leaves with the highest cumulative
  log-probability (IBM's ``generate_suffixes`` rule), :func:`paths_to_tree` merges their common
  prefixes into a tree (structure differs per request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "MedusaTree",
    "TreeBatch",
    "accepted_kv_indices",
    "compact_accepted_kv_",
    "medusa_tree",
    "medusa_tree_tokens",
    "mlp_candidate_paths",
    "paths_to_tree",
    "tree_attention_mask",
    "tree_depth",
    "tree_position_ids",
]


def tree_depth(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root 0; padding nodes 0) for parents [..., N] in topological order."""
    N = parents.shape[-1]
    par = parents.to(torch.int64)
    ar = torch.arange(N, device=par.device)
    valid = (par >= 0) & (par < ar)
    par_c = torch.where(valid, par, ar.expand_as(par))  # root / padding point to themselves
    depth = valid.to(torch.int64)
    anc = par_c
    steps = max(1, (N - 1).bit_length())
    for _ in range(steps):  # pointer jumping: O(log N) gathers
        depth = depth + torch.where(anc != ar, depth.gather(-1, anc), torch.zeros_like(depth))
        anc = anc.gather(-1, anc)
    return depth


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask [..., N, N] (bool) from parents [..., N]."""
    N = parents.shape[-1]
    par = parents.to(torch.int64)
    ar = torch.arange(N, device=par.device)
    valid = (par >= 0) & (par < ar)
    par_c = torch.where(valid, par, ar.expand_as(par))
    mask = torch.zeros(*par.shape, N, dtype=torch.bool, device=par.device)
    cur = ar.expand_as(par).clone()
    for _ in range(N):  # walk up; stops changing at the root (<= max depth + 1 effective steps)
        mask.scatter_(-1, cur.unsqueeze(-1), True)
        nxt = par_c.gather(-1, cur)
        if torch.equal(nxt, cur):
            break
        cur = nxt
    return mask


def tree_position_ids(depth: torch.Tensor, start_positions) -> torch.Tensor:
    """Position ids [B, N] = start_positions[b] + depth (depth [N] or [B, N])."""
    start = torch.as_tensor(start_positions, device=depth.device).to(torch.int64).reshape(-1, 1)
    return start + depth.to(torch.int64).reshape(1, -1) if depth.dim() == 1 else start + depth.to(torch.int64)


# ----------------------------------------------------------------------------------------
# Medusa choices
# ----------------------------------------------------------------------------------------
@dataclass
class MedusaTree:
    """Static tree from Medusa choices.  All tensors have N = len(choices) + 1 entries."""

    parents: torch.Tensor  # [N] int64, -1 for the root
    depth: torch.Tensor  # [N] int64
    head_index: torch.Tensor  # [N] int64: head whose top-k supplies the node's token (-1: root)
    rank: torch.Tensor  # [N] int64: rank within that head's top-k (-1: root)
    attn_mask: torch.Tensor  # [N, N] bool
    choices: list  # sorted choices; node i + 1 is choices[i]

    @property
    def num_nodes(self) -> int:
        return int(self.parents.numel())

    @property
    def max_topk(self) -> int:
        return int(self.rank.max()) + 1 if self.num_nodes > 1 else 1

    @property
    def num_heads(self) -> int:
        return int(self.head_index.max()) + 1 if self.num_nodes > 1 else 0

    def position_ids(self, start_positions) -> torch.Tensor:
        return tree_position_ids(self.depth, start_positions)

    def to(self, device) -> "MedusaTree":
        return MedusaTree(
            self.parents.to(device), self.depth.to(device), self.head_index.to(device), self.rank.to(device),
            self.attn_mask.to(device), self.choices,
        )


def medusa_tree(choices: Sequence[Sequence[int]], device=None) -> MedusaTree:
    """Build the static tree of Medusa ``choices`` (sorted by (depth, choice) like Medusa does).

    Every prefix of a choice must itself be a choice (the path to a node must exist).
    """
    uniq = sorted({tuple(int(x) for x in c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(c) == 0 or min(c) < 0 for c in uniq):
        raise ValueError("choices must be non-empty lists of non-negative ranks")
    index = {c: i + 1 for i, c in enumerate(uniq)}
    parents, depth, head, rank = [-1], [0], [-1], [-1]
    for c in uniq:
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"choice {list(c)} lacks its prefix {list(c[:-1])}")
        parents.append(index[c[:-1]] if len(c) > 1 else 0)
        depth.append(len(c))
        head.append(len(c) - 1)
        rank.append(c[-1])
    par = torch.tensor(parents, dtype=torch.int64, device=device)
    return MedusaTree(
        parents=par,
        depth=torch.tensor(depth, dtype=torch.int64, device=device),
        head_index=torch.tensor(head, dtype=torch.int64, device=device),
        rank=torch.tensor(rank, dtype=torch.int64, device=device),
        attn_mask=tree_attention_mask(par),
        choices=[list(c) for c in uniq],
    )


def medusa_tree_tokens(tree: MedusaTree, root_tokens: torch.Tensor, topk_indices: torch.Tensor) -> torch.Tensor:
    """Tree tokens [B, N]: root token, then ``topk_indices[b, head_index[i], rank[i]]``.

    ``topk_indices`` [B, H, k] is e.g. the index output of
    :func:`~speculators.kernels.medusa_proposal.medusa_propose` with ``top_k >= tree.max_topk``.
    """
    B, H, k = topk_indices.shape
    if tree.num_heads > H or tree.max_topk > k:
        raise ValueError(f"tree needs {tree.num_heads} heads x top-{tree.max_topk}, got [{H}, {k}]")
    dev = topk_indices.device
    h = tree.head_index.to(dev).clamp(min=0)
    r = tree.rank.to(dev).clamp(min=0)
    toks = topk_indices.to(torch.int64)[:, h, r]  # [B, N]
    toks[:, 0] = root_tokens.to(device=dev, dtype=torch.int64).reshape(B)
    return toks


# ----------------------------------------------------------------------------------------
# Candidate paths (MLP speculator) -> tree
# ----------------------------------------------------------------------------------------
@dataclass
class TreeBatch:
    """Per-request trees padded to N nodes."""

    tree_tokens: torch.Tensor  # [B, N] int64 (node 0: root token; padding: pad_token)
    parents: torch.Tensor  # [B, N] int64 (-1: root and padding)
    depth: torch.Tensor  # [B, N] int64
    attn_mask: torch.Tensor  # [B, N, N] bool
    num_nodes: torch.Tensor  # [B] int64 (root included)
    path_nodes: torch.Tensor  # [B, n, L] int64: node of each path position (-1 where the path is shorter)

    def position_ids(self, start_positions) -> torch.Tensor:
        return tree_position_ids(self.depth, start_positions)


def mlp_candidate_paths(stage_outputs, n_candidates: int | None = None):
    """Leaves of the MLP-speculator expansion tree with the highest cumulative log-probability.

    Args:
        stage_outputs: list over stages of ``(logprobs [B * R_i, k_i], indices [B * R_i, k_i])``
            as returned by ``mlp_speculator_propose_topk`` (``R_0 = 1``, ``R_{i+1} = R_i * k_i``;
            row ``r`` of stage ``i+1`` is child ``r % k_i`` of row ``r // k_i`` of stage ``i``).
        n_candidates: leaves to keep (default: all ``prod(k_i)``); ties -> lowest branch index.
    Returns:
        ``(paths [B, n, n_predict] int64 tokens, scores [B, n] fp32 cumulative log-probs,
        branch [B, n] int64 flat leaf index)``, best first.
    """
    if not stage_outputs:
        raise ValueError("need at least one stage")
    lp0, ix0 = stage_outputs[0]
    B = lp0.shape[0]
    dev = lp0.device
    score = lp0.float().reshape(B, -1)
    paths = ix0.to(torch.int64).reshape(B, -1, 1)
    for lp, ix in stage_outputs[1:]:
        R = score.shape[1]
        k = lp.shape[-1]
        if lp.shape[0] != B * R:
            raise ValueError(f"stage has {lp.shape[0]} rows, expected B * R = {B * R}")
        score = (score.unsqueeze(-1) + lp.float().reshape(B, R, k)).reshape(B, R * k)
        paths = torch.cat(
            [paths.unsqueeze(2).expand(B, R, k, paths.shape[-1]), ix.to(torch.int64).reshape(B, R, k, 1)], dim=-1
        ).reshape(B, R * k, -1)
    n = score.shape[1] if n_candidates is None else min(int(n_candidates), score.shape[1])
    # stable descending sort: equal scores keep the lower branch index first
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]
    return paths.gather(1, order.unsqueeze(-1).expand(B, n, paths.shape[-1])), score.gather(1, order), order.to(dev)


def paths_to_tree(root_tokens: torch.Tensor, paths: torch.Tensor, *, max_nodes: int | None = None,
                  pad_token: int = 0) -> TreeBatch:
    """Merge candidate paths [B, n, L] (token ids, -1 = path ended) into per-request trees.

    Paths sharing a prefix share its nodes.  Nodes are numbered by (depth, first path that
    reaches them), so the order is topological.  ``max_nodes`` fixes N (must be >= the largest
    tree; default: the largest tree, which needs one host sync).
    """
    B, n, L = paths.shape
    dev = paths.device
    paths = paths.to(torch.int64)
    valid = torch.cumprod((paths >= 0).to(torch.int64), dim=-1).bool()  # a path ends at its first -1
    same = (paths.unsqueeze(2) == paths.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)  # [B, n, n, L]
    same = torch.cumprod(same.to(torch.int64), dim=-1).bool()  # equal prefixes up to depth d
    canon = same.to(torch.int64).argmax(dim=2)  # first path with the same prefix, [B, n, L]
    ar_n = torch.arange(n, device=dev)
    is_new = valid & (canon == ar_n.view(1, n, 1))
    new_dn = is_new.transpose(1, 2).reshape(B, L * n)  # order: depth, then path index
    ids_dn = torch.cumsum(new_dn.to(torch.int64), dim=1).reshape(B, L, n)  # 1-based node ids
    node_of = ids_dn.gather(2, canon.transpose(1, 2)).transpose(1, 2)  # [B, n, L]
    node_of = torch.where(valid, node_of, torch.full_like(node_of, -1))
    num_nodes = 1 + new_dn.sum(1)
    N = int(num_nodes.max()) if max_nodes is None else int(max_nodes)
    if max_nodes is not None and bool((num_nodes > N).any()):
        raise ValueError(f"a tree has {int(num_nodes.max())} nodes > max_nodes={N}")
    parent_of = torch.cat([torch.zeros(B, n, 1, dtype=torch.int64, device=dev), node_of[:, :, :-1]], dim=-1)
    tokens = torch.full((B, N + 1), pad_token, dtype=torch.int64, device=dev)
    parents = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    depth = torch.zeros(B, N + 1, dtype=torch.int64, device=dev)
    tgt = torch.where(is_new, node_of, torch.full_like(node_of, N)).reshape(B, n * L)  # N: trash column
    tokens.scatter_(1, tgt, paths.reshape(B, n * L))
    parents.scatter_(1, tgt, parent_of.reshape(B, n * L))
    depth.scatter_(1, tgt, (torch.arange(L, device=dev) + 1).expand(B, n, L).reshape(B, n * L))
    tokens, parents, depth = tokens[:, :N], parents[:, :N], depth[:, :N]
    tokens[:, 0] = root_tokens.to(device=dev, dtype=torch.int64).reshape(B)
    parents[:, 0] = -1
    depth[:, 0] = 0
    return TreeBatch(tokens, parents, depth, tree_attention_mask(parents), num_nodes, node_of)


# ----------------------------------------------------------------------------------------
# KV cache bookkeeping after verification
# ----------------------------------------------------------------------------------------
def accepted_kv_indices(accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, cache_start):
    """Cache slots to keep after tree verification.

    The tree's KV entries were written at ``cache_start[b] + node``; the accepted path (root
    included) must end up contiguous at ``cache_start[b] + t``, ``t = 0..num_accepted[b]``.
    Returns ``(src [B, N], dst [B, N], valid [B, N])`` (int64, int64, bool); copy
    ``cache[src] -> cache[dst]`` where valid (sources are never overwritten before they are read
    when copying in one gather/scatter, see :func:`compact_accepted_kv_`).
    """
    B, N = accepted_nodes.shape
    dev = accepted_nodes.device
    start = torch.as_tensor(cache_start, device=dev).to(torch.int64).reshape(B, 1)
    t = torch.arange(N, device=dev).unsqueeze(0)
    valid = t <= num_accepted.to(device=dev, dtype=torch.int64).reshape(B, 1)
    src = start + accepted_nodes.clamp(min=0)
    dst = start + t
    return torch.where(valid, src, dst), dst.expand(B, N).clone(), valid


def compact_accepted_kv_(cache: torch.Tensor, accepted_nodes, num_accepted, cache_start, seq_dim: int = 1):
    """In place: move the accepted path's entries of ``cache`` (batch dim 0, sequence dim
    ``seq_dim``) to the front of the tree slots.  Returns ``cache``."""
    src, dst, valid = accepted_kv_indices(accepted_nodes, num_accepted, cache_start)
    c = cache.movedim(seq_dim, 1)  # [B, S, ...] view
    shape = (src.shape[0], src.shape[1]) + (1,) * (c.dim() - 2)
    idx_src = src.view(shape).expand(-1, -1, *c.shape[2:])
    vals = c.gather(1, idx_src)  # gathered before any write
    keep = valid.view(shape)
    cur = c.gather(1, dst.view(shape).expand(-1, -1, *c.shape[2:]))
    c.scatter_(1, dst.view(shape).expand(-1, -1, *c.shape[2:]), torch.where(keep, vals, cur))
    return cache
