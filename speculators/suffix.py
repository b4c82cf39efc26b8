"""Suffix decoding (SuffixDecoding, Snowflake's ArcticInference; vLLM's `suffix` method) in pure Python.

A draft comes from counting what followed the current context elsewhere: in this request's own prompt
and output, and in the outputs of recent requests. Both are held in depth-limited suffix tries over
token ids, whose node for a path p counts the occurrences of p as a substring.

`SuffixTree.speculate` matches the last m tokens of the context for every m that occurs, walks down
greedily by the most frequent child, and scores each draft token by the product of the count ratios
child/parent along the drafted path (an estimate of the probability that the target accepts it given
the drafts before it). A draft's score, the sum of those products, estimates how many of its tokens
the target will accept; drafting stops when the product falls under `min_token_prob`, and the match
length with the best score wins.

Node for node a Python trie costs a few hundred bytes, and most long substrings of real text occur
once, so a node that counts a single occurrence stores where that occurrence lies (its sequence and
position) instead of a chain of children: the chain is read from the sequence and only turned into
nodes when a second occurrence arrives. Appending a token costs O(max_depth) dictionary steps, and a
proposal O(m^2 + m * k) for a longest match of m tokens.
"""

from __future__ import annotations

import itertools


class _Node:
    """A trie node. Expanded: `children` maps token -> node and `best` is the child with the largest
    count (ties to the smaller token; unused at the root). Compact: `children` is None, the node counts
    exactly one occurrence and its descendants are seq[pos], seq[pos + 1], ... (each counted once),
    bounded by the tree's depth and by the sequence's current length."""

    __slots__ = ("token", "depth", "count", "children", "best", "seq", "pos")

    def __init__(self, token: int, depth: int, seq: list[int] | None = None, pos: int = 0):
        self.token, self.depth, self.count = token, depth, 1
        self.children: dict[int, _Node] | None = None if seq is not None else {}
        self.best: _Node | None = None
        self.seq, self.pos = seq, pos


def _better(a: _Node, b: _Node | None) -> bool:
    return b is None or a.count > b.count or (a.count == b.count and a.token < b.token)


def _best_child(node: _Node) -> _Node | None:
    best = None
    for c in node.children.values():
        if _better(c, best):
            best = c
    return best


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens over a set of token sequences.

    `extend(seq_id, tokens)` appends to a sequence (creating it), `remove(seq_id)` takes exactly that
    sequence's occurrences out again, `speculate(context, ...)` drafts a continuation of `context`.
    """

    def __init__(self, max_depth: int = 24):
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2 (a match of one token plus one draft), got {max_depth!r}")
        self.max_depth = max_depth
        self.root = _Node(-1, 0)
        self.root.count = 0
        self._seqs: dict = {}
        # Per sequence, for each start j of the last max_depth - 1 positions (ascending), the deepest
        # node known on the path seq[j:]; appending walks down from there instead of from the root.
        self._frontiers: dict = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list:
        """Sequence ids in insertion order (the oldest first)."""
        return list(self._seqs)

    def sequence(self, seq_id) -> list[int]:
        """The tree's own list of the tokens of `seq_id` (do not modify it: compact nodes read it)."""
        return self._seqs[seq_id]

    def extend(self, seq_id, tokens) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._frontiers[seq_id] = []
        frontier = self._frontiers[seq_id]
        for t in tokens:
            frontier = self._append(seq, frontier, int(t))
        self._frontiers[seq_id] = frontier

    def _append(self, seq: list[int], frontier: list[_Node], t: int) -> list[_Node]:
        # t joins the sequence before the starts are processed, and the starts go in ascending order:
        # expanding a compact node whose occurrence continues with t (its owner starts exactly one
        # position earlier, so it was processed already and counted t implicitly) then gives that
        # occurrence its child for t.
        n = len(seq)
        seq.append(t)
        max_depth = self.max_depth
        out = []
        j = n - len(frontier)
        for node in itertools.chain(frontier, (self.root,)):
            want = n - j  # the path seq[j:n] is counted; now count seq[j:n + 1]
            while node.depth < want and node.children is not None:
                node = node.children[seq[j + node.depth]]
            if node.children is not None:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node(t, want + 1, seq, n + 1)
                else:
                    if child.children is None:
                        self._expand(child)
                    child.count += 1
                if want and child is not node.best and _better(child, node.best):
                    node.best = child
                node = child
            # else: a compact node on this start's path counts this very occurrence, t included
            if want + 1 < max_depth:
                out.append(node)
            j += 1
        return out

    def _expand(self, node: _Node) -> None:
        seq, pos = node.seq, node.pos
        node.children, node.seq = {}, None
        if node.depth < self.max_depth and pos < len(seq):
            child = node.children[seq[pos]] = _Node(seq[pos], node.depth + 1, seq, pos + 1)
            node.best = child

    def remove(self, seq_id) -> None:
        """Take out every occurrence that `seq_id` contributed; nodes left with no occurrence go."""
        seq = self._seqs.pop(seq_id)
        del self._frontiers[seq_id]
        root, max_depth = self.root, self.max_depth
        for j in range(len(seq)):
            node = root
            for d in range(min(max_depth, len(seq) - j)):
                t = seq[j + d]
                child = node.children[t]
                child.count -= 1
                if child.count == 0:  # no occurrence of its path is left, so none below it either
                    del node.children[t]
                    if node.best is child:
                        node.best = _best_child(node)
                    break
                if node.best is child and node is not root:
                    node.best = _best_child(node)
                node = child

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """{path: occurrences} for every path in the tree, compact chains spelled out (for tests)."""
        out: dict[tuple[int, ...], int] = {}
        stack = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for t, c in node.children.items():
                p = path + (t,)
                out[p] = c.count
                if c.children is not None:
                    stack.append((p, c))
                else:
                    for i in range(c.pos, min(len(c.seq), c.pos + self.max_depth - c.depth)):
                        p = p + (c.seq[i],)
                        out[p] = 1
        return out

    def speculate(self, context, max_tokens: int, min_token_prob: float = 0.1,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0) -> tuple[list[int], float]:
        """(draft, score) continuing `context`. For every match length m (1 up to max_depth - 1, while
        the last m tokens of the context occur) a draft of at most min(max_tokens, max_depth - m,
        int(m * max_spec_factor + max_spec_offset)) tokens follows the most frequent child; the
        highest score wins, a longer match on ties. ([], 0.0) when nothing matches."""
        ctx = list(context[-(self.max_depth - 1):])
        n_ctx = len(ctx)
        best_draft: list[int] = []
        best_score = 0.0
        for m in range(1, n_ctx + 1):
            node, extra = self.root, 0  # extra: tokens read below a compact node
            for i in range(n_ctx - m, n_ctx):
                t = ctx[i]
                if node.children is not None:
                    node = node.children.get(t)
                    if node is None:
                        return best_draft, best_score  # no longer match can occur either
                else:
                    p = node.pos + extra
                    if p >= len(node.seq) or node.seq[p] != t:
                        return best_draft, best_score
                    extra += 1
            limit = min(max_tokens, self.max_depth - m, int(m * max_spec_factor + max_spec_offset))
            draft: list[int] = []
            prob, score = 1.0, 0.0
            while len(draft) < limit:
                if node.children is not None:
                    child = node.best
                    if child is None:
                        break
                    prob *= child.count / node.count
                    t, node = child.token, child
                else:
                    p = node.pos + extra
                    if p >= len(node.seq):
                        break
                    t, extra = node.seq[p], extra + 1  # a single occurrence: ratio 1
                if prob < min_token_prob:
                    break
                draft.append(t)
                score += prob
            if draft and score >= best_score:
                best_draft, best_score = draft, score
        return best_draft, best_score


class _Request:
    __slots__ = ("tree", "tokens", "prompt_len")

    def __init__(self, max_depth: int, prompt_ids):
        self.tree = SuffixTree(max_depth)
        self.tree.extend(0, prompt_ids)
        self.tokens = self.tree.sequence(0)
        self.prompt_len = len(self.tokens)


class SuffixProposer:
    """Suffix decoding drafts from this request's prompt and output and from the outputs of the last
    `max_cached_requests` finished requests (the oldest evicted first).

    Two ways to drive it:
    - with request ids: `start_request(id, prompt_ids)`, `append(id, tokens)` after each step,
      `speculate(id, k)`, and `finish_request(id)`, which moves the request's output into the cache;
    - as the built-in engine does, `propose(history, k)` / `propose_scored(history, k)` with the
      request's whole token history. The proposer tracks one such request: a history that extends the
      tracked one appends the new tokens; any other history starts a new request whose prompt is that
      history, and the tracked one is finished (its output cached). A continuation whose history
      extends the previous one (a second chat turn) therefore counts as the same request.
    """

    needs_hidden = False

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 256, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0):
        if not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0 (0 turns the cache of finished "
                             f"requests off), got {max_cached_requests!r}")
        if not 0 < min_token_prob <= 1:
            raise ValueError(f"min_token_prob must lie in (0, 1], got {min_token_prob!r}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor!r}")
        self.global_tree = SuffixTree(max_depth)
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob, self.max_spec_factor, self.max_spec_offset = min_token_prob, max_spec_factor, max_spec_offset
        self._requests: dict = {}
        self._tracked: _Request | None = None  # the request that `propose(history, k)` follows
        self._cache_ids = itertools.count()  # request ids may be reused; cache entries are not

    def start_request(self, request_id, prompt_ids) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active; finish_request it before starting it again")
        self._requests[request_id] = _Request(self.max_depth, prompt_ids)

    def append(self, request_id, tokens) -> None:
        self._request(request_id).tree.extend(0, tokens)

    def finish_request(self, request_id) -> None:
        """Stop tracking the request and cache its output (the tokens after its prompt)."""
        self._cache(self._request(request_id))
        del self._requests[request_id]

    def speculate(self, request_id, k: int) -> tuple[list[int], float]:
        """(draft of at most k tokens, score: the estimated number of them the target accepts)."""
        return self._speculate(self._request(request_id), k)

    def propose(self, history: list[int], k: int) -> list[int]:
        return self.propose_scored(history, k)[0]

    def propose_scored(self, history: list[int], k: int) -> tuple[list[int], float]:
        r = self._tracked
        if r is not None and len(history) >= len(r.tokens) and history[: len(r.tokens)] == r.tokens:
            if len(history) > len(r.tokens):
                r.tree.extend(0, history[len(r.tokens):])
        else:
            if r is not None:
                self._cache(r)
            r = self._tracked = _Request(self.max_depth, history)
        return self._speculate(r, k)

    def _request(self, request_id) -> _Request:
        r = self._requests.get(request_id)
        if r is None:
            raise ValueError(f"unknown request {request_id!r}; call start_request first")
        return r

    def _speculate(self, r: _Request, k: int) -> tuple[list[int], float]:
        if k <= 0:
            return [], 0.0
        ctx = r.tokens[-(self.max_depth - 1):]
        args = (k, self.min_token_prob, self.max_spec_factor, self.max_spec_offset)
        local = r.tree.speculate(ctx, *args)
        if len(self.global_tree) == 0:
            return local
        cached = self.global_tree.speculate(ctx, *args)
        return cached if cached[1] > local[1] else local

    def _cache(self, r: _Request) -> None:
        output = r.tokens[r.prompt_len:]
        if self.max_cached_requests == 0 or not output:
            return
        self.global_tree.extend(next(self._cache_ids), output)
        while len(self.global_tree) > self.max_cached_requests:
            self.global_tree.remove(next(iter(self.global_tree.seq_ids())))
