"""Split-count choices of the FA-2 path and of the FA-4 backend's cost model (pure functions, CPU)."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flash_attn_sparse.backends import fa2, fa4
from flash_attn_sparse.backends.fa2 import choose_num_splits, decode_tile

pytestmark = pytest.mark.stage5

H200_SLOTS = 2 * 132  # two split-kernel CTAs per SM


@pytest.mark.parametrize("ctas,tiles,expected", [
    (64, 16, 4),     # B8 Hk8 decode at 1/16 of 32k keys: one wave of 256 CTAs
    (8, 64, 32),     # B1 Hk8 at 1/16 of 128k keys
    (64, 64, 4),     # B8 Hk8 Sq1 at 1/4: 4 splits measured fastest of 1-32
    (8, 256, 29),    # B1 Hk8 at 1/4: 39.7 us, within 0.1 us of the best of 1-32
    (256, 16, 1),    # the CTAs already fill the GPU
    (64, 1, 1),      # one tile cannot be split
    (0, 4, 1),       # no CTAs (every varlen query sequence empty): fuzzer seed 2's ZeroDivisionError
])
def test_choose_num_splits(ctas, tiles, expected):
    assert choose_num_splits(ctas, H200_SLOTS, tiles) == expected


@pytest.mark.parametrize("batch,seqlen_k,list_blocks,expected", [
    (8, 32768, 16, (64, H200_SLOTS, 16)),       # B8 Sq1 at 1/16: the key-split tile, counted as two per SM
    (8, 32768, 256, (64, 3 * 132, 256)),        # every block listed: the one-warp decode tile, three per SM
])
def test_split_work_counts_three_ctas_per_sm_only_for_the_decode_tile(monkeypatch, batch, seqlen_k, list_blocks, expected):
    """The key-split tile fits three CTAs per SM, but the heuristic counts two for it (measured:
    fewer, longer splits measured faster, 4 instead of 6 at B8 Sq1 1/16); the one-warp decode
    tile counts three."""
    monkeypatch.setattr(fa2, "num_sms", lambda index: 132)
    call = SimpleNamespace(q=torch.empty(batch, 1, 32, 128), k=torch.empty(batch, 0, 8, 128), batch=batch,
                           max_seqlen_q=1, blocks=SimpleNamespace(block_size=128), max_list_length=lambda: list_blocks)
    monkeypatch.setattr(fa2, "pack_gqa", lambda call: True)
    assert fa2.split_work(call) == expected


@pytest.mark.parametrize("packed_rows,list_keys,ctas,expected_tile", [
    (4, 32768, 64, True),     # B8 Hk8 Sq1 x 4 heads, every block of 32k keys listed: 2M keys
    (4, 131072, 8, True),     # B1 Hk8, every block of 128k keys listed: 1M keys
    (4, 32768, 8, False),     # B1 Hk8 with 256-block lists: 0.26M keys, the 64-row tile measured faster
    (4, 2048, 64, False),     # B8 Hk8 at 1/16 of 32k keys: short lists
    (64, 32768, 64, False),   # Sq16 x 4 heads: 64 packed rows
])
def test_decode_tile_only_for_long_lists_and_much_work(packed_rows, list_keys, ctas, expected_tile):
    """The rule flash_sparse.h's sparse_decode_tile applies, on the shapes measured for it."""
    assert decode_tile(packed_rows, list_keys, ctas) == expected_tile


def c_int(text):
    """A C++ integer constant expression of this header's forms: 16, 16384, 1L << 20."""
    left, _, shift = text.replace("L", "").partition("<<")
    return int(left) << int(shift or 0)


def test_decode_tile_constants_match_the_kernel_rule():
    """The split heuristic assumes the tile flash_sparse.h's sparse_decode_tile picks: same limits."""
    header = (Path(__file__).parents[2] / "patches/overlay/flash-attn/csrc/flash_attn/src/flash_sparse.h").read_text()
    constants = {name: c_int(value) for name, value in re.findall(r"constexpr (?:int|long) (kSparseDecode\w+) = ([^;]+);", header)}
    assert constants == {"kSparseDecodeBlockM": fa2.DECODE_KERNEL_ROWS,
                         "kSparseDecodeMinListKeys": fa2.DECODE_MIN_LIST_KEYS,
                         "kSparseDecodeMinTotalKeys": fa2.DECODE_MIN_TOTAL_KEYS}


def _fa4_work(tiles, list_blocks, batch, seqlen_q, tile_rows):
    """FA-4's split inputs for H32 d128 bf16 with 128-key blocks on 132 SMs (fa4_num_splits)."""
    return fa4.split_work(tiles=tiles, list_blocks=list_blocks, batch=batch, seqlen_q=seqlen_q, heads=32, head_dim=128,
                          block_size=128, element_size=2, small_tile=tile_rows == fa4.SMALL_TILE_ROWS, num_sms=132)


@pytest.mark.parametrize("tiles,list_blocks,batch,seqlen_q,tile_rows,expected", [
    (64, 16, 8, 16, 64, 1),      # B8 Sq16 1/16: one split 22.8 us, two 26.7
    (64, 64, 8, 16, 64, 2),      # B8 Sq16 1/4: 72.5 vs 73.6 us
    (64, 256, 8, 16, 64, 2),     # every block listed: two splits 254.6 vs 291.3 us
    (64, 16, 8, 1, 64, 1),       # B8 Sq1 1/16: 22.3 vs 22.9 us
    (64, 64, 8, 1, 64, 2),       # B8 Sq1 1/4: 67.8 vs 73.3 us
    (256, 64, 1, 4096, 128, 1),  # prefill-sized: the tiles already fill the GPU
    (64, 256, 1, 1024, 128, 2),  # half the SMs busy with compute-bound 128-row tiles: split
])
def test_fa4_split_model_picks_what_run_60_measured_fastest(tiles, list_blocks, batch, seqlen_q, tile_rows, expected):
    assert fa4.choose_num_splits(max_splits=128, **_fa4_work(tiles, list_blocks, batch, seqlen_q, tile_rows)) == expected


def test_fa4_split_model_splits_few_tiles_until_the_chain_stops_paying():
    """B1 decode (8 tiles): one split walks the whole list at one CTA's rate (64.8 us for 64
    blocks in a split sweep, 10.5-17.6 with 8-16 splits); splits stop where the merge costs more than
    the shorter chain, and never exceed the blocks listed."""
    picks = {blocks: fa4.choose_num_splits(max_splits=128, **_fa4_work(8, blocks, 1, 1, 64)) for blocks in (1, 4, 16, 64, 256)}
    assert picks[1] == 1 and all(picks[b] <= b for b in picks)
    assert all(8 <= picks[b] <= 16 for b in (16, 64, 256)), picks


def test_fa4_split_model_against_every_measured_split_table():
    """Every column of the split sweep's tables (3 decode shapes x 9 list lengths, 1-8 splits,
    benchmarks/results/...-98f11cb-profile-fa4.txt): the model's pick is the measured best or
    within 2% of it (benchmarks/fit_split_model.py, which also refits the constants)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import fit_split_model
    results = Path(__file__).parents[2] / "benchmarks/results/2026-11-30-h200-98f11cb-profile-fa4.txt"
    rows = fit_split_model.regrets(fit_split_model.read_tables(results))
    assert len(rows) == 27
    assert max(regret for *_, regret in rows) <= 0.02, [r for r in rows if r[-1] > 0.02]


@pytest.mark.parametrize("group, list_heads, q_block_size, seqlen_q, packs", [
    (4, 8, 128, 16, True), (3, 8, 128, 16, True), (5, 1, 128, 13, True), (7, 8, 64, 7, True),  # one list row
    (4, 32, 128, 16, False),  # per-query-head lists
    (3, 8, 64, 63, True),  # one list row of 189 packed rows over three tiles
    (6, 8, 128, 32, True),  # 128-row list rows, 768 packed rows: whole 64-row tiles
    (1, 1, 128, 16, False), (4, 8, 128, 64, False),  # no GQA; 64+ query rows fill tiles unpacked
])
def test_fa2_packs_any_group_where_no_tile_straddles_two_list_rows(group, list_heads, q_block_size, seqlen_q, packs):
    """fa2.pack_gqa, the rule flash_api_sparse.cpp checks (packed row r: query r / group, head
    r % group): decode-shaped calls whose lists the group shares, one list row for every query or
    list rows of whole 64-row tiles."""
    blocks = SimpleNamespace(num_heads=list_heads, resolved_q_block_size=lambda seqlen: q_block_size)
    call = SimpleNamespace(q=torch.empty(1, seqlen_q, 8 * group if list_heads != 32 else 32, 128),
                           k=torch.empty(1, 1, 8, 128), blocks=blocks, max_seqlen_q=seqlen_q)
    assert fa2.pack_gqa(call) is packs
    cpp = (Path(__file__).parents[2] / "patches/overlay/flash-attn/csrc/flash_attn/flash_api_sparse.cpp").read_text()
    assert "q_block_size >= seqlen_q || (int64_t(q_block_size) * group) % kSparseNarrowBlockM == 0" in cpp
