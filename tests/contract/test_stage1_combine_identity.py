"""Stage 1: the (O, LSE) combine identity, in float64 on the CPU.

FA(A ∪ B) == Combine(FA(A), FA(B)) for disjoint key-block sets, k-way, in any order, with an
empty partial as identity. These references are the oracles of every GPU test.
"""

import math
import random

import pytest
import torch

from flash_attn_sparse.reference import attention_over_blocks, attention_ref, block_positions, combine_ref

pytestmark = pytest.mark.stage1

TOL = 1e-10
BLOCK_SIZES = [16, 32, 64, 128, 256]


def inputs(seqlen_q, seqlen_k, seed, batch=2, heads=4, heads_k=2, dim=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, heads_k, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, heads_k, dim, generator=g, dtype=torch.float64)
    return q, k, v


def split_blocks(n_blocks, pattern, rng):
    blocks = list(range(n_blocks))
    if pattern == "interleaved":
        a, b = blocks[0::2], blocks[1::2]
    elif pattern == "speculative_heavy":
        b = rng.sample(blocks, 2)
        a = [x for x in blocks if x not in b]
    elif pattern == "miss_heavy":
        a = rng.sample(blocks, 2)
        b = [x for x in blocks if x not in a]
    elif pattern == "contiguous_miss":
        lo = n_blocks // 3
        b = blocks[lo:lo + n_blocks // 3]
        a = [x for x in blocks if x not in b]
    rng.shuffle(a)
    rng.shuffle(b)
    return a, b


@pytest.mark.parametrize("pattern", ["interleaved", "speculative_heavy", "miss_heavy", "contiguous_miss"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_union_equals_combine_of_parts(seqlen_q, block_size, pattern):
    n_blocks = 7
    seqlen_k = n_blocks * block_size - block_size // 2  # the tail block is partial
    q, k, v = inputs(seqlen_q, seqlen_k, seed=seqlen_q * 1000 + block_size)
    a, b = split_blocks(n_blocks, pattern, random.Random(block_size + seqlen_q))
    out_u, lse_u = attention_over_blocks(q, k, v, a + b, block_size)
    out_a, lse_a = attention_over_blocks(q, k, v, a, block_size)
    out_b, lse_b = attention_over_blocks(q, k, v, b, block_size)
    out_c, lse_c = combine_ref(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))
    assert (out_c - out_u).abs().max() < TOL
    assert (lse_c - lse_u).abs().max() < TOL


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_union_equals_combine_with_causal_mask(seqlen_q, block_size):
    """The identity holds with the causal mask too: the mask is a property of each key position."""
    n_blocks = 6
    seqlen_k = n_blocks * block_size - 3
    q, k, v = inputs(seqlen_q, seqlen_k, seed=7 + block_size)
    a, b = split_blocks(n_blocks, "interleaved", random.Random(seqlen_q))
    out_u, lse_u = attention_over_blocks(q, k, v, a + b, block_size, causal=True)
    parts = [attention_over_blocks(q, k, v, part, block_size, causal=True) for part in (a, b)]
    out_c, lse_c = combine_ref(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (out_c - out_u).abs().max() < TOL
    assert (lse_c - lse_u).abs().max() < TOL


@pytest.mark.parametrize("k_way", range(2, 9))
def test_k_way_merge(k_way):
    block_size, n_blocks = 32, 16
    q, k, v = inputs(4, n_blocks * block_size - 5, seed=k_way)
    rng = random.Random(k_way)
    blocks = list(range(n_blocks))
    rng.shuffle(blocks)
    groups = [blocks[i::k_way] for i in range(k_way)]
    parts = [attention_over_blocks(q, k, v, g, block_size) for g in groups]
    out_c, lse_c = combine_ref(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    out_u, lse_u = attention_over_blocks(q, k, v, blocks, block_size)
    assert (out_c - out_u).abs().max() < TOL
    assert (lse_c - lse_u).abs().max() < TOL


@pytest.mark.parametrize("seed", range(4))
def test_combine_is_order_invariant(seed):
    block_size, n_blocks, k_way = 16, 12, 5
    q, k, v = inputs(16, n_blocks * block_size, seed=100 + seed)
    groups = [list(range(n_blocks))[i::k_way] for i in range(k_way)]
    parts = [attention_over_blocks(q, k, v, g, block_size) for g in groups]
    order = list(range(k_way))
    random.Random(seed).shuffle(order)
    out_1, lse_1 = combine_ref(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    out_2, lse_2 = combine_ref(torch.stack([parts[i][0] for i in order]), torch.stack([parts[i][1] for i in order]))
    assert (out_1 - out_2).abs().max() < TOL
    assert (lse_1 - lse_2).abs().max() < TOL


@pytest.mark.parametrize("seqlen_q", [1, 4, 16])
def test_empty_partial_is_identity(seqlen_q):
    q, k, v = inputs(seqlen_q, 5 * 64, seed=seqlen_q)
    out, lse = attention_over_blocks(q, k, v, [0, 3, 4], 64)
    empty_out, empty_lse = attention_over_blocks(q, k, v, [], 64)
    assert torch.all(empty_out == 0) and torch.all(empty_lse == -math.inf)
    for stacked in ([out, empty_out], [empty_out, out, empty_out]):
        lses = [lse if o is out else empty_lse for o in stacked]
        out_c, lse_c = combine_ref(torch.stack(stacked), torch.stack(lses))
        assert (out_c - out).abs().max() < TOL
        assert (lse_c - lse).abs().max() < TOL


@pytest.mark.parametrize("k_way", [1, 2, 5])
def test_all_empty_gives_zero_and_minus_inf(k_way):
    q, k, v = inputs(4, 128, seed=k_way)
    empty_out, empty_lse = attention_over_blocks(q, k, v, [], 32)
    out, lse = combine_ref(torch.stack([empty_out] * k_way), torch.stack([empty_lse] * k_way))
    assert torch.all(out == 0) and not torch.isnan(out).any()
    assert torch.all(lse == -math.inf)


def test_list_order_does_not_matter():
    q, k, v = inputs(16, 10 * 32 - 7, seed=3)
    out_1, lse_1 = attention_over_blocks(q, k, v, [9, 2, 5, 0], 32)
    out_2, lse_2 = attention_over_blocks(q, k, v, [0, 2, 5, 9], 32)
    assert (out_1 - out_2).abs().max() < TOL and (lse_1 - lse_2).abs().max() < TOL


@pytest.mark.parametrize("causal", [False, True])
def test_gather_reference_matches_mask_reference(causal):
    """The two oracles agree: explicit gather of listed rows vs a visibility mask over all keys."""
    block_size, seqlen_q, seqlen_k = 16, 8, 100
    q, k, v = inputs(seqlen_q, seqlen_k, seed=11)
    blocks = [6, 1, 3]
    out_g, lse_g = attention_over_blocks(q, k, v, blocks, block_size, causal=causal)
    positions = block_positions(blocks, block_size, seqlen_k)
    visible = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool)
    visible[:, positions] = True
    if causal:
        visible &= torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    out_m, lse_m = attention_ref(q, k, v, visible)
    assert (out_g - out_m).abs().max() < TOL and (lse_g - lse_m).abs().max() < TOL


def test_reference_matches_textbook_softmax():
    """One head, by hand: out = softmax(q k^T * scale) v, lse = log sum exp(q k^T * scale)."""
    q = torch.tensor([[[[1.0, 0.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[2.0, 0.0]], [[0.0, 4.0]]]], dtype=torch.float64)
    out, lse = attention_ref(q, k, v, torch.ones(1, 2, dtype=torch.bool), softmax_scale=1.0)
    e = math.e
    assert abs(lse.item() - math.log(e + 1)) < TOL
    assert torch.allclose(out[0, 0, 0], torch.tensor([2 * e / (e + 1), 4 / (e + 1)], dtype=torch.float64), atol=TOL)


def test_reference_non_finite_v_reaches_only_the_rows_that_see_its_key():
    """A NaN / Inf value at a key a row does not see must not reach that row (0 * NaN would)."""
    q, k, v = (torch.randn(1, n, 1, 8, dtype=torch.float64) for n in (2, 3, 3))
    v[0, 2, 0, 5] = float("nan")
    visible = torch.tensor([[True, True, False], [True, True, True]])
    out, lse = attention_ref(q, k, v, visible)
    clean, _ = attention_ref(q, k[:, :2], v[:, :2], visible[:, :2])
    assert torch.equal(out[0, 0], clean[0, 0]) and torch.isfinite(lse).all()
    assert torch.isnan(out[0, 1, 0, 5]) and torch.isfinite(out[0, 1, 0, :5]).all()
