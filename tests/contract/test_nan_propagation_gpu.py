"""NaN / Inf in q, k or v propagate through the sparse path as through the dense kernels (issue
28, defect 3): a row that sees a NaN or Inf is non-finite in O (and NaN in LSE where the scores
are), every other row is exact, and a NaN in a block no list names changes nothing. Before the
fix the row's LSE came back as the empty row's -inf, so every merge (split-KV combine, the
key-split and cluster merges) weighed its O by 0 and wrote zeros."""

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse.backends import cute
from flash_attn_sparse.reference import attention_over_blocks
from helpers import max_err, random_qkv

pytestmark = pytest.mark.gpu
BLOCK = 128


def _backend_or_skip(backend):
    if backend == "fa3":
        from flash_attn_sparse.backends import fa3_ops
        if reason := fa3_ops.missing_build():
            pytest.skip(reason)
    if backend == "fa4":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the FA-4 backend runs on sm_90 only")
        if reason := cute.missing_runtime():
            pytest.skip(reason)
    return backend


# (batch, seqlen_q, heads, heads_k, seqlen_k, listed blocks): decode over a long list (the 16-row
# decode tiles and splits), and a prefill-shaped call.
SHAPES = {
    "decode": (8, 1, 32, 8, 32768, list(range(255, 0, -2))[:160]),
    "prefill": (1, 256, 4, 4, 4096, [30, 2, 17, 9, 31, 0, 24]),
}
# Where the non-finite value goes: (tensor, batch, position of the listed block's row, head, channel).
POISONS = ("q_nan", "q_inf", "k_nan_listed", "v_inf_listed", "k_nan_unlisted")


def _poison(q, k, v, where, blocks):
    value = float("inf") if where.endswith("inf") or "inf_" in where else float("nan")
    if where.startswith("q"):
        q[0, -1, 3, 5] = value
    elif where == "k_nan_unlisted":
        unlisted = next(b for b in range(k.shape[1] // BLOCK) if b not in blocks)
        k[0, unlisted * BLOCK + 7, 0, 11] = value
    else:
        tensor = k if where.startswith("k") else v
        tensor[0, blocks[1] * BLOCK + 7, 0, 11] = value


def _check(out, lse, ref_out, ref_lse, low_out):
    bad_ref = ~torch.isfinite(ref_out).all(-1)  # (b, s, h) rows the reference makes non-finite
    bad_out = ~torch.isfinite(out.double()).all(-1)
    assert bad_ref.any() or not bad_out.any(), "a non-finite row where the reference has none"
    assert torch.equal(bad_out, bad_ref), f"non-finite rows differ: {bad_out.sum()} vs the reference's {bad_ref.sum()}"
    # An infinite score makes the reference's LSE +inf where the kernel's online softmax has NaN.
    assert torch.equal(~torch.isfinite(lse), ~torch.isfinite(ref_lse)), "non-finite LSE rows differ from the reference's"
    good = ~bad_ref
    err, low = max_err(out[good], ref_out[good]), max_err(low_out[good], ref_out[good])
    assert err <= 2 * low + 1e-5, f"finite rows: error {err:.3e} > 2 x {low:.3e} + 1e-5"
    lse_good = torch.isfinite(ref_lse)
    assert max_err(lse[lse_good], ref_lse[lse_good]) <= 1e-3


@pytest.mark.parametrize("backend", ["fa2", "fa3", "fa4"])
@pytest.mark.parametrize("num_splits", [0, 1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("where", POISONS)
def test_non_finite_inputs_propagate(backend, num_splits, shape, where):
    _backend_or_skip(backend)
    batch, seqlen_q, heads, heads_k, seqlen_k, blocks = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(hash((shape, where)) % 1000)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    _poison(q, k, v, where, blocks)
    table = torch.tensor(blocks, dtype=torch.int32, device="cuda")
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=BLOCK, num_splits=num_splits,
                                                      backend=backend)
    ref_out, ref_lse = attention_over_blocks(q, k, v, blocks, BLOCK, dtype=torch.float32)
    low_out, _ = attention_over_blocks(q, k, v, blocks, BLOCK, dtype=torch.bfloat16)
    _check(out, lse, ref_out, ref_lse, low_out)
    if where != "k_nan_unlisted":
        assert (~torch.isfinite(out.double())).any(), "the poisoned row came back finite (swallowed)"


@pytest.mark.parametrize("where", ["q_nan", "k_nan_listed"])
def test_partials_and_combine_propagate_nan(where):
    batch, seqlen_q, heads, heads_k, seqlen_k, blocks = SHAPES["decode"]
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, 128, torch.bfloat16, generator=g)
    _poison(q, k, v, where, blocks)
    groups = [torch.tensor(blocks[i::3], dtype=torch.int32, device="cuda") for i in range(3)]
    parts = fas.flash_attn_sparse_partials(q, k, v, groups, block_size=BLOCK)
    out, lse = fas.flash_attn_combine(*parts, out_dtype=q.dtype, head_dim=128)
    ref_out, ref_lse = attention_over_blocks(q, k, v, blocks, BLOCK, dtype=torch.float32)
    low_out, _ = attention_over_blocks(q, k, v, blocks, BLOCK, dtype=torch.bfloat16)
    _check(out, lse, ref_out, ref_lse, low_out)


@pytest.mark.parametrize("backend", ["fa2", "fa4"])
def test_speculative_propagates_nan(backend):
    _backend_or_skip(backend)
    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = random_qkv(2, 16, 16384, 32, 8, 128, torch.bfloat16, generator=g)
    missed = [90, 3, 41, 17]
    q[1, 15, 9, 0] = float("nan")
    k_spec, v_spec = k[:, -256:].contiguous(), v[:, -256:].contiguous()
    out, _ = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, torch.tensor(missed, dtype=torch.int32,
                                               device="cuda"), block_size=BLOCK, backend=backend)
    assert torch.isnan(out[1, 15, 9]).all(), "the NaN query row came back finite"
    out[1, 15, 9] = 0
    assert torch.isfinite(out).all(), "a row that saw no NaN is not finite"


def test_empty_rows_stay_zero_with_minus_inf_lse():
    """The fix must not turn the empty row's (O = 0, LSE = -inf) into NaN."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = random_qkv(2, 1, 8192, 32, 8, 128, torch.bfloat16, generator=g)
    lists = [[[[5, 1, 60]] if h else [[]] for h in range(8)] for _ in range(2)]
    blocks = fas.SparseBlocks.from_lists(lists, device="cuda")
    for splits in (1, 4):
        out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=splits, backend="fa2")
        assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))  # query heads 0-3: K/V head 0, empty
        assert torch.isneginf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:]).all()
