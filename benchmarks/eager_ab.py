"""Same-run A/B of eager calls that run one kernel by two routes: `backend="fa3"` against `auto`
where its eager choice is FA-3 (routing.eager_choice). Crossovers that time one column after the
other read auto's eager time above fa3's at some prefill rows and below it at others. Here the
two take turns pass by pass (and a pass of `auto` follows a pass of FA-4's host-bound calls,
where the GPU idles), so drift weighs on both alike; and torch.profiler lists the kernels each
route launches over the same calls, which says whether the routes differ on the GPU at all (the
answer, and the spread between passes: docs/performance.md).

    python benchmarks/eager_ab.py [--out DIR] [--rounds 5]   (GPU; writes eager-ab.md)
"""

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sparse as bench  # noqa: E402  (puts python/ on the path)
import flash_attn_sparse as fas  # noqa: E402
from flash_attn_sparse.backends import cute  # noqa: E402
from profile_decode import kernel_breakdown  # noqa: E402

# The crossover rows where auto's eager FA-3 read above (or below) backend="fa3" when timed in turn.
SHAPES = [bench.Shape(f"B1 Sq{sq} H32/8 Sk16k", 1, sq, 16384, 32, 8, density)
          for sq, density in ((512, 0.25), (1024, 0.25), (1024, 0.0625), (2048, 0.25), (2048, 0.0625), (4096, 0.0625))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    fa4_here = not cute.missing_runtime()
    lines = [f"# eager A/B, {torch.cuda.get_device_name()}, {args.rounds} rounds of {bench.EAGER_CALLS} calls per route", "",
             "| shape | density | fa3 ms (median, range) | auto ms | auto after fa4 ms | auto / fa3 | routes |",
             "|---|---|---|---|---|---|---|"]
    details = []
    for shape in SHAPES:
        q, k, v = bench.random_inputs(shape)
        tables = [bench.to_blocks(lists, shape) for lists in bench.rotated_list_sets(shape)]
        routes = {name: bench.rotating_sparse_call(q, k, v, tables, backend=name) for name in ("fa3", "auto")}
        if fa4_here:
            routes["fa4"] = bench.rotating_sparse_call(q, k, v, tables, backend="fa4")
        eager = fas.choose_backend(q, k, v, tables[0], graph=False)
        for fn in routes.values():
            for _ in range(bench.EAGER_WARMUP):
                fn()
        times = defaultdict(list)
        for _ in range(args.rounds):
            for name in ("fa3", "auto"):
                times[name].append(bench.eager_pass(routes[name]))
            if fa4_here:
                bench.eager_pass(routes["fa4"], 20)
                times["auto after fa4"].append(bench.eager_pass(routes["auto"]))
        med = {name: statistics.median(t) for name, t in times.items()}
        after = f"{med['auto after fa4']:.4f}" if "auto after fa4" in med else "n/a"
        lines.append(f"| {shape.name} | {shape.density:.4g} | {med['fa3']:.4f} ({min(times['fa3']):.4f}-{max(times['fa3']):.4f}) | "
                     f"{med['auto']:.4f} ({min(times['auto']):.4f}-{max(times['auto']):.4f}) | {after} | "
                     f"{med['auto'] / med['fa3']:.3f} | auto eagerly {eager[0]} |")
        for name in ("fa3", "auto"):
            details.append(f"{shape.name} {shape.density:.4g} {name}: " + "; ".join(
                f"{kernel} x{len(means)} {', '.join(f'{m:.1f}' for m in means)} us"
                for kernel, means in sorted(kernel_breakdown(routes[name], calls=10).items())))
        del q, k, v, tables, routes
        torch.cuda.empty_cache()
    text = "\n".join(lines + ["", "Kernels over 10 eager calls (torch.profiler: launches per call, mean GPU us of each):", ""]
                     + [f"- {d}" for d in details]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eager-ab.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
