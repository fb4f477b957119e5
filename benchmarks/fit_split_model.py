"""Check (and refit) FA-4's split-count model against measured split tables.

Reads the "graph us per call vs blocks per (batch, KV head) list" tables that
`profile_decode.py --backend fa4` prints (the GPU runner's profile-fa4 step), one row per forced split count,
and for every (shape, list length) asks which of the measured split counts the model
(`flash_attn_sparse.backends.fa4.split_time_us`) picks and how much slower that is than the measured best.
With --fit it searches the model's four constants for the least total of that regret.

    python benchmarks/fit_split_model.py benchmarks/results/2026-11-30-h200-98f11cb-profile-fa4.txt [--fit]
"""
import argparse
import itertools
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from flash_attn_sparse.backends import fa4  # noqa: E402

# The decode shapes of profile_decode.py: (batch, query rows, heads, K/V heads); d128, 128-key blocks.
SHAPES = {"B8 Sq16": (8, 16, 32, 8), "B8 Sq1": (8, 1, 32, 8), "B1 Sq1": (1, 1, 32, 8)}
HEAD_DIM, BLOCK, NUM_SMS = 128, 128, 132
CONSTANTS = ("CTA_READ_BYTES_PER_US", "CTA_FLOP_PER_US", "HBM_READ_BYTES_PER_US", "SPLIT_MERGE_US")


def read_tables(path: Path) -> dict:
    """{shape: {splits: {blocks: us}}} from the sweep tables of a profile-fa4 output."""
    tables, shape, columns = {}, None, None
    for line in path.read_text().splitlines():
        title = re.match(r"## decode (B\d+ Sq\d+) .*graph us per call vs blocks", line)
        if title:
            shape, columns = title[1], None
            tables[shape] = {}
        elif shape and line.startswith("splits \\ blocks"):
            columns = [int(c) for c in line.split("|")[1:] if c.strip().isdigit()]
        elif shape and columns and re.match(r"^\d+ \|", line):
            cells = [c.strip() for c in line.split("|")]
            tables[shape][int(cells[0])] = {b: float(us) for b, us in zip(columns, cells[1:])}
        elif line.startswith("##"):
            shape = None
    return tables


def work(shape: str, blocks: int) -> dict:
    """The model's arguments for a decode shape, as backends.fa4.num_splits builds them."""
    batch, rows, heads, heads_k = SHAPES[shape]
    return fa4.split_work(tiles=batch * heads_k, list_blocks=blocks, batch=batch, seqlen_q=rows, heads=heads,
                          head_dim=HEAD_DIM, block_size=BLOCK, element_size=2, small_tile=True, num_sms=NUM_SMS)


def regrets(tables: dict) -> list:
    """(shape, blocks, picked, best, measured(picked) / measured(best) - 1) for every column."""
    out = []
    for shape, by_splits in tables.items():
        for blocks in next(iter(by_splits.values())):
            if blocks == 0:
                continue
            measured = {s: row[blocks] for s, row in by_splits.items()}
            picked = min(measured, key=lambda s: (fa4.split_time_us(s, **work(shape, blocks)), s))
            best = min(measured, key=measured.get)
            out.append((shape, blocks, picked, best, measured[picked] / measured[best] - 1))
    return out


def report(tables: dict) -> float:
    rows = regrets(tables)
    for shape, blocks, picked, best, regret in rows:
        flag = "" if picked == best else f"  <- best {best}"
        print(f"  {shape:8} {blocks:4} blocks: picks {picked} split(s), {100 * regret:5.1f}% over the best{flag}")
    total = sum(r[-1] for r in rows)
    print(f"  total regret {100 * total:.1f}%, worst {100 * max(r[-1] for r in rows):.1f}%")
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, nargs="+")
    parser.add_argument("--fit", action="store_true", help="search the constants for the least total regret")
    args = parser.parse_args()
    tables = {}
    for path in args.profile:
        tables.update({f"{shape}": t for shape, t in read_tables(path).items()})
    print("constants now: " + ", ".join(f"{c} = {getattr(fa4, c):g}" for c in CONSTANTS))
    report(tables)
    if not args.fit:
        return
    current = [getattr(fa4, c) for c in CONSTANTS]
    # CTA_FLOP_PER_US stays: these decode tables cannot tell it apart (64-row tiles, 1-16 rows).
    grid = (range(30_000, 90_001, 2_000), (fa4.CTA_FLOP_PER_US,), [x * 1e5 for x in range(30, 47)],
            [x / 2 for x in range(0, 11)])
    best = None
    for values in itertools.product(*grid):
        for name, value in zip(CONSTANTS, values):
            setattr(fa4, name, value)
        total = sum(r[-1] for r in regrets(tables))
        # Least regret; among equals the constants nearest the current ones (the smaller change).
        change = sum(abs(math.log(max(v, 1e-3) / max(c, 1e-3))) for v, c in zip(values, current))
        if best is None or (round(total, 6), change) < best[0]:
            best = ((round(total, 6), change), values)
    for name, value in zip(CONSTANTS, best[1]):
        setattr(fa4, name, value)
    print("fitted: " + ", ".join(f"{c} = {v:g}" for c, v in zip(CONSTANTS, best[1])))
    report(tables)


if __name__ == "__main__":
    main()
