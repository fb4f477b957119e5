"""Split-count choices of the FA-2 path (pure functions, CPU)."""

import pytest

from flash_attn_sparse.interface import choose_num_splits, speculative_split_pair
from flash_attn_sparse.metadata import cdiv

pytestmark = pytest.mark.stage5

H200_SLOTS = 2 * 132  # two split-kernel CTAs per SM


@pytest.mark.parametrize("ctas,tiles,expected", [
    (64, 16, 4),     # B8 Hk8 decode at 1/16 of 32k keys: one wave of 256 CTAs
    (8, 64, 32),     # B1 Hk8 at 1/16 of 128k keys
    (256, 16, 1),    # the CTAs already fill the GPU
    (64, 1, 1),      # one tile cannot be split
])
def test_choose_num_splits(ctas, tiles, expected):
    assert choose_num_splits(ctas, H200_SLOTS, tiles) == expected


@pytest.mark.parametrize("ctas,spec_tiles,missed_tiles", [
    (64, 4, 12), (8, 4, 60), (8, 60, 4), (64, 1, 1), (512, 4, 12), (64, 4, 1), (3, 7, 200),
])
def test_speculative_split_pair_shares_the_union_grid(ctas, spec_tiles, missed_tiles):
    """Side by side, the two passes' grids together are the one-pass grid over the union: no
    more CTAs (beyond one split each), and about its tiles per CTA."""
    spec, missed = speculative_split_pair(ctas, H200_SLOTS, spec_tiles, missed_tiles)
    union = choose_num_splits(ctas, H200_SLOTS, spec_tiles + missed_tiles)
    assert 1 <= spec <= spec_tiles and 1 <= missed <= missed_tiles
    assert spec + missed <= max(union, 2)
    union_tiles_per_cta = cdiv(spec_tiles + missed_tiles, union)
    assert max(cdiv(spec_tiles, spec), cdiv(missed_tiles, missed)) <= union_tiles_per_cta + 1
