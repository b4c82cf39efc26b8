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

Most long substrings of real text occur once, so a node that counts a single occurrence is compact: it
stores where that occurrence lies (its sequence and position) instead of a chain of children, which is
read from the sequence and only turned into nodes when a second occurrence arrives. Nodes are ids into
flat lists of ints, and children are int -> int dicts: none of it is an object Python's cycle
collector tracks, so a tree of millions of nodes neither slows nor triggers full collections of the
process. Appending a token costs O(max_depth) dictionary steps; a proposal O(max_depth * k), the
suffixes to match being where the appends left them.
"""

from __future__ import annotations

import itertools

_NONE = -1  # no node


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens over a set of token sequences.

    `extend(seq_id, tokens)` appends to a sequence (creating it), `remove(seq_id)` takes exactly that
    sequence's occurrences out again, `speculate(context, ...)` drafts a continuation of `context`.

    Node v (the root is 0) has `_count[v]` occurrences, `_token[v]` (the last token of its path) and
    `_depth[v]`. Expanded: `_kids[v]` maps token -> child and `_link[v]` is the child with the largest
    count (ties to the smaller token; unused at the root), or -1. Compact: `_kids[v]` is None, v counts
    one occurrence and its descendants are `_seq[v][_link[v]:]` (each counted once), bounded by
    max_depth and by the sequence's current length.
    """

    def __init__(self, max_depth: int = 24):
        if not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2 (a match of one token plus one draft), got {max_depth!r}")
        self.max_depth = max_depth
        self._count, self._token, self._depth, self._link = [0], [_NONE], [0], [_NONE]
        self._kids: list[dict[int, int] | None] = [{}]
        self._seq: list[list[int] | None] = [None]
        self._free: list[int] = []  # ids of removed nodes, reused first
        self._seqs: dict = {}
        # Per sequence, for each start j of the last max_depth - 1 positions (ascending), the deepest
        # node known on the path seq[j:]; appending walks down from there instead of from the root.
        self._frontiers: dict = {}
        self._limits: dict = {}  # (max_tokens, factor, offset) -> draft length cap per match length

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

    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    def extend(self, seq_id, tokens) -> None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = []
            self._frontiers[seq_id] = []
        frontier = self._frontiers[seq_id]
        for t in tokens:
            self._append(seq, frontier, int(t))

    def _append(self, seq: list[int], frontier: list[int], t: int) -> None:
        # t joins the sequence before the starts are processed, and the starts go in ascending order:
        # expanding a compact node whose occurrence continues with t (its owner starts exactly one
        # position earlier, so it was processed already and counted t implicitly) then gives that
        # occurrence its child for t.
        n = len(seq)
        seq.append(t)
        kids = self._kids
        j0 = n - len(frontier)
        for i, v in enumerate(frontier):
            if kids[v] is not None:  # a compact node counts this occurrence, t included, by itself
                frontier[i] = self._count_next(seq, v, j0 + i, n, t)
        frontier.append(self._count_next(seq, 0, n, n, t))
        if len(frontier) == self.max_depth:  # the oldest start's path has reached max_depth tokens
            del frontier[0]

    def _count_next(self, seq: list[int], v: int, j: int, n: int, t: int) -> int:
        """Count the occurrence seq[j:n + 1] (t = seq[n]), walking down from v, an expanded node on its
        path; returns the deepest node of the path."""
        kids, depth, count, link = self._kids, self._depth, self._count, self._link
        want = n - j
        while depth[v] < want:
            v = kids[v][seq[j + depth[v]]]
            if kids[v] is None:
                return v
        c = kids[v].get(t)
        if c is None:
            c = kids[v][t] = self._new(t, want + 1, seq, n + 1)
        else:
            if kids[c] is None:
                self._expand(c)
            count[c] += 1
        b = link[v]
        if want and c != b and (b == _NONE or count[c] > count[b] or (count[c] == count[b] and t < self._token[b])):
            link[v] = c
        return c

    def _new(self, token: int, depth: int, seq: list[int], pos: int) -> int:
        """A compact node counting one occurrence, continued by seq[pos:]."""
        if self._free:
            v = self._free.pop()
            self._count[v], self._token[v], self._depth[v] = 1, token, depth
            self._kids[v], self._seq[v], self._link[v] = None, seq, pos
            return v
        self._count.append(1)
        self._token.append(token)
        self._depth.append(depth)
        self._kids.append(None)
        self._seq.append(seq)
        self._link.append(pos)
        return len(self._count) - 1

    def _expand(self, v: int) -> None:
        seq, pos = self._seq[v], self._link[v]
        kids = self._kids[v] = {}
        self._seq[v], self._link[v] = None, _NONE
        if self._depth[v] < self.max_depth and pos < len(seq):
            t = seq[pos]
            kids[t] = self._link[v] = self._new(t, self._depth[v] + 1, seq, pos + 1)

    def _best_child(self, v: int) -> int:
        count, token = self._count, self._token
        best = _NONE
        for c in self._kids[v].values():
            if best == _NONE or count[c] > count[best] or (count[c] == count[best] and token[c] < token[best]):
                best = c
        return best

    def remove(self, seq_id) -> None:
        """Take out every occurrence that `seq_id` contributed; nodes left with no occurrence go."""
        seq = self._seqs.pop(seq_id)
        del self._frontiers[seq_id]
        kids, count, link = self._kids, self._count, self._link
        for j in range(len(seq)):
            v = 0
            for d in range(min(self.max_depth, len(seq) - j)):
                t = seq[j + d]
                c = kids[v][t]
                count[c] -= 1
                if count[c] == 0:  # no occurrence of its path is left, so none below it either
                    del kids[v][t]
                    self._free_subtree(c)
                    if link[v] == c:
                        link[v] = self._best_child(v)
                    break
                if link[v] == c and v:
                    link[v] = self._best_child(v)
                v = c

    def _free_subtree(self, v: int) -> None:
        stack = [v]
        while stack:
            v = stack.pop()
            if self._kids[v] is not None:
                stack.extend(self._kids[v].values())
            self._kids[v], self._seq[v] = None, None
            self._free.append(v)

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """{path: occurrences} for every path in the tree, compact chains spelled out (for tests)."""
        out: dict[tuple[int, ...], int] = {}
        stack = [((), 0)]
        while stack:
            path, v = stack.pop()
            for t, c in self._kids[v].items():
                p = path + (t,)
                out[p] = self._count[c]
                if self._kids[c] is not None:
                    stack.append((p, c))
                else:
                    seq, pos = self._seq[c], self._link[c]
                    for i in range(pos, min(len(seq), pos + self.max_depth - self._depth[c])):
                        p = p + (seq[i],)
                        out[p] = 1
        return out

    def speculate(self, context, max_tokens: int, min_token_prob: float = 0.1,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0) -> tuple[list[int], float]:
        """(draft, score) continuing `context`. For every match length m (1 up to max_depth - 1, while
        the last m tokens of the context occur) a draft of at most min(max_tokens, max_depth - m,
        int(m * max_spec_factor + max_spec_offset)) tokens follows the most frequent child; the
        highest score wins, a longer match on ties. ([], 0.0) when nothing matches."""
        matches = self._advance([], list(context[-(self.max_depth - 1):]))
        return self._draft(matches, max_tokens, min_token_prob, max_spec_factor, max_spec_offset)

    def speculate_sequence(self, seq_id, max_tokens: int, min_token_prob: float = 0.1,
                           max_spec_factor: float = 1.0, max_spec_offset: float = 0.0) -> tuple[list[int], float]:
        """`speculate(sequence(seq_id), ...)` without matching: the sequence's own suffixes are where
        its appends left them."""
        return self._draft(self._sequence_matches(seq_id), max_tokens, min_token_prob, max_spec_factor,
                           max_spec_offset)

    def _sequence_matches(self, seq_id) -> list[tuple[int, int]]:
        """`_advance([], sequence(seq_id))`, read from the sequence's frontier."""
        seq, frontier = self._seqs[seq_id], self._frontiers[seq_id]
        kids, depth = self._kids, self._depth
        n, j0 = len(seq), len(seq) - len(frontier)
        matches = []
        for i in range(len(frontier) - 1, -1, -1):  # the shortest suffix first
            v, j = frontier[i], j0 + i
            while kids[v] is not None and depth[v] < n - j:  # expanded by a later occurrence
                v = kids[v][seq[j + depth[v]]]
            frontier[i] = v
            matches.append((v, n - j - depth[v]))
        return matches

    def _advance(self, matches: list[tuple[int, int]], tokens) -> list[tuple[int, int]]:
        """Match states after the context grows by `tokens`. A state (node, extra) per match length
        m = 1, 2, ... up to max_depth - 1 while the context's last m tokens occur: `extra` tokens read
        below a compact node, 0 at an expanded one."""
        kids, seqs, link = self._kids, self._seq, self._link
        root_kids, longest = kids[0], self.max_depth - 1
        for t in tokens:
            v = root_kids.get(t)
            if v is None:
                matches = []  # no suffix of the context occurs followed by t
                continue
            grown = [(v, 0)]
            for v, extra in matches:  # a shorter suffix that cannot be followed by t stops the longer ones
                if len(grown) == longest:
                    break
                if kids[v] is not None:
                    v = kids[v].get(t)
                    if v is None:
                        break
                    grown.append((v, 0))
                else:
                    p = link[v] + extra
                    if p >= len(seqs[v]) or seqs[v][p] != t:
                        break
                    grown.append((v, extra + 1))
            matches = grown
        return matches

    def _draft(self, matches, max_tokens: int, min_token_prob: float, max_spec_factor: float,
               max_spec_offset: float) -> tuple[list[int], float]:
        key = (max_tokens, max_spec_factor, max_spec_offset)
        limits = self._limits.get(key)
        if limits is None:
            limits = self._limits[key] = [min(max_tokens, self.max_depth - m, int(m * max_spec_factor + max_spec_offset))
                                          for m in range(1, self.max_depth)]
        kids, link, count, token, seqs = self._kids, self._link, self._count, self._token, self._seq
        best_draft: list[int] = []
        best_score = 0.0
        for (v, extra), limit in zip(matches, limits):
            if limit < best_score:  # every token adds at most 1
                continue
            draft: list[int] = []
            prob, score = 1.0, 0.0
            while len(draft) < limit:
                if kids[v] is not None:
                    c = link[v]
                    if c == _NONE:
                        break
                    prob *= count[c] / count[v]
                    v = c
                    t = token[c]
                else:
                    p = link[v] + extra
                    if p >= len(seqs[v]):
                        break
                    t, extra = seqs[v][p], extra + 1  # a single occurrence: ratio 1
                if prob < min_token_prob:
                    break
                draft.append(t)
                score += prob
            if draft and score >= best_score:
                best_draft, best_score = draft, score
        return best_draft, best_score


class _Request:
    __slots__ = ("tree", "tokens", "cache_id")

    def __init__(self, max_depth: int, prompt_ids, cache_id: int):
        self.tree = SuffixTree(max_depth)
        self.tree.extend(0, prompt_ids)
        self.tokens = self.tree.sequence(0)  # prompt and output
        self.cache_id = cache_id  # its output's sequence in the cache, while the cache holds it


class SuffixProposer:
    """Suffix decoding drafts from this request's prompt and output (its own tree) and from the outputs
    of the last `max_cached_requests` requests started (one shared tree, the oldest evicted first).

    A request's output joins the cache as it is generated, as in ArcticInference: counts over outputs
    alone, the request's own included, draft what the target writes better than counts diluted by the
    prompt (more tokens per step in benchmarks/bench_suffix.py than caching outputs when they finish).

    Two ways to drive it:
    - with request ids: `start_request(id, prompt_ids)`, `append(id, tokens)` after each step,
      `speculate(id, k)`, and `finish_request(id)`, which drops the request's own tree (its output
      stays cached until evicted);
    - as the built-in engine does, `propose(history, k)` / `propose_scored(history, k)` with the
      request's whole token history. The proposer tracks one such request: a history that extends the
      tracked one appends the new tokens; any other history finishes the tracked request and starts a
      new one whose prompt is that history. A continuation whose history extends the previous one (a
      second chat turn) therefore counts as the same request.
    """

    needs_hidden = False

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 256, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0, max_spec_offset: float = 0.0):
        if not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0 (0 turns the cache of outputs off), "
                             f"got {max_cached_requests!r}")
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

    @property
    def active_requests(self):
        """The ids of the requests started and not finished."""
        return self._requests.keys()

    def start_request(self, request_id, prompt_ids) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active; finish_request it before starting it again")
        self._requests[request_id] = self._start(prompt_ids)

    def append(self, request_id, tokens) -> None:
        self._append(self._request(request_id), tokens)

    def finish_request(self, request_id) -> None:
        """Stop tracking the request; its output stays in the cache until evicted."""
        self._finish(self._request(request_id))
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
                self._append(r, history[len(r.tokens):])
        else:
            if r is not None:
                self._finish(r)
            r = self._tracked = self._start(history)
        return self._speculate(r, k)

    def _request(self, request_id) -> _Request:
        r = self._requests.get(request_id)
        if r is None:
            raise ValueError(f"unknown request {request_id!r}; call start_request first")
        return r

    def _start(self, prompt_ids) -> _Request:
        r = _Request(self.max_depth, prompt_ids, next(self._cache_ids))
        if self.max_cached_requests:
            cache = self.global_tree
            cache.extend(r.cache_id, [])
            while len(cache) > self.max_cached_requests:
                cache.remove(next(iter(cache.seq_ids())))
        return r

    def _append(self, r: _Request, tokens) -> None:
        r.tree.extend(0, tokens)
        if r.cache_id in self.global_tree:
            self.global_tree.extend(r.cache_id, tokens)

    def _finish(self, r: _Request) -> None:
        cache = self.global_tree
        if r.cache_id in cache and not cache.sequence(r.cache_id):
            cache.remove(r.cache_id)  # no output: free its place in the cache

    def _speculate(self, r: _Request, k: int) -> tuple[list[int], float]:
        if k <= 0:
            return [], 0.0
        args = (k, self.min_token_prob, self.max_spec_factor, self.max_spec_offset)
        local = r.tree.speculate_sequence(0, *args)
        cache = self.global_tree
        if len(cache) == 0:
            return local
        if r.cache_id in cache and len(cache.sequence(r.cache_id)) >= self.max_depth - 1:
            # every suffix that can match is one of its output's own: read from where its appends left them
            cached = cache.speculate_sequence(r.cache_id, *args)
        else:
            cached = cache.speculate(r.tokens[-(self.max_depth - 1):], *args)
        return cached if cached[1] > local[1] else local
