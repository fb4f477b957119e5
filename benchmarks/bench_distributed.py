"""Context-parallel sparse decode over the GPUs of one host vs one GPU holding every key.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --out benchmarks/results

Decode B1 Sq1 H32/Hk8 d128 bf16, 1M keys cut evenly over the ranks (block-aligned), per-K/V-head
lists of a given density (random blocks, ascending, the last block always listed). Per call,
the slowest rank's time of: the sharded call (list split + local forward + all-gather + combine;
merge="all_gather", and "owner"); its parts alone (the list split; the local forward with the
split; the all_gather_into_tensor of the partial); and, on rank 0, the unsharded call over all keys where
they fit. Each is timed eagerly and replayed from a CUDA graph (launch overhead removed); the
communication share is the all-gather's time over the sharded call's. Run with one process it
times the unsharded call only.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from flash_attn_sparse import SparseBlocks, flash_attn_with_sparse_block_table
from flash_attn_sparse.distributed import KeyShard, head_dim_padded, local_attention, pack_partial, sharded_sparse_attention
from flash_attn_sparse.metadata import cdiv
from flash_attn_sparse.shard_lists import shard_blocks


def lists(n_blocks: int, density: float, heads_k: int, device) -> SparseBlocks:
    gen = torch.Generator().manual_seed(0)
    count = max(1, int(n_blocks * density))
    rows = []
    for _ in range(heads_k):
        chosen = torch.randperm(n_blocks - 1, generator=gen)[:count - 1]
        rows.append(torch.cat((chosen.sort().values, torch.tensor([n_blocks - 1]))))
    idx = torch.stack(rows).to(torch.int32).view(1, heads_k, 1, count)
    cnt = torch.full((1, heads_k, 1), count, dtype=torch.int32)
    return SparseBlocks(cnt.to(device), idx.to(device), block_size=128)


def time_us(fn, iters: int, graph: bool, barrier: bool = True) -> float:
    """Median of 5 repeats of the mean per-call time over `iters` calls, in microseconds; with
    barrier, the ranks start each repeat together."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(iters):
                fn()
        fn = captured.replay
        calls = 1
    else:
        calls = iters
    samples = []
    for _ in range(5):
        if barrier and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / iters)
    return statistics.median(samples)


def slowest(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1 << 20)
    parser.add_argument("--densities", type=float, nargs="+", default=[1 / 16, 1 / 64])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    rank = dist.get_rank() if world > 1 else 0
    heads, heads_k, head_dim, block = 32, 8, 128, 128
    n_blocks = cdiv(args.keys, block)
    cut = cdiv(n_blocks, world) * block  # block-aligned even shards
    start, stop = min(rank * cut, args.keys), min((rank + 1) * cut, args.keys)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 1, heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    k_local, v_local = (torch.randn(1, stop - start, heads_k, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                        for _ in range(2))
    shard = KeyShard(start, stop, seqlen_k=args.keys)
    rows = []
    for density in args.densities:
        blocks = lists(n_blocks, density, heads_k, "cuda")
        row = dict(world=world, keys=args.keys, density=density, listed_blocks=int(blocks.full_cnt[0, 0, 0]))
        for graph in (False, True):
            mode = "graph" if graph else "eager"
            if world > 1:
                sharded = lambda: sharded_sparse_attention(q, k_local, v_local, blocks, shard, causal=True)
                owner = lambda: sharded_sparse_attention(q, k_local, v_local, blocks, shard, causal=True, merge="owner")
                local = lambda: local_attention(q, k_local, v_local, blocks, shard, causal=True)
                split = lambda: shard_blocks(blocks, start, stop)
                out, lse = local()
                flat = pack_partial(out, lse, head_dim_padded(head_dim, q.device), varlen=False)
                gathered = flat.new_empty(world * flat.numel())
                gather = lambda: dist.all_gather_into_tensor(gathered, flat)
                row[f"sharded_us_{mode}"] = slowest(time_us(sharded, args.iters, graph))
                if not graph:  # gather to one rank is timed eagerly only
                    row["owner_us_eager"] = slowest(time_us(owner, args.iters, graph))
                row[f"local_forward_us_{mode}"] = slowest(time_us(local, args.iters, graph))
                row[f"list_split_us_{mode}"] = slowest(time_us(split, args.iters, graph))
                row[f"all_gather_us_{mode}"] = slowest(time_us(gather, args.iters, graph))
                row[f"comm_share_{mode}"] = row[f"all_gather_us_{mode}"] / row[f"sharded_us_{mode}"]
                row["partial_bytes_per_rank"] = flat.numel() * flat.element_size()
        if rank == 0:
            try:  # one GPU holding every key (4 GiB of K/V at 1M keys)
                k_all, v_all = (torch.randn(1, args.keys, heads_k, head_dim, device="cuda", generator=gen,
                                            dtype=torch.bfloat16) for _ in range(2))
                whole = lambda: flash_attn_with_sparse_block_table(q, k_all, v_all, blocks, causal=True)
                for graph in (False, True):
                    row[f"one_gpu_us_{'graph' if graph else 'eager'}"] = time_us(whole, args.iters, graph, barrier=False)
                del k_all, v_all
            except torch.cuda.OutOfMemoryError:
                row["one_gpu_us_eager"] = row["one_gpu_us_graph"] = None
        if world > 1:
            dist.barrier()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row))
    if rank == 0 and args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"distributed_decode_{world}gpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
