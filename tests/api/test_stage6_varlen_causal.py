"""Stage 6 (GPU part): per-(batch, head, query tile) lists, causal "mask" blocks, varlen batches."""

import random

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.reference import visibility_from_lists
from helpers import assert_close_to_reference, causal_lists, poison_allocator, random_qkv, sparse_kernel_launches

pytestmark = [pytest.mark.stage6, pytest.mark.gpu]


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split"])
@pytest.mark.parametrize("table_heads", ["kv", "q"])
@pytest.mark.parametrize("q_block_size,block_size", [(128, 128), (128, 64), (64, 32), (256, 256)])
def test_batched_causal_mask_blocks(q_block_size, block_size, table_heads, num_splits):
    seed = q_block_size + block_size + num_splits
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    batch, seqlen_q, seqlen_k, heads, heads_k = 2, 700, 1500, 8, 2
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    n_table_heads = heads_k if table_heads == "kv" else heads
    per_batch = [causal_lists(seqlen_q, seqlen_k, n_table_heads, block_size, q_block_size, 0.5, rng) for _ in range(batch)]
    blocks = SparseBlocks.from_lists([pb[0] for pb in per_batch], [pb[1] for pb in per_batch], block_size=block_size,
                                     q_block_size=q_block_size, device="cuda")
    poison_allocator(((batch, seqlen_q, heads, 128), torch.bfloat16), ((batch, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits, validate="full")
    for b in range(batch):
        visible = visibility_from_lists(per_batch[b][0], per_batch[b][1], block_size, q_block_size, seqlen_q, seqlen_k,
                                        heads, causal=True, device="cuda")
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], visible)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split"])
@pytest.mark.parametrize("block_size", [128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 16, 130, 200])
def test_mask_blocks_on_both_sides_of_the_diagonal(seqlen_q, block_size, num_splits):
    """Every block a causal "mask" block, permuted: the kernel masks only the tiles that cross
    the diagonal of their first row and runs the others unmasked. seqlen_q 130 puts the first
    row's last visible key one before the last key of a 128-key block, so skipping the mask one
    key too early shows; block size 256 makes a kernel tile half a block."""
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + block_size + num_splits)
    seqlen_k, heads, heads_k = 5120, 8, 2
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    order = list(range(seqlen_k // block_size))
    random.Random(seqlen_q).shuffle(order)
    blocks = SparseBlocks.from_lists([[[[]]] * heads_k] * 2, [[[order]] * heads_k] * 2, block_size=block_size, device="cuda")
    poison_allocator(((2, seqlen_q, heads, 128), torch.bfloat16), ((2, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits, backend="fa2")
    rows, cols = torch.arange(seqlen_q, device="cuda"), torch.arange(seqlen_k, device="cuda")
    visible = cols[None, :] <= rows[:, None] + seqlen_k - seqlen_q
    assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.parametrize("num_splits", [1, 4], ids=["nosplit", "split"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [64, 128])
def test_varlen_ragged_batch(block_size, causal, num_splits):
    """Ragged lengths from 1 to a few thousand, one empty sequence, seqlen_q != seqlen_k."""
    seed = block_size + 2 * causal + num_splits
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    seqlens = [(1, 1), (300, 2500), (0, 700), (1000, 1000), (65, 4097), (129, 129)]
    heads, heads_k, q_block_size = 8, 2, 128
    per_seq = [random_qkv(1, sq, sk, heads, heads_k, 64, torch.float16, generator=g) for sq, sk in seqlens]
    lists = [causal_lists(max(sq, 1) if sq else 0, sk, heads_k, block_size, q_block_size, 0.6, rng) if sq else
             ([[] for _ in range(heads_k)], [[] for _ in range(heads_k)]) for sq, sk in seqlens]
    if not causal:  # without the causal mask every listed block is simply visible
        lists = [([[f + mk for f, mk in zip(fh, mh)] for fh, mh in zip(full, mask)], [[[] for _ in fh] for fh in full])
                 for full, mask in lists]
    blocks = pack_varlen_lists([pair[0] for pair in lists], [pair[1] for pair in lists], block_size, q_block_size, device="cuda")
    cu_q = torch.tensor([0] + list(torch.tensor([s[0] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor([s[1] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.cat([x[0][0] for x in per_seq])
    k = torch.cat([x[1][0] for x in per_seq])
    v = torch.cat([x[2][0] for x in per_seq])
    poison_allocator((tuple(q.shape), q.dtype), ((heads, q.shape[0]), torch.float32))
    out, lse = fas.flash_attn_varlen_with_sparse_blocks(q, k, v, blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                        max_seqlen_q=max(s[0] for s in seqlens),
                                                        max_seqlen_k=max(s[1] for s in seqlens), causal=causal,
                                                        num_splits=num_splits, validate="full")
    for i, (sq, sk) in enumerate(seqlens):
        if sq == 0:
            continue
        visible = visibility_from_lists(lists[i][0], lists[i][1], block_size, q_block_size, sq, sk, heads,
                                        causal=causal, device="cuda")
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert_close_to_reference(out[rows].unsqueeze(0), lse[:, rows], *per_seq[i], visible, lse_layout="hs")


def check_decode_causal(seqlen_q, heads, heads_k, num_splits, seqlen_k, density, batch=3):
    seed = seqlen_q * 100 + heads_k + num_splits + seqlen_k
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    block_size = 64
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    per_batch = [causal_lists(seqlen_q, seqlen_k, heads_k, block_size, 128, density, rng) for _ in range(batch)]
    blocks = SparseBlocks.from_lists([pb[0] for pb in per_batch], [pb[1] for pb in per_batch], block_size=block_size,
                                     device="cuda")
    poison_allocator(((batch, seqlen_q, heads, 128), torch.bfloat16), ((batch, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits, validate="full")
    for b in range(batch):
        visible = visibility_from_lists(per_batch[b][0], per_batch[b][1], block_size, 128, seqlen_q, seqlen_k,
                                        heads, causal=True, device="cuda")
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], visible)
    return q, k, v, blocks


@pytest.mark.parametrize("num_splits", [0, 1, 5], ids=["auto", "nosplit", "split"])
@pytest.mark.parametrize("heads,heads_k", [(8, 2), (8, 1), (32, 8)], ids=["gqa4", "mqa", "gqa4-32"])
@pytest.mark.parametrize("seqlen_q", [1, 7, 16, 33])
def test_decode_shaped_causal_per_kv_head_lists(seqlen_q, heads, heads_k, num_splits):
    """Few query rows per sequence (draft tokens): the query heads of a K/V head are packed into
    one tile (GQA packing); the causal mask must follow each packed row's position."""
    check_decode_causal(seqlen_q, heads, heads_k, num_splits, seqlen_k=3000, density=0.3)


@pytest.mark.parametrize("num_splits", [0, 1, 5], ids=["auto", "nosplit", "split"])
@pytest.mark.parametrize("heads,heads_k,seqlen_q", [(32, 8, 1), (8, 2, 4), (32, 2, 1), (8, 8, 16)])
def test_decode_over_long_lists_runs_the_16_row_tile(seqlen_q, heads, heads_k, num_splits):
    """Packed rows that fit 16 and lists of 16384+ keys, 2^20+ keys in all, take the one-warp
    16-row tile (as the split heuristic assumes); it must give the same results, and shorter
    lists must not take it: they take the 16-row tile whose four warps split each tile's keys."""
    q, k, v, blocks = check_decode_causal(seqlen_q, heads, heads_k, num_splits, seqlen_k=36000, density=0.95, batch=16)
    call = lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits)
    assert all("Sparse_decode_kernel_traits" in name for name in sparse_kernel_launches(call))
    short = SparseBlocks(blocks.full_cnt.clamp(max=8), blocks.full_idx[..., :8].contiguous(), block_size=64,
                         q_block_size=blocks.q_block_size)
    short_call = lambda: fas.flash_attn_with_sparse_block_table(q, k, v, short, num_splits=num_splits)
    assert not any("Sparse_decode_kernel_traits" in name for name in sparse_kernel_launches(short_call))
    # Shorter lists take the 16-row tile whose warps split the keys (the packed rows fit 16).
    assert all("Sparse_keysplit_kernel_traits" in name for name in sparse_kernel_launches(short_call))
