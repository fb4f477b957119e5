"""Stage 6 (GPU): our sparse forward against FlexAttention given the same BlockMask, and
one CUDA graph that builds the block lists on the device and runs the sparse forward with them.

FlexAttention parity. Random per-(batch, K/V head, query tile) lists (permuted, gapped, the
partial tail block in some rows, causal "mask" blocks on the diagonal) become our SparseBlocks;
`flex_block_mask_from_blocks` turns them into a FlexAttention BlockMask (its mask_mod carries the
causal mask of the "mask" blocks); both run on the same inputs. The tolerance is FlashAttention's
convention with FlexAttention as the low-precision baseline: against an fp32 reference computed
from the lists (reference.py, independent of both), our error must be at most twice
FlexAttention's plus a rounding term; LSE within 1e-3 of the reference and of FlexAttention.

Rows that see no key. Each case lists nothing for one (batch, K/V head, query tile), so some
rows see no key. Our contract there is O = 0, LSE = -inf (checked). FlexAttention's answer for
fully masked rows is not a promise of its API: depending on version and path it has been 0 or
NaN for O and -inf or a finite value for LSE, so those rows are left out of the comparison with
it (and it is not asserted on them).

CUDA graphs. The builders are plain torch ops with shapes fixed by the inputs; these tests
capture a builder (`blocks_from_scores` or `blocks_from_mask`) and the attention call that reads
its lists in ONE graph, with host syncs turned into errors during the capture, then replay it
with new scores and new q/k/v copied into the static inputs and check against eager calls
(bitwise) and the reference. The speculative two-pass with 1-D tables is captured in
tests/contract/test_reliability_gpu.py; here its missed lists come from `blocks_from_scores` and the
speculative K/V is gathered inside the graph.
"""

import random
import warnings

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.metadata import cdiv, validate_block_contents
from flash_attn_sparse.reference import attention_ref, visibility_from_lists
from helpers import LSE_TOLERANCE, assert_close_to_reference, batched_rows, max_err, poison_allocator, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.stage6]

DEVICE = "cuda"
BLOCK = 128    # key block size: FlexAttention's default BLOCK_SIZE
Q_BLOCK = 128  # query rows per list row, also FlexAttention's query block
# The rounding term of the tolerance: about one output ulp at |O| ~ 0.25 in the input dtype
# (bf16 has 8 significant bits, fp16 11).
ROUNDING = {torch.bfloat16: 1e-3, torch.float16: 1.25e-4}


# --- helpers ---------------------------------------------------------------------------------

def parity_lists(batch, table_heads, seqlen_q, seqlen_k, causal, rng):
    """full[b][hs][m], mask[b][hs][m] (mask None when not causal), shuffled.

    Not causal: a random 40% of the key blocks (so with gaps), plus the partial tail block in
    every other row. Causal: a random 40% of the blocks fully visible to the tile's first row as
    "full", the blocks some row of the tile sees only partly as "mask", and sometimes one fully
    visible block moved to "mask" (the causal mask leaves it whole). (b, hs, m) = (0, 0, 0)
    lists nothing: its rows see no key.
    """
    n_blocks, m_blocks = cdiv(seqlen_k, BLOCK), cdiv(seqlen_q, Q_BLOCK)
    offset = seqlen_k - seqlen_q  # bottom-right causal alignment
    full, mask = [], []
    for b in range(batch):
        full_b, mask_b = [], []
        for hs in range(table_heads):
            full_h, mask_h = [], []
            for m in range(m_blocks):
                first_row, last_row = m * Q_BLOCK, min((m + 1) * Q_BLOCK, seqlen_q) - 1
                if (b, hs, m) == (0, 0, 0):
                    f, mk = [], []
                elif not causal:
                    f = [n for n in range(n_blocks) if rng.random() < 0.4]
                    if (b + hs + m) % 2 == 0 and n_blocks - 1 not in f:
                        f.append(n_blocks - 1)
                    if not f:
                        f = [rng.randrange(n_blocks)]
                    mk = []
                else:
                    historical = [n for n in range(n_blocks) if (n + 1) * BLOCK - 1 <= first_row + offset]
                    partial = [n for n in range(n_blocks) if n not in historical and n * BLOCK <= last_row + offset]
                    f = [n for n in historical if rng.random() < 0.4]
                    mk = list(partial)
                    if f and rng.random() < 0.5:
                        mk.append(f.pop(rng.randrange(len(f))))
                rng.shuffle(f)
                rng.shuffle(mk)
                full_h.append(f)
                mask_h.append(mk)
            full_b.append(full_h)
            mask_b.append(mask_h)
        full.append(full_b)
        mask.append(mask_b)
    return full, (mask if causal else None)


def flex_forward(flex_fn, q, k, v, block_mask):
    """FlexAttention's (out, lse) in our layouts: q, k, v (batch, seqlen, heads, dim) go in as its
    (batch, heads, seqlen, dim); out comes back as (batch, seqlen_q, heads, dim), lse stays
    (batch, heads, seqlen_q) (natural log, as ours)."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch before AuxRequest: return_lse
        AuxRequest = None

    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    kwargs = dict(block_mask=block_mask, enable_gqa=q.shape[2] != k.shape[2])
    with warnings.catch_warnings():
        # Eager flex_attention warns that it is unfused; return_lse is deprecated where AuxRequest exists.
        warnings.simplefilter("ignore")
        if AuxRequest is not None:
            out, aux = flex_fn(qf, kf, vf, return_aux=AuxRequest(lse=True), **kwargs)
            lse = aux.lse
        else:
            out, lse = flex_fn(qf, kf, vf, return_lse=True, **kwargs)
    return out.transpose(1, 2), lse


def check_flex_parity(flex_fn, causal, dtype, head_dim, seqlen_q, seqlen_k, num_splits, seed):
    """Runs one case and asserts the tolerance; returns the report line."""
    batch, heads, heads_k = 2, 8, 2
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rng = random.Random(seed)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, device=DEVICE, generator=g)
    full, mask = parity_lists(batch, heads_k, seqlen_q, seqlen_k, causal, rng)
    blocks = SparseBlocks.from_lists(full, mask, block_size=BLOCK, q_block_size=Q_BLOCK, device=DEVICE)
    poison_allocator(((batch, seqlen_q, heads, head_dim), dtype), ((batch, heads, seqlen_q), torch.float32), device=DEVICE)
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, num_splits=num_splits,
                                                      validate="full")

    # The same lists as a FlexAttention BlockMask, per query head (FlexAttention's masks have 1
    # or num_heads heads; our table has one row per K/V head).
    block_mask = fas.flex_block_mask_from_blocks(blocks, seqlen_q, seqlen_k, causal=causal, num_heads=heads)
    assert block_mask.BLOCK_SIZE == (Q_BLOCK, BLOCK)
    flex_out, flex_lse = flex_forward(flex_fn, q, k, v, block_mask)
    assert flex_out.shape == out.shape and flex_lse.shape == lse.shape

    visible = torch.stack([visibility_from_lists(full[b], mask[b] if mask else None, BLOCK, Q_BLOCK, seqlen_q, seqlen_k,
                                                 heads, causal, device=DEVICE) for b in range(batch)])
    ref_out, ref_lse = attention_ref(q, k, v, visible, dtype=torch.float32)
    seen = visible.any(-1)             # (batch, heads, seqlen_q): rows that see at least one key
    seen_rows = seen.transpose(1, 2)   # (batch, seqlen_q, heads), the row layout of out
    assert seen.any() and (~seen).any(), "each case has rows that see keys and rows that see none"

    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "our output has NaN (unwritten or poisoned)"
    assert (out[~seen_rows] == 0).all(), "rows that see no key must have O = 0"
    assert torch.isneginf(lse[~seen]).all(), "rows that see no key must have LSE = -inf"

    err = max_err(out[seen_rows], ref_out[seen_rows])
    flex_err = max_err(flex_out[seen_rows], ref_out[seen_rows])
    vs_flex = max_err(out[seen_rows], flex_out[seen_rows])
    lse_err = max_err(lse[seen], ref_lse[seen])
    flex_lse_err = max_err(flex_lse[seen], ref_lse[seen])
    lse_vs_flex = max_err(lse[seen], flex_lse[seen])
    report = (f"causal={causal} {str(dtype).split('.')[-1]} d={head_dim} sq={seqlen_q} sk={seqlen_k}: "
              f"max|ours-ref|={err:.3e} max|flex-ref|={flex_err:.3e} max|ours-flex|={vs_flex:.3e}; "
              f"LSE max|ours-ref|={lse_err:.3e} max|flex-ref|={flex_lse_err:.3e} max|ours-flex|={lse_vs_flex:.3e}")
    print(report)

    assert torch.isfinite(flex_out[seen_rows]).all() and torch.isfinite(flex_lse[seen]).all(), \
        "FlexAttention gave non-finite values on rows that see keys: " + report
    # A BlockMask that named other keys than our lists would move FlexAttention's LSE by far more
    # than this; it also keeps the bound below from being loosened by a wrong baseline.
    assert flex_lse_err <= LSE_TOLERANCE, "FlexAttention disagrees with the reference (BlockMask != lists): " + report
    assert err <= 2 * flex_err + ROUNDING[dtype], "output error above 2x FlexAttention's + rounding: " + report
    assert lse_err <= LSE_TOLERANCE, report
    assert lse_vs_flex <= LSE_TOLERANCE, report
    return report


# --- FlexAttention parity ----------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,seqlen_q,seqlen_k", [(64, 128, 1000), (128, 256, 1717)],
                         ids=["d64-sq128-sk1000", "d128-sq256-sk1717"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_matches_flex_attention_eager(causal, dtype, head_dim, seqlen_q, seqlen_k, record_property):
    """GQA 8/2 with per-K/V-head lists against eager flex_attention (which evaluates mask_mod at
    every position: it checks the BlockMask's mask_mod, the visibility in it). fp16 runs without
    split-KV, bf16 with the automatic split count (several splits at these shapes)."""
    from torch.nn.attention.flex_attention import flex_attention

    seed = 1000 * causal + 100 * (dtype == torch.float16) + head_dim
    num_splits = 1 if dtype == torch.float16 else 0
    report = check_flex_parity(flex_attention, causal, dtype, head_dim, seqlen_q, seqlen_k, num_splits, seed)
    record_property("flex_parity", report)


def test_matches_flex_attention_compiled(record_property):
    """One causal GQA case against torch.compile'd flex_attention, whose fused kernel reads the
    BlockMask's lists: only the listed blocks, mask_mod on the partial ("mask") blocks only and
    not on the full ones. One shape only: each compile takes seconds."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    report = check_flex_parity(compiled, True, torch.bfloat16, 128, 256, 1717, num_splits=0, seed=77)
    record_property("flex_parity", report)


# --- CUDA graphs: build the lists and attend in one graph ----------------------------------------

def capture(step):
    """Warm-up on a side stream, then step() captured in one CUDA graph; a host sync during the
    capture raises (sync debug mode "error", on only while capturing). Returns (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static = step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return graph, static


def refill(generator, *tensors):
    """New random contents, in place (the static inputs of a captured graph)."""
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float32))


def replays_matching_eager(graph, step, captured, generator, *inputs):
    """For two fresh draws of the inputs: replay the graph, then call step() eagerly; the lists
    and (out, lse) of the replay must equal the eager call's bitwise. Yields after each check."""
    static_lists, static_out, static_lse = captured
    for seed in (1, 2):
        generator.manual_seed(seed)
        refill(generator, *inputs)
        graph.replay()
        torch.cuda.synchronize()
        eager_lists, eager_out, eager_lse = step()
        assert_same_lists(static_lists, eager_lists)
        assert torch.equal(static_out, eager_out) and torch.equal(static_lse, eager_lse), "replay != eager call"
        yield


def assert_same_lists(got: SparseBlocks, want: SparseBlocks):
    for name, x, y in zip(("full_cnt", "full_idx", "mask_cnt", "mask_idx"), got.tensors(), want.tensors()):
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), f"{name}: the replayed lists differ from an eager build"


def causal_tile_geometry(seqlen_q, seqlen_k):
    """Per query tile: (blocks fully visible to its first row, blocks some row sees at all)."""
    offset = seqlen_k - seqlen_q
    tiles = []
    for m in range(cdiv(seqlen_q, Q_BLOCK)):
        first_row, last_row = m * Q_BLOCK, min((m + 1) * Q_BLOCK, seqlen_q) - 1
        historical = (first_row + offset + 1) // BLOCK
        seen = min(cdiv(last_row + offset + 1, BLOCK), cdiv(seqlen_k, BLOCK))
        tiles.append((historical, seen))
    return tiles


TOPK, SINKS = 4, 1


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split"])
@pytest.mark.parametrize("builder", ["blocks_from_scores", "blocks_from_mask"])
def test_graph_builds_lists_and_runs_sparse_forward(builder, num_splits):
    """Causal prefill tiles, GQA 8/2, per-K/V-head lists built in the graph from a score tensor:
    top-k with a sink and the local (diagonal) blocks as "mask" blocks, or a thresholded boolean
    block mask with the diagonal blocks as the mask_block_mask."""
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim = 2, 256, 2000, 8, 2, 128
    n_blocks, m_blocks = cdiv(seqlen_k, BLOCK), cdiv(seqlen_q, Q_BLOCK)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.bfloat16, device=DEVICE, generator=g)
    scores = torch.randn(batch, heads_k, m_blocks, n_blocks, generator=g, device=DEVICE)

    tiles = causal_tile_geometry(seqlen_q, seqlen_k)
    local = max(seen - historical for historical, seen in tiles)  # the diagonal blocks of every tile
    assert tiles == [(13, 15), (14, 16)] and local == 2
    num_valid = torch.tensor([seen for _, seen in tiles], dtype=torch.int32, device=DEVICE).view(1, 1, m_blocks)
    positions = torch.arange(n_blocks, device=DEVICE)
    historical_mask = torch.stack([positions < h for h, _ in tiles]).view(1, 1, m_blocks, n_blocks)
    diagonal_mask = torch.stack([(positions >= h) & (positions < s) for h, s in tiles]).view(1, 1, m_blocks, n_blocks)

    def build():
        if builder == "blocks_from_scores":
            return fas.blocks_from_scores(scores, TOPK, BLOCK, Q_BLOCK, sink_blocks=SINKS, local_blocks=local,
                                          num_valid_blocks=num_valid, causal_diagonal=True)
        return fas.blocks_from_mask((scores > 0.5) & historical_mask, BLOCK, Q_BLOCK,
                                    mask_block_mask=diagonal_mask.expand(batch, heads_k, m_blocks, n_blocks))

    def step():
        blocks = build()
        # validate="cheap" explicitly: FLASH_ATTN_SPARSE_VALIDATE=full would read the lists (a
        # sync) in the warm-up and in the eager calls.
        out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, num_splits=num_splits,
                                                          validate="cheap")
        return blocks, out, lse

    graph, captured = capture(step)
    static_blocks, static_out, static_lse = captured
    lists_per_replay = []
    for _ in replays_matching_eager(graph, step, captured, g, q, k, v, scores):
        validate_block_contents(static_blocks, causal=True, seqlens_q=[seqlen_q] * batch, seqlens_k=[seqlen_k] * batch)
        full = batched_rows(static_blocks.full_cnt, static_blocks.full_idx)
        mask = batched_rows(static_blocks.mask_cnt, static_blocks.mask_idx)
        host_scores = scores.cpu()
        for b in range(batch):
            for hs in range(heads_k):
                for m, (historical, seen) in enumerate(tiles):
                    assert mask[b][hs][m] == list(range(seen - local, seen)), "the diagonal blocks are the mask blocks"
                    if builder == "blocks_from_scores":
                        assert len(full[b][hs][m]) + local == min(TOPK + SINKS + local, seen)
                        assert full[b][hs][m][:SINKS] == list(range(SINKS)), "the sink is kept"
                    else:
                        assert full[b][hs][m] == [n for n in range(historical) if host_scores[b, hs, m, n] > 0.5]
        lists_per_replay.append(full)
        for b in range(batch):
            visible = visibility_from_lists(full[b], mask[b], BLOCK, Q_BLOCK, seqlen_q, seqlen_k, heads, causal=True,
                                            device=DEVICE)
            assert_close_to_reference(static_out[b:b + 1], static_lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                      visible)
    assert lists_per_replay[0] != lists_per_replay[1], "new scores must give new lists on replay"


def test_graph_builds_missed_lists_and_runs_speculative_two_pass():
    """Decode with 16 draft tokens: in one graph, gather the speculative K/V (the last two key
    blocks, the tail one partial) from the cache, pick the missed blocks per K/V head by top-k
    over the older blocks (one sink, one local block), run flash_attn_speculative_sparse."""
    batch, seqlen_q, seqlen_k, heads, heads_k, head_dim = 2, 16, 4000, 8, 2, 128
    n_blocks = cdiv(seqlen_k, BLOCK)
    spec_ids = [n_blocks - 2, n_blocks - 1]
    spec_start = spec_ids[0] * BLOCK
    g = torch.Generator(device=DEVICE).manual_seed(21)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, torch.bfloat16, device=DEVICE, generator=g)
    k_spec = torch.empty_like(k[:, spec_start:])
    v_spec = torch.empty_like(v[:, spec_start:])
    scores = torch.randn(batch, heads_k, 1, spec_ids[0], generator=g, device=DEVICE)  # the older blocks only
    topk = 6

    def step():
        k_spec.copy_(k[:, spec_start:])
        v_spec.copy_(v[:, spec_start:])
        missed = fas.blocks_from_scores(scores, topk, BLOCK, sink_blocks=1, local_blocks=1)
        out, lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, missed, validate="cheap")
        return missed, out, lse

    graph, captured = capture(step)
    static_missed, static_out, static_lse = captured
    lists_per_replay = []
    for _ in replays_matching_eager(graph, step, captured, g, q, k, v, scores):
        missed = batched_rows(static_missed.full_cnt, static_missed.full_idx)
        lists_per_replay.append(missed)
        for b in range(batch):
            for hs in range(heads_k):
                row = missed[b][hs][0]
                assert len(row) == topk + 2 and row[0] == 0 and row[-1] == spec_ids[0] - 1 and row[-1] < spec_start // BLOCK
            # The union: missed blocks whole, the speculative blocks under the causal mask.
            visible = visibility_from_lists(missed[b], [[spec_ids]] * heads_k, BLOCK, Q_BLOCK, seqlen_q, seqlen_k, heads,
                                            causal=True, device=DEVICE)
            assert_close_to_reference(static_out[b:b + 1], static_lse[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                      visible)
    assert lists_per_replay[0] != lists_per_replay[1], "new scores must give new lists on replay"
