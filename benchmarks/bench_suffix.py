"""Per-step cost of the pure-Python suffix decoding proposer (speculators.suffix) at batch 1.

Real token streams, tokenized with the default target's tokenizer:
- `sharegpt`: multi-turn ShareGPT conversations, the prompt being every turn before the last assistant
  answer (chosen between --min-prompt and --max-prompt tokens) and the output that answer;
- `humaneval`: the HumanEval problem as a chat prompt, the function rewritten with its canonical body
  as the output.

Each stream is decoded as greedy verification against its recorded output would: each step the
proposer sees the history, drafts k tokens, and the step emits the drafts that match the output plus
one more token. The first --cache requests fill the cache of outputs (not timed); the next
--requests are timed. A step's time is the `propose_scored(history, k)` call, which also appends the
tokens emitted since the last one; the first step of a request, which builds the tree over its prompt
and evicts the oldest cached output, is shown apart. Times are the thread's CPU time (what the
proposer costs, whatever else the machine runs) and, for reference, the median wall time. Tokens/step
is the teacher-forced acceptance, 1 + accepted drafts.
vLLM's prompt lookup (`ngram_lookup`, n = 1..4) runs over the same steps for reference.

    python benchmarks/bench_suffix.py                    # both streams, k 4 and 16: about 2 min on 2 cores
    python benchmarks/bench_suffix.py --data humaneval --k 8 --cache 100 --requests 40
"""

import argparse
import gzip
import json
import statistics
import time
import tracemalloc

from speculators.assets import DEFAULT_TARGET, fetch
from speculators.data import chat_ids, iter_json_array, to_messages
from speculators.proposers import ngram_lookup
from speculators.suffix import SuffixProposer, SuffixTree
from speculators.target import model_tokenizer


def sharegpt_streams(tokenizer, n: int, min_prompt: int, max_prompt: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for record in iter_json_array(fetch("sharegpt")):
        messages = to_messages(record)
        if messages is None or messages[-1]["role"] != "assistant":
            continue
        prompt = chat_ids(tokenizer, messages[:-1])
        if not min_prompt <= len(prompt) <= max_prompt:
            continue
        output = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        if len(output) >= 32:
            out.append((prompt, output))
            if len(out) == n:
                break
    return out


def humaneval_streams(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    with gzip.open(fetch("humaneval"), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for r in rows[:n]:
        messages = [{"role": "user", "content": "Complete this Python function.\n\n" + r["prompt"]}]
        out.append((chat_ids(tokenizer, messages),
                    tokenizer(r["prompt"] + r["canonical_solution"], add_special_tokens=False)["input_ids"]))
    return out


def decode(propose, prompt: list[int], output: list[int], k: int, times: list[tuple[float, float]] | None):
    """Teacher-forced greedy decoding of one stream with propose(history, k) -> drafts; appends each
    step's (CPU seconds, wall seconds) to `times`; returns (steps, tokens emitted)."""
    history = list(prompt) + output[:1]
    i, steps = 1, 0
    while i < len(output):
        cpu, wall = time.thread_time(), time.perf_counter()
        drafts = propose(history, k)
        if times is not None:
            times.append((time.thread_time() - cpu, time.perf_counter() - wall))
        n = 0
        while n < len(drafts) and i + n < len(output) and drafts[n] == output[i + n]:
            n += 1
        emitted = output[i : i + n + 1]
        history += emitted
        i += len(emitted)
        steps += 1
    return steps, len(output) - 1


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(name: str, streams, k: int, n_cache: int, max_depth: int):
    warm, timed = streams[:n_cache], streams[n_cache:]
    suffix = SuffixProposer(max_depth=max_depth, max_cached_requests=max(n_cache, 1))

    def suffix_drafts(history, k):
        return suffix.propose_scored(history, k)[0]

    def ngram_drafts(history, k):
        return ngram_lookup(history, k, 1, 4)

    for prompt, output in warm:
        decode(suffix_drafts, prompt, output, k, None)
    suffix.propose([], k)  # finishes the last warm-up request: its output joins the cache
    rows = []
    for label, propose in (("suffix", suffix_drafts), ("ngram", ngram_drafts)):
        steady: list[tuple[float, float]] = []
        firsts: list[float] = []
        steps = tokens = 0
        for prompt, output in timed:
            times: list[tuple[float, float]] = []
            s, t = decode(propose, prompt, output, k, times)
            steps, tokens = steps + s, tokens + t
            firsts.append(times[0][0])
            steady += times[1:]
        rows.append((label, steady, firsts, tokens / steps))
    prompt_len = statistics.mean(len(p) for p, _ in timed)
    output_len = statistics.mean(len(o) for _, o in timed)
    print(f"\n{name}: {len(timed)} timed requests (prompt {prompt_len:.0f} tokens, output {output_len:.0f} on "
          f"average), {len(suffix.global_tree)} cached outputs, max_depth {max_depth}, k {k}")
    print(f"  {'':8} {'':>6} {'CPU time per step, us':^26} {'wall, us':>8} {'1st step':>9} {'tokens/':>8}")
    print(f"  {'proposer':8} {'steps':>6} {'mean':>8} {'p50':>8} {'p99':>8} {'p50':>8} {'CPU ms':>9} {'step':>8}")
    for label, steady, firsts, tau in rows:
        cpu = [c * 1e6 for c, _ in steady]
        wall = [w * 1e6 for _, w in steady]
        print(f"  {label:8} {len(cpu):6d} {statistics.mean(cpu):8.1f} {percentile(cpu, 0.5):8.1f} "
              f"{percentile(cpu, 0.99):8.1f} {percentile(wall, 0.5):8.1f} {statistics.mean(firsts) * 1e3:9.2f} {tau:8.3f}")


def cache_cost(streams, n_cache: int, max_depth: int) -> None:
    """CPU time and memory of holding n_cache outputs in one tree, and of one request's tree over its prompt."""
    outputs = [o for _, o in streams[:n_cache]]
    n_tokens = sum(len(o) for o in outputs)
    tree = SuffixTree(max_depth)
    start = time.thread_time()
    for i, output in enumerate(outputs):
        tree.extend(i, output)
    built = time.thread_time() - start
    start = time.thread_time()
    tree.remove(0)
    removed = time.thread_time() - start
    tracemalloc.start()
    tree = SuffixTree(max_depth)
    for i, output in enumerate(outputs):
        tree.extend(i, output)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"  cache of {len(outputs)} outputs ({n_tokens} tokens): {tree.num_nodes()} nodes, {size / 2**20:.1f} MiB, "
          f"{built / n_tokens * 1e6:.1f} us per token to add, {removed * 1e3:.1f} ms to evict the first")
    prompt = max((p for p, _ in streams), key=len)
    start = time.thread_time()
    SuffixTree(max_depth).extend(0, prompt)
    print(f"  a request's tree over its {len(prompt)}-token prompt: {(time.thread_time() - start) * 1e3:.1f} ms to build")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", nargs="+", default=["sharegpt", "humaneval"], choices=["sharegpt", "humaneval"])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--cache", type=int, default=100, help="finished requests in the cache of outputs")
    ap.add_argument("--requests", type=int, default=20, help="timed requests")
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--min-prompt", type=int, default=1000, help="ShareGPT prompt length range, tokens")
    ap.add_argument("--max-prompt", type=int, default=2000)
    args = ap.parse_args()
    if args.cache < 0 or args.requests < 1 or min(args.k) < 1:
        ap.error("--cache must be >= 0, --requests >= 1 and every --k >= 1")
    tokenizer = model_tokenizer(DEFAULT_TARGET)
    for name in args.data:
        n = args.cache + args.requests
        if name == "sharegpt":
            streams = sharegpt_streams(tokenizer, n, args.min_prompt, args.max_prompt)
        else:
            streams = humaneval_streams(tokenizer, n)
        if len(streams) <= args.cache:
            ap.error(f"{name} gave {len(streams)} streams, not more than --cache {args.cache}; lower --cache")
        for k in args.k:
            run(name, streams, k, args.cache, args.max_depth)
        cache_cost(streams, args.cache, args.max_depth)


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
