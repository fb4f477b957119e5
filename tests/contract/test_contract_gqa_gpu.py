"""GPU: every GQA group size through the public API on every backend present (fa2, fa3, fa4).

Groups 1-8 and 16 with odd query lengths, shared / per-K/V-head / per-query-head lists, the
partial tail block anywhere in a permuted, gapped list, forced splits, chunked prefill with a
list per 128-row query tile (packed tiles must never read a neighbouring tile's list), varlen with
an empty sequence, and NaN rows: each against the fp32 reference over exactly the listed keys,
with outputs poisoned first. Groups that do not divide a kernel tile (3, 5, 6, 7) are the point:
their packed tiles start mid query position, where a row-to-head map that ignores the tile's
first row goes wrong (tests/mutations/packed-row-head-ignores-tile-start.patch must fail here).
"""

import random

import pytest
import torch

import flash_attn_sparse as fas
from contract import (
    BLOCK,
    causal_split_rows,
    check_batched,
    check_varlen,
    gapped_permuted,
    make_qkv,
    sparse_blocks,
    varlen_inputs,
)
from contract import attend as contract_attend
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.backends import fa3_ops
from flash_attn_sparse.reference import attention_ref, visibility_from_lists
from helpers import max_err, poison_allocator

pytestmark = pytest.mark.gpu

GROUPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]
HK, D = 2, 128


def attend(backend, call):
    """contract.attend; FA-2 and FA-3 run every case here, so a refusal there fails."""
    return contract_attend(backend, call, must_run=("fa2", "fa3"))


def table_heads(table, heads):
    return {"shared": 1, "per_kv_head": HK, "per_q_head": heads}[table]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("table", ["shared", "per_kv_head", "per_q_head"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 7, 13])
@pytest.mark.parametrize("group", GROUPS)
def test_every_group_at_decode_with_the_tail_anywhere(backend, group, seqlen_q, table, num_splits):
    batch, seqlen_k, heads = 2, 1000, HK * group  # 8 key blocks, the last of 104 keys
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, HK, D, torch.bfloat16, seed=group * 100 + seqlen_q)
    rng = random.Random(f"{group}-{seqlen_q}-{table}")
    full = [[[gapped_permuted(rng, 8, 0.5, must=[7])] for _ in range(table_heads(table, heads))] for _ in range(batch)]
    blocks, tables = sparse_blocks(full, q_block=None)
    if backend == "fa3" and table != "per_q_head":
        assert fa3_ops.packed_group(q, k, blocks, seqlen_q) == group  # packed whatever the group
    poison_allocator((q.shape, q.dtype))
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=num_splits,
                                                                               backend=backend))
    check_batched(out, lse, q, k, v, *tables, 128, False, D ** -0.5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("group", [3, 5, 6, 7])
def test_chunked_prefill_reads_each_query_tiles_own_list(backend, group, num_splits):
    """300 query rows in three 128-row list rows of different (causal) lists per K/V head: a packed
    tile that read its neighbour's list would see keys its rows must not."""
    batch, seqlen_q, seqlen_k, heads = 2, 300, 1000, HK * group
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, HK, D, torch.bfloat16, seed=group)
    full, mask = causal_split_rows(random.Random(group), batch, HK, 3, 128, seqlen_q, seqlen_k, keep=0.6)
    blocks, tables = sparse_blocks(full, mask)
    poison_allocator((q.shape, q.dtype))
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True,
                                                                               num_splits=num_splits, backend=backend))
    check_batched(out, lse, q, k, v, *tables, 128, True, D ** -0.5)


@pytest.mark.parametrize("seqlens_q", [[13, 0, 7, 1], [13, 0, 7, 129]], ids=["decode", "with-a-prefill-chunk"])
@pytest.mark.parametrize("group", [3, 5, 7, 16])
def test_varlen_with_an_empty_sequence(backend, group, seqlens_q):
    seqlens_k = [1000, 300, 500, 2100]
    heads = HK * group
    q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, per_seq, varlen = varlen_inputs(
        seqlens_q, seqlens_k, heads, HK, D, HK, 128, random.Random(group), causal=True)
    cu_m, cu_off, cu_q, cu_k, max_q, max_k = varlen
    blocks = SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=BLOCK, q_block_size=128,
                          cu_total_m_blocks=cu_m, cu_block_idx_offsets=cu_off)
    poison_allocator((q.shape, q.dtype))
    out, lse = attend(backend, lambda: fas.flash_attn_varlen_with_sparse_blocks(
        q, k, v, blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=True,
        backend=backend))
    check_varlen(out, lse, q, k, v, seqlens_q, seqlens_k, per_seq, 128, True, D ** -0.5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("group", [3, 6, 7])
def test_a_nan_row_stays_in_its_own_head(backend, group, num_splits):
    """A NaN in one query head's row makes that (position, head) NaN and no other row of its packed
    tile; a NaN in a listed K row of one K/V head makes that head's group NaN, nothing else."""
    batch, seqlen_q, seqlen_k, heads = 2, 13, 1000, HK * group
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, HK, D, torch.bfloat16, seed=group)
    ids = [[[[6, 1, 7, 3]] for _ in range(HK)] for _ in range(batch)]
    blocks, (full_cnt, full_idx, _, _) = sparse_blocks(ids, q_block=None)
    q[0, 5, group + 1, 9] = float("nan")  # a head of K/V head 1, mid tile
    k[1, 3 * BLOCK + 2, 0, 4] = float("nan")  # listed, K/V head 0 of batch 1
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=num_splits,
                                                                               backend=backend))
    visible = torch.stack([visibility_from_lists(row_b, None, BLOCK, 128, seqlen_q, seqlen_k, heads, False, device=q.device)
                           for row_b in ids])
    ref_out, _ = attention_ref(q, k, v, visible, D ** -0.5, dtype=torch.float32)
    bad_ref = ~torch.isfinite(ref_out).all(-1)
    assert bad_ref.sum() == 1 + seqlen_q * group  # the reference's own count: one q row, one K/V head's group
    assert torch.equal(~torch.isfinite(out.double()).all(-1), bad_ref)
    assert torch.equal(~torch.isfinite(lse.transpose(1, 2)), bad_ref)
    good = ~bad_ref
    low_out, _ = attention_ref(q, k, v, visible, D ** -0.5, dtype=q.dtype)
    assert max_err(out[good], ref_out[good]) <= 2 * max_err(low_out[good], ref_out[good]) + 1e-5
