"""Stage 4: the Hopper backend (flash-attn-4's CuTe-DSL SM90 forward) and backend routing.

CPU: batched lists passed as views, the varlen re-lay against a plain Python reference.
GPU (SM90 with flash-attn-4 importable): the Hopper path against the fp32 reference and against
the FA-2 path, batched and varlen, causal with mask blocks, per-head lists, fp16/bf16, head dims
64/128, split-KV over the lists (packed query heads, empty splits); auto's rule with FA-4 present
(it runs on request only), the speculative forms on FA-4.
"""

import importlib.util
import os
import random
import subprocess
import sys

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks, SparseInputError, routing
from flash_attn_sparse.backends import cute, fa3_ops, fa4
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.options import CallOptions
from flash_attn_sparse.reference import block_positions, visibility_from_lists
from helpers import assert_close_to_reference, causal_lists, max_err, poison_allocator, random_qkv

pytestmark = pytest.mark.stage4


# --- CPU: the lists as flash-attn-4 gets them ----------------------------------------------------

def test_batched_lists_pass_as_views_with_a_broadcast_zero_mask_count(monkeypatch):
    """Batched tables reach flash-attn-4 as views (no copy, no launch: its patched SM90 kernel reads
    bad counts, out-of-range ids and a tail block anywhere itself, test_bad_lists_skip_like_fa2),
    trimmed to the query tiles of the call; calls without mask lists share one zero count, viewed
    with the full lists' shape (a (1, 1, 1) count beside several query tiles
    failed flash-attn-4's "must share the same m-block dimension"; defect 2: beside per-query-head
    GQA lists it made flash-attn-4 pack the heads, "head dim must be 4 or 1")."""
    cnt = torch.randint(0, 9, (2, 3, 5), dtype=torch.int32)
    idx = torch.randint(-2, 12, (2, 3, 5, 9), dtype=torch.int32)
    seen = {}
    block_sparsity = type("block_sparsity", (), {"BlockSparseTensorsTorch": lambda **fields: seen.update(fields)})
    monkeypatch.setattr(cute, "import_cute", lambda module: block_sparsity)  # flash-attn-4 need not be installed
    cute.block_sparse_tensors(SparseBlocks(cnt, idx, block_size=128, q_block_size=128), batch=2, max_seqlen_q=400,
                             max_seqlen_k=7 * 128 - 5)
    assert seen["full_block_cnt"].shape == (2, 3, 4) and seen["full_block_idx"].shape == (2, 3, 4, 7)
    assert seen["full_block_cnt"].data_ptr() == cnt.data_ptr() and seen["full_block_idx"].data_ptr() == idx.data_ptr()
    zero = cute._zero_counts(torch.device("cpu"), (2, 3, 4))
    mask_cnt, mask_idx = seen["mask_block_cnt"], seen["mask_block_idx"]
    assert mask_cnt.data_ptr() == zero.data_ptr() and mask_cnt.is_contiguous()  # made once per shape, unit stride
    assert mask_cnt.shape == seen["full_block_cnt"].shape and mask_cnt.shape[2] == mask_idx.shape[2]
    assert (mask_cnt == 0).all()


def test_fa4_refuses_what_it_would_answer_wrongly(monkeypatch):
    """Two wrong answers of the GPU fuzzer (seed 3) are refusals now, from shapes: seqused_k on a
    fixed-length call (flash-attn-4's flash_attn_func takes none, so its kernel attended to every
    key up to k's length: configs 26, 33, 718) and list rows wider than the K/V's block count
    (flash-attn-4 takes at most one entry per block, and the row cut there dropped blocks listed
    after skipped ids: configs 307, 1248, 1519). auto then runs FA-2."""
    from flash_attn_sparse import calls
    monkeypatch.setattr(fa4, "unsupported_reason", lambda *args, **kwargs: None)  # as on an SM90 with the runtime
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16) for shape in ((2, 16, 8, 128), (2, 1000, 2, 128), (2, 1000, 2, 128)))

    def call(width, **options):
        blocks = SparseBlocks(torch.ones(2, 2, 1, dtype=torch.int32), torch.zeros(2, 2, 1, width, dtype=torch.int32))
        return calls.SparseCall(q, k, v, blocks, CallOptions(backend=options.pop("backend", "auto")), **options)

    assert fa4.refusal(call(8)) is None  # 1000 keys: 8 blocks of 128
    assert fa4.refusal(call(8, seqused_k=torch.tensor([131, 1000], dtype=torch.int32))) == fa4.SEQUSED_K_UNSUPPORTED
    assert "list rows of 9 entries for 8 K/V blocks" in fa4.refusal(call(9))
    assert routing.choose(call(9))[0] == "fa2"


def _unpacked_gqa_lists():
    """Per-query-head full lists (16 heads over 4 K/V heads), 3 query tiles, no mask lists."""
    cnt = torch.randint(0, 4, (1, 16, 3), dtype=torch.int32)
    return SparseBlocks(cnt, torch.randint(0, 4, (1, 16, 3, 4), dtype=torch.int32), block_size=128, q_block_size=128)


def test_per_query_head_gqa_lists_reach_flash_attn_4_with_their_head_count(monkeypatch):
    """flash-attn-4 packs GQA heads only when its mask counts have 1 or num_heads_k heads; per
    query head lists must reach it with all 16 (it then runs them unpacked) and with matching
    m-block dims, and FA-4's tile count assumes the same unpacked tiles."""
    seen = {}
    block_sparsity = type("block_sparsity", (), {"BlockSparseTensorsTorch": lambda **fields: seen.update(fields)})
    monkeypatch.setattr(cute, "import_cute", lambda module: block_sparsity)
    blocks = _unpacked_gqa_lists()
    cute.block_sparse_tensors(blocks, batch=1, max_seqlen_q=300, max_seqlen_k=512)
    assert seen["mask_block_cnt"].shape == seen["full_block_cnt"].shape == (1, 16, 3)
    assert seen["mask_block_idx"].shape[:3] == (1, 16, 3)
    q, k = torch.empty(1, 300, 16, 128), torch.empty(1, 512, 4, 128)
    assert fa4._packed(q, k, blocks) == (16, 1)  # per-query-head lists: unpacked
    assert fa4.tiles(q, k, blocks, batch=1, max_seqlen_q=300) == 16 * 3


@pytest.mark.parametrize("block_size", [64, 128])
def test_varlen_lists_relaid_at_flash_attn_4_stride(block_size):
    rng = random.Random(block_size)
    seqlens_k = [300, 1, 0, 1000, 129]
    m_blocks = [2, 1, 1, 3, 0]
    heads = 2

    def row(sk):
        n = -(-sk // block_size)
        ids = rng.sample(range(n), rng.randrange(0, n + 1)) if n else []
        return ids + [n + 2] * rng.randrange(0, 2)  # sometimes an id past the sequence

    full = [[[row(sk) for _ in range(m)] for _ in range(heads)] for sk, m in zip(seqlens_k, m_blocks)]
    blocks = pack_varlen_lists(full, None, block_size, 128)
    cnt = blocks.full_cnt.clone()
    cnt[0, 0] += 3  # a count past its row
    rows = cute._VarlenRows.of(blocks, torch.tensor(seqlens_k), max(seqlens_k))
    new_cnt, new_idx = cute._varlen_lists(cnt, blocks.full_idx, rows)
    offsets = rows.new_offsets
    stride = [-(-sk // block_size) for sk in seqlens_k]
    expected_offsets = [0]
    for m, n in zip(m_blocks, stride):
        expected_offsets.append(expected_offsets[-1] + m * n)
    assert offsets.tolist() == expected_offsets
    tile = 0
    ours = blocks.cu_block_idx_offsets.tolist()
    for b, (sk, m_count) in enumerate(zip(seqlens_k, m_blocks)):
        width = (ours[b + 1] - ours[b]) // m_count if m_count else 0
        for m in range(m_count):
            for h in range(heads):
                # What the FA-2 kernels read: the first cnt entries of the row (padding included).
                row = blocks.full_idx[h, ours[b] + m * width:ours[b] + (m + 1) * width].tolist()
                expected = sorted(i for i in row[:int(cnt[h, tile])] if 0 <= i < stride[b])[:stride[b]]
                start = expected_offsets[b] + m * stride[b]
                assert new_cnt[h, tile] == len(expected), (b, m, h)
                assert new_idx[h, start:start + len(expected)].tolist() == expected, (b, m, h)
            tile += 1


def test_bad_backend_name_is_refused():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(SparseInputError, match="^backend"):
        fas.flash_attn_with_sparse_block_table(q, k, v, torch.arange(2, dtype=torch.int32), backend="fa5")


def test_missing_runtime_is_named():
    """Without flash-attn-4's runtime, backend="fa4" says so (and auto takes FA-2: every GPU run
    without the runtime in tests/RESULTS.md went through auto)."""
    reason = cute.missing_runtime()
    if reason is None:
        pytest.skip("flash-attn-4 and its runtime import here")
    assert "[hopper]" in reason


# --- GPU: the Hopper path ----------------------------------------------------------------------

def _needs_fa4():
    """Skip where the CuTe-DSL runtime is absent; where it is present, flash-attn-4 must import
    (the stale flash_attn/cute of the FA-2 sdist once shadowed it: patches/flash-attn/0004)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("the CuTe-DSL runtime (nvidia-cutlass-dsl, extra [hopper]) is not installed")
    assert cute.missing_runtime() is None, cute.missing_runtime()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("dtype,head_dim,causal,table_heads,block_size", [
    (torch.bfloat16, 128, False, "q", 128),
    (torch.float16, 64, True, "kv", 128),
    (torch.bfloat16, 128, True, "shared", 128),
    (torch.float16, 128, True, "kv", 64),
    (torch.bfloat16, 64, False, "kv", 64),
], ids=["bf16-d128-q", "fp16-d64-causal-kv", "bf16-d128-causal-shared", "fp16-d128-causal-kv-bs64", "bf16-d64-kv-bs64"])
def test_batched_matches_reference_and_fa2(dtype, head_dim, causal, table_heads, block_size):
    _needs_fa4()
    seed = head_dim + block_size + causal
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    batch, seqlen_q, seqlen_k, heads, heads_k, q_block = 2, 700, 1500, 8, 2, 128
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, generator=g)
    n_table_heads = {"q": heads, "kv": heads_k, "shared": 1}[table_heads]
    per_batch = [causal_lists(seqlen_q, seqlen_k, n_table_heads, block_size, q_block, 0.5, rng) for _ in range(batch)]
    if not causal:  # every listed block simply visible: all "full", shuffled (tail block anywhere)
        per_batch = [([[rng.sample(f + mk, len(f + mk)) for f, mk in zip(fh, mh)] for fh, mh in zip(full, mask)],
                      [[[] for _ in fh] for fh in full]) for full, mask in per_batch]
    per_batch[0][0][0][1], per_batch[0][1][0][1] = [], []  # one empty tile: O = 0, LSE = -inf
    blocks = SparseBlocks.from_lists([pb[0] for pb in per_batch], [pb[1] for pb in per_batch], block_size=block_size,
                                     q_block_size=q_block, device="cuda")
    poison_allocator(((batch, seqlen_q, heads, head_dim), dtype), ((batch, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, backend="fa4", validate="full")
    out_fa2, lse_fa2 = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, backend="fa2")
    for b in range(batch):
        visible = visibility_from_lists(per_batch[b][0], per_batch[b][1], block_size, q_block, seqlen_q, seqlen_k,
                                        heads, causal=causal, device="cuda")
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], visible)
    empty_rows = slice(q_block, 2 * q_block)
    assert (out[0, empty_rows, :heads // n_table_heads] == 0).all()
    assert torch.isneginf(lse[0, :heads // n_table_heads, empty_rows]).all()
    assert max_err(lse, lse_fa2) <= 1e-3
    assert max_err(out, out_fa2) <= 2e-2


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("backend", ["auto", "fa4"])
@pytest.mark.parametrize("seqlen_q,heads,heads_k,table_heads", [
    (2048, 32, 32, 32),  # defect 1: per-query-tile full lists, no mask lists (DESIGN 7's prefill, scaled)
    (1000, 16, 4, 16),   # defect 2: per-query-head lists with GQA at prefill
    (16, 16, 4, 16),     # ... and at decode
], ids=["prefill-per-tile", "gqa-per-query-head-prefill", "gqa-per-query-head-decode"])
def test_full_lists_only_per_tile_and_per_query_head(backend, seqlen_q, heads, heads_k, table_heads):
    """Lists per (batch, head, query tile) with no mask lists ran into
    flash-attn-4's own ValueErrors (m-block dims; GQA head dim) on fa4 and auto."""
    _needs_fa4()
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + heads)
    rng = random.Random(seqlen_q + heads)
    seqlen_k, block, q_block = 2000, 128, 128
    n_blocks, m_blocks = -(-seqlen_k // block), -(-seqlen_q // q_block)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    full = [[rng.sample(range(n_blocks), rng.randint(0, 6)) for _ in range(m_blocks)] for _ in range(table_heads)]
    full[0][0] = []  # an empty tile: O = 0, LSE = -inf
    blocks = SparseBlocks.from_lists([full], block_size=block, q_block_size=q_block, device="cuda")
    poison_allocator(((1, seqlen_q, heads, 128), torch.bfloat16), ((1, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend, validate="full")
    empty = [[[] for _ in per_h] for per_h in full]
    visible = visibility_from_lists(full, empty, block, q_block, seqlen_q, seqlen_k, heads, causal=False, device="cuda")
    assert_close_to_reference(out, lse, q, k, v, visible)
    assert (out[0, :min(q_block, seqlen_q), 0] == 0).all() and torch.isneginf(lse[0, 0, :min(q_block, seqlen_q)]).all()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("seqlen_q,table_heads,causal,num_splits", [
    (16, "kv", False, 2),     # decode: the query heads of a K/V head packed in one tile, lists split in two
    (1, "kv", False, 5),      # more splits than the short lists hold: empty splits
    (16, "shared", False, 3),
    (16, "q", False, 4),      # per-query-head lists: no packing
    (300, "kv", True, 3),     # causal: the mask and the full list of a tile each split
    (16, "kv", False, 0),     # the heuristic's count
], ids=["decode-kv-2", "sq1-kv-5-empty-splits", "decode-shared-3", "decode-q-4", "causal-kv-3", "decode-kv-auto"])
def test_split_kv_over_lists(seqlen_q, table_heads, causal, num_splits):
    """Split-KV on FA-4 (stage 4): each split walks an even share of a tile's lists and writes an
    fp32 partial that the combine merges. Lists permuted and gapped, of every length from 0 to
    all blocks, the sequence's tail block anywhere in them; one tile's lists empty."""
    _needs_fa4()
    seed = seqlen_q * 10 + num_splits
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    batch, seqlen_k, heads, heads_k, block, q_block = 3, 3000, 8, 2, 128, 128
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    n_table_heads = {"q": heads, "kv": heads_k, "shared": 1}[table_heads]
    n_blocks = -(-seqlen_k // block)
    if causal:
        per_batch = [causal_lists(seqlen_q, seqlen_k, n_table_heads, block, q_block, 0.5, rng) for _ in range(batch)]
    else:
        lengths = [1, 7, n_blocks, 2, 13, 5, 24, 3]
        per_batch = [([[rng.sample(range(n_blocks), lengths[(b + h) % len(lengths)])] for h in range(n_table_heads)],
                      [[[]] for _ in range(n_table_heads)]) for b in range(batch)]
    per_batch[0][0][0][0], per_batch[0][1][0][0] = [], []  # one empty tile: O = 0, LSE = -inf
    blocks = SparseBlocks.from_lists([pb[0] for pb in per_batch], [pb[1] for pb in per_batch], block_size=block,
                                     q_block_size=q_block, device="cuda")
    if num_splits == 0:
        assert fas.choose_num_splits_for(q, k, v, blocks, backend="fa4") > 1  # 12 tiles on a GPU of 100+ SMs
    poison_allocator(((batch, seqlen_q, heads, 128), torch.bfloat16), ((batch, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, backend="fa4",
                                                      num_splits=num_splits, validate="full")
    for b in range(batch):
        visible = visibility_from_lists(per_batch[b][0], per_batch[b][1], block, q_block, seqlen_q, seqlen_k,
                                        heads, causal=causal, device="cuda")
        assert_close_to_reference(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], visible)
    empty_heads = slice(0, heads // n_table_heads)
    assert (out[0, :min(seqlen_q, q_block), empty_heads] == 0).all()
    assert torch.isneginf(lse[0, empty_heads, :min(seqlen_q, q_block)]).all()
    out_fa2, lse_fa2 = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, backend="fa2")
    assert max_err(lse, lse_fa2) <= 1e-3
    assert max_err(out, out_fa2) <= 2e-2


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("dtype,block_size,causal,num_splits", [
    (torch.bfloat16, 128, True, 1),
    (torch.float16, 64, False, 1),   # tile_n 64: fails without patches/flash-attn-4/0001
    (torch.bfloat16, 64, True, 1),
    (torch.bfloat16, 128, True, 3),  # split-KV over varlen lists: refused, with the reason
])
def test_varlen_ragged_batch(dtype, block_size, causal, num_splits):
    _needs_fa4()
    seed = block_size + causal + num_splits
    g = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    seqlens = [(1, 1), (300, 2500), (0, 700), (1000, 1000), (65, 4097), (129, 129)]
    heads, heads_k, q_block = 8, 2, 128
    per_seq = [random_qkv(1, sq, sk, heads, heads_k, 128, dtype, generator=g) for sq, sk in seqlens]
    lists = [causal_lists(sq, sk, heads_k, block_size, q_block, 0.6, rng) if sq else
             ([[] for _ in range(heads_k)], [[] for _ in range(heads_k)]) for sq, sk in seqlens]
    if not causal:
        lists = [([[f + mk for f, mk in zip(fh, mh)] for fh, mh in zip(full, mask)], [[[] for _ in fh] for fh in full])
                 for full, mask in lists]
    blocks = pack_varlen_lists([pair[0] for pair in lists], [pair[1] for pair in lists], block_size, q_block, device="cuda")
    cu_q = torch.tensor([0] + list(torch.tensor([s[0] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor([s[1] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.cat([x[0][0] for x in per_seq])
    k = torch.cat([x[1][0] for x in per_seq])
    v = torch.cat([x[2][0] for x in per_seq])
    args = (q, k, v, blocks)
    sizes = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(s[0] for s in seqlens),
                 max_seqlen_k=max(s[1] for s in seqlens))
    if num_splits > 1:
        with pytest.raises(SparseInputError, match="^backend: 'fa4' cannot run this call: split-KV runs on fixed-length"):
            fas.flash_attn_varlen_with_sparse_blocks(*args, **sizes, causal=causal, backend="fa4", num_splits=num_splits)
        return
    poison_allocator((tuple(q.shape), q.dtype), ((heads, q.shape[0]), torch.float32))
    out, lse = fas.flash_attn_varlen_with_sparse_blocks(*args, **sizes, causal=causal, backend="fa4", validate="full")
    out_fa2, lse_fa2 = fas.flash_attn_varlen_with_sparse_blocks(*args, **sizes, causal=causal, backend="fa2")
    for i, (sq, sk) in enumerate(seqlens):
        if sq == 0:
            continue
        visible = visibility_from_lists(lists[i][0], lists[i][1], block_size, q_block, sq, sk, heads,
                                        causal=causal, device="cuda")
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        assert_close_to_reference(out[rows].unsqueeze(0), lse[:, rows], *per_seq[i], visible, lse_layout="hs")
    assert max_err(lse, lse_fa2) <= 1e-3


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("seqlen_q,heads,heads_k,num_splits", [
    (256, 4, 4, 1),
    (256, 4, 4, 3),   # the clamped counts are what the splits share
    (16, 8, 2, 2),    # decode: packed query heads in the 64-row tile, per-K/V-head lists
])
@pytest.mark.parametrize("seqlen_k", [1000, 1024])  # a partial tail block, or none
def test_bad_lists_skip_like_fa2(seqlen_q, heads, heads_k, num_splits, seqlen_k):
    """Counts past the list and ids outside the sequence count for nothing, as the FA-2 kernels
    skip them, and the partial tail block may come first or in the middle: both backends give
    attention over the valid entries. FA-4 gets the lists as they are (patch flash-attn-4/0004);
    a tile whose full list names neither runs the unmasked loop (0007), the others the masked."""
    _needs_fa4()
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    rows = [[7, 3, -1, 12, 0, 5], [1, 2, 7, 4, 5, 6], [0, 99, 2, 7, 1, 3], [6, 5, 4, 3, 2, 1]][:heads_k]
    idx = torch.tensor([[[row] for row in rows]], dtype=torch.int32, device="cuda")
    cnt = torch.tensor([[[6], [9], [3], [0]][:heads_k]], dtype=torch.int32, device="cuda")
    blocks = SparseBlocks(cnt, idx, block_size=128)
    poison_allocator(((1, seqlen_q, heads, 128), torch.bfloat16), ((1, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa4", num_splits=num_splits)
    out_fa2, lse_fa2 = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa2")
    assert max_err(lse, lse_fa2) <= 1e-3 and max_err(out, out_fa2) <= 2e-2
    valid = [[i for i in row[:int(c)] if 0 <= i < 8] for row, c in zip(rows, cnt[0, :, 0].tolist())]
    visible = visibility_from_lists([[r] for r in valid], [[[]] for _ in valid], 128, blocks.resolved_q_block_size(seqlen_q),
                                    seqlen_q, seqlen_k, heads, causal=False, device="cuda")
    assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.gpu
@pytest.mark.sm90
def test_seqused_k_inside_a_block_and_rows_wider_than_the_keys_answer_right_on_auto():
    """The fuzzer's two fa4 defects on the GPU: seqused_k ending inside listed blocks (131 keys
    of a 1000-key cache: inside block 1) and a row of 10 entries over 8 blocks whose valid ids
    follow skipped ones; backend="fa4" refuses both, auto answers as the reference."""
    _needs_fa4()
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = random_qkv(2, 16, 1000, 8, 2, 128, torch.bfloat16, generator=g)
    seqused = torch.tensor([131, 1000], dtype=torch.int32, device="cuda")
    rows = [[1, 0, 7], [7, 2, 5]]
    blocks = SparseBlocks.from_lists([[[row]] * 2 for row in rows], device="cuda")
    with pytest.raises(SparseInputError, match="seqused_k"):
        fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa4", seqused_k=seqused)
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, seqused_k=seqused)
    visible = torch.stack([visibility_from_lists([[row]] * 2, [[[]]] * 2, 128, 128, 16, 1000, 8, causal=False,
                                                 device="cuda") for row in rows])
    visible &= (torch.arange(1000, device="cuda") < seqused.view(2, 1, 1, 1))
    assert_close_to_reference(out, lse, q, k, v, visible)

    wide = torch.tensor([20, -1, 3, 0, 5, 99, 2, 1, 7, 6], dtype=torch.int32, device="cuda")  # 1-D: every row
    with pytest.raises(SparseInputError, match="list rows of 10 entries for 8 K/V blocks"):
        fas.flash_attn_with_sparse_block_table(q, k, v, wide, backend="fa4")
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, wide)
    valid = [3, 0, 5, 2, 1, 7, 6]
    visible = visibility_from_lists([[valid]] * 8, [[[]]] * 8, 128, 128, 16, 1000, 8, causal=False, device="cuda")
    assert_close_to_reference(out, lse, q, k, v, visible.unsqueeze(0).expand(2, -1, -1, -1))


@pytest.mark.gpu
@pytest.mark.sm90
def test_fa4_runs_on_request_and_auto_never_takes_it():
    """With FA-4 present auto keeps its one rule (fa3 for prefill-shaped and packed decode calls
    FA-3 takes, else fa2), and backend="fa4" runs where FA-4 can."""
    _needs_fa4()
    dense = lambda sk, bs=128: torch.arange(-(-sk // bs), dtype=torch.int32, device="cuda")
    fa3_here = fa3_ops.missing_build() is None
    q, k, v = random_qkv(1, 4096, 4096, 8, 8, 128, torch.bfloat16)
    assert fas.choose_backend(q, k, v, dense(4096))[0] == ("fa3" if fa3_here else "fa2")
    assert fas.choose_backend(q, k, v, dense(4096), backend="fa4") == ("fa4", "requested")
    assert fas.choose_backend(q, k, v, dense(4096), num_splits=2, backend="fa4")[0] == "fa4"  # it splits fixed-length calls
    assert fas.choose_backend(q, k, v, dense(4096, 256), block_size=256)[0] == "fa2"
    with pytest.raises(SparseInputError, match="^backend"):
        fas.choose_backend(q, k, v, dense(4096, 256), block_size=256, backend="fa4")
    page_table = torch.arange(32, dtype=torch.int32, device="cuda").view(1, 32)
    k_cache, v_cache = k.view(32, 128, 8, 128), v.view(32, 128, 8, 128)
    # Pages of whole 128-key blocks take the contiguous call's rule (prefill-shaped: fa3 where built).
    assert fas.choose_backend(q, k_cache, v_cache, dense(4096), page_table=page_table)[0] == ("fa3" if fa3_here else "fa2")
    with pytest.raises(SparseInputError, match="^backend"):
        fas.choose_backend(q, k_cache, v_cache, dense(4096), page_table=page_table, backend="fa4")
    q_decode, k_decode, v_decode = random_qkv(8, 16, 32768, 32, 8, 128, torch.bfloat16)
    assert fas.choose_backend(q_decode, k_decode, v_decode, dense(32768)[:16])[0] == ("fa3" if fa3_here else "fa2")
    assert fas.choose_backend(q_decode[:, :1], k_decode, v_decode, dense(32768)[:16])[0] == ("fa3" if fa3_here else "fa2")
    assert fas.choose_num_splits_for(q_decode, k_decode, v_decode, dense(32768), backend="fa4") > 1


FIRST_CALL_INSIDE_A_CAPTURE = """
import sys, torch
import flash_attn_sparse as fas
g = torch.Generator(device="cuda").manual_seed(3)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
           for shape in ((2, 16, 8, 128), (2, 4096, 2, 128), (2, 4096, 2, 128)))
ids = torch.randperm(32, device="cuda", generator=g)[:9].to(torch.int32)  # permuted, gapped
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, ids, backend="fa4")
except Exception as error:
    print("capture failed:", type(error).__name__, str(error)[:800])
    sys.exit(3)
out.zero_()
graph.replay()
ref, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, ids, backend="fa2")
print("max |out - fa2|", (out.float() - ref.float()).abs().max().item(), "lse", (lse - ref_lse).abs().max().item())
"""


@pytest.mark.gpu
@pytest.mark.sm90
def test_first_fa4_call_of_a_shape_inside_a_graph_capture(tmp_path):
    """A process whose first FA-4 call of a shape is made while a CUDA graph is captured (its
    CuTe-DSL kernel compiled and loaded inside the capture, an empty compile cache) replays the
    right answer."""
    _needs_fa4()
    env = dict(os.environ, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", FIRST_CALL_INSIDE_A_CAPTURE], env=env, capture_output=True,
                          text=True, timeout=300)
    print(done.stdout, done.stderr[-3000:])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    diffs = [float(x) for x in done.stdout.split()[-3::2]]
    assert diffs[0] < 2e-2 and diffs[1] < 1e-3, done.stdout


def _speculative_sets(spec_ids, missed_ids, seqlen_q, seqlen_k, block, causal_spec):
    """The speculative and missed tables on the GPU, and which keys each query row sees."""
    spec = torch.tensor(spec_ids, dtype=torch.int32, device="cuda")
    missed = torch.tensor(missed_ids, dtype=torch.int32, device="cuda")
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    visible[:, block_positions(missed_ids, block, seqlen_k).cuda()] = True
    spec_pos = block_positions(spec_ids, block, seqlen_k).cuda()
    rows = torch.arange(seqlen_q, device="cuda")[:, None]
    visible[:, spec_pos] = spec_pos[None, :] <= rows + seqlen_k - seqlen_q if causal_spec else True
    return spec, missed, visible


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("causal_spec", [True, False])
def test_speculative_forms_run_on_fa4_at_prefill(causal_spec, monkeypatch):
    """Prefill-shaped speculative calls with backend="fa4": the zero-copy form
    as one FA-4 pass with its shared speculative mask lists; the gathered form as the missed pass
    on FA-4 over every row plus a speculative pass over the rows that see k_spec (with
    causal_spec the last 512 of 2048: few tiles, which FA-4 splits), merged into those rows."""
    _needs_fa4()
    g = torch.Generator(device="cuda").manual_seed(11 + causal_spec)
    seqlen_q, seqlen_k, heads, heads_k, block = 2048, 8192, 8, 2, 128  # 128 FA-4 tiles: auto takes FA-4
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    spec_start = seqlen_k // block - 4  # the speculative set: the last 4 blocks (every row's diagonal)
    spec_ids = list(range(spec_start, seqlen_k // block))[::-1]  # permuted
    missed_ids = random.Random(5).sample(range((seqlen_k - seqlen_q) // block), 12)  # gapped, historical for every row
    spec, missed, visible = _speculative_sets(spec_ids, missed_ids, seqlen_q, seqlen_k, block, causal_spec)
    fa4_lists = []
    run_fa4 = fa4.launch
    monkeypatch.setattr(fa4, "launch", lambda q, k, v, blocks, **kw: fa4_lists.append(blocks) or run_fa4(q, k, v, blocks, **kw))

    poison_allocator(((1, seqlen_q, heads, 128), torch.bfloat16), ((1, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec, missed, causal_spec=causal_spec, validate="full",
                                                           backend="fa4")
    assert len(fa4_lists) == 1 and torch.equal(fa4_lists[0].mask_idx[0, 0, 0], spec)
    assert_close_to_reference(out, lse, q, k, v, visible)
    out_fa2, lse_fa2 = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec, missed, causal_spec=causal_spec,
                                                                   backend="fa2")
    assert len(fa4_lists) == 1
    assert max_err(lse, lse_fa2) <= 1e-3 and max_err(out, out_fa2) <= 2e-2

    k_spec, v_spec = k[:, spec_start * block:].contiguous(), v[:, spec_start * block:].contiguous()
    poison_allocator(((1, seqlen_q, heads, 128), torch.bfloat16), ((1, heads, seqlen_q), torch.float32))
    out_g, lse_g = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, missed, causal_spec=causal_spec,
                                                     validate="full", backend="fa4")
    assert len(fa4_lists) == 3  # both passes on FA-4
    assert_close_to_reference(out_g, lse_g, q, k, v, visible)
    out_g2, lse_g2 = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, missed, causal_spec=causal_spec,
                                                       backend="fa2")
    assert len(fa4_lists) == 3
    assert max_err(lse_g, lse_g2) <= 1e-3 and max_err(out_g, out_g2) <= 2e-2


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("causal_spec", [True, False])
def test_speculative_forms_at_decode_with_fa4_present(causal_spec, monkeypatch):
    """At decode with backend="fa4" (16 queries x 4 query heads per K/V head in a tile) the
    zero-copy form runs as one FA-4 pass with its shared speculative mask lists, split; the
    gathered form as one FA-4 launch whose mask lists read k_spec / v_spec (patch
    flash-attn-4/0006). Both against the fp32 reference."""
    _needs_fa4()
    g = torch.Generator(device="cuda").manual_seed(23)
    batch, seqlen_q, seqlen_k, heads, heads_k, block = 2, 16, 8192, 8, 2, 128
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    spec_start = seqlen_k // block - 2  # the speculative set: the last 2 blocks, causal
    spec_ids = [spec_start + 1, spec_start]
    missed_ids = random.Random(3).sample(range(spec_start), 9)
    spec, missed, visible = _speculative_sets(spec_ids, missed_ids, seqlen_q, seqlen_k, block, causal_spec)
    fa4_calls = []
    run_fa4 = fa4.launch
    monkeypatch.setattr(fa4, "launch", lambda *a, **kw: fa4_calls.append((kw["num_splits"], kw.get("mask_source") is not None))
                        or run_fa4(*a, **kw))

    poison_allocator(((batch, seqlen_q, heads, 128), torch.bfloat16), ((batch, heads, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec, missed, causal_spec=causal_spec, validate="full",
                                                           backend="fa4")
    assert len(fa4_calls) == 1 and fa4_calls[0][0] > 1 and not fa4_calls[0][1]  # 4 tiles on 100+ SMs: split
    assert_close_to_reference(out, lse, q, k, v, visible)

    k_spec, v_spec = k[:, spec_start * block:].contiguous(), v[:, spec_start * block:].contiguous()
    out_g, lse_g = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, missed, causal_spec=causal_spec,
                                                     validate="full", backend="fa4")
    assert len(fa4_calls) == 2 and fa4_calls[1][1]  # one launch, the mask lists on k_spec
    assert_close_to_reference(out_g, lse_g, q, k, v, visible)
    assert max_err(lse, lse_g) <= 1e-3 and max_err(out, out_g) <= 2e-2
