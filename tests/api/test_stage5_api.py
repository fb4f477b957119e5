"""Stage 5: the speculative two-pass, partials + combine, torch.compile, dense regression."""

import random
import subprocess
import sys

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse.backends import fa2_ops
from flash_attn_sparse.reference import attention_over_blocks, attention_ref, block_positions, combine_ref
from helpers import (
    assert_close_to_reference,
    gather_speculative,
    max_err,
    missed_and_spec,
    poison_allocator,
    random_qkv,
    sparse_kernel_launches,
)

pytestmark = [pytest.mark.stage5, pytest.mark.gpu]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlen_q", [1, 16, 128])
@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["auto", "nosplit", "split"])
def test_speculative_gathered_equals_attention_over_union(seqlen_q, dtype, num_splits):
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + num_splits)
    block_size, seqlen_k = 128, 6000
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, 128, dtype, generator=g)
    n_blocks = -(-seqlen_k // block_size)
    spec, missed = missed_and_spec(n_blocks, 3, random.Random(seqlen_q))
    k_spec, v_spec, table, reference = gather_speculative(q, k, v, spec, missed, block_size)
    out, lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table, num_splits=num_splits)
    assert_close_to_reference(out, lse, q, *reference)


@pytest.mark.parametrize("missed_blocks", [0, 1, 40])
def test_speculative_edge_missed_sets(missed_blocks):
    """An empty or one-block missed set, and a long one, each with 16 draft rows and GQA packing."""
    g = torch.Generator(device="cuda").manual_seed(missed_blocks)
    block_size, seqlen_k, seqlen_q = 128, 8192, 16
    q, k, v = random_qkv(3, seqlen_q, seqlen_k, 8, 2, 128, torch.bfloat16, generator=g)
    n_blocks = seqlen_k // block_size
    spec = list(range(n_blocks - 2, n_blocks))
    missed = random.Random(missed_blocks).sample(range(n_blocks - 2), missed_blocks)
    k_spec, v_spec, table, reference = gather_speculative(q, k, v, spec, missed, block_size)
    poison_allocator(((3, seqlen_q, 8, 128), torch.bfloat16), ((3, 8, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table)
    assert_close_to_reference(out, lse, q, *reference)


@pytest.mark.parametrize("layout", ["like_k", "other_strides", "tile_above_block"])
def test_speculative_runs_as_one_launch_where_the_kernel_allows(layout):
    """k_spec laid out like k: both passes in one kernel launch. k_spec with other row and head
    strides, or blocks smaller than the kernel tile (head dim 64 takes 256-key tiles): the two
    passes. The same results either way."""
    head_dim = 64 if layout == "tile_above_block" else 128
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    block_size, seqlen_k, seqlen_q = 128, 3000, 16
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, generator=g)
    spec, missed = missed_and_spec(-(-seqlen_k // block_size), 2, random.Random(7))
    k_spec, v_spec, table, reference = gather_speculative(q, k, v, spec, missed, block_size)
    if layout == "other_strides":
        k_spec, v_spec = (torch.cat([t, t], dim=-1)[..., :head_dim] for t in (k_spec, v_spec))
    results = []
    launches = sparse_kernel_launches(lambda: results.append(fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table)))
    assert len(launches) == (1 if layout == "like_k" else 2)
    assert_close_to_reference(*results[0], q, *reference)


def test_speculative_with_per_query_head_missed_lists():
    """Per-query-head missed lists (not GQA-packed) with a shared, packed speculative list: the
    two passes tile the queries differently and still merge row by row."""
    g = torch.Generator(device="cuda").manual_seed(5)
    block_size, seqlen_k, seqlen_q, heads = 128, 4096, 4, 8
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads, 2, 128, torch.bfloat16, generator=g)
    n_blocks = seqlen_k // block_size
    rng = random.Random(5)
    missed = [[[rng.sample(range(n_blocks - 1), 5)] for _ in range(heads)] for _ in range(2)]
    blocks = fas.SparseBlocks.from_lists(missed, block_size=block_size, device="cuda")
    k_spec, v_spec = k[:, -block_size:].contiguous(), v[:, -block_size:].contiguous()
    out, lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, blocks)
    # Reference over the full K/V: each head's missed blocks, plus the last block causally.
    visible = torch.zeros(2, heads, seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    for b in range(2):
        for h in range(heads):
            visible[b, h, :, block_positions(missed[b][h][0], block_size, seqlen_k).cuda()] = True
    spec_pos = torch.arange(seqlen_k - block_size, seqlen_k, device="cuda")
    rows = torch.arange(seqlen_q, device="cuda")[:, None]
    visible[:, :, :, spec_pos] = spec_pos[None, :] <= rows + seqlen_k - seqlen_q
    assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_merge_with_empty_splits_and_rows(head_dim):
    """128 splits of a 3-block list (most splits see nothing), and a batch whose list is empty:
    the merge keeps empty partials out and writes O = 0, LSE = -inf for unseen rows."""
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    block_size, seqlen_k, seqlen_q = 64, 3000, 16
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, generator=g)
    lists = [[[[5, 40, 17]]] * 2, [[[]]] * 2]
    blocks = fas.SparseBlocks.from_lists(lists, block_size=block_size, device="cuda")
    poison_allocator(((2, seqlen_q, 8, head_dim), torch.bfloat16), ((2, 8, seqlen_q), torch.float32))
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=128, backend="fa2")
    visible = torch.zeros(2, 1, seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    visible[0, :, :, block_positions([5, 40, 17], block_size, seqlen_k).cuda()] = True
    assert_close_to_reference(out, lse, q, k, v, visible)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("seqlen_q", [1, 16, 200])
def test_speculative_zero_copy_equals_attention_over_union(seqlen_q, block_size):
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * block_size)
    seqlen_k = 5000
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, 128, torch.bfloat16, generator=g)
    n_blocks = -(-seqlen_k // block_size)
    spec, missed = missed_and_spec(n_blocks, 4, random.Random(block_size))
    as_table = lambda blocks: torch.tensor(blocks, dtype=torch.int32, device="cuda")
    out, lse = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, as_table(spec), as_table(missed), block_size=block_size)
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    visible[:, block_positions(missed, block_size, seqlen_k).cuda()] = True
    spec_pos = block_positions(spec, block_size, seqlen_k).cuda()
    rows = torch.arange(seqlen_q, device="cuda")[:, None]
    visible[:, spec_pos] = spec_pos[None, :] <= rows + seqlen_k - seqlen_q
    assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.parametrize("groups", [2, 3, 8])
def test_partials_and_combine_equal_one_pass(groups):
    g = torch.Generator(device="cuda").manual_seed(groups)
    block_size, seqlen_k = 64, 4000
    q, k, v = random_qkv(2, 16, seqlen_k, 8, 2, 128, torch.bfloat16, generator=g)
    n_blocks = -(-seqlen_k // block_size)
    blocks = random.Random(groups).sample(range(n_blocks), 30)
    parts = [blocks[i::groups] for i in range(groups)]
    tables = [torch.tensor(p, dtype=torch.int32, device="cuda") for p in parts]
    out_partials, lse_partials = fas.flash_attn_sparse_partials(q, k, v, tables, block_size=block_size)
    poison_allocator(((2, 16, 8, 128), torch.bfloat16), ((2, 8, 16), torch.float32))
    out, lse = fas.flash_attn_combine(out_partials, lse_partials, out_dtype=torch.bfloat16)
    one_out, one_lse = fas.flash_attn_with_sparse_block_table(q, k, v, torch.cat(tables), block_size=block_size)
    # Each partial against its own reference, then the merge against the one pass and the oracle.
    for p, (o, lse_p) in zip(parts, zip(out_partials, lse_partials)):
        vis = torch.zeros(16, seqlen_k, dtype=torch.bool, device="cuda")
        vis[:, block_positions(p, block_size, seqlen_k).cuda()] = True
        assert_close_to_reference(o.transpose(1, 2), lse_p, q, k, v, vis)
    vis = torch.zeros(16, seqlen_k, dtype=torch.bool, device="cuda")
    vis[:, block_positions(blocks, block_size, seqlen_k).cuda()] = True
    assert_close_to_reference(out, lse, q, k, v, vis)
    assert max_err(out, one_out) <= 2e-2 and max_err(lse, one_lse) <= 1e-4


# Rows and splits that take the combine kernel's four-warp rows (few rows), its one-warp rows
# (many rows), and more splits than one round of loads holds (32 per four-warp row, 8 per warp).
@pytest.mark.parametrize("slots,batch,heads", [(5, 2, 4), (70, 1, 2), (40, 4, 32)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_combine_kernel_matches_reference_combine_with_empty_partials(slots, batch, heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(slots + head_dim)
    seqlen_q = 16
    out_p = torch.randn(slots, batch, heads, seqlen_q, head_dim, generator=g, device="cuda")
    lse_p = torch.randn(slots, batch, heads, seqlen_q, generator=g, device="cuda") * 3
    lse_p[1] = float("-inf")          # one empty partial everywhere
    lse_p[:, 0, 0, 3] = float("-inf")  # one row with no keys at all
    out_p[:, 0, 0, 3] = 0
    out, lse = fas.flash_attn_combine(out_p, lse_p, out_dtype=torch.float16)
    ref_out, ref_lse = combine_ref(out_p.transpose(2, 3).double(), lse_p.double())
    assert max_err(out, ref_out) <= 2e-3
    assert max_err(lse, ref_lse) <= 1e-5
    assert torch.all(out[0, 3, 0] == 0) and lse[0, 0, 3] == float("-inf")


def test_torch_compile_fullgraph_matches_eager():
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = random_qkv(2, 16, 3000, 8, 2, 128, torch.bfloat16, generator=g)
    table = torch.tensor([7, 1, 20, 4], dtype=torch.int32, device="cuda")
    spec_table = torch.tensor([21, 22, 23], dtype=torch.int32, device="cuda")

    def attend(q, k, v, table, spec_table):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, table)
        spec_out, spec_lse = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec_table, table)
        parts = fas.flash_attn_sparse_partials(q, k, v, [table, spec_table])
        merged, merged_lse = fas.flash_attn_combine(*parts)
        return out.float() + spec_out.float() + merged.float(), lse + spec_lse + merged_lse

    eager = attend(q, k, v, table, spec_table)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v, table, spec_table)
    assert max_err(eager[0], compiled[0]) <= 1e-6 and max_err(eager[1], compiled[1]) <= 1e-6


# ---- dense regression on the patched build ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 4000), (128, 1000), (1000, 1000), (77, 3001)])
def test_dense_flash_attn_func_unchanged(seqlen_q, seqlen_k, head_dim, dtype, causal):
    from flash_attn import flash_attn_func
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + seqlen_k)
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype, generator=g)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda")
    if causal:
        visible = torch.arange(seqlen_k, device="cuda")[None] <= torch.arange(seqlen_q, device="cuda")[:, None] + seqlen_k - seqlen_q
    ref_out, _ = attention_ref(q, k, v, visible, dtype=torch.float32)
    low_out, _ = attention_ref(q, k, v, visible, dtype=dtype)
    assert max_err(out, ref_out) <= 2 * max_err(low_out, ref_out) + 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dense_flash_attn_varlen_func_unchanged(head_dim, causal):
    from flash_attn import flash_attn_varlen_func
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    seqlens = [(5, 300), (200, 200), (1, 1000)]
    qs, ks, vs = zip(*[random_qkv(1, sq, sk, 8, 2, head_dim, torch.bfloat16, generator=g) for sq, sk in seqlens])
    cu_q = torch.tensor([0] + list(torch.tensor([s[0] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor([s[1] for s in seqlens]).cumsum(0)), dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(torch.cat([x[0] for x in qs]), torch.cat([x[0] for x in ks]), torch.cat([x[0] for x in vs]),
                                 cu_q, cu_k, max(s[0] for s in seqlens), max(s[1] for s in seqlens), causal=causal)
    for i, (sq, sk) in enumerate(seqlens):
        visible = torch.ones(sq, sk, dtype=torch.bool, device="cuda")
        if causal:
            visible = torch.arange(sk, device="cuda")[None] <= torch.arange(sq, device="cuda")[:, None] + sk - sq
        ref_out, _ = attention_ref(qs[i], ks[i], vs[i], visible, dtype=torch.float32)
        low_out, _ = attention_ref(qs[i], ks[i], vs[i], visible, dtype=torch.bfloat16)
        got = out[cu_q[i]:cu_q[i + 1]].unsqueeze(0)
        assert max_err(got, ref_out) <= 2 * max_err(low_out, ref_out) + 1e-5


def test_head_dim_without_an_even_kernel_is_exact_or_refused():
    """Head dim 112 runs the 128 kernel with its columns past 112 predicated off (full profile),
    or is refused before C++ by a build without those kernels (the dev profile's
    FLASHATTENTION_DISABLE_UNEVEN_K), never computed past each row."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = random_qkv(2, 16, 1000, 8, 2, 112, torch.bfloat16, generator=g)
    blocks = [6, 0, 3]
    table = torch.tensor(blocks, dtype=torch.int32, device="cuda")
    head_dims, uneven = fa2_ops.compiled_head_dims()
    if not uneven:
        with pytest.raises(fas.SparseInputError, match="^q: this build .* runs head dims"):
            fas.flash_attn_with_sparse_block_table(q, k, v, table, num_splits=2)
        return
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, num_splits=2)
    ref_out, ref_lse = attention_over_blocks(q, k, v, blocks, 128, dtype=torch.float32)
    low_out, _ = attention_over_blocks(q, k, v, blocks, 128, dtype=torch.bfloat16)
    assert max_err(out, ref_out) <= 2 * max_err(low_out, ref_out) + 1e-5
    assert max_err(lse, ref_lse) <= 1e-3


def test_head_dims_the_build_lacks_are_refused_by_the_combine_too():
    head_dims, uneven = fa2_ops.compiled_head_dims()
    missing = [d for d in fa2_ops.HEAD_DIM_KERNELS if d not in head_dims]
    if not missing:
        pytest.skip("this build compiled every head dim")
    d = missing[0]
    partials = torch.zeros(2, 1, 1, 1, fa2_ops.head_dim_rounded(d), device="cuda")
    with pytest.raises(fas.SparseInputError, match="^head_dim: this build"):
        fas.flash_attn_combine(partials, torch.zeros(2, 1, 1, 1, device="cuda"), torch.bfloat16)


def test_a_check_in_cpp_raises_runtime_error_not_a_crash():
    """The C++ backstop behind the Python checks (a call straight to the extension) must raise,
    not take the process down: run in a child process so that a crash fails only this test."""
    script = """
import torch, flash_attn_2_cuda
q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda")
cnt = torch.zeros(1, 1, 1, dtype=torch.int32, device="cuda")
try:  # k in float32: refused by mha_fwd_sparse's dtype check
    flash_attn_2_cuda.sparse_fwd(
        q=q, k=q.float(), v=q, out=None, full_cnt=cnt, full_idx=cnt.view(1, 1, 1, 1), mask_cnt=None, mask_idx=None,
        cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None, cu_total_m_blocks=None,
        cu_block_idx_offsets=None, max_seqlen_q=1, max_seqlen_k=1, block_size=128, q_block_size=0, softmax_scale=1.0,
        is_causal=False, num_splits=1, pack_gqa=False, out_partial=None, lse_partial=None, partial_offset=0,
        k_mask_source=None, v_mask_source=None)
except RuntimeError as error:
    print("RuntimeError:", str(error).splitlines()[0])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "RuntimeError:" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])
