"""Where a call's host time goes, at the decode shapes of DESIGN §7 (1/16, per-K/V-head lists).

For each backend present (fa2, fa3: their planned kernels launched as one CUDA graph per run,
backends/device.GRAPH_LAUNCH, the default; fa2-direct and fa3-direct, the same with that switch
off, each kernel launched by the runtime; fa4, and auto) and each shape it times, in one
process (every figure the median of --passes whole passes over the rows, 3 by default, with the
one-shot's range across them):
- `after sync`: median over 200 calls of one call started on an idle GPU, plan.run, the one-shot
  call, their parts and a lone copy taking turns call by call (a drifting host weighs on each
  alike), and `back to back`: the mean host time of 200 calls issued without waiting (what an
  eager model's launch stream costs the CPU);
- eager ms per call (back-to-back calls, synchronized at the end) over the graph-replay ms, the
  ratio the host-time contract bounds (one list set here, so L2 stays warm for both, unlike bench_sparse.py);
- the parts: the launches alone (a plan's Planned.run, a one-shot entry's Planned.run_with, the
  checked path for an out of other strides), the one-shot cache's key, the plan's Python
  checks, and for scale a lone device copy and an empty Python call;
- the host time of one plan.run captured as a CUDA graph and replayed (`graph of one run`): what
  a run would cost as a single graph launch; on fa2 and fa3, `SparseForward.run (graph launch)`:
  a SparseForward of the plan's launching its kernels as one graph given each run's parameters
  (graph_launch), beside the plan's own `SparseForward.run` (direct in the direct rows);
- the CUDA runtime calls inside 100 plan.run calls (torch.profiler's CPU-side events: count and
  mean us each), which says which driver calls a launch pays.

    python benchmarks/host_time.py [--out DIR] [--shapes "B8 Sq1"]   (GPU; writes host-time.md/.json)
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_attn_sparse as fas  # noqa: E402
from bench_sparse import DECODE, host_us_after_sync, make_lists, random_inputs, to_blocks  # noqa: E402
from flash_attn_sparse.backends import BACKENDS  # noqa: E402
from flash_attn_sparse.calls import facts  # noqa: E402

CALLS = 200


def interleaved_after_sync(fns: dict) -> dict:
    """{name: median host us of one call of fns[name] started on an idle GPU}, the functions
    taking turns call by call (CALLS rounds, the order rotating), so that a host drifting during
    the measurement weighs on each alike and their ratios hold within a row."""
    samples, items = {name: [] for name in fns}, list(fns.items())
    for turn in range(CALLS):
        for name, fn in items[turn % len(items):] + items[:turn % len(items)]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return {name: statistics.median(taken) * 1e6 for name, taken in samples.items()}


def back_to_back_us(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    took = time.perf_counter() - start
    torch.cuda.synchronize()
    return took / CALLS * 1e6


def eager_over_graph(fn) -> tuple:
    """(eager ms per call of back-to-back calls, graph-replay ms per call)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) * 1e3 / CALLS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    for _ in range(10):
        graph.replay()
    end_event.record()
    torch.cuda.synchronize()
    return eager, start_event.elapsed_time(end_event) / 200


def runtime_calls(fn) -> str:
    """The CUDA runtime / driver calls of 100 calls of fn: 'name xcount mean-us' each."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu")) and e.key != "cudaDeviceSynchronize"]
    return "; ".join(f"{e.key} x{e.count / 100:g} {e.cpu_time_total / e.count:.1f}" for e in events)


def parts(backend, plan, q, k, v, blocks):
    """The launches a plan's run or a one-shot call makes, without their Python: [(name, fn)]."""
    from flash_attn_sparse.calls import SparseCall
    from flash_attn_sparse.interface import cache_key
    from flash_attn_sparse.options import CallOptions
    out, b = plan.out, plan.blocks
    options = CallOptions(backend=backend)
    tensors = dict(cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None)
    # The one-shot cache's key (interface.run_cached): what a cached call pays before its launch.
    found = [("one-shot key", lambda: cache_key(q, k, v, out, b, options, None, None, None, None, (None, None)))]
    if backend not in ("fa2", "fa3"):
        return found
    call = SparseCall(q, k, v, blocks, options)
    planned = plan._planned
    # The plan's launch (SparseForward.run), a one-shot entry's (SparseForward.run_with, a new LSE
    # per call) and the path for an out of other strides (the extension's checked entry point).
    one_shot = BACKENDS[backend].plan(call, plan.num_splits, out, keep_buffers=False)
    found += [("Planned.run", lambda: planned.run(q, k, v, out)),
              ("one-shot run_with", lambda: one_shot.run_with(q, k, v, out, b, tensors)),
              ("run_any_out", lambda: planned.run_any_out(q, k, v, out))]
    if backend == "fa2":
        from flash_attn_sparse.backends import fa2, fa2_ops
        args = fa2_ops.extension_args(fa2.op_args(call, plan.num_splits))
        return found + graph_launched(lambda: fa2_ops.planned_forward(args, q, k, v, out, graph_launch=True), q, k, v, out)
    from flash_attn_sparse.backends import fa3
    return found + graph_launched(lambda: fa3.planned(call, plan.num_splits, out, graph_launch=True), q, k, v, out)


def graph_launched(make, q, k, v, out) -> list:
    """[("SparseForward.run (graph launch)", run)]: a plan's SparseForward made with graph_launch
    (its first run captures), or [] for a build before graph_launch."""
    try:
        graphed = make()
    except TypeError:
        return []
    graphed.run(q, k, v, out)
    return [("SparseForward.run (graph launch)", lambda: graphed.run(q, k, v, out))]


def one_run_graph(run) -> list:
    """[("graph of one run", replay)]: one plan.run captured as a CUDA graph and replayed, the host
    time a run would cost as one graph launch (what a SparseForward owning a graph of its launches
    would pay, before updating the graph's parameters per run), or [] where run cannot be captured."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except Exception:  # a backend whose run cannot be captured: no such part
        torch.cuda.synchronize()
        return []
    return [("graph of one run", graph.replay)]


DIRECT_ROWS = {"fa2-direct": "fa2", "fa3-direct": "fa3"}  # the rows with graph_launch off, and their backends


def measure(shape, backend):
    """One row; backend "fa2-direct" / "fa3-direct": fa2 / fa3 with device.GRAPH_LAUNCH off (plans
    and the one-shot cache's entries launch each kernel through the runtime), beside the default
    row of the same pass."""
    if backend in DIRECT_ROWS:
        from flash_attn_sparse import interface
        from flash_attn_sparse.backends import device
        default = device.GRAPH_LAUNCH
        device.GRAPH_LAUNCH = False
        interface.one_shot_cache.clear()  # the one-shot cache's entries, planned anew without graph_launch
        try:
            row = measure(shape, DIRECT_ROWS[backend])
        finally:
            device.GRAPH_LAUNCH = default
            interface.one_shot_cache.clear()
        return dict(row, backend=backend)
    import random
    q, k, v = random_inputs(shape)
    blocks = to_blocks(make_lists(shape, random.Random(0)), shape)
    try:
        plan = fas.plan(q, k, v, blocks, backend=backend)
    except fas.SparseInputError as error:
        return {"shape": shape.name, "backend": backend, "note": f"refused: {error}"}
    run = lambda: plan.run(q, k, v)  # noqa: E731
    one_shot = lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend)  # noqa: E731
    row = {"shape": shape.name, "backend": backend if backend != "auto" else f"auto ({plan.backend})",
           "splits": plan.num_splits}
    found = parts(backend, plan, q, k, v, blocks)
    src = torch.empty(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):
        run(), one_shot()
    found += one_run_graph(run)
    # Interleaved: plan.run, the one-shot call, their parts and a lone copy, in one set of turns.
    timed = interleaved_after_sync({"plan.run": run, "one-shot": one_shot, "lone copy": lambda: dst.copy_(src),
                                    **dict(found)})
    row["plan_run_after_sync_us"] = timed["plan.run"]
    row["plan_run_back_to_back_us"] = back_to_back_us(run)
    row["one_shot_after_sync_us"] = timed["one-shot"]
    row["one_shot_back_to_back_us"] = back_to_back_us(one_shot)
    row["copy_after_sync_us"] = timed["lone copy"]
    try:
        row["eager_ms"], row["graph_ms"] = eager_over_graph(run)
    except Exception as error:  # a backend whose run cannot be captured: the other columns stand
        row["eager_ms"] = row["graph_ms"] = float("nan")
        row["graph_note"] = f"{type(error).__name__}: {str(error)[:80]}"
    row["launches"] = [dict(name=name, after_sync_us=timed[name], back_to_back_us=back_to_back_us(fn))
                       for name, fn in found]
    row["checks_us"] = back_to_back_us(lambda: (facts(q), facts(k), facts(v)) == plan._facts)
    row["runtime_calls"] = runtime_calls(run)
    return row


def median_of_passes(taken: list) -> dict:
    """One row from a (shape, backend)'s passes: each number the median of its passes, the
    launches' by name, and the one-shot's back-to-back range across passes."""
    row = dict(taken[0])
    if "note" in row:
        return row
    for name, value in row.items():
        if isinstance(value, float):
            row[name] = statistics.median(t[name] for t in taken)
    row["launches"] = [dict(launch, after_sync_us=statistics.median(t["launches"][i]["after_sync_us"] for t in taken),
                            back_to_back_us=statistics.median(t["launches"][i]["back_to_back_us"] for t in taken))
                       for i, launch in enumerate(row["launches"])]
    one_shot = [t["one_shot_back_to_back_us"] for t in taken]
    row["passes"] = len(taken)
    row["one_shot_back_to_back_range_us"] = (min(one_shot), max(one_shot))
    return row


def markdown(rows, copy_us, empty_us) -> str:
    lines = [f"lone copy_: {copy_us[0]:.1f} us after sync, {copy_us[1]:.1f} back to back; empty Python call {empty_us:.2f} us",
             f"medians of {rows[0].get('passes', 1) if rows else 0} passes", "",
             "| shape | backend | splits | plan.run us (after sync / back to back) | one-shot us (back to back: range "
             "of the passes) | lone copy us | parts us | checks us | eager / graph | runtime calls per run (name xN mean us) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['shape']} | {r['backend']} | | {r['note']} | | | | | | |")
            continue
        low, high = r["one_shot_back_to_back_range_us"]
        launch = "; ".join(f"{p['after_sync_us']:.1f} / {p['back_to_back_us']:.1f} ({p['name']})" for p in r["launches"])
        lines.append(f"| {r['shape']} | {r['backend']} | {r['splits']} | {r['plan_run_after_sync_us']:.1f} / "
                     f"{r['plan_run_back_to_back_us']:.1f} | {r['one_shot_after_sync_us']:.1f} / "
                     f"{r['one_shot_back_to_back_us']:.1f} ({low:.1f}-{high:.1f}) | {r['copy_after_sync_us']:.1f} | {launch} | "
                     f"{r['checks_us']:.1f} | "
                     f"{r['eager_ms'] * 1e3:.1f} / {r['graph_ms'] * 1e3:.1f} us = {r['eager_ms'] / r['graph_ms']:.2f} | "
                     f"{r['runtime_calls']} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default="B8 Sq16,B8 Sq1,B1 Sq1", help="comma-separated substrings of the decode shapes")
    parser.add_argument("--backends", default="fa2,fa2-direct,fa3,fa3-direct,fa4,auto")
    parser.add_argument("--passes", type=int, default=3, help="whole passes over the rows; each figure their median")
    args = parser.parse_args()
    shapes = [s for s in DECODE if abs(s.density - 1 / 16) < 1e-9 and any(p in s.name for p in args.shapes.split(","))]
    src = torch.empty(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    copy_us = (host_us_after_sync(lambda: dst.copy_(src)), back_to_back_us(lambda: dst.copy_(src)))
    empty_us = back_to_back_us(lambda: None)
    # The first shape measured once and dropped: a process's first rows, a lone copy's included,
    # read well above the same calls later in the process.
    for backend in args.backends.split(",")[:1]:
        measure(shapes[0], backend)
    # Whole passes over every row, and each figure the median of its passes: a host slows and
    # recovers within a run, and the same call's median moved with it from row to row.
    passes = {}
    for _ in range(args.passes):
        for shape in shapes:
            for backend in args.backends.split(","):
                if backend != "auto" and DIRECT_ROWS.get(backend, backend) not in BACKENDS:
                    continue
                row = measure(shape, backend)
                passes.setdefault((shape.name, backend), []).append(row)
                print(row, flush=True)
    rows = [median_of_passes(taken) for taken in passes.values()]
    table = markdown(rows, copy_us, empty_us)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host-time.md").write_text(table + "\n")
        (args.out / "host-time.json").write_text(json.dumps({"copy_us": copy_us, "empty_us": empty_us, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
