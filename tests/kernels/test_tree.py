import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / the kernels are imported

import itertools

import pytest
import torch

from speculators.kernels.medusa_proposal import medusa_propose_reference
from speculators.kernels.mlp_proposal import mlp_speculator_propose_topk_reference
from speculators.kernels.tree import (
    accepted_kv_indices,
    compact_accepted_kv_,
    medusa_tree,
    medusa_tree_tokens,
    mlp_candidate_paths,
    paths_to_tree,
    tree_attention_mask,
    tree_depth,
    tree_position_ids,
)
from speculators.kernels.tree_verification import tree_verify_reference

CHOICES = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [1, 1], [0, 0, 1]]


def _ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_medusa_tree_structure():
    t = medusa_tree(CHOICES)
    assert t.num_nodes == len(CHOICES) + 1
    assert t.choices[:5] == [[0], [1], [2], [0, 0], [0, 1]]  # sorted by (depth, choice)
    par = t.parents.tolist()
    for i, c in enumerate(t.choices, start=1):
        assert t.depth[i] == len(c) and t.head_index[i] == len(c) - 1 and t.rank[i] == c[-1]
        assert par[i] == (0 if len(c) == 1 else t.choices.index(c[:-1]) + 1)
        assert par[i] < i
    for i in range(t.num_nodes):
        assert set(t.attn_mask[i].nonzero().flatten().tolist()) == _ancestors(par, i)
    assert torch.equal(tree_depth(t.parents), t.depth)
    assert t.max_topk == 3 and t.num_heads == 3
    assert t.position_ids(torch.tensor([10, 20])).tolist()[1] == [20 + d for d in t.depth.tolist()]
    with pytest.raises(ValueError):
        medusa_tree([[0, 1]])  # missing prefix [0]


def test_medusa_tree_tokens():
    t = medusa_tree(CHOICES)
    topk = torch.arange(2 * 3 * 4).view(2, 3, 4) + 100
    toks = medusa_tree_tokens(t, torch.tensor([5, 6]), topk)
    assert toks[:, 0].tolist() == [5, 6]
    for i, c in enumerate(t.choices, start=1):
        assert toks[1, i] == topk[1, len(c) - 1, c[-1]]


def test_paths_to_tree_merges_prefixes():
    paths = torch.tensor([
        [[5, 6, 7], [5, 6, 8], [5, 9, -1], [4, -1, -1]],
        [[1, 2, 3], [1, 2, 3], [2, 2, 2], [-1, -1, -1]],  # duplicate path, empty path
    ])
    tb = paths_to_tree(torch.tensor([100, 200]), paths)
    assert tb.num_nodes.tolist() == [7, 7]
    N = tb.tree_tokens.shape[1]
    assert N == 7
    for b in range(2):
        par = tb.parents[b].tolist()
        toks = tb.tree_tokens[b].tolist()
        assert toks[0] == [100, 200][b] and par[0] == -1
        for i in range(1, int(tb.num_nodes[b])):
            assert 0 <= par[i] < i and tb.depth[b, i] == tb.depth[b, par[i]] + 1
        # every path is reachable and ends at its node
        for p in range(4):
            seq = [x for x in paths[b, p].tolist() if x >= 0]
            for d in range(len(seq)):
                node = int(tb.path_nodes[b, p, d])
                walk = []
                while node > 0:
                    walk.append(toks[node])
                    node = par[node]
                assert walk[::-1] == seq[: d + 1]
        for i in range(N):
            assert set(tb.attn_mask[b, i].nonzero().flatten().tolist()) == _ancestors(par, i)
    # distinct token sequences -> distinct nodes (request 0: 5, 4, 5-6, 5-9, 5-6-7, 5-6-8)
    assert sorted(tb.tree_tokens[0, 1:].tolist()) == sorted([5, 4, 6, 9, 7, 8])
    assert tb.position_ids(torch.tensor([3, 4]))[0].tolist() == (3 + tb.depth[0]).tolist()


def test_mlp_candidate_paths_bruteforce():
    g = torch.Generator().manual_seed(0)
    B, ks = 2, [3, 2, 2]
    stages, rows = [], B
    for k in ks:
        stages.append((torch.randn(rows, k, generator=g), torch.randint(0, 50, (rows, k), generator=g)))
        rows *= k
    paths, scores, branch = mlp_candidate_paths(stages, n_candidates=5)
    assert paths.shape == (B, 5, 3)
    for b in range(B):
        cands = []
        for c0, c1, c2 in itertools.product(range(3), range(2), range(2)):
            r1 = b * 3 + c0
            r2 = r1 * 2 + c1
            s = float(stages[0][0][b, c0] + stages[1][0][r1, c1] + stages[2][0][r2, c2])
            toks = [int(stages[0][1][b, c0]), int(stages[1][1][r1, c1]), int(stages[2][1][r2, c2])]
            cands.append((s, toks))
        cands.sort(key=lambda x: -x[0])
        assert paths[b].tolist() == [c[1] for c in cands[:5]]
        torch.testing.assert_close(scores[b], torch.tensor([c[0] for c in cands[:5]]))


def test_kv_compaction():
    B, S, Hd = 2, 12, 3
    cache = torch.arange(B * S * Hd, dtype=torch.float32).view(B, S, Hd)
    orig = cache.clone()
    acc = torch.tensor([[0, 2, 5, -1, -1, -1], [0, 1, -1, -1, -1, -1]])
    nacc = torch.tensor([2, 1])
    start = torch.tensor([4, 6])
    src, dst, valid = accepted_kv_indices(acc, nacc, start)
    assert src[0, :3].tolist() == [4, 6, 9] and dst[0, :3].tolist() == [4, 5, 6] and valid[0].tolist()[:4] == [1, 1, 1, 0]
    compact_accepted_kv_(cache, acc, nacc, start)
    assert torch.equal(cache[0, 4:7], orig[0, [4, 6, 9]]) and torch.equal(cache[1, 6:8], orig[1, [6, 7]])
    assert torch.equal(cache[0, :4], orig[0, :4]) and torch.equal(cache[0, 7:], orig[0, 7:])
    # [B, heads, S, dim] layout
    c4 = orig.view(B, S, 1, Hd).transpose(1, 2).contiguous()
    compact_accepted_kv_(c4, acc, nacc, start, seq_dim=2)
    assert torch.equal(c4[:, 0], cache)


class _ToyAttentionLM(torch.nn.Module):
    """One attention layer with learned absolute positions: enough to check masks + positions."""

    def __init__(self, V=40, d=16, P=64):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(V, d, generator=g)
        self.pos = torch.randn(P, d, generator=g)
        self.wq, self.wk, self.wv = (torch.randn(d, d, generator=g) / d**0.5 for _ in range(3))
        self.out = torch.randn(V, d, generator=g)

    def forward(self, tokens, positions, mask):  # tokens [T], positions [T], mask [T, T] bool
        h = self.emb[tokens] + self.pos[positions]
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        att = (q @ k.T).masked_fill(~mask, float("-inf")).softmax(-1)
        return (h + att @ v) @ self.out.T


def test_tree_forward_matches_sequential_and_verifies():
    """Target logits of a tree forward (tree mask + position ids) equal sequential decoding along
    every path, and greedy tree verification accepts what sequential greedy decoding would."""
    lm = _ToyAttentionLM()
    V, D = 40, 16
    prefix = torch.tensor([3, 7, 1])
    tree = medusa_tree(CHOICES)
    N, P0 = tree.num_nodes, len(prefix)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, D, generator=g)
    bw = torch.randn(3, 1, D, D, generator=g) / D**0.5
    lm_heads = torch.randn(3, V, D, generator=g)
    _, topk = medusa_propose_reference(hidden, bw, None, lm_heads, 3)
    root = torch.tensor([int(lm(prefix, torch.arange(P0), torch.ones(P0, P0).tril().bool())[-1].argmax())])
    # plant the target's own greedy continuation on the [0] -> [0, 0] branch
    seq = torch.cat([prefix, root])
    for d in range(2):
        T = len(seq)
        nxt = int(lm(seq, torch.arange(T), torch.ones(T, T).tril().bool())[-1].argmax())
        topk[0, d, 0] = nxt
        seq = torch.cat([seq, torch.tensor([nxt])])
    toks = medusa_tree_tokens(tree, root, topk)[0]
    # one forward over prefix + tree
    T = P0 + N
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[:, :P0] = torch.ones(T, P0).tril().bool() | (torch.arange(T) >= P0)[:, None]
    mask[P0:, P0:] = tree.attn_mask
    pos = torch.cat([torch.arange(P0), tree.position_ids(torch.tensor([P0]))[0]])
    logits = lm(torch.cat([prefix, toks]), pos, mask)[P0:]
    # sequential along each node's root path
    par = tree.parents.tolist()
    for i in range(N):
        path = sorted(_ancestors(par, i))
        s = torch.cat([prefix, toks[path]])
        ref = lm(s, torch.arange(len(s)), torch.ones(len(s), len(s)).tril().bool())[-1]
        torch.testing.assert_close(logits[i], ref, atol=1e-5, rtol=1e-5)
    res = tree_verify_reference(logits[None], toks[None], tree.parents[None])
    assert int(res.num_accepted[0]) >= 2
    assert res.output_tokens[0, :2].tolist() == seq[P0 + 1 : P0 + 3].tolist()


def test_mlp_tree_end_to_end_shapes():
    g = torch.Generator().manual_seed(3)
    V, D, inner, n = 30, 16, 16, 3
    emb = [torch.randn(V, inner, generator=g) for _ in range(n)]
    proj = [torch.randn(inner, D, generator=g) / 4 for _ in range(n)]
    lw, lb = [torch.ones(inner)] * n, [torch.zeros(inner)] * n
    head = [torch.randn(V, inner, generator=g) for _ in range(n)]
    hidden, tokens = torch.randn(2, D, generator=g), torch.tensor([1, 2])
    stages = mlp_speculator_propose_topk_reference(hidden, tokens, emb, proj, lw, lb, head, False, [5, 4, 3])
    paths, scores, _ = mlp_candidate_paths(stages, n_candidates=5)
    tb = paths_to_tree(tokens, paths)
    assert paths.shape == (2, 5, 3) and (scores[:, :-1] >= scores[:, 1:]).all()
    assert int(tb.num_nodes.max()) <= 1 + 5 * 3 and int(tb.num_nodes.min()) >= 1 + 3 + 2
    assert tb.attn_mask.shape[1:] == (tb.tree_tokens.shape[1],) * 2
    assert torch.equal(tree_position_ids(tb.depth, torch.tensor([0, 0])), tb.depth)
    assert torch.equal(tree_attention_mask(tb.parents), tb.attn_mask)
