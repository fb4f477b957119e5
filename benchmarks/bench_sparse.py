"""Sparse attention benchmark: this project's FA-2 sparse path against its peers, on the same
inputs and the same block lists, in one run on one GPU (DESIGN.md §7).

For every shape it prints ms (median of CUDA-event timings of CUDA-graph replays after warm-up,
as decode is served; plain launches where a method cannot be captured), effective TFLOP/s
(FLOPs of the listed blocks only), effective TB/s (bytes of the listed K/V blocks read once per
KV head, plus Q and O) and the fraction of the roofline measured in the same run (copy bandwidth,
bf16 matmul rate). Lists rotate between calls so the listed blocks are not served from L2.
At decode shapes the row copy_same_bytes times a device copy moving the counted bytes: what one
memory-bound kernel of that size reaches, launch and ramp included; read_listed_blocks times a
Triton kernel that reads exactly the listed K/V blocks and nothing else (listed_reader.py): the
same scattered pieces, without the attention.
Beside ms every row has eager_ms, the wall time per call of 100 back-to-back eager calls (after
10 warm-up calls, synchronized before and after: what a caller without graphs waits, Python and
launch gaps included), and host_us, the median over 200 calls of one call's host time started
on an idle GPU and not waiting for it (what the call costs the CPU); NaN where that timing failed.
plan_run <backend> times SparsePlan.run (plans made outside the timing) against the API's call;
*_dense_listed and cudnn_listed time dense FA-3 / FA-2 / cuDNN over a K/V gathered to exactly
the listed keys (non-causal lists of one length); fa3_dense_listed_128 the same FA-3 attention in
the sparse path's 128 x 128 tile steps (upstream tiles non-causal keys by 176, causal ones by
128): causal, each 128-row query tile its own batch entry reading its K/V by cache_batch_idx, so
the mask touches only the last block, whose MMAs run all the same; at causal shapes, where
fa3_dense_listed is non-causal over a tile's mean key count, the same keys in those 128-key
steps. --pristine-fa4 (flash-attn-4 installed as
released, without this project's patches) runs only fa4_pristine_blocksparse: its own
block-sparse call on the same lists in its form.

    python benchmarks/bench_sparse.py [--shapes "B8 Sq16,prefill"] [--out benchmarks/results] [--pristine-fa4]
    (nox -s bench): writes <date>-<gpu>-<commit>.json / .md / .png into --out.
"""

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import flash_attn_sparse as fas  # noqa: E402
from flash_attn_sparse import SparseBlocks  # noqa: E402
from flash_attn_sparse.backends import cute, fa3_ops, fa4  # noqa: E402

BLOCK = 128
ROTATIONS = 4
# eager_and_host's call counts: the eager column is the median of EAGER_PASSES passes of
# EAGER_CALLS calls, so a one-off stall in one pass does not set it. Passes of one route can
# spread by over 10% at prefill, so two methods' eager columns can differ that much with the
# same kernel.
EAGER_WARMUP, EAGER_CALLS, EAGER_PASSES, HOST_CALLS = 10, 100, 3, 200
DEFAULT_METHODS = ",".join(("copy", "read_listed", "fa2_sparse", "fa3_sparse", "fa4_sparse", "fa4_direct", "auto", "plan_run",
                            "fa2_dense", "fa3_dense_listed", "fa3_dense_listed_128", "fa2_dense_listed", "cudnn_listed",
                            "speculative", "speculative_fa3", "sdpa", "flex"))


@dataclass
class Shape:
    name: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    density: float
    causal: bool = False
    head_dim: int = 128
    only: tuple = ()  # methods this shape is run with (empty: all asked for)


@dataclass
class Row:
    shape: str
    density: float
    method: str
    ms: float
    tflops: float
    tbps: float
    roofline_fraction: float
    note: str = ""
    eager_ms: float = float("nan")  # per call, back-to-back eager calls (eager_and_host)
    host_us: float = float("nan")   # host time of one call (eager_and_host)


def measure_roofline():
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured now."""
    src = torch.empty(2 * 1024 ** 3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy_tbps = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    matmul_tflops = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    return copy_tbps, matmul_tflops


def make_lists(shape, rng):
    """Per-KV-head lists with one query tile: the last block always (the diagonal for causal
    decode), the rest drawn at the given density. Returns sorted id lists [b][hk]."""
    n_blocks = shape.seqlen_k // BLOCK
    keep = max(1, round(n_blocks * shape.density))
    lists = []
    for _ in range(shape.batch):
        per_head = []
        for _ in range(shape.heads_k):
            chosen = set(rng.sample(range(n_blocks - 1), keep - 1)) | {n_blocks - 1} if keep < n_blocks else set(range(n_blocks))
            per_head.append(sorted(chosen))
        lists.append(per_head)
    return lists


def make_causal_lists(shape, rng):
    """Per-(batch, KV head, query tile) lists of a causal prefill: the tile's diagonal block as a
    "mask" block, its earlier blocks drawn at the density as "full" ones. Returns (full, mask),
    each [b][hk][m] sorted id lists."""
    tiles = shape.seqlen_q // BLOCK
    full = [[[sorted(rng.sample(range(m), round(m * shape.density))) for m in range(tiles)]
             for _ in range(shape.heads_k)] for _ in range(shape.batch)]
    mask = [[[[m] for m in range(tiles)] for _ in range(shape.heads_k)] for _ in range(shape.batch)]
    return full, mask


def to_blocks(lists, shape):
    if shape.causal:
        full, mask = lists
        return SparseBlocks.from_lists(full, mask, block_size=BLOCK, q_block_size=BLOCK, device="cuda")
    return SparseBlocks.from_lists([[[row] for row in per_b] for per_b in lists], block_size=BLOCK, device="cuda")


def counted_work(shape, lists):
    """FLOPs of the listed (query, key) pairs and bytes of the listed K/V read once per KV head.
    Causal: a diagonal block counts its BLOCK * (BLOCK + 1) / 2 unmasked pairs, and a K/V block
    listed by several query tiles of a head is counted once."""
    group = shape.heads // shape.heads_k
    qo_bytes = 2 * shape.batch * shape.seqlen_q * shape.heads * shape.head_dim * 2
    if shape.causal:
        full, mask = lists
        pairs = sum(len(f) * BLOCK * BLOCK + len(d) * BLOCK * (BLOCK + 1) // 2
                    for full_b, mask_b in zip(full, mask) for full_h, mask_h in zip(full_b, mask_b)
                    for f, d in zip(full_h, mask_h))
        keys = sum(len(set().union(*full_h, *mask_h)) for full_b, mask_b in zip(full, mask)
                   for full_h, mask_h in zip(full_b, mask_b)) * BLOCK
        return 4 * pairs * group * shape.head_dim, 2 * keys * shape.head_dim * 2 + qo_bytes
    keys = sum(len(row) for per_b in lists for row in per_b) * BLOCK  # over (batch, kv head)
    flops = 4 * shape.seqlen_q * group * keys * shape.head_dim
    kv_bytes = 2 * keys * shape.head_dim * 2
    return flops, kv_bytes + qo_bytes


def flex_kv_tables(rows, shape):
    """(counts, ids) in FlexAttention's kv-block layout for lists rows[b][hk][m], one copy per query
    head of a K/V head, on the GPU."""
    tiles, n_blocks, group = len(rows[0][0]), shape.seqlen_k // BLOCK, shape.heads // shape.heads_k
    counts = torch.zeros(shape.batch, shape.heads_k, tiles, dtype=torch.int32)
    idx = torch.zeros(shape.batch, shape.heads_k, tiles, n_blocks, dtype=torch.int32)
    for b, per_b in enumerate(rows):
        for h, per_h in enumerate(per_b):
            for m, ids in enumerate(per_h):
                counts[b, h, m] = len(ids)
                idx[b, h, m, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return counts.repeat_interleave(group, dim=1).cuda(), idx.repeat_interleave(group, dim=1).cuda()


def flex_block_mask(lists, shape):
    """A FlexAttention BlockMask of the same lists. Non-causal: every query block of a sequence
    uses its (batch, K/V head) list, all as full blocks (no mask_mod work). Causal: the "full"
    blocks as full blocks, the diagonal ("mask") blocks as partial blocks under a causal mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask
    if shape.causal:
        full, mask = lists
        return BlockMask.from_kv_blocks(*flex_kv_tables(mask, shape), *flex_kv_tables(full, shape),
                                        BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                        seq_lengths=(shape.seqlen_q, shape.seqlen_k))
    q_blocks = -(-shape.seqlen_q // BLOCK)
    counts, idx = flex_kv_tables([[[row] for row in per_b] for per_b in lists], shape)
    counts, idx = counts.expand(-1, -1, q_blocks).contiguous(), idx.expand(-1, -1, q_blocks, -1).contiguous()
    return BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(idx), counts, idx,
                                    BLOCK_SIZE=(BLOCK, BLOCK), seq_lengths=(shape.seqlen_q, shape.seqlen_k))


def rotating(calls):
    """One zero-argument function that runs the next of `calls` each time: a graph captures
    several in turn, so successive replays read different blocks (different list sets), as
    calls over fresh lists would, instead of finding the last call's blocks in L2 (50 MB)."""
    turn = [0]

    def run():
        turn[0] = (turn[0] + 1) % len(calls)
        return calls[turn[0]]()
    return run


def rotating_sparse_call(q, k, v, tables, **options):
    """flash_attn_with_sparse_block_table over each of `tables` in turn (see rotating)."""
    return rotating([lambda t=t: fas.flash_attn_with_sparse_block_table(q, k, v, t, **options) for t in tables])


def timed(fn):
    """Median ms of graph replays; plain launches if fn cannot be captured."""
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median"), ""
    except Exception as error:
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median"), f"no graph: {type(error).__name__}"


def eager_and_host(fn):
    """(eager ms, host us, note), NaN for a part that failed (the note says which): ms per call of
    EAGER_CALLS back-to-back eager calls, as a caller without graphs runs them (Python and launch
    gaps included; the median of EAGER_PASSES passes), and the median host time of one call
    started on an idle GPU without waiting for it: what the call costs the CPU, which graph
    replays hide."""
    eager_ms = host_us = float("nan")
    failed = []
    try:
        for _ in range(EAGER_WARMUP):
            fn()
        eager_ms = statistics.median(eager_pass(fn) for _ in range(EAGER_PASSES))
    except Exception as error:  # the graph-replay ms stands; this column is NaN
        failed.append(f"eager timing failed: {type(error).__name__}: {str(error)[:100]}")
    try:
        host_us = host_us_after_sync(fn)
    except Exception as error:
        failed.append(f"host timing failed: {type(error).__name__}: {str(error)[:100]}")
    return eager_ms, host_us, "; ".join(failed)


def eager_pass(fn, calls: int = EAGER_CALLS) -> float:
    """ms per call of `calls` back-to-back eager calls of fn, synchronized before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / calls


def host_us_after_sync(fn, calls: int = HOST_CALLS) -> float:
    """Median host time (us) of one call of fn started on an idle GPU, not waiting for it."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def random_inputs(shape, seed=0):
    """bf16 q, k, v of the shape, from a seeded generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape.batch, shape.seqlen_q, shape.heads, shape.head_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(shape.batch, shape.seqlen_k, shape.heads_k, shape.head_dim, device="cuda", generator=g).bfloat16()
    return q, k, torch.randn_like(k)


def rotated_list_sets(shape):
    """ROTATIONS list sets of the shape; calls rotate through them (see rotating)."""
    rng = random.Random(0)
    return [(make_causal_lists if shape.causal else make_lists)(shape, rng) for _ in range(ROTATIONS)]


class SpeculativeInputs(NamedTuple):
    missed: Tensor      # table of the listed blocks outside the speculative set
    spec_table: Tensor  # the speculative set: the last 4 blocks
    k_spec: Tensor      # their K and V, gathered
    v_spec: Tensor
    union: Tensor       # missed + spec_table


def speculative_inputs(shape, k, v, listed) -> SpeculativeInputs:
    """A speculative set (the last 4 blocks) and the missed set (the other blocks of `listed`)."""
    n_blocks = shape.seqlen_k // BLOCK
    spec_blocks = list(range(n_blocks - 4, n_blocks))
    missed = torch.tensor(sorted(set(listed) - set(spec_blocks)), dtype=torch.int32, device="cuda")
    spec_table = torch.tensor(spec_blocks, dtype=torch.int32, device="cuda")
    k_spec, v_spec = k[:, spec_blocks[0] * BLOCK:].contiguous(), v[:, spec_blocks[0] * BLOCK:].contiguous()
    return SpeculativeInputs(missed, spec_table, k_spec, v_spec, torch.cat([missed, spec_table]))


def speculative_calls(shape, q, k, v, list_sets, backend="auto"):
    """{name: call} of the union pass and the two speculative forms over the same blocks (the
    first list of each list set, shared by every row), each rotating through the list sets."""
    spec = [speculative_inputs(shape, k, v, lists[0][0]) for lists in list_sets]
    gathered = lambda **options: rotating([lambda s=s: fas.flash_attn_speculative_sparse(q, s.k_spec, s.v_spec, k, v, s.missed,
                                                                                          **options) for s in spec])
    calls = {
        "union_one_pass": rotating_sparse_call(q, k, v, [s.union for s in spec], backend=backend),
        "speculative_two_pass": gathered(backend=backend),
        "speculative_zero_copy": rotating([lambda s=s: fas.flash_attn_speculative_sparse_zero_copy(q, k, v, s.spec_table,
                                                                                                     s.missed, backend=backend)
                                           for s in spec]),
    }
    if backend == "auto" and not cute.missing_runtime():
        # The gathered form on FA-4 whatever auto would choose: one launch whose mask lists read
        # k_spec / v_spec (patch flash-attn-4/0006); at prefill the two-pass FA-4 form.
        calls["speculative_two_pass fa4"] = gathered(backend="fa4")
    return calls


def one_length(shape, lists) -> bool:
    """Whether non-causal lists give every (batch, K/V head) one list of the same length: those
    have a dense equivalent, attention over a K/V of exactly the listed keys (listed_kv)."""
    return not shape.causal and len({len(row) for per_b in lists for row in per_b}) == 1


def listed_kv(k, v, lists):
    """K and V holding exactly the listed keys of lists[b][hk] (ids of BLOCK-key blocks, one
    length n), in list order: (B, n * BLOCK, Hk, D) each, contiguous, gathered once at setup."""
    ids = torch.tensor(lists, dtype=torch.int64, device=k.device)  # (B, Hk, n)
    keys = (ids[..., None] * BLOCK + torch.arange(BLOCK, device=k.device)).flatten(2)  # (B, Hk, n * BLOCK)
    index = keys.transpose(1, 2)[..., None].expand(-1, -1, -1, k.shape[-1])  # (B, n * BLOCK, Hk, D)
    return torch.gather(k, 1, index).contiguous(), torch.gather(v, 1, index).contiguous()


def keys_per_tile(lists) -> float:
    """Keys a query tile's causal lists (full, mask) name, on average over (batch, K/V head, tile)."""
    full, mask = lists
    lengths = [len(f) + len(d) for full_b, mask_b in zip(full, mask) for full_h, mask_h in zip(full_b, mask_b)
               for f, d in zip(full_h, mask_h)]
    return BLOCK * sum(lengths) / len(lengths)


def fa3_dense_128(q, seqlen_q):
    """forward(k, v): dense FA-3 over k, v in the sparse path's 128 x 128 tile steps (see the
    fa3_dense_listed_128 method), or why it cannot run."""
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except Exception as error:  # no flash_attn_3 wheel, or one that does not load here
        return f"flash_attn_interface is not importable: {type(error).__name__}: {error}"
    if seqlen_q <= BLOCK:
        return lambda k, v: flash_attn_with_kvcache(q, k, v, causal=True, num_splits=0)
    if seqlen_q % BLOCK:
        return f"{seqlen_q} query rows are neither one tile nor whole 128-row tiles"
    batch, _, heads, dim = q.shape
    tiles = seqlen_q // BLOCK
    q_tiles = q.reshape(batch * tiles, BLOCK, heads, dim)
    kv_batch = torch.arange(batch, dtype=torch.int32, device=q.device).repeat_interleave(tiles)
    return lambda k, v: flash_attn_with_kvcache(q_tiles, k, v, cache_batch_idx=kv_batch, causal=True, num_splits=0)


def fa3_dense_forward():
    """(forward, None): upstream FA-3's dense flash_attn_interface.flash_attn_func (the flash_attn_3
    wheel) returning out only, as its versions return out or (out, lse); or (None, why not)."""
    try:
        from flash_attn_interface import flash_attn_func
    except Exception as error:  # no flash_attn_3 wheel, or one that does not load here
        return None, f"flash_attn_interface (the flash_attn_3 wheel) is not importable: {type(error).__name__}: {error}"

    def forward(q, k, v, **options):
        # num_splits=0: FA-3's own split heuristic (its Python default, 1, never splits a decode call)
        out = flash_attn_func(q, k, v, num_splits=0, **options)
        return out[0] if isinstance(out, tuple) else out
    return forward, None


def pristine_block_sparse_tensors(blocks, shape):
    """flash-attn-4's own BlockSparseTensorsTorch of these lists (SparseBlocks of to_blocks) in the
    form the unpatched release takes: a list per query head (each K/V head's repeated over its
    group; the release packs no per-K/V-head lists), per 128-row m-block, ids padded to the K/V's
    block count, and mask lists always given: zero counts for non-causal lists (all "full"),
    the diagonal block for causal ones (make_causal_lists)."""
    BlockSparseTensorsTorch = cute.import_cute("block_sparsity").BlockSparseTensorsTorch
    group, m_blocks, n_blocks = shape.heads // shape.heads_k, -(-shape.seqlen_q // BLOCK), shape.seqlen_k // BLOCK

    def laid_out(cnt, idx):
        idx = F.pad(idx, (0, n_blocks - idx.shape[-1]))
        cnt, idx = cnt.expand(-1, -1, m_blocks), idx.expand(-1, -1, m_blocks, -1)  # one non-causal list: every m-block
        return cnt.repeat_interleave(group, dim=1).contiguous(), idx.repeat_interleave(group, dim=1).contiguous()

    full_cnt, full_idx = laid_out(blocks.full_cnt, blocks.full_idx)
    if blocks.mask_cnt is None:
        mask_cnt, mask_idx = torch.zeros_like(full_cnt), torch.zeros_like(full_idx)
    else:
        mask_cnt, mask_idx = laid_out(blocks.mask_cnt, blocks.mask_idx)
    return BlockSparseTensorsTorch(mask_block_cnt=mask_cnt, mask_block_idx=mask_idx, full_block_cnt=full_cnt,
                                   full_block_idx=full_idx, block_size=(BLOCK, BLOCK))


def bench_shape(shape, roofline, rows, methods, pristine=False):
    """Rows of `methods` at this shape; pristine: flash-attn-4 is the unpatched release, so only
    fa4_pristine_blocksparse runs (nothing that needs this project's patched kernels)."""
    copy_tbps, matmul_tflops = roofline
    q, k, v = random_inputs(shape)
    list_sets = rotated_list_sets(shape)
    flops, nbytes = counted_work(shape, list_sets[0])
    roof_ms = max(flops / (matmul_tflops * 1e12), nbytes / (copy_tbps * 1e12)) * 1e3
    print(f"  counted: {flops / 1e9:.2f} GFLOP of listed (query, key) pairs, {nbytes / 1e6:.1f} MB (listed K/V once "
          f"per KV head, Q and O); roofline {roof_ms * 1e3:.1f} us", flush=True)

    def add(method, fn, note=""):
        try:
            fn()
            ms, how = timed(fn)
        except Exception as error:  # a peer that cannot run this shape is reported, not fatal
            print(f"  {method}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return
        eager_ms, host_us, eager_how = eager_and_host(fn)  # NaN, not a lost row, where they fail
        note = "; ".join(n for n in (note, how, eager_how) if n)
        rows.append(Row(shape=shape.name, density=shape.density, method=method, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
                        tbps=nbytes / (ms * 1e-3) / 1e12, roofline_fraction=roof_ms / ms, note=note, eager_ms=eager_ms,
                        host_us=host_us))
        print(f"  {method:>24}: {ms:8.4f} ms  eager {eager_ms:8.4f} ms  host {host_us:7.1f} us  {rows[-1].tflops:7.1f} TFLOP/s  "
              f"{rows[-1].tbps:6.3f} TB/s  {100 * rows[-1].roofline_fraction:5.1f}% of roofline {note}", flush=True)

    def built(method, make):
        """make()'s value, or None with the failure printed: setup outside the timing, guarded as add is."""
        try:
            return make()
        except Exception as error:
            print(f"  {method}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
            return None

    blocks = [to_blocks(lists, shape) for lists in list_sets]

    if pristine:
        # flash-attn-4 as released: its own block-sparse call on the same lists in its own form
        # (pristine_block_sparse_tensors), at its default split count; nothing of this project's kernels.
        setup = built("fa4_pristine_blocksparse", lambda: (cute.import_cute("interface"),
                                                           [pristine_block_sparse_tensors(b, shape) for b in blocks]))
        if setup is not None:
            fa4_interface, tensors = setup
            note = "flash-attn-4 unpatched: its block-sparse call, lists per query head and 128-row m-block"
            if cute.unpatched_reason() is None:
                note += "; WARNING: the installed flash-attn-4 carries this series' patches"
            add("fa4_pristine_blocksparse", rotating([lambda t=t: fa4_interface.flash_attn_func(
                q, k, v, causal=shape.causal, block_sparse_tensors=t, return_lse=True) for t in tensors]), note)
        return

    fa3_missing = fa3_ops.missing_build()

    def fa3_refusal():
        """Why backend="fa3" cannot run this shape's lists (the build, or the router's SparseInputError), or None."""
        if fa3_missing:
            return fa3_missing
        try:
            fas.choose_backend(q, k, v, blocks[0], causal=shape.causal, backend="fa3")
        except fas.SparseInputError as error:
            return str(error)
        return None

    def ours(backend, num_splits=0):
        return rotating_sparse_call(q, k, v, blocks, causal=shape.causal, backend=backend, num_splits=num_splits)

    if "copy" in methods and shape.seqlen_q <= 16:
        # The ceiling of one memory-bound kernel at this size: a device copy moving the counted
        # bytes (half read, half written), in graphs like the rest, sources rotating past L2.
        sources = [torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(ROTATIONS)]
        target = torch.empty_like(sources[0])
        add("copy_same_bytes", rotating([lambda s=s: target.copy_(s) for s in sources]), "device copy of the counted bytes")
        del sources, target
    if "read_listed" in methods and shape.seqlen_q <= 16:
        # The ceiling of reading exactly the listed blocks' scattered pieces: Triton programs
        # that only load them and sum (listed_reader.py), each checked once against torch; one
        # block per program, then 2 or 4 in turn, as a split of the sparse kernel walks its
        # share (2 tiles at B1 1/16, 4 at B8 1/16 with the default split count).
        from listed_reader import block_ids, read_listed_blocks, read_listed_blocks_reference
        ids = [block_ids(lists) for lists in list_sets]
        entries = ids[0].shape[-1]
        reference = read_listed_blocks_reference(k, v, ids[0], BLOCK)
        for walk, name, note in ((1, "read_listed_blocks", "Triton: the listed K/V blocks read, nothing else"),
                                 (2, "read_listed_walk2", "Triton: a program reads 2 listed blocks in turn, as a split does"),
                                 (4, "read_listed_walk4", "Triton: a program reads 4 listed blocks in turn, as a split does")):
            if walk > 1 and (entries % walk or entries == walk):
                continue
            torch.testing.assert_close(read_listed_blocks(k, v, ids[0], BLOCK, walk).double(), reference, rtol=1e-4, atol=1e-2)
            add(name, rotating([lambda i=i, w=walk: read_listed_blocks(k, v, i, BLOCK, w) for i in ids]), note)
    if "fa2_sparse" in methods:
        add("fa2_sparse", ours("fa2"))
    if "fa3_sparse" in methods:
        if reason := fa3_refusal():
            print(f"  fa3_sparse: skipped: {reason}", flush=True)
        else:
            add("fa3_sparse", ours("fa3"), "API, backend=fa3")
            if "split_sweep" in methods and shape.seqlen_q <= 16:  # against the op's own choice (num_splits=0)
                for splits in (1, 2, 3, 4, 8, 16):
                    add(f"fa3_sparse splits={splits}", ours("fa3", splits))
    if "split_sweep" in methods and shape.seqlen_q <= 16:
        for splits in (2, 4, 8, 16, 32):  # what the split heuristic leaves on the table
            add(f"fa2_sparse splits={splits}", ours("fa2", splits))
    fa4_missing = cute.missing_runtime()
    if "fa4_sparse" in methods and not fa4_missing:
        add("fa4_sparse", ours("fa4"), "API, backend=fa4")
    if "split_sweep" in methods and shape.seqlen_q <= 16 and not fa4_missing:
        for splits in (1, 2, 4, 8, 16, 32, 64):  # 32, 64: one or two blocks per split at B1 1/16
            add(f"fa4_sparse splits={splits}", ours("fa4", splits))
    if "auto" in methods:
        add("auto", ours("auto"), f"chose {fas.choose_backend(q, k, v, blocks[0], causal=shape.causal)[0]}")
    if "plan_run" in methods:
        # Plan once, run many: a SparsePlan per list set made outside the timing; run() is timed,
        # for host_us beside the API call's (auto, fa2_sparse, fa3_sparse rows).
        for backend in ("auto", "fa2", "fa3"):
            method = f"plan_run {backend}"
            if backend == "fa3" and (reason := fa3_refusal()):
                print(f"  {method}: skipped: {reason}", flush=True)
                continue
            plans = built(method, lambda backend=backend: [fas.plan(q, k, v, b, causal=shape.causal, backend=backend)
                                                           for b in blocks])
            if plans is None:
                continue
            add(method, rotating([lambda p=p: p.run(q, k, v) for p in plans]),
                f"SparsePlan.run, planned {plans[0].backend} ({plans[0].why})")
    if "fa4_direct" in methods and not fa4_missing:
        # flash-attn-4's kernel called directly on lists already in its form, at the API's split
        # count: the floor of the fa4 backend, whose API call adds its Python (the batched lists
        # pass as views since patch flash-attn-4/0004; varlen ones are re-laid). Where the API
        # takes the 64-row tile (fa4.small_tile), the 128-row tile runs too, for the same-run ratio.
        fa4_interface = cute.import_cute("interface")
        splits = fas.choose_num_splits_for(q, k, v, blocks[0], backend="fa4")
        small = fa4.small_tile(q, k, blocks[0], max_seqlen_q=shape.seqlen_q)
        for name, tile in (("fa4_direct", fa4.SMALL_TILE_ROWS if small else None),) + \
                ((("fa4_direct tile128", None),) if small else ()):
            tensors = [cute.block_sparse_tensors(b, batch=shape.batch, max_seqlen_q=shape.seqlen_q,
                                                    max_seqlen_k=shape.seqlen_k, q_block_size=tile) for b in blocks]
            add(name, rotating([lambda t=t: fa4_interface.flash_attn_func(q, k, v, causal=shape.causal, block_sparse_tensors=t,
                                                                 return_lse=True, num_splits=splits) for t in tensors]),
                f"CuTe-DSL kernel, lists in its form, {tile or '128'}-row tiles, {splits} splits")
    if "speculative" in methods and shape.density < 1 and not shape.causal:
        # The same union of blocks as a speculative set (the last 4 blocks, "mask" blocks) plus
        # the missed set, one pass (zero-copy form) and two passes + combine (gathered form).
        for name, call in speculative_calls(shape, q, k, v, list_sets).items():
            add(name, call, "shared list")
    if "speculative_fa3" in methods and shape.density < 1 and not shape.causal:
        for name, call in speculative_calls(shape, q, k, v, list_sets, backend="fa3").items():
            add(f"{name} fa3", call, "shared list, backend fa3")
    if shape.density == 1.0 and "fa2_dense" in methods:
        from flash_attn import flash_attn_func
        add("fa2_dense", lambda: flash_attn_func(q, k, v, causal=shape.causal))
    if shape.density == 1.0 and "sdpa" in methods:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend, name in ((SDPBackend.FLASH_ATTENTION, "sdpa_flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn")):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=shape.causal and shape.seqlen_q > 1, enable_gqa=True)
            add(name, run)
    # Dense attention over exactly the listed keys: K/V gathered per list set at setup (listed_kv).
    listed = None
    if {"fa3_dense_listed", "fa3_dense_listed_128", "fa2_dense_listed", "cudnn_listed"} & methods and not shape.causal:
        if all(one_length(shape, lists) for lists in list_sets):
            listed = built("listed K/V", lambda: [listed_kv(k, v, lists) for lists in list_sets])
        else:
            print("  *_listed: skipped: lists of several lengths have no one dense K/V", flush=True)
    # Causal per-tile lists have no one dense equivalent: their peers read as many keys as a tile's lists.
    causal_keys = [round(keys_per_tile(lists)) for lists in list_sets] if shape.causal else None
    if "fa3_dense_listed" in methods:
        fa3_dense, why_not = fa3_dense_forward()
        if fa3_dense is None:
            print(f"  fa3_dense_listed: skipped: {why_not}", flush=True)
        elif shape.causal:
            add("fa3_dense_listed", rotating([lambda n=n: fa3_dense(q, k[:, :n], v[:, :n], causal=False)
                                              for n in causal_keys]),
                f"dense FA-3 over as many keys as a tile's lists, non-causal ({causal_keys[0]} keys, k[:, :n])")
        elif listed:
            add("fa3_dense_listed", rotating([lambda kl=kl, vl=vl: fa3_dense(q, kl, vl, causal=False) for kl, vl in listed]),
                "dense FA-3 over K/V gathered to the listed keys")
    if "fa3_dense_listed_128" in methods and shape.causal:
        # fa3_dense_listed's keys in the sparse path's 128-key steps: the tile-size share of the
        # causal gap. (A private copy of each tile's own listed keys would make the peer read
        # several GB that the sparse call's tiles share through L2, so it would not be a peer.)
        dense_128 = fa3_dense_128(q, shape.seqlen_q)
        if isinstance(dense_128, str):
            print(f"  fa3_dense_listed_128: skipped: {dense_128}", flush=True)
        else:
            add("fa3_dense_listed_128", rotating([lambda n=n: dense_128(k[:, :n], v[:, :n]) for n in causal_keys]),
                f"dense FA-3 over as many keys as a tile's lists ({causal_keys[0]}), in 128-key tile steps")
    if "fa3_dense_listed_128" in methods and listed:
        # FA-3 tiles non-causal hdim-128 keys by 176 and causal ones by 128 (tile_size.h), the
        # sparse path by its 128-key blocks. A causal call over the listed keys runs the same
        # 128 x 128 tile steps (the bottom-right mask hides part of the last block, whose MMAs
        # still run): directly when the query rows fit one tile (Sq <= 128), else with each
        # 128-row query tile a batch entry that reads its batch's K/V through cache_batch_idx.
        dense_128 = fa3_dense_128(q, shape.seqlen_q)
        if isinstance(dense_128, str):
            print(f"  fa3_dense_listed_128: skipped: {dense_128}", flush=True)
        else:
            add("fa3_dense_listed_128", rotating([lambda kl=kl, vl=vl: dense_128(kl, vl) for kl, vl in listed]),
                "dense FA-3 over K/V gathered to the listed keys in 128-key tiles (causal: the same tile steps)")
    if "fa2_dense_listed" in methods and listed:
        try:
            from flash_attn import flash_attn_func as fa2_dense
        except ImportError as error:
            print(f"  fa2_dense_listed: skipped: {error}", flush=True)
        else:
            add("fa2_dense_listed", rotating([lambda kl=kl, vl=vl: fa2_dense(q, kl, vl, causal=False) for kl, vl in listed]),
                "dense FA-2 over K/V gathered to the listed keys")
    if "cudnn_listed" in methods and listed:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qt = q.transpose(1, 2)
        listed_t = [(kl.transpose(1, 2), vl.transpose(1, 2)) for kl, vl in listed]

        def cudnn(kt, vt):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        add("cudnn_listed", rotating([lambda kt=kt, vt=vt: cudnn(kt, vt) for kt, vt in listed_t]),
            "torch SDPA cuDNN over K/V gathered to the listed keys")
        del listed_t
    del listed
    if "flex" in methods:
        from torch.nn.attention.flex_attention import flex_attention
        flex = torch.compile(flex_attention)
        masks = [flex_block_mask(lists, shape) for lists in list_sets]
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        add("flex_attention", rotating([lambda m=m: flex(qt, kt, vt, block_mask=m, enable_gqa=True) for m in masks]))


DECODE = [Shape(f"decode B8 Sq{sq} H32/8 Sk32k", 8, sq, 32768, 32, 8, d) for sq in (16, 1) for d in (1.0, 1 / 4, 1 / 16)] + \
         [Shape("decode B1 Sq1 H32/8 Sk128k", 1, 1, 131072, 32, 8, d) for d in (1.0, 1 / 4, 1 / 16)]
# Non-causal: one list per (batch, K/V head) for every query row; causal: per query tile, the
# diagonal block as a "mask" block and earlier blocks at the density (make_causal_lists).
PREFILL = [Shape("prefill B1 S16k H32 full", 1, 16384, 16384, 32, 32, d) for d in (1.0, 1 / 4, 1 / 16)] + \
          [Shape("prefill B1 S16k H32 causal", 1, 16384, 16384, 32, 32, d, causal=True) for d in (1.0, 1 / 4, 1 / 16)]
# How fa2, fa3 and fa4 trade places as query rows grow: the data behind auto's FA3_MIN_QUERY_ROWS
# and FA3_MIN_PACKED_ROWS (routing.py), decode rows first.
CROSSOVER = [Shape(f"crossover decode B{b} Sq{sq} H32/8 Sk32k", b, sq, 32768, 32, 8, 1 / 16,
                   only=("fa2_sparse", "fa3_sparse", "fa4_sparse", "auto"))
             for b in (1, 8) for sq in (1, 4, 8, 16, 32)] + \
            [Shape(f"crossover B1 Sq{sq} H32/8 Sk16k", 1, sq, 16384, 32, 8, d,
                   only=("fa2_sparse", "fa3_sparse", "fa4_sparse", "auto"))
             for sq in (64, 128, 256, 512, 1024, 2048, 4096) for d in (1 / 4, 1 / 16)] + \
            [Shape(f"crossover causal B1 S{s // 1024}k H32/8", 1, s, s, 32, 8, d, causal=True,
                   only=("fa2_sparse", "fa3_sparse", "fa4_sparse", "auto"))
             for s in (4096, 16384) for d in (1 / 4, 1 / 16)]


def select_shapes(spec: Optional[str]) -> list:
    """The shapes `--shapes` names (None: all): a comma-separated part matches a shape's name or
    "name density", e.g. "full 0.25" or "causal 0.25"; crossover rows only for a part that says
    "crossover" (so "Sk32k 0.0625" means the DECODE rows, not the crossover's decode rows)."""
    shapes = DECODE + PREFILL + CROSSOVER
    if not spec:
        return shapes
    parts = [part.strip() for part in spec.split(",")]
    return [shape for shape in shapes if any(part in f"{shape.name} {shape.density:.4g}"
                                             and ("crossover" in part or shape not in CROSSOVER) for part in parts)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated substrings of 'shape-name density' to run (default: all)")
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--pristine-fa4", action="store_true",
                        help="flash-attn-4 here is the unpatched release: run only fa4_pristine_blocksparse")
    parser.add_argument("--out", type=Path, help="folder for <date>-<gpu>-<commit>.json, .md and .png")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"{time.strftime('%Y-%m-%d')}-{torch.cuda.get_device_name().split()[-1].lower()}-{source_commit()}"
        args.json, args.markdown = args.out / f"{stem}.json", args.out / f"{stem}.md"
    methods = {"fa4_pristine_blocksparse"} if args.pristine_fa4 else set(args.methods.split(","))
    shapes = select_shapes(args.shapes)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    print(f"FA-4 backend: {cute.missing_runtime() or 'available'}", flush=True)
    if args.pristine_fa4:
        print(f"--pristine-fa4: only fa4_pristine_blocksparse, flash-attn-4 {installed_version('flash-attn-4')}", flush=True)
    else:
        print(f"FA-3 backend: {fa3_ops.missing_build() or 'available'}", flush=True)
    roofline = measure_roofline()
    print(f"roofline: copy {roofline[0]:.2f} TB/s, bf16 matmul {roofline[1]:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in shapes:
        print(f"{shape.name}, density {shape.density:.4g}", flush=True)
        chosen = methods & set(shape.only) if shape.only and not args.pristine_fa4 else methods
        bench_shape(shape, roofline, rows, chosen, pristine=args.pristine_fa4)
        write_results(args, roofline, rows)  # after every shape, so a cut-short run keeps its rows
    print(markdown_table(rows))


def source_commit() -> str:
    """The commit benchmarked (the GPU runner's reading of this checkout)."""
    from forktools.gpu import source_commit as commit_of
    return commit_of(Path(__file__).resolve().parent.parent)


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or why it is not known."""
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "(version unknown: no installed distribution of that name)"


def markdown_table(rows):
    table = ["| shape | density | method | ms | eager ms | host us | TFLOP/s | TB/s | % roofline | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r.shape} | {r.density:.4g} | {r.method} | {r.ms:.4f} | {r.eager_ms:.4f} | {r.host_us:.1f} | {r.tflops:.1f} | "
              f"{r.tbps:.3f} | {100 * r.roofline_fraction:.1f} | {r.note} |" for r in rows]
    return "\n".join(table) + "\n"


def write_results(args, roofline, rows):
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "copy_tbps": roofline[0], "matmul_tflops": roofline[1], "rows": [asdict(r) for r in rows]}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown_table(rows))
    if args.json and rows:
        try:
            from plot_results import plot
            plot(args.json)
        except ImportError:  # matplotlib is optional
            pass


if __name__ == "__main__":
    main()
