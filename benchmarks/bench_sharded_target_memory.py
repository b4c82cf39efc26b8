"""Host memory of loading the frozen target: whole in every process (DDP) against `shard_target`'s
shard-by-shard load (FSDP2), in N gloo processes on this machine, one run.

Each variant runs in fresh processes. Per process, after the load and one forward, it reports the memory
the target added as proportional set size (PSS: a checkpoint that every process maps is shared, not
counted N times; transformers maps a checkpoint already in the target's dtype instead of copying it), the
anonymous part of it (after malloc_trim: what the target keeps alive, not what glibc keeps of freed
buffers), the decoder-layer parameters held, and how far the loaded target's hidden states
on one batch are from the whole target's (they must agree: same weights, same forward).

    python benchmarks/bench_sharded_target_memory.py                        # the default target, bf16
    python benchmarks/bench_sharded_target_memory.py --widen 4 --layers 12  # random weights, its architecture:
                                                                            # 16x the layer size, 12 layers

Memory depends only on the shapes, so `--widen`/`--layers` write a random-weight checkpoint (hidden and MLP
sizes times `--widen`) to a temporary directory, to show the effect at a size where the layers dominate.
"""

import argparse
import ctypes
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from speculators.target import Target, load_tokenizer, resolve_model_path

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 2**30


def pss_bytes() -> tuple[int, int]:
    """(proportional set size, its anonymous part): resident memory with pages shared by several processes
    (a checkpoint file mapped by all of them) split among them, so the sum over processes is what the
    machine spends."""
    with open("/proc/self/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Pss")}
    return fields["Pss"], fields["Pss_Anon"]


def worker(rank, world, port, model, dtype, sharded, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ids = torch.arange(1, 33)[None]
    pss_before, anon_before = pss_bytes()
    device = torch.device("cpu")
    target = (Target.load_sharded(model, dtype, device, world) if sharded else Target.load(model, dtype))
    hidden = target(ids, logits=False).hidden.float()  # every weight has been read once
    dist.barrier()  # all processes map what they will map before any measures
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # live memory, not freed blocks (all-gather buffers) malloc keeps
    pss, anon = pss_bytes()
    held, total = target.layer_parameters()
    results[(sharded, rank)] = (pss - pss_before, anon - anon_before, held, total, hidden)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_checkpoint(model: str, widen: int, layers: int | None, dtype: torch.dtype, out: str) -> str:
    """A random-weight model of `model`'s architecture, `widen` times wider, as a safetensors directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(model)[0]
    cfg = AutoConfig.from_pretrained(path)
    cfg.hidden_size *= widen
    cfg.intermediate_size *= widen
    cfg.num_attention_heads *= widen
    cfg.num_key_value_heads *= widen
    cfg.num_hidden_layers = layers or cfg.num_hidden_layers
    torch.manual_seed(0)
    big = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    big.save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or safetensors model directory")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--widen", type=int, default=1, help="a random-weight target this many times wider")
    p.add_argument("--layers", type=int, help="its number of decoder layers (default: the model's)")
    p.add_argument("--saved-dtype", choices=DTYPES, default="fp32", help="the random checkpoint's dtype on disk")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.widen > 1 or args.layers:
            model = random_checkpoint(args.model, args.widen, args.layers, DTYPES[args.saved_dtype], tmp)
        print(f"target: {model} ({resolve_model_path(model)[0]}), {args.dtype}, {args.processes} gloo processes")
        results = mp.Manager().dict()
        for sharded in (False, True):  # fresh processes per variant: nothing of the other's load remains
            mp.spawn(worker, args=(args.processes, free_port(), model, DTYPES[args.dtype], sharded, results),
                     nprocs=args.processes)
    reference = results[(False, 0)][4]
    print(f"{'variant':<28} {'rank':>4} {'PSS added GiB':>14} {'of it anon GiB':>15} {'layer params held':>22} "
          f"{'max |dh|':>9}")
    for sharded in (False, True):
        for rank in range(args.processes):
            pss, anon, held, total, hidden = results[(sharded, rank)]
            name = "shard_target (FSDP2)" if sharded else "whole target (DDP)"
            print(f"{name:<28} {rank:>4} {pss / GIB:>14.3f} {anon / GIB:>15.3f} {held:>11,}/{total:,} "
                  f"{(hidden - reference).abs().max().item():>9.2e}")
    whole = sum(results[(False, r)][0] for r in range(args.processes))
    shard = sum(results[(True, r)][0] for r in range(args.processes))
    print(f"target memory (PSS) over the processes, whole / sharded: {whole / shard:.2f}x")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
