"""Context-parallel sparse attention on CPU: the per-shard list splitter against a Python loop,
the shard-and-merge path in one process, and gloo process groups of 2-4 ranks, all against the
unsharded fp64 reference (1e-10)."""

import dataclasses
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distributed_cases import Case, build, oracle, shard_arguments
from flash_attn_sparse import SparseBlocks, SparseInputError
from flash_attn_sparse.distributed import (
    KeyShard,
    combine_partials,
    local_attention,
    pack_partial,
    sharded_sparse_attention,
    unpack_partials,
)
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.shard_lists import shard_blocks

TOLERANCE = 1e-10


def expected_rows(rows, lo, hi):
    return [g - lo for g in rows if lo <= g < hi]


def read_batched(cnt, idx):
    return [[[row[:c] for c, row in zip(ch, ih)] for ch, ih in zip(cb, ib)] for cb, ib in zip(cnt.tolist(), idx.tolist())]


def random_lists(rng, batch, heads, tiles, n_blocks):
    return [[[rng.sample(range(n_blocks), rng.randrange(0, n_blocks + 1)) for _ in range(tiles[b])]
             for _ in range(heads)] for b in range(batch)]


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_split_batched_matches_loop(heads, per_sequence):
    import random
    rng = random.Random(heads * 10 + per_sequence)
    bs, n_blocks, batch = 16, 12, 3
    full = random_lists(rng, batch, heads, [2] * batch, n_blocks)
    mask = random_lists(rng, batch, heads, [2] * batch, n_blocks)
    blocks = SparseBlocks.from_lists(full, mask, bs, 64)
    ranges = [(rng.randrange(0, 7) * bs, rng.randrange(7, 13) * bs - rng.randrange(0, 5)) for _ in range(batch)]
    if per_sequence:
        start = torch.tensor([lo for lo, _ in ranges], dtype=torch.int32)
        stop = torch.tensor([hi for _, hi in ranges], dtype=torch.int32)
    else:
        ranges = [ranges[0]] * batch
        start, stop = ranges[0]
    local = shard_blocks(blocks, start, stop)
    for lists, cnt, idx in ((full, local.full_cnt, local.full_idx), (mask, local.mask_cnt, local.mask_idx)):
        got = read_batched(cnt, idx)
        for b, (lo, hi) in enumerate(ranges):
            want = [[expected_rows(row, lo // bs, -(-hi // bs)) for row in per_h] for per_h in lists[b]]
            assert got[b] == want
    assert local.full_idx.shape == blocks.full_idx.shape


def test_split_shared_table_view():
    table = torch.tensor([9, 2, 5, 7, 0], dtype=torch.int32)
    blocks = SparseBlocks.from_block_table(table, 32, batch_size=2)
    local = shard_blocks(blocks, 64, 8 * 32)
    assert read_batched(local.full_cnt, local.full_idx) == [[[[0, 3, 5]]]] * 2  # 2, 5, 7 of blocks [2, 8)


@pytest.mark.parametrize("heads", [1, 4])
def test_split_varlen_matches_loop(heads):
    import random
    rng = random.Random(heads)
    bs, n_blocks = 16, 10
    tiles = [2, 1, 3, 1]
    full = random_lists(rng, 4, heads, tiles, n_blocks)
    full[1] = [[[]] for _ in range(heads)]  # a sequence with empty lists
    blocks = pack_varlen_lists(full, None, bs, 64)
    start = torch.tensor([0, 32, 64, 96], dtype=torch.int32)
    stop = torch.tensor([80, 160, 100, 97], dtype=torch.int32)
    local = shard_blocks(blocks, start, stop)
    cu_m, cu_off = blocks.cu_total_m_blocks.tolist(), blocks.cu_block_idx_offsets.tolist()
    cnt, idx = local.full_cnt.tolist(), local.full_idx.tolist()
    for b in range(4):
        n_b = (cu_off[b + 1] - cu_off[b]) // tiles[b]
        for h in range(heads):
            for m in range(tiles[b]):
                c = cnt[h][cu_m[b] + m]
                begin = cu_off[b] + m * n_b
                want = expected_rows(full[b][h][m], int(start[b]) // bs, -(-int(stop[b]) // bs))
                assert idx[h][begin:begin + c] == want, (b, h, m)


def test_split_rejects_unaligned_start():
    blocks = SparseBlocks.from_block_table(torch.tensor([0, 1], dtype=torch.int32), 32)
    with pytest.raises(SparseInputError, match="key_start"):
        shard_blocks(blocks, 40, 64)


CASES = [
    Case("decode-kv", 3, [1], [200], causal=True, seed=1),
    Case("decode-shared-b2", 2, [1, 1], [130, 130], table_heads="shared", causal=True, seed=2),
    Case("prefill-causal-q", 3, [90], [150], table_heads="q", causal=True, q_block_size=64, seed=3),
    Case("prefill-causal-one-tile", 4, [70, 70], [100, 100], causal=True, seed=4),
    Case("prefill-noncausal", 2, [33], [96], q_block_size=64, seed=5),
    Case("empty-shard", 3, [5], [160], causal=True, empty_shard=1, seed=6),
    Case("paged", 3, [3, 3], [120, 120], block_size=32, paged=True, causal=True, seed=7),
    Case("paged-prefill", 2, [80], [128], block_size=32, paged=True, causal=True, q_block_size=64, seed=8),
    Case("varlen-kv", 3, [1, 70, 4], [100, 64, 150], varlen=True, q_block_size=64, seed=9),
    # shard 0 has 96 keys after it: rows 0-103 causal, the non-causal call starts at tile 1 (row 64)
    Case("prefill-split-mid-tile", 2, [200], [256], q_block_size=64, causal=True, seed=12, boundaries=[[0, 160, 256]]),
    Case("varlen-q", 2, [2, 1], [50, 33], table_heads="q", varlen=True, seed=10),
]


def check(case, out, lse, want_out, want_lse):
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{case.name}: rows seeing no key differ"
    assert (lse[finite] - want_lse[finite]).abs().max().item() <= TOLERANCE if finite.any() else True
    assert (out - want_out).abs().max().item() <= TOLERANCE, f"{case.name}: out differs"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_shard_and_merge_in_one_process(case):
    """Every rank's partial in one process, merged by the code that merges gathered partials."""
    q, k, v, full, mask, blocks = build(case)
    flats = []
    for rank in range(case.world):
        args, kwargs = shard_arguments(case, rank, q, k, v, blocks)
        out, lse = local_attention(*args, **kwargs)
        flats.append(pack_partial(out, lse, case.head_dim, case.varlen))
    batch, seqlen_q = (1, q.shape[0]) if case.varlen else q.shape[:2]
    parts = unpack_partials(torch.cat(flats), case.world, batch, case.heads, seqlen_q, case.head_dim)
    out, lse = combine_partials(*parts, torch.float64, case.head_dim)
    if case.varlen:
        out, lse = out[0], lse[0]
    check(case, out, lse, *oracle(case, q, k, v, full, mask))


def test_local_lists_equal_global_lists():
    """Each rank's own (already split) lists give what the global lists give."""
    case = CASES[2]
    q, k, v, _, _, blocks = build(case)
    for rank in range(case.world):
        (q_, k_, v_, _, shard), kwargs = shard_arguments(case, rank, q, k, v, blocks)
        own = shard_blocks(blocks, shard.start, shard.stop)
        got = local_attention(q_, k_, v_, own, shard, local_lists=True, **kwargs)
        want = local_attention(q_, k_, v_, blocks, shard, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_empty_shard_is_neutral():
    case = Case("neutral", 3, [4], [96], causal=True, empty_shard=0, seed=11)
    q, k, v, _, _, blocks = build(case)
    out, lse = local_attention(*shard_arguments(case, 0, q, k, v, blocks)[0], causal=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    no_keys = KeyShard(32, 32, seqlen_k=96)  # a shard holding no key launches nothing
    out, lse = local_attention(q, k[:, :0], v[:, :0], blocks, no_keys, causal=True)
    assert out.shape == q.shape and torch.all(out == 0) and lse.shape == (1, case.heads, 4) and torch.all(lse == float("-inf"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, runs, error_dir):
    try:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=90))
        for case, merge in runs:
            q, k, v, full, mask, blocks = build(case)
            args, kwargs = shard_arguments(case, rank, q, k, v, blocks)
            out, lse = sharded_sparse_attention(*args, merge=merge, owner=world - 1, **kwargs)
            if merge == "owner" and rank != world - 1:
                assert out is None and lse is None
                continue
            check(case, out, lse, *oracle(case, q, k, v, full, mask))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_group(world, runs, timeout_s=150):
    """Forks `world` gloo ranks over `runs` ((case, merge) pairs); forked where it is safe, since
    a spawned rank spends seconds importing torch and the package; fails with the first rank's traceback, or after
    timeout_s (then terminates the ranks it started)."""
    with tempfile.TemporaryDirectory() as error_dir:
        # Forking a process that has initialised CUDA is unsafe (a GPU machine running the whole suite).
        start_method = "spawn" if torch.cuda.is_initialized() else "fork"
        context = mp.start_processes(_worker, args=(world, _free_port(), runs, error_dir), nprocs=world, join=False,
                                     start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail(f"gloo group of {world} timed out after {timeout_s} s")
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(error_dir, name)).read() for name in sorted(os.listdir(error_dir))]
            pytest.fail("\n".join(errors) or "a rank failed")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()


def with_world(cases, world):
    return [dataclasses.replace(case, world=world, boundaries=[]) for case in cases]


def test_gloo_two_ranks_both_merges():
    runs = [(case, "all_gather") for case in with_world(CASES, 2)]
    runs += [(case, "owner") for case in with_world([CASES[0], CASES[2], CASES[6], CASES[8]], 2)]
    run_group(2, runs)


@pytest.mark.parametrize("world", [3, 4])
def test_gloo_more_ranks(world):
    runs = [(case, "all_gather") for case in with_world(CASES, world)]
    runs += [(case, "owner") for case in with_world(CASES[:3], world)]
    run_group(world, runs)
