"""GQA sweep at decode: every group size against dense FA-3 over exactly the listed keys.

For each batch, query length, GQA group (query heads per K/V head; 8 K/V heads), key length and
density, per-K/V-head lists (the last block and a random choice of the rest, 4 rotating sets),
it times `auto`, backend="fa3" and backend="fa2" through the public call, and dense FA-3
(flash_attn_3's flash_attn_func, PackGQA on, its own split heuristic) over K/V gathered to the
listed keys, and that dense call in the sparse path's 128-key steps (FA-3 steps non-causal
hdim-128 keys by 176; bench_sparse.fa3_dense_128): CUDA-graph replay with L2 flushed before every replay (median of the replays), and
eager back-to-back calls for `auto` and dense FA-3. Every point runs its methods in two passes
one after the other; a ratio's passes show the spread.

Beside them, once per list set, the floor the memory pattern sets: a Triton kernel that only reads
the listed blocks where they lie (listed_reader.py) over the same kernel reading the gathered copy
the dense peer reads (the same bytes, contiguous per key). --lists also runs lists shared by every
K/V head of a sequence (the dense peer's access pattern) and per-query-head lists (unpacked; no
dense peer exists, so fa3 is compared with fa2 there). --kv-layouts hnd also runs K/V caches stored
head-major ((batch, heads_k, seqlen_k, head_dim) memory, passed as its (batch, seqlen_k, heads_k,
head_dim) view), each head's block one contiguous span, with the dense peer's copy in that layout too.

    python benchmarks/bench_gqa.py [--batches 1,4,8] [--seqlens-q 1,4,8,16] [--groups 1,...,16]
        [--seqlens-k 32768,131072] [--densities 0.125,0.0625] [--lists per-kv-head,shared,per-query-head]
        [--kv-layouts nhd,hnd] [--split-rules efficiency] [--out DIR]

writes gqa.json (every timing) and gqa.md (the summary per group, then every point) into --out.
"""

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_attn_sparse as fas  # noqa: E402
from bench_sparse import (  # noqa: E402
    BLOCK,
    ROTATIONS,
    Shape,
    eager_pass,
    fa3_dense_128,
    fa3_dense_forward,
    listed_kv,
    make_lists,
    rotating,
    source_commit,
    to_blocks,
)

HEADS_K, HEAD_DIM = 8, 128
REPLAYS = 40  # graph replays per method and pass, L2 flushed before each
EAGER_CALLS = 40
EAGER_SPANS = 5  # eager time is the median of these spans of EAGER_CALLS: one host stall sets no figure
L2_FLUSH_BYTES = 256 << 20  # several times the 50 MB L2 of an H100 or H200
PASSES = 2
LIST_KINDS = ("per-kv-head", "shared", "per-query-head")
KV_LAYOUTS = ("nhd", "hnd")  # K/V memory: key-major (batch, seqlen_k, heads_k, dim), or head-major


@dataclass
class Point:
    batch: int
    seqlen_q: int
    group: int
    seqlen_k: int
    density: float
    lists: str = "per-kv-head"
    kv_layout: str = "nhd"
    auto_backend: str = ""
    graph_us: dict = field(default_factory=dict)  # method -> [us per pass]
    eager_us: dict = field(default_factory=dict)
    splits: dict = field(default_factory=dict)  # with --split-rules: rule -> split count
    reader_us: dict = field(default_factory=dict)  # listed / gathered -> [us per pass], per list set

    @property
    def name(self) -> str:
        kind = ("" if self.lists == "per-kv-head" else f" {self.lists}") + ("" if self.kv_layout == "nhd" else " HND")
        return f"B{self.batch} Sq{self.seqlen_q} H{HEADS_K * self.group}/{HEADS_K} Sk{self.seqlen_k // 1024}k {self.density:g}{kind}"

    @property
    def kind(self) -> str:
        """The summary's row label: the list kind, and the K/V layout where it is not key-major."""
        return self.lists + ("" if self.kv_layout == "nhd" else ", HND")


def graph_replay_us(calls, flush) -> float:
    """Median us of one replay: each call (a rotation) captured into its own graph, the graphs
    replayed in turn, L2 flushed before each replay and outside the timed span."""
    for call in calls:  # warm-up: the one-shot caches, FA-3's planned forwards, allocations
        call()
    torch.cuda.synchronize()
    graphs = []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for i, (start, end) in enumerate(events):
        flush()
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3


def eager_us(calls) -> float:
    """us per call of back-to-back eager calls rotating through `calls` (bench_sparse.eager_pass):
    the median of EAGER_SPANS spans."""
    for call in calls:
        call()
    run = rotating(calls)
    return statistics.median(eager_pass(run, EAGER_CALLS) for _ in range(EAGER_SPANS)) * 1e3


def dense_fa3():
    """Dense FA-3 (flash_attn_3's flash_attn_func, its own split count) with PackGQA on."""
    forward, why_not = fa3_dense_forward()
    if forward is None:
        raise SystemExit(why_not)
    return lambda q, k, v: forward(q, k, v, causal=False, pack_gqa=True)


def run_sweep(args, written=lambda points: None) -> list:
    """Every point of the sweep; written(points) after each point (a run cut short keeps what it
    measured)."""
    flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    dense = dense_fa3()
    points = []
    for layout, kind in [(layout, kind) for layout in args.kv_layouts for kind in args.lists]:
        for batch in args.batches:
            for seqlen_k in args.seqlens_k:
                g = torch.Generator(device="cuda").manual_seed(batch * 7 + seqlen_k)
                k, v = (kv_cache(batch, seqlen_k, layout, g) for _ in range(2))
                for density in args.densities:
                    shape = Shape("gqa", batch, 1, seqlen_k, HEADS_K, HEADS_K, density)
                    rng = random.Random(f"{batch}-{seqlen_k}-{density}")
                    list_sets = [make_lists(shape, rng) for _ in range(ROTATIONS)]
                    if kind == "shared":  # every K/V head of a sequence lists its head 0's blocks
                        list_sets = [[[per_b[0]] * HEADS_K for per_b in lists] for lists in list_sets]
                    listed, reader = None, {}  # per-query-head lists have no dense peer
                    if kind != "per-query-head":
                        listed = [tuple(in_layout(t, layout) for t in listed_kv(k, v, lists)) for lists in list_sets]
                        reader = reader_floor(k, v, list_sets, listed, flush_buffer.zero_)
                    for group in args.groups:
                        if kind == "per-query-head":  # lists of their own for each query head
                            heads = Shape("gqa", batch, 1, seqlen_k, HEADS_K * group, HEADS_K * group, density)
                            blocks = [to_blocks(make_lists(heads, rng), heads) for _ in range(ROTATIONS)]
                        else:
                            blocks = [to_blocks(lists, shape) for lists in list_sets]
                        for seqlen_q in args.seqlens_q:
                            q = torch.randn(batch, seqlen_q, HEADS_K * group, HEAD_DIM, device="cuda", generator=g).bfloat16()
                            point = Point(batch, seqlen_q, group, seqlen_k, density, kind, layout, reader_us=reader)
                            measure_point(point, q, k, v, blocks, listed, dense, flush_buffer.zero_, args.split_rules)
                            print(summary_line(point), flush=True)
                            points.append(point)
                            written(points)
    return points


def kv_cache(batch: int, seqlen_k: int, layout: str, generator) -> torch.Tensor:
    """A random bf16 K or V cache as the (batch, seqlen_k, heads_k, head_dim) view the calls take,
    its memory key-major (nhd) or head-major (hnd)."""
    if layout == "nhd":
        return torch.randn(batch, seqlen_k, HEADS_K, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    return torch.randn(batch, HEADS_K, seqlen_k, HEAD_DIM, device="cuda", generator=generator).bfloat16().transpose(1, 2)


def in_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t's values in the memory layout of kv_cache (the dense peer reads its copy like the cache)."""
    return t if layout == "nhd" else t.transpose(1, 2).contiguous().transpose(1, 2)


def reader_floor(k, v, list_sets, listed, flush) -> dict:
    """{listed, gathered: [us per pass]}: a kernel that only reads the listed blocks where they lie,
    and the same kernel over the gathered copy the dense peer reads (same bytes), graph replay with
    L2 flushed; the reads are checked once against torch."""
    from listed_reader import block_ids, read_listed_blocks, read_listed_blocks_reference
    ids = [block_ids(lists) for lists in list_sets]
    in_order = torch.arange(ids[0].shape[-1], dtype=torch.int32, device="cuda").expand_as(ids[0]).contiguous()
    torch.testing.assert_close(read_listed_blocks(k, v, ids[0], BLOCK).double(),
                               read_listed_blocks_reference(k, v, ids[0], BLOCK), rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(read_listed_blocks(*listed[0], in_order, BLOCK).double(),
                               read_listed_blocks_reference(*listed[0], in_order, BLOCK), rtol=1e-4, atol=1e-2)
    methods = {"listed": [lambda i=i: read_listed_blocks(k, v, i, BLOCK) for i in ids],
               "gathered": [lambda kl=kl, vl=vl: read_listed_blocks(kl, vl, in_order, BLOCK) for kl, vl in listed]}
    times = {}
    for _ in range(PASSES):
        for name, calls in methods.items():
            times.setdefault(name, []).append(graph_replay_us(calls, flush))
    return times


def wave_efficiency_splits(tiles: int, num_sms: int, n_blocks: int, max_splits: int = 128) -> int:
    """Upstream FA-3's split rule (hopper/heuristics.h, num_splits_heuristic, without its L2 branch):
    the fewest splits whose wave efficiency (tiles * splits / SMs over its ceiling) is within 85% of
    the best, one split when the tiles nearly fill the SMs or there are at most 4 key blocks."""
    if tiles >= 0.8 * num_sms or n_blocks <= 4:
        return 1
    efficiency = [tiles * s / num_sms / math.ceil(tiles * s / num_sms) for s in range(1, min(max_splits, num_sms, n_blocks) + 1)]
    return next(s for s, e in enumerate(efficiency, 1) if e >= 0.85 * max(efficiency))


def fa3_tiles(point: Point, tile_rows: int = 0) -> int:
    """The packed decode call's M tiles on fa3: of tile_rows rows, by default as its split kernel
    tiles them (64 rows where the packed rows fit, else 128). With 128, the count fa3's host
    splits by (sparse_kernel_choice.h's sparse_auto_num_splits, mirrored for the table)."""
    rows = point.seqlen_q * point.group
    return point.batch * HEADS_K * -(-rows // (tile_rows or (64 if rows <= 64 else 128)))


def measure_point(point: Point, q, k, v, blocks, listed, dense, flush, split_rules=()) -> Point:
    """Every method at one point, PASSES times in turn; split_rules: "efficiency" adds fa3 at
    wave_efficiency_splits' count (method fa3_efficiency_splits)."""
    point.auto_backend = fas.choose_backend(q, k, v, blocks[0])[0]
    methods = {name: [lambda b=b, name=name: fas.flash_attn_with_sparse_block_table(q, k, v, b, backend=name)
                      for b in blocks] for name in ("auto", "fa3", "fa2")}
    if "efficiency" in split_rules and point.lists != "per-query-head":  # the rule's tiles assume packing
        n_blocks, sms = int(blocks[0].full_cnt.max()), torch.cuda.get_device_properties(0).multi_processor_count
        splits = wave_efficiency_splits(fa3_tiles(point), sms, n_blocks)
        host_tiles = fa3_tiles(point, 128)
        point.splits = {"fa3": 1 if host_tiles >= sms else max(1, min(sms // host_tiles, n_blocks // 2)), "efficiency": splits}
        methods["fa3_efficiency_splits"] = [lambda b=b: fas.flash_attn_with_sparse_block_table(q, k, v, b, backend="fa3",
                                                                                              num_splits=splits)
                                            for b in blocks]
    if listed is not None:  # per-query-head lists have no dense peer
        methods["dense_fa3_listed"] = [lambda kl=kl, vl=vl: dense(q, kl, vl) for kl, vl in listed]
        dense_128 = fa3_dense_128(q, point.seqlen_q)
        if isinstance(dense_128, str):
            point.graph_us["dense_fa3_listed_128"] = dense_128
        else:
            methods["dense_fa3_listed_128"] = [lambda kl=kl, vl=vl: dense_128(kl, vl) for kl, vl in listed]
    for _ in range(PASSES):
        for name, calls in methods.items():
            try:
                point.graph_us.setdefault(name, []).append(graph_replay_us(calls, flush))
                if name in ("auto", "fa3", "dense_fa3_listed"):
                    point.eager_us.setdefault(name, []).append(eager_us(calls))
            except Exception as error:  # a method that cannot run a point is reported, not fatal
                point.graph_us[name] = f"{type(error).__name__}: {str(error)[:160]}"
    return point


def ratio(point: Point, method: str, peer: str = "dense_fa3_listed", eager: bool = False):
    """(median over passes, [per pass]) of method's time over peer's, or None where either failed."""
    times = point.eager_us if eager else point.graph_us
    ours, theirs = times.get(method), times.get(peer)
    if not isinstance(ours, list) or not isinstance(theirs, list):
        return None
    per_pass = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(per_pass), per_pass


def reader_ratio(point: Point):
    """Median over passes of reading the listed blocks where they lie over reading the gathered copy."""
    listed, gathered = point.reader_us.get("listed"), point.reader_us.get("gathered")
    return statistics.median(a / b for a, b in zip(listed, gathered)) if listed and gathered else None


# (column, method, peer, eager) of the tables; a point lacking either side shows "-"
RATIOS = (("auto", "auto", "dense_fa3_listed", False), ("fa3", "fa3", "dense_fa3_listed", False),
          ("fa2", "fa2", "dense_fa3_listed", False), ("eager auto", "auto", "dense_fa3_listed", True),
          ("eager fa3", "fa3", "dense_fa3_listed", True), ("fa3 / 128-key", "fa3", "dense_fa3_listed_128", False),
          ("fa3 at upstream's splits", "fa3_efficiency_splits", "dense_fa3_listed", False),
          ("fa3 / fa2", "fa3", "fa2", False))


def summary_line(point: Point) -> str:
    parts = [f"{point.name:<28} auto={point.auto_backend}"]
    for column, method, peer, eager in RATIOS:
        r = ratio(point, method, peer, eager)
        parts.append(f"{column} {r[0]:.3f}" + (f" ({'/'.join(f'{x:.3f}' for x in r[1])})" if column == "fa3" else "")
                     if r else f"{column} -")
    reader = reader_ratio(point)
    parts.append(f"listed/gathered read {reader:.3f}" if reader else "read -")
    dense = point.graph_us.get("dense_fa3_listed")
    parts.append(f"dense {statistics.median(dense):.1f} us" if isinstance(dense, list) else "dense -")
    return "  ".join(parts)


def _cell(values, how) -> str:
    return f"{how(values):.3f}" if values else "-"


def markdown(points, gpu: str, commit: str) -> str:
    lines = [f"# GQA sweep, {gpu}, {time.strftime('%Y-%m-%d')}, commit {commit}", "",
             "Time over dense FA-3 over exactly the listed keys (PackGQA on), graph replay with L2 flushed "
             "before each replay, median of two passes (each pass's ratio in the JSON); eager: back-to-back calls, "
         f"the median of {EAGER_SPANS} spans of {EAGER_CALLS}. "
             "128-key: fa3 over the same dense call in the sparse path's 128-key steps. Read floor: a kernel that "
             "only reads the listed blocks where they lie, over the same kernel reading the dense peer's gathered "
             "copy (the same bytes). Per-query-head lists have no dense peer.", "",
             "| lists | group | points | " + " | ".join(f"{c} median / worst" for c, *_ in RATIOS)
             + " | read floor median / worst | worst auto point |",
             "|---|---|---|" + "---|" * (len(RATIOS) + 2)]
    for kind in dict.fromkeys(p.kind for p in points):
        for group in sorted({p.group for p in points if p.kind == kind}):
            of_group = [p for p in points if p.kind == kind and p.group == group]
            cells = []
            for _, method, peer, eager in RATIOS:
                values = [r[0] for p in of_group if (r := ratio(p, method, peer, eager))]
                cells.append(f"{_cell(values, statistics.median)} / {_cell(values, max)}")
            reads = [r for p in of_group if (r := reader_ratio(p))]
            autos = [(r[0], p.name) for p in of_group if (r := ratio(p, "auto"))]
            lines.append(f"| {kind} | {group} | {len(of_group)} | {' | '.join(cells)} | "
                         f"{_cell(reads, statistics.median)} / {_cell(reads, max)} | {max(autos)[1] if autos else '-'} |")
    lines += ["", "| point | auto runs | " + " | ".join(c for c, *_ in RATIOS) + " | read floor | splits | dense FA-3 us |",
              "|---|---|" + "---|" * (len(RATIOS) + 3)]
    for p in points:
        cells = [f"{r[0]:.3f}" if (r := ratio(p, m, peer, eager)) else "-" for _, m, peer, eager in RATIOS]
        reader = reader_ratio(p)
        dense = p.graph_us.get("dense_fa3_listed")
        dense_us = f"{statistics.median(dense):.1f}" if isinstance(dense, list) else "-"
        splits = "/".join(f"{rule} {n}" for rule, n in p.splits.items()) or "-"
        lines.append(f"| {p.name} | {p.auto_backend} | {' | '.join(cells)} | {f'{reader:.3f}' if reader else '-'} | "
                     f"{splits} | {dense_us} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--batches", type=ints, default=[1, 4, 8])
    parser.add_argument("--seqlens-q", type=ints, default=[1, 4, 8, 16])
    parser.add_argument("--groups", type=ints, default=[1, 2, 3, 4, 5, 6, 7, 8, 16])
    parser.add_argument("--seqlens-k", type=ints, default=[32768, 131072])
    parser.add_argument("--densities", type=lambda text: [float(x) for x in text.split(",")], default=[1 / 8, 1 / 16])
    parser.add_argument("--lists", type=lambda text: text.split(","), default=["per-kv-head"],
                        help="list kinds, in order: " + ", ".join(LIST_KINDS))
    parser.add_argument("--kv-layouts", type=lambda text: text.split(","), default=["nhd"],
                        help="K/V memory layouts, in order: nhd (key-major), hnd (head-major)")
    parser.add_argument("--split-rules", type=lambda text: text.split(","), default=[],
                        help="efficiency: also time fa3 at upstream FA-3's wave-efficiency split count")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if unknown := set(args.lists) - set(LIST_KINDS):
        parser.error(f"--lists: unknown kinds {sorted(unknown)}; known: {', '.join(LIST_KINDS)}")
    if unknown := set(args.kv_layouts) - set(KV_LAYOUTS):
        parser.error(f"--kv-layouts: unknown layouts {sorted(unknown)}; known: {', '.join(KV_LAYOUTS)}")
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  torch {torch.__version__}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = source_commit()

    def write(points):
        (args.out / "gqa.json").write_text(json.dumps({"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "commit": commit,
                                                       "points": [dict(asdict(p), name=p.name) for p in points]}, indent=1))
        (args.out / "gqa.md").write_text(markdown(points, gpu, commit))
    points = run_sweep(args, write)
    print(markdown(points, gpu, commit).split("\n\n| point")[0])


if __name__ == "__main__":
    main()
