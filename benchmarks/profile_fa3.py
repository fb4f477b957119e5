"""The FA-3 sparse forward and its dense peer over the same keys in the same tile steps, for ncu.

One bench shape (--shape: the start of a bench_sparse PREFILL or DECODE shape name; --density),
non-causal, one list per K/V head (DESIGN §7), one list set: 3 calls of backend="fa3", then 3 of
dense FA-3 over a K/V gathered to exactly the listed keys (bench_sparse.fa3_dense_128: prefill in
128-row query tiles, decode as one tile with FA-3's own splits). Under `ncu --launch-skip 2
--launch-count 4` over the FA-3 forward kernels (the runner's `ncu-fa3-prefill` and
`ncu-fa3-decode` steps) the third sparse and the three dense launches are profiled, so their
per-instruction stalls compare tile for tile (where the sparse kernel trails dense FA-3
over the same keys; docs/performance.md).

    python benchmarks/profile_fa3.py [--shape "prefill B1 S16k H32 full"] [--density 0.0625]

The step's fa3-prefill-sass.csv.gz (or fa3-decode-) then reads on any machine with
`python benchmarks/ncu_sass_compare.py fa3-prefill-sass.csv.gz` (the sparse kernel against the
mean of the dense ones: stall reasons, opcode mix, most stalled instructions).
"""

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_attn_sparse as fas  # noqa: E402
from bench_sparse import DECODE, PREFILL, fa3_dense_128, listed_kv, make_lists, random_inputs, to_blocks  # noqa: E402

CALLS = 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="prefill B1 S16k H32 full", help="start of a bench shape's name")
    parser.add_argument("--density", type=float, default=1 / 16)
    args = parser.parse_args()
    shape = next((s for s in PREFILL + DECODE if not s.causal and s.name.startswith(args.shape)
                  and abs(s.density - args.density) < 1e-9), None)
    if shape is None:
        sys.exit(f"no non-causal bench shape starts with {args.shape!r} at density {args.density}")
    q, k, v = random_inputs(shape)
    lists = make_lists(shape, random.Random(0))
    blocks = to_blocks(lists, shape)
    k_listed, v_listed = listed_kv(k, v, lists)
    dense = fa3_dense_128(q, shape.seqlen_q)
    if isinstance(dense, str):
        sys.exit(f"dense FA-3 over the listed keys cannot run: {dense}")
    for _ in range(CALLS):
        fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa3")
    for _ in range(CALLS):
        dense(k_listed, v_listed)
    torch.cuda.synchronize()
    print(f"{shape.name} at {shape.density:.4g}: {CALLS} fa3 sparse calls, then {CALLS} dense FA-3 calls over "
          f"{k_listed.shape[1]} listed keys")


if __name__ == "__main__":
    main()
