"""Where decode time goes: per-kernel GPU times of one call, and a fit of time against listed
bytes (fixed cost + bytes / bandwidth) per split count, on the decode shapes of bench_sparse;
then each shape with every block listed beside upstream's dense FA-2 call. Sparse calls rotate
through four list sets, as bench_sparse's do, so their blocks come from HBM and not from L2.

    python benchmarks/profile_decode.py [--shapes "B8 Sq16"] [--ncu-target "B8 Sq16"] [--split-sweep] [--backend fa4]

--split-sweep times each split count on the 1/4 and 1/16 lists of the shapes instead, beside
the heuristic's pick (num_splits=0), to check the heuristic against the measured best.

--ncu-target runs only a few plain calls of one shape at 1/16 density, for
`ncu -k regex:flash_fwd_sparse ...` to profile (no graphs, no sweep); with --ncu-speculative,
the union pass and the one-launch speculative call alternate (union first), so that launches
2 and 3 are one of each.

--backend fa4 profiles the sparse calls on flash-attn-4's SM90 kernel instead (the union row
stays FA-2's and the speculative forms take auto's backend, as bench_sparse's speculative_calls
builds them; ncu then needs `-k regex:FlashAttentionForwardSm90`).
"""

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton.testing import do_bench_cudagraph  # noqa: E402

import flash_attn_sparse as fas  # noqa: E402
from bench_sparse import (  # noqa: E402
    BLOCK,
    DECODE,
    ROTATIONS,
    make_lists,
    random_inputs,
    rotated_list_sets,
    rotating_sparse_call,
    speculative_calls,
    speculative_inputs,
    to_blocks,
)

LIST_LENGTHS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
SPLITS = (0, 1, 2, 4, 8)


def timed(fn):
    """Median ms of graph replays (shorter than bench_sparse's: the sweep times ~100 cases)."""
    fn()
    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def short(name: str) -> str:
    for key in ("flash_fwd_sparse_kernel", "flash_sparse_combine_kernel", "flash_fwd_splitkv_combine_kernel",
                "FlashAttentionForwardSm90", "FlashAttentionForwardCombine", "FlashAttnFwdSm90", "FlashAttnFwdCombine",
                "fill", "arange", "copy",
                "pad", "cat"):
        if key in name:
            return key
    return name[:40]


def kernel_breakdown(fn, calls: int = 20):
    """{kernel: mean us of its 1st, 2nd, ... launch within a call} over `calls` plain calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(list)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for event in sorted(events, key=lambda e: e.time_range.start):
        times[short(event.name)].append(event.device_time)
    breakdown = {}
    for name, t in times.items():
        per_call = max(len(t) // calls, 1)
        breakdown[name] = [sum(t[i::per_call]) / len(t[i::per_call]) for i in range(per_call)]
    return breakdown


def describe(breakdown) -> str:
    """'kernel 1x27.5, other 2x[12.1 30.2]', slowest first."""
    parts = []
    for name, us in sorted(breakdown.items(), key=lambda kv: -sum(kv[1])):
        parts.append(f"{name} 1x{us[0]:.1f}" if len(us) == 1 else f"{name} {len(us)}x[{' '.join(f'{u:.1f}' for u in us)}]")
    return ", ".join(parts)


def profile_shape(shape, backend: str = "fa2"):
    q, k, v = random_inputs(shape)
    list_sets = rotated_list_sets(shape)
    blocks = [to_blocks(lists, shape) for lists in list_sets]
    n_blocks = shape.seqlen_k // BLOCK
    methods = {
        f"{backend}_sparse": rotating_sparse_call(q, k, v, blocks, backend=backend),
        f"{backend}_sparse splits=1": rotating_sparse_call(q, k, v, blocks, backend=backend, num_splits=1),
        **speculative_calls(shape, q, k, v, list_sets, backend="fa2"),
    }
    print(f"## {shape.name} at 1/16: graph ms and kernels of one call (plain launches, us)")
    for name, fn in methods.items():
        ms = timed(fn)
        kernels = kernel_breakdown(fn)
        busy = sum(sum(us) for us in kernels.values())
        print(f"{name:>22}: graph {1e3 * ms:6.1f} us, kernels {busy:6.1f} us: {describe(kernels)}", flush=True)

    print(f"## {shape.name}: graph us per call vs blocks per (batch, KV head) list")
    print("splits \\ blocks | " + " | ".join(str(n) for n in LIST_LENGTHS) + " | fixed us | TB/s (fit)")
    bytes_per_block = shape.batch * shape.heads_k * 2 * BLOCK * shape.head_dim * 2
    for splits in SPLITS:
        row = []
        for n in LIST_LENGTHS:
            tables = [torch.tensor(sorted(random.Random(r).sample(range(n_blocks), n)), dtype=torch.int32, device="cuda")
                      for r in range(ROTATIONS)]
            ms = timed(rotating_sparse_call(q, k, v, tables, backend=backend, num_splits=splits))
            row.append(1e3 * ms)
        xs = [n * bytes_per_block for n in LIST_LENGTHS[3:]]  # fit on 4+ blocks: past the one-tile regime
        ys = row[3:]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        label = "auto" if splits == 0 else str(splits)
        print(f"{label} | " + " | ".join(f"{t:.1f}" for t in row) + f" | {fixed:.1f} | {1e-6 / slope:.2f}", flush=True)


def split_sweep(shape, max_splits: int = 32, backend: str = "fa2"):
    """Graph us of the call at each split count; the heuristic's pick is num_splits=0."""
    q, k, v = random_inputs(shape)
    blocks = [to_blocks(lists, shape) for lists in rotated_list_sets(shape)]
    times = {splits: 1e3 * timed(rotating_sparse_call(q, k, v, blocks, backend=backend, num_splits=splits))
             for splits in range(max_splits + 1)}
    best = min(range(1, max_splits + 1), key=times.get)
    print(f"## {shape.name} at 1/{round(1 / shape.density)}: graph us per split count; "
          f"auto {times[0]:.1f}, best {best} splits {times[best]:.1f}")
    print(" | ".join(f"{splits}: {us:.1f}" for splits, us in times.items() if splits), flush=True)


def profile_dense(shape, backend: str = "fa2"):
    """Every block listed vs upstream's dense FA-2 on the same shape: the sparse kernel's own cost."""
    from flash_attn import flash_attn_func
    q, k, v = random_inputs(shape)
    blocks = to_blocks(make_lists(shape, random.Random(0)), shape)
    print(f"## {shape.name}, every block listed: graph us and kernels of one call (plain launches, us)")
    for name, fn in {f"{backend}_sparse": lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend),
                     "upstream flash_attn_func": lambda: flash_attn_func(q, k, v)}.items():
        ms = timed(fn)
        kernels = kernel_breakdown(fn)
        print(f"{name:>24}: graph {1e3 * ms:6.1f} us, kernels {sum(sum(us) for us in kernels.values()):6.1f} us: "
              f"{describe(kernels)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="B8 Sq16,B8 Sq1,B1 Sq1")
    parser.add_argument("--ncu-target", help="a shape name substring: run 5 plain calls at 1/16 for ncu")
    parser.add_argument("--ncu-dense", action="store_true",
                        help="with --ncu-target: every block listed, 3 calls, then 3 of upstream's dense flash_attn_func")
    parser.add_argument("--ncu-speculative", action="store_true",
                        help="with --ncu-target: 3 x (union pass, speculative call) at 1/16")
    parser.add_argument("--split-sweep", action="store_true", help="only the split-count sweep at 1/4 and 1/16")
    parser.add_argument("--max-splits", type=int, default=32, help="the sweep's largest split count")
    parser.add_argument("--backend", choices=("fa2", "fa4"), default="fa2", help="the sparse calls' backend")
    args = parser.parse_args()
    sixteenth = [s for s in DECODE if s.density == 1 / 16]
    if args.ncu_target:
        density = 1.0 if args.ncu_dense else 1 / 16
        shape = next(s for s in DECODE if s.density == density and args.ncu_target in s.name)
        q, k, v = random_inputs(shape)
        lists = make_lists(shape, random.Random(0))
        if args.ncu_speculative:
            spec = speculative_inputs(shape, k, v, lists[0][0])
            for _ in range(3):
                fas.flash_attn_with_sparse_block_table(q, k, v, spec.union, backend="fa2")
                fas.flash_attn_speculative_sparse(q, spec.k_spec, spec.v_spec, k, v, spec.missed)
            torch.cuda.synchronize()
            return
        blocks = to_blocks(lists, shape)
        for _ in range(3 if args.ncu_dense else 5):
            fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=args.backend)
        if args.ncu_dense:
            from flash_attn import flash_attn_func
            for _ in range(3):
                flash_attn_func(q, k, v)
        torch.cuda.synchronize()
        return
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    print("(the sparse combine is a programmatic dependent launch: it starts while the split kernel runs,\n"
          " so its time below includes that wait; the graph time is the call's cost)", flush=True)
    wanted = lambda shape: any(part.strip() in shape.name for part in args.shapes.split(","))
    if args.split_sweep:
        for shape in filter(wanted, (s for s in DECODE if s.density < 1)):
            split_sweep(shape, args.max_splits, args.backend)
        return
    for shape in sixteenth:
        if wanted(shape):
            profile_shape(shape, args.backend)
    for shape in DECODE:
        if shape.density == 1.0 and wanted(shape):
            profile_dense(shape, args.backend)


if __name__ == "__main__":
    main()
