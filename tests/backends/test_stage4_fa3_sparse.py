"""Stage 4, FA-3: GPU tests of the sparse SM90 forward (patches flash-attn-3/0002-0003), torch.ops.flash_attn_3_sparse.fwd, against an fp32
reference that gathers exactly the listed blocks (the sparse contract of
flash_attn_sparse/metadata.py, with the kernel's rules for bad input: counts clamped to
[0, capacity], ids outside [0, n_blocks) skipped, an empty list giving O = 0 and LSE = -inf).

Lists are permuted and gapped, and V gets a per-block offset, so a kernel whose V steps densely
while K follows the list (tests/mutations/fa3-v-steps-densely.patch) fails. Needs an H100/H200 and the flash_attn_3
wheel of `forktools build` (dev profile: flash_api_sparse.cpp and the *_sparse_sm90.cu units).
"""

import math
import random

import pytest
import torch

from contract import BLOCK, causal_split_rows, check_batched, gapped_permuted, make_qkv, pack_rows, varlen_inputs
from helpers import assert_captured_run_equals_direct, one_shot_calls_on_two_streams, poison_allocator, random_qkv


def _load_op():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return None, "needs an sm90 GPU"
    try:
        import flash_attn_3._C  # noqa: F401  (registers torch.ops.flash_attn_3 and flash_attn_3_sparse)
    except ImportError as error:
        return None, f"flash_attn_3 extension not importable: {error}"
    if not hasattr(torch.ops, "flash_attn_3_sparse") or not hasattr(torch.ops.flash_attn_3_sparse, "fwd"):
        return None, "flash_attn_3 built without flash_api_sparse.cpp"
    return torch.ops.flash_attn_3_sparse.fwd, None


SPARSE_FWD, SKIP_REASON = _load_op()
pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.stage4,
              pytest.mark.skipif(SPARSE_FWD is None, reason=str(SKIP_REASON))]


# ----------------------------------------------------------------------------------------------
# The op (inputs and the reference check: tests/contract.py)


def run_sparse(q, k, v, full_cnt, full_idx, mask_cnt=None, mask_idx=None, *, q_block_size, causal=False,
               num_splits=1, pack_gqa=None, varlen=None):
    scale = q.shape[-1] ** -0.5
    poison_allocator((q.shape, q.dtype), ((q.shape[0] * q.shape[1] * q.shape[2],), torch.float32))
    cu_m = cu_off = cu_q = cu_k = max_q = max_k = None
    if varlen is not None:
        cu_m, cu_off, cu_q, cu_k, max_q, max_k = varlen
    out, lse = SPARSE_FWD(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, cu_m, cu_off, cu_q, cu_k, max_q, max_k,
                          block_size=BLOCK, q_block_size=q_block_size, softmax_scale=scale, causal=causal,
                          num_splits=num_splits, pack_gqa=pack_gqa)
    torch.cuda.synchronize()
    return out, lse, scale


# ----------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("table", ["shared", "per_kv_head", "per_q_head"])
@pytest.mark.parametrize("pack_gqa", [None, False])
def test_permuted_gapped_lists(dtype, head_dim, table, pack_gqa):
    batch, heads, heads_k, seqlen_q, seqlen_k, q_block = 2, 8, 2, 300, 1000, 128
    rng = random.Random(1000 + head_dim)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed=rng.randrange(1 << 30))
    table_heads = {"shared": 1, "per_kv_head": heads_k, "per_q_head": heads}[table]
    m_blocks, n_blocks = math.ceil(seqlen_q / q_block), math.ceil(seqlen_k / BLOCK)
    # The partial tail block (n_blocks - 1) sits anywhere in the permuted lists.
    rows = [[[gapped_permuted(rng, n_blocks, 0.5, must=[n_blocks - 1] if (b + h + m) % 2 else [])
              for m in range(m_blocks)] for h in range(table_heads)] for b in range(batch)]
    full_cnt, full_idx = pack_rows(rows)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, q_block_size=q_block, pack_gqa=pack_gqa)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block, False, scale)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlens", [(512, 512), (256, 1000), (384, 200)])
@pytest.mark.parametrize("table", ["per_kv_head", "per_q_head"])
def test_causal_mask_blocks(head_dim, seqlens, table):
    seqlen_q, seqlen_k = seqlens
    batch, heads, heads_k, q_block = 2, 4, 2, 128
    rng = random.Random(seqlen_q * 7 + seqlen_k)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.bfloat16, seed=rng.randrange(1 << 30))
    table_heads = heads_k if table == "per_kv_head" else heads
    m_blocks = math.ceil(seqlen_q / q_block)
    full, mask = causal_split_rows(rng, batch, table_heads, m_blocks, q_block, seqlen_q, seqlen_k, keep=0.7)
    width = max(max(len(r) for pb in full for ph in pb for r in ph), max(len(r) for pb in mask for ph in pb for r in ph), 1)
    full_cnt, full_idx = pack_rows(full, width)
    mask_cnt, mask_idx = pack_rows(mask, width)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size=q_block, causal=True)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block, True, scale)


@pytest.mark.parametrize("num_splits", [2, 3, 7, 40])
@pytest.mark.parametrize("table", ["shared", "per_kv_head", "per_q_head"])
def test_forced_splits(num_splits, table):
    """Each split takes an even share of the entries; splits past the end are empty partials
    (LSE -inf) that the combine must ignore."""
    batch, heads, heads_k, seqlen_q, seqlen_k, q_block = 2, 8, 2, 16, 4000, 128
    rng = random.Random(num_splits)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=rng.randrange(1 << 30))
    table_heads = {"shared": 1, "per_kv_head": heads_k, "per_q_head": heads}[table]
    n_blocks = math.ceil(seqlen_k / BLOCK)
    rows = [[[gapped_permuted(rng, n_blocks, 0.4, must=[n_blocks - 1])] for _ in range(table_heads)] for _ in range(batch)]
    rows[0][0][0] = []  # one empty row among split ones
    full_cnt, full_idx = pack_rows(rows)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, q_block_size=q_block, num_splits=num_splits)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block, False, scale)


@pytest.mark.parametrize("num_splits,causal", [(1, False), (1, True), (4, False)])
def test_fwd_out_writes_a_given_strided_out_as_fwd_allocates_it(num_splits, causal):
    """fwd_out (an out= call) and the extension's fwd_into (the eager launcher's) write into a
    NaN-poisoned out that is a strided view of a larger tensor, bitwise what fwd returns, touching
    nothing outside the view; split calls (no tile counter) and the persistent scheduler's (counter
    zeroed per call) alike, twice each."""
    batch, heads, heads_k, seqlen_q, seqlen_k, q_block = 2, 8, 2, 200, 3000, 128
    rng = random.Random(31 + num_splits + causal)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=rng.randrange(1 << 30))
    n_blocks, m_blocks = math.ceil(seqlen_k / BLOCK), math.ceil(seqlen_q / q_block)
    rows = [[[gapped_permuted(rng, n_blocks, 0.4, must=[n_blocks - 1]) for _ in range(m_blocks)] for _ in range(heads_k)]
            for _ in range(batch)]
    full_cnt, full_idx = pack_rows(rows)
    options = dict(softmax_scale=0.125, q_block_size=q_block, causal=causal, num_splits=num_splits)
    want, want_lse = SPARSE_FWD(q, k, v, full_cnt, full_idx, None, None, None, None, None, None, None, None, **options)
    wide = torch.full((batch, seqlen_q, heads + 3, 128), float("nan"), dtype=q.dtype, device="cuda")
    out = wide[:, :, 1:heads + 1]
    fwd_out = torch.ops.flash_attn_3_sparse.fwd_out
    from flash_attn_3._C import fwd_into  # the module loaded by the skip check above
    named = dict(q=q, k=k, v=v, out=out, full_cnt=full_cnt, full_idx=full_idx, mask_cnt=None, mask_idx=None,
                 cu_total_m_blocks=None, cu_block_idx_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, block_size=BLOCK, pack_gqa=None, **options)
    for run in [lambda: fwd_out(q, k, v, out, full_cnt, full_idx, None, None, None, None, None, None, None, None,
                                **options), lambda: fwd_into(**named)] * 2:
        out.fill_(float("nan"))
        lse = run()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert wide[:, :, 0].isnan().all() and wide[:, :, heads + 1:].isnan().all()
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block, causal, 0.125)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_lists(num_splits):
    batch, heads, heads_k, seqlen_q, seqlen_k, q_block = 2, 4, 4, 256, 640, 128
    rng = random.Random(5)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.float16, seed=11)
    n_blocks = math.ceil(seqlen_k / BLOCK)
    rows = [[[gapped_permuted(rng, n_blocks, 0.5) if (b, h, m) != (1, 2, 1) else [] for m in range(2)]
             for h in range(heads)] for b in range(batch)]
    rows[0] = [[[] for _ in range(2)] for _ in range(heads)]  # a whole batch with nothing listed
    full_cnt, full_idx = pack_rows(rows)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, q_block_size=q_block, num_splits=num_splits)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block, False, scale)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()


@pytest.mark.parametrize("q_block_size,heads,heads_k,table", [(256, 4, 4, "per_q_head"), (128, 8, 2, "per_kv_head"),
                                                              (256, 8, 1, "shared"), (64, 8, 4, "per_kv_head")])
def test_query_tiles_and_pack_gqa(q_block_size, heads, heads_k, table):
    """List rows of q_block_size rows over kernel tiles of 128 (packed) rows."""
    batch, seqlen_q, seqlen_k = 1, 600, 900
    rng = random.Random(q_block_size + heads)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=rng.randrange(1 << 30))
    table_heads = {"shared": 1, "per_kv_head": heads_k, "per_q_head": heads}[table]
    m_blocks, n_blocks = math.ceil(seqlen_q / q_block_size), math.ceil(seqlen_k / BLOCK)
    rows = [[[gapped_permuted(rng, n_blocks, 0.5) for _ in range(m_blocks)] for _ in range(table_heads)]]
    full_cnt, full_idx = pack_rows(rows)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, q_block_size=q_block_size)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block_size, False, scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,q_block_size,num_splits", [(16, 128, 0), (48, 32, 3), (200, 64, 2), (384, 128, 0)])
def test_packed_split_calls_map_their_tiles_onto_their_query_blocks(seqlen_q, q_block_size, num_splits, head_dim,
                                                                     causal):
    """Packed split calls (a K/V head's 4 query heads per tile): 64 packed rows at Sq16 take the
    64-row decode tile; more take 128-row tiles, so that at q_block_size 32 one tile covers one
    list row's 128 packed rows, and at 64 two tiles share a list row, the second starting mid-way
    through its query block (sparse_kernel_choice.h)."""
    batch, heads, heads_k, seqlen_k = 2, 8, 2, 1000
    rng = random.Random(seqlen_q * 31 + head_dim + causal)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.bfloat16, seed=rng.randrange(1 << 30))
    m_blocks, n_blocks = math.ceil(seqlen_q / q_block_size), math.ceil(seqlen_k / BLOCK)
    if causal:
        full, mask = causal_split_rows(rng, batch, heads_k, m_blocks, q_block_size, seqlen_q, seqlen_k, keep=0.7)
    else:  # the partial tail block anywhere in half the rows
        full = [[[gapped_permuted(rng, n_blocks, 0.5, must=[n_blocks - 1] if (b + h + m) % 2 else [])
                  for m in range(m_blocks)] for h in range(heads_k)] for b in range(batch)]
        mask = [[[[] for _ in range(m_blocks)] for _ in range(heads_k)] for _ in range(batch)]
    width = max(max(len(r) for pb in rows for ph in pb for r in ph) for rows in (full, mask)) or 1
    full_cnt, full_idx = pack_rows(full, width)
    mask_cnt, mask_idx = pack_rows(mask, width)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size=q_block_size,
                                 causal=causal, num_splits=num_splits, pack_gqa=True)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size, causal, scale)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("position", [0, 32, 40, -2, -1])
@pytest.mark.parametrize("odd", ["tail", "out_of_range", "out_of_range_causal"])
def test_one_entry_needing_the_mask_anywhere_in_a_long_list(odd, position, num_splits):
    """Lists of 60-70 entries, more than one pass of a warp's 32 lanes, where one entry of the
    first query tile's full list needs the sequence-end mask: the partial tail block or an
    out-of-range id (also in causal lists, whose mask entries the walk meets first), at entry
    `position`. A tile's full entries skip the per-entry mask check only when its warps' vote
    over their ids finds no such entry (patch flash-attn-3/0006), so a vote that missed one would
    let the keys past the sequence end in. The second tile's lists have none."""
    causal = odd.endswith("causal")
    batch, heads, heads_k, seqlen_q, q_block, n_blocks = 1, 4, 2, 256, 128, 81
    seqlen_k = (n_blocks - 1) * BLOCK + 17
    rng = random.Random(f"{odd}/{position}/{num_splits}")
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=rng.randrange(1 << 30))
    if causal:
        full, mask = causal_split_rows(rng, batch, heads_k, 2, q_block, seqlen_q, seqlen_k, keep=0.85)
    else:  # the tail block only where the test puts it
        full, mask = [[[rng.sample(range(n_blocks - 1), 69) for _ in range(2)] for _ in range(heads_k)]], None
    odd_id = n_blocks - 1 if odd == "tail" else n_blocks + 5
    for per_h in full[0]:
        per_h[0].insert(position if position >= 0 else len(per_h[0]) + 1 + position, odd_id)
    lists = [full] + ([mask] if mask else [])
    width = max(len(r) for rows in lists for pb in rows for ph in pb for r in ph)
    full_cnt, full_idx = pack_rows(full, width)
    mask_cnt, mask_idx = pack_rows(mask, width) if mask else (None, None)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size=q_block, causal=causal,
                                 num_splits=num_splits)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block, causal, scale)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_bad_ids_and_counts(num_splits):
    """Counts above the capacity are clamped, negative ones read as 0; ids outside
    [0, n_blocks) are skipped. No fault, and the valid blocks still count."""
    batch, heads, heads_k, seqlen_q, seqlen_k, q_block = 2, 4, 2, 200, 700, 128
    rng = random.Random(9)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=3)
    n_blocks = math.ceil(seqlen_k / BLOCK)
    rows = [[[gapped_permuted(rng, n_blocks, 0.6) + [-1, n_blocks, 10 ** 6, -(2 ** 31)] for _ in range(2)]
             for _ in range(heads_k)] for _ in range(batch)]
    for per_b in rows:
        for per_h in per_b:
            for r in per_h:
                rng.shuffle(r)
    # Padding past a count is an out-of-range id, so a count clamped to the capacity reads only
    # skipped ids beyond the real entries.
    full_cnt, full_idx = pack_rows(rows, pad=-7)
    full_cnt[0, 0, 0] = 1000  # above the capacity: clamped
    full_cnt[1, 1, 1] = -5  # negative: nothing
    mask_cnt = torch.zeros_like(full_cnt)
    mask_idx = torch.full_like(full_idx, n_blocks + 3)  # all out of range: skipped
    mask_cnt[1, 0, 0] = 10 ** 6
    mask_cnt[0, 1, 1] = 2
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size=q_block, num_splits=num_splits)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block, False, scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table", ["shared", "per_kv_head", "per_q_head"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_varlen_ragged_and_empty(causal, table, num_splits):
    seqlens_q = [300, 0, 128, 77, 1]
    seqlens_k = [1000, 500, 0, 77, 2100]
    heads, heads_k, q_block = 4, 2, 128
    if causal:
        seqlens_k = [max(sk, sq) for sq, sk in zip(seqlens_q, seqlens_k)]
    rng = random.Random(hash((causal, table, num_splits)) & 0xFFFF)
    table_heads = {"shared": 1, "per_kv_head": heads_k, "per_q_head": heads}[table]
    q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, per_seq, varlen = varlen_inputs(
        seqlens_q, seqlens_k, heads, heads_k, 128, table_heads, q_block, rng, causal)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block_size=q_block,
                                 causal=causal, num_splits=num_splits, varlen=varlen)
    assert lse.shape == (heads, q.shape[0])
    q_start = k_start = 0
    for (sq, sk), (full, mask, width) in zip(zip(seqlens_q, seqlens_k), per_seq):
        if sq:
            f_cnt, f_idx = pack_rows([full], width)
            m_cnt, m_idx = pack_rows([mask], width)
            check_batched(out[q_start:q_start + sq].unsqueeze(0), lse[:, q_start:q_start + sq].unsqueeze(0),
                          q[q_start:q_start + sq].unsqueeze(0), k[k_start:k_start + sk].unsqueeze(0),
                          v[k_start:k_start + sk].unsqueeze(0), f_cnt, f_idx, m_cnt, m_idx, q_block, causal, scale)
        q_start += sq
        k_start += sk


def test_every_block_listed_matches_dense():
    """All blocks listed, ascending: dense attention (every key visible)."""
    batch, heads, heads_k, seqlen_q, seqlen_k = 2, 8, 2, 512, 1000
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, seed=21)
    n_blocks = math.ceil(seqlen_k / BLOCK)
    rows = [[[list(range(n_blocks)) for _ in range(4)]] for _ in range(batch)]
    full_cnt, full_idx = pack_rows(rows)
    out, lse, scale = run_sparse(q, k, v, full_cnt, full_idx, q_block_size=128)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, 128, False, scale)


# ----------------------------------------------------------------------------------------------
# The Python wrapper flash_attn_sparse.backends.fa3_ops


@pytest.mark.parametrize("causal", [False, True])
def test_wrapper_matches_the_reference_and_refuses_what_the_host_refuses(causal):
    """fa3_ops.sparse_fwd (keyword call, default scale, SparseBlocks) against the fp32 reference
    with the FA-2 LSE layout; refusal() is None for it and names block_size, head dim and page size."""
    from flash_attn_sparse import SparseBlocks
    from flash_attn_sparse.backends import fa3_ops

    assert fa3_ops.missing_build() is None
    batch, heads, heads_k, seqlen_q, seqlen_k, head_dim, q_block = 2, 4, 2, 256, 700, 128, 128
    rng = random.Random(77 + causal)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.bfloat16, seed=rng.randrange(1 << 30))
    n_blocks = math.ceil(seqlen_k / BLOCK)
    rows = [[[gapped_permuted(rng, n_blocks, 0.6, must=[n_blocks - 1]) for _ in range(2)] for _ in range(heads_k)]
            for _ in range(batch)]
    full_cnt, full_idx = pack_rows(rows)
    blocks = SparseBlocks(full_cnt, full_idx, block_size=BLOCK, q_block_size=q_block)
    assert fa3_ops.refusal(q, k, blocks, varlen=False) is None
    poison_allocator((q.shape, q.dtype), ((batch * seqlen_q * heads,), torch.float32))
    out, lse = fa3_ops.sparse_fwd(q, k, v, blocks, causal=causal, num_splits=1)
    torch.cuda.synchronize()
    assert lse.shape == (batch, heads, seqlen_q)
    check_batched(out, lse, q, k, v, full_cnt, full_idx, None, None, q_block, causal, head_dim ** -0.5)
    assert "block_size" in fa3_ops.refusal(q, k, SparseBlocks(full_cnt, full_idx, block_size=64, q_block_size=q_block),
                                           varlen=False)
    assert "head dims" in fa3_ops.refusal(q[..., :96], k[..., :96], blocks, varlen=False)
    # Pages under 128 keys: refused by a build without the cp.async paged kernels, taken by one with them.
    if "PAGEDKV" in fa3_ops.disabled():
        assert "multiple of 128" in fa3_ops.refusal(q, k, blocks, varlen=False, page_size=64)
    else:
        assert fa3_ops.refusal(q, k, blocks, varlen=False, page_size=64) is None
    assert fa3_ops.refusal(q, k, blocks, varlen=False, page_size=256) is None
    assert "q_block_size" in fa3_ops.refusal(q, k, SparseBlocks(full_cnt, full_idx, block_size=BLOCK, q_block_size=96),
                                             varlen=False)


def test_backend_fa3_through_the_public_api():
    """backend="fa3" runs the same kernel through flash_attn_with_sparse_block_table (permuted,
    gapped per-K/V-head lists with an empty one), and refuses what the op does not take."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import SparseBlocks, SparseInputError
    from flash_attn_sparse.backends import fa3_ops
    from flash_attn_sparse.reference import attention_over_blocks
    from helpers import random_qkv
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = random_qkv(2, 1, 8192, 16, 4, 128, torch.bfloat16, generator=g)
    rows = [[[[40, 3, 17, 63]], [[9]], [[]], [[62, 0, 31]]] for _ in range(2)]
    blocks = SparseBlocks.from_lists(rows, device="cuda")
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3")
    for h in range(16):
        listed = rows[0][h // 4][0]
        if not listed:
            assert torch.equal(out[:, :, h], torch.zeros_like(out[:, :, h])) and torch.isneginf(lse[:, h]).all()
            continue
        ref, ref_lse = attention_over_blocks(q[:, :, h:h + 1], k[:, :, h // 4:h // 4 + 1], v[:, :, h // 4:h // 4 + 1],
                                             listed, 128, dtype=torch.float32)
        low, _ = attention_over_blocks(q[:, :, h:h + 1], k[:, :, h // 4:h // 4 + 1], v[:, :, h // 4:h // 4 + 1],
                                       listed, 128, dtype=torch.bfloat16)
        err = (out[:, :, h:h + 1].float() - ref).abs().max().item()
        assert err <= 2 * (low.float() - ref).abs().max().item() + 1e-5
        assert (lse[:, h:h + 1] - ref_lse).abs().max().item() <= 1e-3
    # seqused_k: sequence 1 uses 5000 keys, so its listed blocks 40-63 are skipped and block 39 is cut.
    seqused = [8192, 5000]
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3",
                                                      seqused_k=torch.tensor(seqused, dtype=torch.int32, device="cuda"))
    for b, used in enumerate(seqused):
        for h in range(16):
            listed = [i for i in rows[b][h // 4][0] if i * 128 < used]
            if not listed:
                assert torch.equal(out[b, :, h], torch.zeros_like(out[b, :, h])) and torch.isneginf(lse[b, h]).all()
                continue
            kv = slice(b, b + 1), slice(0, used), slice(h // 4, h // 4 + 1)
            ref, ref_lse = attention_over_blocks(q[b:b + 1, :, h:h + 1], k[kv], v[kv], listed, 128, dtype=torch.float32)
            low, _ = attention_over_blocks(q[b:b + 1, :, h:h + 1], k[kv], v[kv], listed, 128, dtype=torch.bfloat16)
            assert (out[b:b + 1, :, h:h + 1].float() - ref).abs().max().item() <= 2 * (low.float() - ref).abs().max().item() + 1e-5
            assert (lse[b:b + 1, h:h + 1] - ref_lse).abs().max().item() <= 1e-3
    # The same keys in pages of 64 (in order): refused by a build without the cp.async paged kernels,
    # bitwise the contiguous call's answer with them.
    paged = lambda: fas.flash_attn_with_sparse_block_table(  # noqa: E731
        q, k.reshape(2 * 128, 64, 4, 128), v.reshape(2 * 128, 64, 4, 128), blocks, backend="fa3",
        seqused_k=torch.tensor(seqused, dtype=torch.int32, device="cuda"),
        page_table=torch.arange(256, dtype=torch.int32, device="cuda").view(2, 128))
    if "PAGEDKV" in fa3_ops.disabled():
        with pytest.raises(SparseInputError, match="multiple of 128"):
            paged()
    else:
        paged_out, paged_lse = paged()
        assert torch.equal(paged_out, out) and torch.equal(paged_lse, lse)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_one_shot_calls_of_one_shape_keep_their_own_lse_on_any_stream(num_splits):
    """The one-shot cache runs one planned forward per shape (SparseForward.run_with) over each
    call's own lists with a new LSE: a second call of the same shape with other lists, on the
    same stream and on another, leaves the first call's out and LSE as they were, and each
    equals the one-call path (the op fwd, uncached) bitwise."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import SparseBlocks, interface
    from flash_attn_sparse.backends import fa3, fa3_ops
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = random_qkv(2, 16, 4096, 8, 2, 128, torch.bfloat16, generator=g)
    rng = random.Random(12)

    def lists():  # one capacity (32 entries), so that the three calls share a cache entry
        rows = [[[gapped_permuted(rng, 32, 0.4)] for _ in range(2)] for _ in range(2)]
        return SparseBlocks(*pack_rows(rows, 32), block_size=128, q_block_size=128)
    first, second, third = lists(), lists(), lists()
    interface.one_shot_cache.clear()
    run = lambda blocks: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3", num_splits=num_splits)  # noqa: E731
    results = one_shot_calls_on_two_streams(run, first, second, third)
    assert len(interface.one_shot_cache) == 1 and fa3_ops.planner() is not None
    for blocks, out, lse in results:
        call = calls_for(q, k, v, blocks, num_splits)
        ref_out, ref_lse = fa3.run(call, num_splits)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def calls_for(q, k, v, blocks, num_splits):
    from flash_attn_sparse import calls
    from flash_attn_sparse.options import CallOptions
    return calls.SparseCall(q, k, v, blocks, CallOptions(num_splits=num_splits, backend="fa3"))


def test_fa3_under_torch_compile_fullgraph_and_in_a_plan_replayed_as_a_cuda_graph():
    """torch.compile(fullgraph=True) traces backend="fa3" to the op (its Meta implementation), and
    a SparsePlan on fa3 replays in a CUDA graph with lists updated in place; both equal eager."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import SparseBlocks
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = random_qkv(2, 16, 8192, 16, 4, 128, torch.bfloat16, generator=g)
    blocks = SparseBlocks.from_lists([[[[40, 3, 17, 63]], [[9]], [[]], [[62, 0, 31]]] for _ in range(2)], device="cuda")

    def attend(q, k, v, full_cnt, full_idx):
        return fas.flash_attn_with_sparse_block_table(q, k, v, SparseBlocks(full_cnt, full_idx), backend="fa3")

    eager = attend(q, k, v, blocks.full_cnt, blocks.full_idx)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v, blocks.full_cnt, blocks.full_idx)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])

    plan = fas.plan(q, k, v, blocks, backend="fa3")
    assert plan.backend == "fa3" and plan._planned is not None  # the extension's SparseForward (fa3.planned)
    plan.run(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out, graphed_lse = plan.run(q, k, v)
    blocks.full_idx[:, :, :, :2].copy_(blocks.full_idx[:, :, :, :2].flip(-1))  # the next replay reads them
    blocks.full_idx[0, 1, 0, 0] = 10
    graph.replay()
    want = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3")
    assert torch.equal(graphed_out, want[0]) and torch.equal(graphed_lse, want[1])


@pytest.mark.parametrize("num_splits,causal", [(3, False), (1, True), (1, False)])
def test_a_planned_forward_reruns_bitwise_like_the_op(num_splits, causal):
    """The extension's SparseForward (a plan's run) over the split path (no tile counter) and the
    persistent scheduler's (its counter zeroed by each run, else the second run would find it
    spent and skip tiles): run twice, each bitwise the op's answer."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import SparseBlocks
    g = torch.Generator(device="cuda").manual_seed(13 + num_splits + causal)
    q, k, v = random_qkv(2, 300, 3000, 8, 2, 128, torch.bfloat16, generator=g)
    rng = random.Random(num_splits)
    rows = [[[[b for b in gapped_permuted(rng, 24, 0.5, must=[23]) if b != m] for m in range(3)] for _ in range(2)]
            for _ in range(2)]
    diagonal = [[[[m] for m in range(3)] for _ in range(2)] for _ in range(2)]
    blocks = SparseBlocks.from_lists(rows, diagonal, block_size=BLOCK, q_block_size=128, device="cuda")
    want = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3", causal=causal, num_splits=num_splits)
    plan = fas.plan(q, k, v, blocks, backend="fa3", causal=causal, num_splits=num_splits)
    assert plan._planned is not None
    for _ in range(2):
        plan.out.fill_(float("nan"))
        out, lse = plan.run(q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize("num_splits,causal", [(3, False), (8, True), (1, False)])
def test_fa3_graph_launch_runs_bitwise_like_direct_launches(num_splits, causal):
    """SparseForward(graph_launch=True) (KernelGraph, kernel_launch_sink.h): after the first run
    the split forward and its combine launch as one CUDA graph given each run's arguments (TMA
    descriptors built anew). Every run, and run_with over other lists, equals the direct forward
    bitwise; the unsplit call (the persistent scheduler's tile counter) launches directly; a run on
    a stream being captured launches directly, and its replay equals too."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import SparseBlocks
    from flash_attn_sparse.backends import fa3
    g = torch.Generator(device="cuda").manual_seed(21 + num_splits)
    q, k, v = random_qkv(2, 16, 6000, 8, 2, 128, torch.bfloat16, generator=g)
    rng = random.Random(num_splits)

    def lists():  # one capacity, so run_with takes the second set; causal: the tail block 46 is the diagonal
        rows = [[[[b for b in gapped_permuted(rng, 47, 0.5, must=[46]) if not (causal and b == 46)]]
                 for _ in range(2)] for _ in range(2)]
        mask = pack_rows([[[[46]] for _ in range(2)] for _ in range(2)], 47) if causal else (None, None)
        return SparseBlocks(*pack_rows(rows, 47), *mask, block_size=BLOCK, q_block_size=128)
    blocks, other = lists(), lists()
    plan = fas.plan(q, k, v, blocks, backend="fa3", causal=causal, num_splits=num_splits)
    from flash_attn_sparse import calls
    from flash_attn_sparse.options import CallOptions
    call = calls.SparseCall(q, k, v, blocks, CallOptions(causal=causal, num_splits=num_splits, backend="fa3"))
    try:
        graphed = fa3.planned(call, plan.num_splits, torch.empty_like(q), graph_launch=True)
    except TypeError as error:  # a build before graph_launch
        pytest.skip(f"this flash_attn_3._C has no SparseForward graph_launch: {error}")
    direct = fa3.planned(call, plan.num_splits, torch.empty_like(q))
    other_lists = dict(full_cnt=other.full_cnt, full_idx=other.full_idx, mask_cnt=other.mask_cnt, mask_idx=other.mask_idx,
                       cu_total_m_blocks=None, cu_block_idx_offsets=None, cu_seqlens_q=None, cu_seqlens_k=None)
    for seed in range(4):
        q_i, k_i, v_i = random_qkv(2, 16, 6000, 8, 2, 128, torch.bfloat16,
                                   generator=torch.Generator(device="cuda").manual_seed(seed))
        out_graph, out_direct = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
        lse_graph = graphed.run(q_i, k_i, v_i, out_graph).clone()
        lse_direct = direct.run(q_i, k_i, v_i, out_direct).clone()
        assert torch.equal(out_graph, out_direct) and torch.equal(lse_graph, lse_direct)
        lse_graph = graphed.run_with(q=q_i, k=k_i, v=v_i, out=out_graph, **other_lists)
        lse_direct = direct.run_with(q=q_i, k=k_i, v=v_i, out=out_direct, **other_lists)
        assert torch.equal(out_graph, out_direct) and torch.equal(lse_graph, lse_direct)
    want = fas.flash_attn_with_sparse_block_table(q_i, k_i, v_i, other, backend="fa3", causal=causal, num_splits=num_splits)
    assert torch.equal(out_graph, want[0]) and torch.equal(lse_graph, want[1])
    assert_captured_run_equals_direct(graphed, direct, q, k, v)


def test_run_with_refuses_new_sequences_longer_than_planned():
    """SparseForward.run_with takes new cu_seqlens without a host sync, so the caller states their
    longest sequences: a bound past the planned one (the tile choice, the split count and the
    combine grid were sized for it) is refused, as is none; within it the run equals a one-shot
    call over the new sequences."""
    import flash_attn_sparse as fas
    from flash_attn_sparse import calls
    from flash_attn_sparse.backends import fa3
    from flash_attn_sparse.metadata import pack_varlen_lists
    from flash_attn_sparse.options import CallOptions
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (t[0] for t in random_qkv(1, 128, 1000, 8, 2, 128, torch.bfloat16, generator=g))
    blocks = pack_varlen_lists([[[[5, 0, 2]], [[1, 4]]], [[[2, 0]], [[1]]]], None, BLOCK, 128, device="cuda")
    cumulative = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                              device="cuda")
    cu_k = cumulative([700, 300])
    call = calls.SparseCall(q, k, v, blocks, CallOptions(backend="fa3", num_splits=2), cu_seqlens_q=cumulative([100, 28]),
                            cu_seqlens_k=cu_k, max_seqlen_q=100, max_seqlen_k=700)
    forward = fa3.planned(call, 2, torch.empty_like(q))
    if forward is None:
        pytest.skip("this flash_attn_3 build has no SparseForward")
    lists = dict(full_cnt=blocks.full_cnt, full_idx=blocks.full_idx, mask_cnt=None, mask_idx=None,
                 cu_total_m_blocks=blocks.cu_total_m_blocks, cu_block_idx_offsets=blocks.cu_block_idx_offsets)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(RuntimeError, match="plan again for longer sequences"):
        forward.run_with(q=q, k=k, v=v, out=out, **lists, cu_seqlens_q=cumulative([120, 8]), cu_seqlens_k=cu_k,
                         max_seqlen_q=120, max_seqlen_k=700)
    with pytest.raises(RuntimeError, match="need max_seqlen_q and max_seqlen_k"):
        forward.run_with(q=q, k=k, v=v, out=out, **lists, cu_seqlens_q=cumulative([60, 68]), cu_seqlens_k=cu_k)
    lse = forward.run_with(q=q, k=k, v=v, out=out, **lists, cu_seqlens_q=cumulative([60, 68]), cu_seqlens_k=cu_k,
                           max_seqlen_q=100, max_seqlen_k=700)
    want_out, want_lse = fas.flash_attn_varlen_with_sparse_blocks(
        q, k, v, blocks, cu_seqlens_q=cumulative([60, 68]), cu_seqlens_k=cu_k, max_seqlen_q=100, max_seqlen_k=700,
        backend="fa3", num_splits=2)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
