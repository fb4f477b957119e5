"""Where a one-shot call's host time goes, function by function: cProfile over back-to-back
one-shot calls (`flash_attn_with_sparse_block_table`, the cache warm) at host_time.py's decode
shapes (1/16), per backend; the top functions by own time into one-shot-profile.txt.

    python benchmarks/one_shot_profile.py --out DIR [--backends fa2,fa3] [--calls 200]

cProfile adds its own cost per Python call, so read the shares, not the absolute times; the
host time itself is host_time.py's."""

import argparse
import cProfile
import io
import pstats
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_attn_sparse as fas  # noqa: E402
from bench_sparse import DECODE, make_lists, random_inputs, to_blocks  # noqa: E402


def profile_one_shot(shape, backend: str, calls: int) -> str:
    q, k, v = random_inputs(shape)
    blocks = to_blocks(make_lists(shape, random.Random(0)), shape)
    try:
        for _ in range(20):
            fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend)
    except fas.SparseInputError as error:
        return f"refused: {error}\n"
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backends", default="fa2,fa3")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    sections = []
    for shape in (s for s in DECODE if abs(s.density - 1 / 16) < 1e-9):
        for backend in args.backends.split(","):
            sections.append(f"## {shape.name}, {backend}, {args.calls} one-shot calls\n\n"
                            + profile_one_shot(shape, backend, args.calls))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "one-shot-profile.txt").write_text("\n".join(sections))
    print(f"one-shot profile: {args.out / 'one-shot-profile.txt'}")


if __name__ == "__main__":
    main()
