"""bench_engine.py's lists on the CPU: the engine-shaped step's varlen lists keep the sparse
contract under the causal mask (full blocks wholly visible to their tile, no block twice), list
every tile's diagonal as mask blocks, and name about 1/8 of each tile's history."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import bench_engine  # noqa: E402
from flash_attn_sparse.metadata import validate_block_contents  # noqa: E402


def test_the_step_lists_keep_the_contract_and_list_each_diagonal():
    rng = random.Random(0)
    shape = bench_engine.step_shape(rng, decode_only=False)
    assert [sq for sq, _ in shape] == [1] * bench_engine.DECODE_ROWS + list(bench_engine.CHUNKS)
    blocks = bench_engine.list_set(shape, rng, device="cpu")
    validate_block_contents(blocks, causal=True, seqlens_q=[sq for sq, _ in shape], seqlens_k=[sk for _, sk in shape])
    sq, sk = shape[-1]
    full, mask = bench_engine.tile_lists(sq, sk, random.Random(1))
    for tile, (f, m) in enumerate(zip(full, mask)):
        first_key, last_key = tile * 128 + sk - sq, min((tile + 1) * 128, sq) - 1 + sk - sq
        assert m == list(range((first_key + 1) // 128, last_key // 128 + 1))
        assert all((block + 1) * 128 - 1 <= first_key for block in f)
        assert len(f) == max(1, int((first_key + 1) // 128 * bench_engine.DENSITY))
    decode_full, decode_mask = bench_engine.tile_lists(1, 40000, random.Random(2))
    assert decode_mask == [[-(-40000 // 128) - 1]] and len(decode_full[0]) == int((-(-40000 // 128) - 1) / 8)
