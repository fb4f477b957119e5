"""GPU: the sparse contract over every backend present, one suite through the public
API with backend="fa2", "fa3" or "fa4": permuted and gapped lists with V distinct per block, the
partial tail block anywhere, empty lists, per-query-head / per-K/V-head / shared tables, causal
mask blocks, forced splits, varlen with ragged and empty sequences, block-CSR input, the
zero-copy speculative form, paged K/V with seqused_k, CUDA-graph replay with lists updated in place, determinism and
torch.compile. Each call is
checked against the fp32 reference over exactly the listed keys (tests/contract.py).

A backend may refuse a case before any kernel, with SparseInputError naming why: the test then
skips with that reason. FA-2 runs every case here, so a refusal there fails.
"""

import random
import warnings

import pytest
import torch

import flash_attn_sparse as fas
from contract import (
    BLOCK,
    attend,
    backend_present,
    causal_split_rows,
    check_batched,
    check_varlen,
    gapped_permuted,
    make_qkv,
    pack_rows,
    sparse_blocks,
    varlen_inputs,
)
from flash_attn_sparse import SparseBlocks
from helpers import assert_close_to_reference, poison_allocator

pytestmark = pytest.mark.gpu

H, HK, D = 8, 2, 128
TABLES = {"shared": 1, "per_kv_head": HK, "per_q_head": H}


def lists_with_the_tail(rng, batch, table_heads, m_blocks, n_blocks, keep=0.5):
    """rows[b][h][m]: gapped, permuted ids, each row holding the partial tail block somewhere."""
    return [[[gapped_permuted(rng, n_blocks, keep, must=[n_blocks - 1]) for _ in range(m_blocks)]
             for _ in range(table_heads)] for _ in range(batch)]


def scale_of(q):
    return q.shape[-1] ** -0.5


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_permuted_gapped_lists_with_the_tail_anywhere(backend, table, head_dim):
    batch, seqlen_q, seqlen_k = 2, 256, 1000  # 8 key blocks, the last of 104 keys
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, H, HK, head_dim, torch.bfloat16, seed=head_dim + TABLES[table])
    rng = random.Random(f"{table}-{head_dim}")
    blocks, tables = sparse_blocks(lists_with_the_tail(rng, batch, TABLES[table], 2, 8))
    poison_allocator((q.shape, q.dtype))
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=1,
                                                                               backend=backend))
    check_batched(out, lse, q, k, v, *tables, 128, False, scale_of(q))


def test_empty_lists_give_zero_and_minus_infinity(backend):
    q, k, v = make_qkv(2, 256, 1000, H, HK, D, torch.bfloat16, seed=2)
    full = [[[[], [7, 0, 3]] for _ in range(HK)], [[[], []] for _ in range(HK)]]  # the second batch lists nothing
    blocks, tables = sparse_blocks(full)
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend))
    assert torch.isneginf(lse[1]).all() and not out[1].any()
    check_batched(out, lse, q, k, v, *tables, 128, False, scale_of(q))


@pytest.mark.parametrize("table", TABLES)
def test_causal_mask_blocks(backend, table):
    batch, seqlen_q, seqlen_k = 2, 384, 1000
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, H, HK, D, torch.bfloat16, seed=3 + TABLES[table])
    full, mask = causal_split_rows(random.Random(table), batch, TABLES[table], 3, 128, seqlen_q, seqlen_k, keep=0.7)
    blocks, tables = sparse_blocks(full, mask)
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True,
                                                                               backend=backend))
    check_batched(out, lse, q, k, v, *tables, 128, True, scale_of(q))


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_forced_and_chosen_splits_at_decode(backend, num_splits):
    batch, seqlen_q, seqlen_k = 4, 1, 4000  # 32 key blocks, the last of 32 keys
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, H, HK, D, torch.bfloat16, seed=4 + num_splits)
    blocks, tables = sparse_blocks(lists_with_the_tail(random.Random(num_splits), batch, HK, 1, 32, keep=0.4))
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=num_splits,
                                                                               backend=backend))
    check_batched(out, lse, q, k, v, *tables, 128, False, scale_of(q))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table", TABLES)
def test_varlen_with_ragged_and_empty_sequences(backend, table, causal):
    seqlens_q, seqlens_k = [300, 0, 128, 77, 1], [1000, 500, 0, 77, 2100]
    if causal:
        seqlens_k = [max(sk, sq) for sq, sk in zip(seqlens_q, seqlens_k)]
    q_block = 128
    q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, per_seq, varlen = varlen_inputs(
        seqlens_q, seqlens_k, H, HK, D, TABLES[table], q_block, random.Random(f"{table}-{causal}"), causal)
    cu_m, cu_off, cu_q, cu_k, max_q, max_k = varlen
    blocks = SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=BLOCK, q_block_size=q_block,
                          cu_total_m_blocks=cu_m, cu_block_idx_offsets=cu_off)
    out, lse = attend(backend, lambda: fas.flash_attn_varlen_with_sparse_blocks(
        q, k, v, blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
        backend=backend))
    check_varlen(out, lse, q, k, v, seqlens_q, seqlens_k, per_seq, q_block, causal, scale_of(q))


@pytest.mark.parametrize("table", ["per_kv_head", "per_q_head"])
def test_block_csr_lists_converted_on_the_device(backend, table):
    """FlashInfer-style block-CSR rows (batch, table head, query tile), permuted and gapped, some
    empty, converted by blocks_from_csr on the GPU: the lists it gives run as listed."""
    batch, seqlen_q, seqlen_k, n_blocks, m_blocks = 2, 256, 1000, 8, 2
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, H, HK, D, torch.bfloat16, seed=9 + TABLES[table])
    g = torch.Generator().manual_seed(TABLES[table])
    rows = [torch.randperm(n_blocks, generator=g)[:int(torch.randint(0, n_blocks + 1, (1,), generator=g))].tolist()
            for _ in range(batch * TABLES[table] * m_blocks)]
    indptr = torch.tensor([0] + [len(row) for row in rows]).cumsum(0).to(device="cuda", dtype=torch.int32)
    indices = torch.tensor([i for row in rows for i in row], dtype=torch.int32, device="cuda")
    blocks = fas.blocks_from_csr(indptr, indices, block_size=BLOCK, q_block_size=128, num_heads=TABLES[table],
                                 batch=batch, max_row_length=n_blocks)
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend))
    listed = [[[rows[(b * TABLES[table] + h) * m_blocks + m] for m in range(m_blocks)] for h in range(TABLES[table])]
              for b in range(batch)]
    check_batched(out, lse, q, k, v, *pack_rows(listed, n_blocks), None, None, 128, False, scale_of(q))


@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_kv_in_permuted_pages_with_seqused_k(backend, page_size, num_splits):
    """The serving layout: K/V in a cache of permuted pages (pages past seqused_k and unused table
    entries hold NaN / garbage ids), per-K/V-head lists with the tail block anywhere, causal mask
    blocks: the reference over each sequence's first seqused_k keys."""
    batch, seqlen_q, used = 2, 16, [1000, 777]
    n_cols = -(-1024 // page_size)
    q, k, v = make_qkv(batch, seqlen_q, n_cols * page_size, H, HK, D, torch.bfloat16, seed=page_size + num_splits)
    g = torch.Generator().manual_seed(page_size)
    num_pages = batch * n_cols + 3
    order = torch.randperm(num_pages, generator=g)[:batch * n_cols].view(batch, n_cols)
    k_cache = torch.full((num_pages, page_size, HK, D), float("nan"), dtype=k.dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    for b in range(batch):
        for column in range(n_cols):
            rows = slice(column * page_size, min((column + 1) * page_size, used[b]))
            if rows.start < rows.stop:
                k_cache[order[b, column], :rows.stop - rows.start] = k[b, rows]
                v_cache[order[b, column], :rows.stop - rows.start] = v[b, rows]
    page_table = order.to(torch.int32).cuda()
    for b in range(batch):
        page_table[b, -(-used[b] // page_size):] = -5  # never read
    rng = random.Random(page_size)
    full, mask = [], []
    for b in range(batch):
        n_blocks, diagonal = -(-used[b] // BLOCK), (used[b] - seqlen_q) // BLOCK
        full.append([[gapped_permuted(rng, diagonal, 0.5)] for _ in range(HK)])
        mask.append([[list(range(diagonal, n_blocks))[::-1]] for _ in range(HK)])
    blocks, (full_cnt, full_idx, mask_cnt, mask_idx) = sparse_blocks(full, mask)
    seqused_k = torch.tensor(used, dtype=torch.int32, device="cuda")
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(
        q, k_cache, v_cache, blocks, causal=True, num_splits=num_splits, seqused_k=seqused_k, page_table=page_table,
        backend=backend))
    for b in range(batch):
        check_batched(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1, :used[b]], v[b:b + 1, :used[b]],
                      full_cnt[b:b + 1], full_idx[b:b + 1], mask_cnt[b:b + 1], mask_idx[b:b + 1], 128, True, scale_of(q))


def test_the_zero_copy_speculative_form(backend):
    """Speculative blocks (causal among themselves: the last two) and missed blocks (permuted,
    gapped) of one K/V in one call: the reference sees their union."""
    seqlen_q, seqlen_k = 16, 2000  # the last block of 80 keys
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, H, HK, D, torch.bfloat16, seed=5)
    spec_ids, missed_ids = [15, 14], [3, 9, 0, 12]
    spec = torch.tensor(spec_ids, dtype=torch.int32, device="cuda")
    missed = torch.tensor(missed_ids, dtype=torch.int32, device="cuda")
    out, lse = attend(backend, lambda: fas.flash_attn_speculative_sparse_zero_copy(
        q, k, v, spec, missed, block_size=BLOCK, causal_spec=True, backend=backend))
    keys = torch.arange(seqlen_k, device="cuda")
    rows = torch.arange(seqlen_q, device="cuda").unsqueeze(1)
    listed = lambda ids: torch.isin(keys // BLOCK, torch.tensor(ids, device="cuda"))  # noqa: E731
    visible = listed(missed_ids) | (listed(spec_ids) & (keys <= rows + seqlen_k - seqlen_q))
    assert_close_to_reference(out, lse, q, k, v, visible)


def test_a_cuda_graph_replays_lists_updated_in_place(backend):
    batch, seqlen_k = 4, 4000
    q, k, v = make_qkv(batch, 1, seqlen_k, H, HK, D, torch.bfloat16, seed=6)
    rng = random.Random(6)
    rows = lambda: [[[rng.sample(range(32), 8)] for _ in range(HK)] for _ in range(batch)]  # noqa: E731
    blocks, (full_cnt, full_idx, _, _) = sparse_blocks(rows())
    out = torch.empty_like(q)
    attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend, out=out))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend, out=out)
    new_cnt, new_idx = pack_rows(rows(), 8)
    new_cnt[0, 1, 0] = 3  # a shorter list: entries past the count are not read
    full_cnt.copy_(new_cnt)
    full_idx.copy_(new_idx)
    graph.replay()
    torch.cuda.synchronize()
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, 128, False, scale_of(q))


def test_repeated_calls_are_bitwise_equal(backend):
    q, k, v = make_qkv(2, 256, 4000, H, HK, D, torch.bfloat16, seed=7)
    blocks, _ = sparse_blocks(lists_with_the_tail(random.Random(7), 2, HK, 2, 32))
    first = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend))
    for _ in range(3):
        again = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_torch_compile_fullgraph_traces_the_backend(backend):
    if backend == "fa4":
        pytest.skip("flash-attn-4's call is not traced: under torch.compile this package runs FA-2 or FA-3")
    q, k, v = make_qkv(2, 16, 4000, H, HK, D, torch.bfloat16, seed=8)
    blocks, (full_cnt, full_idx, _, _) = sparse_blocks(lists_with_the_tail(random.Random(8), 2, HK, 1, 32))

    def forward(q, k, v, full_cnt, full_idx):
        return fas.flash_attn_with_sparse_block_table(q, k, v, SparseBlocks(full_cnt, full_idx), backend=backend)

    eager = attend(backend, lambda: forward(q, k, v, full_cnt, full_idx))
    torch._dynamo.reset()
    torch._dynamo.utils.warn_once_cache.clear()  # Dynamo warns once per process: an earlier test's trace would hide one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(forward, fullgraph=True)(q, k, v, full_cnt, full_idx)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    dynamo = [str(w.message).splitlines()[0] for w in caught if "dynamo" in f"{w.filename} {w.message}".lower()]
    assert not dynamo, f"torch.compile warned while tracing the call: {dynamo}"


@pytest.mark.parametrize("shape", ["decode", "prefill"])
@pytest.mark.parametrize("name", ["fa2", pytest.param("fa3", marks=pytest.mark.sm90), pytest.param("fa4", marks=pytest.mark.sm90),
                                  "auto"])
def test_eager_and_graph_replay_are_bitwise_equal(name, shape):
    """The same call eagerly, as a one-shot call captured into a CUDA graph and replayed, and as a
    plan's run replayed: bitwise equal, whatever backends are installed (auto's choice does not
    depend on the capture)."""
    backend_present(name)
    batch, seqlen_q, seqlen_k = (4, 16, 4000) if shape == "decode" else (1, 512, 4000)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, H, HK, D, torch.bfloat16, seed=11)
    blocks, _ = sparse_blocks(lists_with_the_tail(random.Random(11), batch, HK, -(-seqlen_q // 128), 32, keep=0.4))
    eager_out, eager_lse = attend(name, lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=name))
    plan = fas.plan(q, k, v, blocks, backend=name)
    assert name != "auto" or plan.backend == fas.choose_backend(q, k, v, blocks)[0]
    out = torch.empty_like(q)
    plan.run(q, k, v)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, one_shot_lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=name, out=out)
        plan_out, plan_lse = plan.run(q, k, v)
    out.zero_()
    plan_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got_out, got_lse in ((out, one_shot_lse), (plan_out, plan_lse)):
        assert torch.equal(got_out, eager_out) and torch.equal(got_lse, eager_lse)
