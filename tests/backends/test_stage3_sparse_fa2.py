"""Stage 3 (and the stage 5 API over it): the FA-2 sparse path against the stage-1 oracles.

Every list shape that broke earlier forks is here: permuted and gapped lists (so that a V that
steps densely instead of following the list fails), the partial tail block anywhere in the list,
single-block, all-blocks, tail-only and empty lists, over both kernels (split forced and not).
"""

import random

import pytest
import torch

from flash_attn_sparse import SparseBlocks, flash_attn_with_sparse_block_table
from flash_attn_sparse.reference import block_positions
from helpers import assert_close_to_reference, poison_allocator, random_qkv, sparse_kernel_launches

pytestmark = [pytest.mark.stage3, pytest.mark.gpu]

BLOCK_SIZES = [16, 32, 64, 128, 256]
LIST_KINDS = ["permuted_gapped", "contiguous", "single", "all", "tail_only", "empty"]
# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype), cycled through the cases so that
# every value meets every list kind and block size somewhere.
BATCHES = [1, 3]
SEQLENS_Q = [1, 4, 16, 128, 1000]
SEQLENS_K = [32768, 1000, 4096 + 77, 8191, 300]
HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA, MQA
HEAD_DIMS = [64, 128]
DTYPES = [torch.float16, torch.bfloat16]


def case_config(index):
    pick = lambda values, stride=1: values[(index // stride) % len(values)]
    return (pick(BATCHES), pick(SEQLENS_Q, 2), pick(SEQLENS_K, 3), pick(HEADS, 5), pick(HEAD_DIMS, 7), pick(DTYPES, 11))


def make_list(kind, n_blocks, rng):
    if kind == "permuted_gapped":
        chosen = sorted(rng.sample(range(n_blocks), max(2, n_blocks // 2)))
        # Make sure the list has a gap and holds the (possibly partial) tail block.
        if n_blocks - 1 not in chosen:
            chosen[-1] = n_blocks - 1
        if chosen == list(range(chosen[0], chosen[0] + len(chosen))) and n_blocks > 2:
            chosen = [b for b in chosen if b != chosen[len(chosen) // 2]]
        rng.shuffle(chosen)
        return chosen
    if kind == "contiguous":
        lo = rng.randrange(n_blocks)
        return list(range(lo, min(n_blocks, lo + max(1, n_blocks // 3))))
    if kind == "single":
        return [rng.randrange(n_blocks)]
    if kind == "all":
        return list(range(n_blocks))
    if kind == "tail_only":
        return [n_blocks - 1]
    return []


def visibility_of(blocks, block_size, seqlen_q, seqlen_k, device):
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    visible[:, block_positions(blocks, block_size, seqlen_k).to(device)] = True
    return visible


def run_and_check(q, k, v, blocks, block_size, num_splits):
    batch, seqlen_q, heads, head_dim = q.shape
    table = torch.tensor(blocks, dtype=torch.int32, device=q.device)
    poison_allocator(((batch, seqlen_q, heads, head_dim), q.dtype), ((batch, heads, seqlen_q), torch.float32))
    out, lse = flash_attn_with_sparse_block_table(q, k, v, table, block_size=block_size, num_splits=num_splits)
    visible = visibility_of(blocks, block_size, seqlen_q, k.shape[1], q.device)
    return assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", LIST_KINDS)
def test_block_table_lists(kind, block_size, num_splits):
    index = LIST_KINDS.index(kind) * len(BLOCK_SIZES) * 2 + BLOCK_SIZES.index(block_size) * 2 + (num_splits > 1)
    batch, seqlen_q, seqlen_k, (heads, heads_k), head_dim, dtype = case_config(index)
    g = torch.Generator(device="cuda").manual_seed(index)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, generator=g)
    blocks = make_list(kind, -(-seqlen_k // block_size), random.Random(index))
    run_and_check(q, k, v, blocks, block_size, num_splits)


@pytest.mark.parametrize("num_splits", [0, 1, 4], ids=["auto", "nosplit", "split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("seqlen_q", SEQLENS_Q)
def test_permuted_lists_across_shapes(seqlen_q, heads, head_dim, dtype, num_splits):
    seed = seqlen_q * 7 + head_dim + heads[1]
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, seqlen_k, block_size = (3, 5000, 128) if seqlen_q <= 128 else (1, 3000, 64)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads[0], heads[1], head_dim, dtype, generator=g)
    blocks = make_list("permuted_gapped", -(-seqlen_k // block_size), random.Random(seed))
    run_and_check(q, k, v, blocks, block_size, num_splits)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_tail_block_in_the_middle_of_the_list(block_size):
    g = torch.Generator(device="cuda").manual_seed(block_size)
    seqlen_k = 10 * block_size + 5
    q, k, v = random_qkv(2, 16, seqlen_k, 8, 2, 128, torch.bfloat16, generator=g)
    run_and_check(q, k, v, [3, 10, 0, 7], block_size, num_splits=1)


def test_per_batch_and_head_lists():
    """SparseBlocks with a different list per (batch, KV head), one query tile."""
    g = torch.Generator(device="cuda").manual_seed(5)
    batch, seqlen_q, seqlen_k, heads, heads_k, block_size = 2, 16, 2000, 8, 2, 64
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    n_blocks = -(-seqlen_k // block_size)
    rng = random.Random(5)
    lists = [[[rng.sample(range(n_blocks), rng.randrange(0, 12))] for _ in range(heads_k)] for _ in range(batch)]
    blocks = SparseBlocks.from_lists(lists, block_size=block_size, device="cuda")
    for num_splits in (1, 3):
        out, lse = flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=num_splits)
        for b in range(batch):
            visible = torch.stack([visibility_of(lists[b][h // (heads // heads_k)][0], block_size, seqlen_q, seqlen_k, "cuda")
                                   for h in range(heads)])
            assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], visible)


def test_repeated_calls_are_deterministic():
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = random_qkv(2, 16, 8192, 8, 2, 128, torch.bfloat16, generator=g)
    table = torch.tensor([5, 60, 2, 33, 63, 17], dtype=torch.int32, device="cuda")
    first = flash_attn_with_sparse_block_table(q, k, v, table, num_splits=4)
    second = flash_attn_with_sparse_block_table(q, k, v, table, num_splits=4)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("num_splits", [2, 4, 5])
@pytest.mark.parametrize("listed", [5, 20])
@pytest.mark.parametrize("seqlen_q,heads,heads_k", [(1, 32, 8), (40, 8, 2)], ids=["keysplit_tile", "64row_tile"])
def test_few_short_splits_merge_in_a_cluster(seqlen_q, heads, heads_k, listed, num_splits):
    """On sm_90+, two to four splits of the key-split tile, each walking at most 8 tiles of 128
    keys, merge inside a thread-block cluster (no partials, no combine kernel); five splits,
    longer walks, or the 64-row tile go through the partials and the combine. Either way the
    result matches the reference, with splits that get no tile among them (5 listed tiles: at 4
    splits of 2 tiles each, the last split has none)."""
    seed = num_splits * 100 + seqlen_q + listed
    g = torch.Generator(device="cuda").manual_seed(seed)
    seqlen_k, block_size = 5000, 128
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    blocks = make_list("permuted_gapped", -(-seqlen_k // block_size), random.Random(seed))[:listed]
    assert len(blocks) == listed
    table = torch.tensor(blocks, dtype=torch.int32, device="cuda")
    call = lambda: flash_attn_with_sparse_block_table(q, k, v, table, block_size=block_size, num_splits=num_splits)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    combined = any("flash_sparse_combine_kernel" in e.name for e in prof.events())
    assert len(sparse_kernel_launches(call)) == 1
    keysplit_tile = seqlen_q * (heads // heads_k) <= 16
    short_walks = len(blocks) <= 8 * num_splits
    in_cluster = torch.cuda.get_device_capability()[0] >= 9 and num_splits <= 4 and keysplit_tile and short_walks
    assert combined != in_cluster
    run_and_check(q, k, v, blocks, block_size, num_splits)
