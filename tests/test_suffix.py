"""Suffix decoding: the trie's counts, drafts and eviction against brute force over random sequences."""

import gc
import random
from collections import Counter

import pytest

from speculators.suffix import SuffixProposer, SuffixTree


def brute_counts(seqs, max_depth):
    counts = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + max_depth) + 1):
                counts[tuple(s[i:j])] += 1
    return dict(counts)


def brute_speculate(counts, max_depth, context, max_tokens, min_token_prob=0.1, factor=1.0, offset=0.0):
    children = {}
    for path, c in counts.items():
        children.setdefault(path[:-1], []).append((path[-1], c))
    context = list(context)[-(max_depth - 1):]
    best, best_score = [], 0.0
    for m in range(1, len(context) + 1):
        path = tuple(context[-m:])
        if path not in counts:
            break
        limit = min(max_tokens, max_depth - m, int(m * factor + offset))
        draft, prob, score = [], 1.0, 0.0
        while len(draft) < limit and children.get(path):
            token, c = max(children[path], key=lambda tc: (tc[1], -tc[0]))
            prob *= c / counts[path]
            if prob < min_token_prob:
                break
            draft.append(token)
            score += prob
            path += (token,)
        if draft and score >= best_score:
            best, best_score = draft, score
    return best, best_score


def random_seq(rng, alphabet, n):
    # Repeats make deep shared paths (expanded nodes); long random runs stay compact.
    out = []
    while len(out) < n:
        if out and rng.random() < 0.3:
            i = rng.randrange(len(out))
            out.extend(out[i : i + rng.randint(1, 8)])
        else:
            out.append(rng.randrange(alphabet))
    return out[:n]


def extend_in_chunks(tree, rng, seqs):
    """Extend every sequence of `seqs` in random chunks, interleaving the sequences."""
    pos = {i: 0 for i in seqs}
    while pos:
        i = rng.choice(sorted(pos))
        n = rng.randint(1, 7)
        tree.extend(i, seqs[i][pos[i] : pos[i] + n])
        pos[i] += n
        if pos[i] >= len(seqs[i]):
            del pos[i]


def random_contexts(rng, seqs, alphabet, n):
    out = []
    for _ in range(n):
        s = rng.choice(seqs)
        if rng.random() < 0.8 and s:
            end = rng.randint(1, len(s))
            out.append(s[max(0, end - rng.randint(1, 30)) : end])
        else:
            out.append([rng.randrange(alphabet) for _ in range(rng.randint(1, 6))])
    return out


def check_speculate(tree, seqs, rng, alphabet, n=40):
    counts = brute_counts(seqs, tree.max_depth)
    for ctx in random_contexts(rng, seqs, alphabet, n):
        k = rng.randint(1, 10)
        min_p = rng.choice([0.05, 0.1, 0.3, 0.6])
        factor, offset = rng.choice([(1.0, 0.0), (2.0, 1.0), (100.0, 0.0)])
        got = tree.speculate(ctx, k, min_p, factor, offset)
        assert got == brute_speculate(counts, tree.max_depth, ctx, k, min_p, factor, offset), (ctx, k, min_p, factor)


@pytest.mark.parametrize("max_depth", [2, 3, 5, 9])
def test_counts_match_every_substring_occurrence(max_depth):
    rng = random.Random(max_depth)
    for trial in range(25):
        alphabet = rng.choice([2, 3, 5, 20])
        seqs = {i: random_seq(rng, alphabet, rng.randint(0, 60)) for i in range(rng.randint(1, 4))}
        tree = SuffixTree(max_depth)
        extend_in_chunks(tree, rng, seqs)
        assert tree.path_counts() == brute_counts(seqs.values(), max_depth), (trial, seqs)


def test_incremental_append_equals_rebuild():
    rng = random.Random(1)
    for trial in range(30):
        max_depth, alphabet = rng.choice([3, 6, 12]), rng.choice([2, 4, 30])
        seq = random_seq(rng, alphabet, 80)
        one_by_one, whole = SuffixTree(max_depth), SuffixTree(max_depth)
        for t in seq:
            one_by_one.extend("a", [t])
        whole.extend("a", seq)
        assert one_by_one.path_counts() == whole.path_counts() == brute_counts([seq], max_depth)
        for ctx in random_contexts(rng, [seq], alphabet, 20):
            assert one_by_one.speculate(ctx, 8, 0.1, 4.0) == whole.speculate(ctx, 8, 0.1, 4.0)


@pytest.mark.parametrize("max_depth", [3, 6, 24])
def test_speculate_matches_brute_force(max_depth):
    rng = random.Random(100 + max_depth)
    for _ in range(20):
        alphabet = rng.choice([2, 3, 6, 50])
        seqs = {i: random_seq(rng, alphabet, rng.randint(1, 80)) for i in range(rng.randint(1, 4))}
        tree = SuffixTree(max_depth)
        extend_in_chunks(tree, rng, seqs)
        check_speculate(tree, list(seqs.values()), rng, alphabet)


def test_speculate_sequence_equals_matching_the_sequence():
    rng = random.Random(11)
    for _ in range(30):
        max_depth, alphabet = rng.choice([2, 4, 10, 24]), rng.choice([2, 3, 6])
        seqs = {i: random_seq(rng, alphabet, rng.randint(1, 60)) for i in range(rng.randint(1, 3))}
        tree = SuffixTree(max_depth)
        pos = {i: 0 for i in seqs}
        while pos:  # interleaved appends expand other sequences' compact nodes between queries
            i = rng.choice(sorted(pos))
            start, pos[i] = pos[i], pos[i] + rng.randint(1, 5)
            tree.extend(i, seqs[i][start : pos[i]])
            k, factor = rng.randint(1, 12), rng.choice([1.0, 100.0])
            # the same match states (node, tokens below it) as matching from the root
            assert tree._sequence_matches(i) == tree._advance([], tree.sequence(i)[-(max_depth - 1):])
            assert tree.speculate_sequence(i, k, 0.1, factor) == tree.speculate(tree.sequence(i), k, 0.1, factor)
            if pos[i] >= len(seqs[i]):
                del pos[i]


def test_eviction_leaves_the_tree_of_the_remaining_sequences():
    rng = random.Random(7)
    for trial in range(25):
        max_depth, alphabet = rng.choice([3, 5, 10]), rng.choice([2, 3, 8])
        seqs = {i: random_seq(rng, alphabet, rng.randint(0, 50)) for i in range(5)}
        tree = SuffixTree(max_depth)
        extend_in_chunks(tree, rng, seqs)
        for victim in rng.sample(sorted(seqs), 5):
            tree.remove(victim)
            del seqs[victim]
            assert tree.path_counts() == brute_counts(seqs.values(), max_depth), (trial, victim)
            if seqs:
                # the cached most-frequent children must follow the decremented counts
                check_speculate(tree, list(seqs.values()), rng, alphabet, n=15)
        assert tree.path_counts() == {} and len(tree) == 0 and tree.num_nodes() == 1  # no node leaks
        # sequences added after removals are counted from scratch, in the removed nodes' ids
        fresh = {i: random_seq(rng, alphabet, 40) for i in (9, 10, 11)}
        extend_in_chunks(tree, rng, fresh)
        assert tree.path_counts() == brute_counts(fresh.values(), max_depth)
        check_speculate(tree, list(fresh.values()), rng, alphabet, n=30)


def test_nodes_are_not_objects_the_cycle_collector_tracks():
    rng = random.Random(2)
    before = len(gc.get_objects())
    tree = SuffixTree(24)
    for i in range(20):
        tree.extend(i, random_seq(rng, 50, 500))
    assert tree.num_nodes() > 10_000
    assert len(gc.get_objects()) - before < 100  # the tree's lists and the sequences, not one per node


def test_scores_and_min_token_prob_cutoff():
    # (1) occurs 3 times: followed by 2 twice and 3 once; (1, 2) by 5 once and 6 once (tie: 5).
    tree = SuffixTree(4)
    tree.extend(0, [1, 2, 5, 8, 1, 2, 6, 1, 3, 7, 9])
    ctx = [9, 1]  # (9, 1) does not occur, so the match is (1)
    assert tree.speculate(ctx, 3, 0.1, 100.0) == ([2, 5, 8], pytest.approx(2 / 3 + 1 / 3 + 1 / 3))
    assert tree.speculate(ctx, 3, 0.5, 100.0) == ([2], pytest.approx(2 / 3))
    assert tree.speculate(ctx, 3, 2 / 3, 100.0) == ([2], pytest.approx(2 / 3))  # equal to the cutoff: kept
    assert tree.speculate(ctx, 3, 0.7, 100.0) == ([], 0.0)
    # the draft length is capped by match length * factor + offset, and by the depth left
    assert tree.speculate(ctx, 3, 0.1) == ([2], pytest.approx(2 / 3))
    assert tree.speculate(ctx, 9, 0.1, 100.0)[0] == [2, 5, 8]  # depth 4 = 1 matched + 3 drafted
    assert tree.speculate([4], 3) == ([], 0.0)


def expected_draft(depth, tokens, cached_outputs, k):
    """The proposer's draft, brute force: the request's prompt and output against the cached outputs."""
    local = brute_speculate(brute_counts([tokens], depth), depth, tokens, k, 0.1, 100.0)
    cached = brute_speculate(brute_counts(cached_outputs, depth), depth, tokens, k, 0.1, 100.0)
    return cached if cached[1] > local[1] else local


def test_proposer_caches_outputs_as_they_grow_and_evicts_the_oldest():
    rng = random.Random(3)
    depth, cap = 8, 3
    prop = SuffixProposer(max_depth=depth, max_cached_requests=cap, max_spec_factor=100.0)
    outputs = []
    for r in range(6):
        prompt, output = random_seq(rng, 6, 20), random_seq(rng, 6, 30)
        prop.start_request(r, prompt)
        for i in range(0, len(output), 3):
            prop.append(r, output[i : i + 3])
            cached = outputs[-(cap - 1):] + [output[: i + 3]]  # its own output so far is cached too
            assert prop.speculate(r, 5) == expected_draft(depth, prompt + output[: i + 3], cached, 5)
        prop.finish_request(r)
        outputs.append(output)
        assert prop.global_tree.path_counts() == brute_counts(outputs[-cap:], depth)
    prop.start_request("empty", [1, 2, 3])  # its place in the cache evicts the oldest output
    prop.finish_request("empty")  # no output: the place is freed
    assert len(prop.global_tree) == cap - 1
    assert prop.global_tree.path_counts() == brute_counts(outputs[-(cap - 1):], depth)
    with pytest.raises(ValueError, match="unknown request 0"):
        prop.speculate(0, 3)


def test_concurrent_requests_draft_from_each_others_outputs():
    rng = random.Random(9)
    depth, cap = 6, 4
    prop = SuffixProposer(max_depth=depth, max_cached_requests=cap, max_spec_factor=100.0)
    streams = {r: (random_seq(rng, 4, 10), random_seq(rng, 4, rng.randint(5, 40))) for r in range(16)}
    outputs = {r: [] for r in streams}  # generated so far
    started = []
    waiting = list(streams)
    while waiting or set(started) - {r for r in started if len(outputs[r]) == len(streams[r][1])}:
        active = [r for r in started if len(outputs[r]) < len(streams[r][1])]
        if waiting and (len(active) < 3 or rng.random() < 0.1):
            r = waiting.pop(0)
            prop.start_request(r, streams[r][0])
            started.append(r)
            continue
        r = rng.choice(active)
        prompt, output = streams[r]
        new = output[len(outputs[r]) : len(outputs[r]) + rng.randint(1, 4)]
        prop.append(r, new)
        outputs[r] += new
        # the cache holds the outputs of the last `cap` requests started, as far as they have got
        cached = [outputs[q] for q in started[-cap:]]
        assert prop.global_tree.path_counts() == brute_counts(cached, depth)
        assert prop.speculate(r, 4) == expected_draft(depth, prompt + outputs[r], cached, 4)
        if len(outputs[r]) == len(output):
            prop.finish_request(r)


def test_another_requests_output_drafts_while_it_runs():
    prop = SuffixProposer(max_depth=8, max_cached_requests=4, max_spec_factor=100.0)
    prop.start_request("x", [0])
    prop.append("x", [7, 7, 7])
    prop.finish_request("x")
    prop.start_request("a", [1, 2, 3, 4])
    assert prop.speculate("a", 4) == ([], 0.0)  # neither its prompt nor the cache continues (.., 3, 4)
    prop.start_request("b", [0])
    prop.append("b", [3, 4, 5, 6])
    assert prop.speculate("a", 4) == ([5, 6], 2.0)


def test_propose_from_history_tracks_one_request_at_a_time():
    rng = random.Random(5)
    explicit = SuffixProposer(max_depth=10, max_cached_requests=4)
    implicit = SuffixProposer(max_depth=10, max_cached_requests=4)
    for r in range(4):
        prompt, output = random_seq(rng, 5, 25), random_seq(rng, 5, 40)
        explicit.start_request(r, prompt)
        history = list(prompt)
        step = 0
        while step < len(output):
            drafts, score = implicit.propose_scored(history, 4)
            assert (drafts, score) == explicit.speculate(r, 4)
            assert implicit.propose(history, 4) == drafts
            emitted = output[step : step + rng.randint(1, 4)]
            history += emitted
            explicit.append(r, emitted)
            step += len(emitted)
        implicit.propose(history, 4)
        explicit.finish_request(r)  # the implicit one finishes at the next request's first call
        assert implicit.global_tree.path_counts() == explicit.global_tree.path_counts()


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="max_depth must be an integer >= 2"):
        SuffixTree(1)
    with pytest.raises(ValueError, match="max_cached_requests must be an integer >= 0"):
        SuffixProposer(max_cached_requests=-1)
    with pytest.raises(ValueError, match="min_token_prob must lie in"):
        SuffixProposer(min_token_prob=0)
    prop = SuffixProposer()
    prop.start_request("a", [1, 2])
    with pytest.raises(ValueError, match="already active"):
        prop.start_request("a", [1])
    assert prop.speculate("a", 0) == ([], 0.0)
