"""Split-count choices of the FA-2 path (pure functions, CPU)."""

import pytest

from flash_attn_sparse.interface import choose_num_splits

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

