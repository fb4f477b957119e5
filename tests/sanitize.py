"""compute-sanitizer over every sparse kernel: `python tests/sanitize.py` (nox -s sanitize).
`python tests/sanitize.py --fuzz-subset [N]` runs the tools over the fuzzer's adversarial
subset instead (tests/fuzz/run.py --sanitizer-subset: N configurations, default 60 (the GPU runner passes 30), every backend,
at most 6 FA-4 kernel classes), printing per tool the case count, its error count and the
fuzzer's own failure count.

Runs memcheck, racecheck, initcheck and synccheck, each over this file's --cases: adversarial valid calls
(lists that are empty, one block, the tail block only, every block, as long as the row) of the
non-split, split, GQA-packed, paged, varlen, decode-tile, key-split-tile, one-launch speculative
and partials + combine paths, and FA-3's sparse kernel (fa3_cases; its e4m3 kernels where the
build has them), small enough for the tools.
Where FA-3 is built, racecheck and synccheck (MANY_TILE_TOOLS) then run over FA-3 calls of more
tiles than SMs with list lengths skewed across tiles (--only fa3-many-tiles: many_tile_cases;
synccheck, which ends a launch at its first report, one process per call: --case-index),
where each persistent CTA hands its barriers and K/V pipeline from tile to tile; and every tool
over upstream FA-3's dense calls of the same shapes alone (--upstream-fa3-cases, with --only
fa3-many-tiles the many-tile ones), run first, to tell upstream's (or the tool's) reports from
this series': synccheck's barrier errors at a site where upstream's calls get the same report
(CUTLASS's mbarrier arrives of upstream's pipelines) are counted apart, not failures.
Prints one summary line per tool, the kinds of report and where (function, file:line, the Python
line that launched it; most frequent first), and exits non-zero if any tool reports an error
other than the CUDA runtime's benign cuGetProcAddress probes in this series' cases; --raw DIR
keeps each tool's whole output there.

Racecheck reports upstream FA-3's hand-off of the next tile index between its producer warp and
consumer warpgroups (tile_scheduler.hpp), ordered by named barriers (bar.sync / bar.arrive).
Before the tools run, tests/sanitizer_probes/named_barrier_handoff.cu (that protocol reduced to
one shared int, and a racy control without the barriers) is built and run under racecheck: only
when the tool reports the ordered probe (and the racy control) are races whose every site is that
hand-off set apart as the tool's, counted and printed, not failures.
"""

import collections
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.metadata import pack_varlen_lists
from helpers import skewed_rows


def cases(only=None, index=None):
    """Every case, or with only="fa3" FA-3's (fa3_cases), or with only=MANY_TILES the many-tile ones
    (with index, the one many-tile call at that place of many_tile_plan)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, device="cuda").bfloat16()
    if only in ("fa3", MANY_TILES):
        fa3_cases(randn) if only == "fa3" else many_tile_cases(randn, index)
        torch.cuda.synchronize()
        return
    batch, seqlen_q, seqlen_k, heads, heads_k, dim, block = 2, 16, 1000, 4, 2, 128, 64
    q, k, v = randn(batch, seqlen_q, heads, dim), randn(batch, seqlen_k, heads_k, dim), randn(batch, seqlen_k, heads_k, dim)
    n_blocks = -(-seqlen_k // block)
    tables = {"empty": [], "one": [3], "tail only": [n_blocks - 1], "every": list(range(n_blocks))[::-1]}
    for name, blocks in tables.items():
        table = torch.tensor(blocks, dtype=torch.int32, device="cuda")
        for num_splits in (1, 3):
            fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=block, num_splits=num_splits)
        print(f"batched {name}: ok", flush=True)
    # Per-(batch, head) lists at full row length, long queries (no packing), causal mask blocks.
    q_long = randn(batch, 200, heads, dim)
    full = [[[list(range(0, 6)), list(range(2, 9))] for _ in range(heads_k)] for _ in range(batch)]
    mask = [[[[14, 15], [15]] for _ in range(heads_k)] for _ in range(batch)]
    blocks = SparseBlocks.from_lists(full, mask, block_size=block, q_block_size=128, device="cuda")
    for num_splits in (1, 2):
        fas.flash_attn_with_sparse_block_table(q_long, k, v, blocks, causal=True, num_splits=num_splits)
    print("per-tile causal: ok", flush=True)
    # Varlen with an empty sequence.
    # Sequences (q, k): (5, 300), (0, 100), (130, 700).
    cu_q = torch.tensor([0, 5, 5, 135], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 400, 1100], dtype=torch.int32, device="cuda")
    lists = [[[[0, 4]] for _ in range(heads_k)], [[] for _ in range(heads_k)], [[[1, 10], [10]] for _ in range(heads_k)]]
    vblocks = pack_varlen_lists(lists, None, block, 128, device="cuda")
    qv, kv, vv = randn(135, heads, dim), randn(1100, heads_k, dim), randn(1100, heads_k, dim)
    for num_splits in (1, 2):
        fas.flash_attn_varlen_with_sparse_blocks(qv, kv, vv, vblocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=130,
                                                 max_seqlen_k=700, num_splits=num_splits)
    print("varlen: ok", flush=True)
    # Paged K/V: permuted pages smaller and larger than the block, seqused_k short of the table
    # (the unused entries name no page), causal mask blocks, split and not.
    for page in (16, 128):
        n_cols = -(-seqlen_k // page)
        perm = torch.randperm(batch * n_cols + 3, generator=torch.Generator().manual_seed(page)).cuda()
        page_table = perm[:batch * n_cols].view(batch, n_cols).to(torch.int32).contiguous()
        seqused_k = torch.tensor([seqlen_k, seqlen_k - page - 5], dtype=torch.int32, device="cuda")
        page_table[1, -1] = -1
        k_cache = randn(perm.numel(), page, heads_k, dim)
        v_cache = randn(perm.numel(), page, heads_k, dim)
        for num_splits in (1, 3):
            fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, blocks, causal=True, num_splits=num_splits,
                                                   seqused_k=seqused_k, page_table=page_table)
            fas.flash_attn_with_sparse_block_table(q_long, k_cache, v_cache, blocks, causal=True, num_splits=num_splits,
                                                   seqused_k=seqused_k, page_table=page_table)
    # A bad page table (ids past the cache, without validate="full") must not read out of bounds.
    bad_table = page_table.clone()
    bad_table[0, 0], bad_table[1, 2] = k_cache.shape[0] + 5, 2 ** 31 - 1
    fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, blocks, causal=True, seqused_k=seqused_k, page_table=bad_table)
    print("paged: ok", flush=True)
    # Decode over long lists: the one-warp 16-row tile (1 query x 4 heads per K/V head, 2^20+
    # listed keys in all), every block in reverse with the partial tail block, split and not.
    q1, k1, v1 = randn(4, 1, 32, dim), randn(4, 33000, 8, dim), randn(4, 33000, 8, dim)
    every = torch.arange(-(-33000 // 128) - 1, -1, -1, dtype=torch.int32, device="cuda")
    for num_splits in (0, 1, 3):
        fas.flash_attn_with_sparse_block_table(q1, k1, v1, every, num_splits=num_splits)
    print("decode tile: ok", flush=True)
    # Decode over short lists: the 16-row tile whose four warps split the keys and merge in shared
    # memory (permuted, with the partial tail block 257), split and not; 3 and 4 splits merge in a
    # thread-block cluster on sm_90 (at 4, one split has no tile); then the one-launch
    # speculative call at one query row, whose causal mask blocks also run in that tile.
    short = torch.tensor([257, 3, 100, 256, 40], dtype=torch.int32, device="cuda")
    k_spec1, v_spec1 = randn(4, 300, 8, dim), randn(4, 300, 8, dim)
    for num_splits in (0, 1, 3, 4):
        fas.flash_attn_with_sparse_block_table(q1, k1, v1, short, num_splits=num_splits)
        fas.flash_attn_speculative_sparse(q1, k_spec1, v_spec1, k1, v1, short[1:], block_size=128, num_splits=num_splits)
    print("key-split tile: ok", flush=True)
    # Speculative in one launch: the mask blocks read k_spec / v_spec (a separate allocation,
    # 300 keys: a partial last block) through the address shift; an empty missed set too.
    k_spec, v_spec = randn(batch, 300, heads_k, dim), randn(batch, 300, heads_k, dim)
    for missed in ([5, 0, 9], []):
        for num_splits in (1, 3):
            fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, torch.tensor(missed, dtype=torch.int32, device="cuda"),
                                              block_size=128, num_splits=num_splits)
    print("speculative one launch: ok", flush=True)
    groups = [torch.tensor(t, dtype=torch.int32, device="cuda") for t in ([1, 2], [], [7])]
    parts = fas.flash_attn_sparse_partials(q, k, v, groups, block_size=block)
    fas.flash_attn_combine(*parts)
    # Many rows (4 x 32 x 16): the combine kernel's one-warp-per-row form; 40 splits: several rounds.
    lse_many = torch.randn(40, 4, 32, 16, generator=g, device="cuda")
    lse_many[3] = float("-inf")
    fas.flash_attn_combine(torch.randn(40, 4, 32, 16, dim, generator=g, device="cuda"), lse_many)
    print("partials + combine: ok", flush=True)
    fa3_cases(randn)
    torch.cuda.synchronize()


def fa3_inputs(randn):
    """The FA-3 cases' tensors, for the sparse calls and upstream's dense ones alike: batched
    (q, k, v) with 4 query heads per K/V head, and varlen (q, k, v, cu_seqlens_q, cu_seqlens_k)
    of three sequences, the second with no query row (max_seqlen_q 130, max_seqlen_k 700)."""
    batched = randn(2, 16, 8, 128), randn(2, 1000, 2, 128), randn(2, 1000, 2, 128)
    cu_q = torch.tensor([0, 5, 5, 135], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 400, 1100], dtype=torch.int32, device="cuda")
    varlen = randn(135, 8, 128), randn(1100, 2, 128), randn(1100, 2, 128), cu_q, cu_k
    return batched, varlen


def fa3_cases(randn):
    """FA-3's sparse SM90 kernel (backend="fa3"), where this build has it: not split and split,
    per-K/V-head lists (PackGQA), varlen with an empty sequence, ids past the end or negative and
    counts over the capacity (skipped / clamped, unvalidated)."""
    from flash_attn_sparse.backends import fa3_ops
    if fa3_ops.missing_build() is not None:
        print(f"fa3: not in this build ({fa3_ops.missing_build()})", flush=True)
        return
    (q, k, v), (qv, kv, vv, cu_q, cu_k) = fa3_inputs(randn)
    good = torch.tensor([7, 3, 0], dtype=torch.int32, device="cuda")
    bad = torch.tensor([7, 3, 40, -2, 2 ** 30, 0], dtype=torch.int32, device="cuda")
    full = [[[[7, 0, 3]], [[5, 1]]] for _ in range(2)]
    per_head = SparseBlocks.from_lists(full, block_size=128, device="cuda")
    over = SparseBlocks(torch.full_like(per_head.full_cnt, 1000), per_head.full_idx, block_size=128)
    for num_splits in (1, 3):
        for lists in (good, bad, per_head, over):
            fas.flash_attn_with_sparse_block_table(q, k, v, lists, block_size=128, num_splits=num_splits, backend="fa3")
    lists = [[[[0, 2]] for _ in range(2)], [[] for _ in range(2)], [[[1, 5], [5]] for _ in range(2)]]
    vblocks = pack_varlen_lists(lists, None, 128, 128, device="cuda")
    for num_splits in (1, 2):
        fas.flash_attn_varlen_with_sparse_blocks(qv, kv, vv, vblocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=130,
                                                 max_seqlen_k=700, num_splits=num_splits, backend="fa3")
    fa3_paged_cases(randn, q, per_head, vblocks, cu_q)
    fa3_fp8_cases(q, k, v, (good, bad, per_head), qv, kv, vv, vblocks, cu_q, cu_k)
    print("fa3: ok", flush=True)


def fa3_fp8_cases(q, k, v, lists, qv, kv, vv, vblocks, cu_q, cu_k):
    """FA-3's e4m3 sparse kernels, where this build has them: the batched lists (bad ids too) with
    q in e4m3 and in bf16 (quantized by the package: its Triton kernel runs under the tools too),
    descales per (batch, K/V head), split and not; varlen with an empty sequence."""
    from flash_attn_sparse.backends import fa3_ops
    if "FP8" in fa3_ops.disabled():
        print("fa3 fp8: not in this build (FLASH_ATTENTION_DISABLE_FP8)", flush=True)
        return
    e4m3 = torch.float8_e4m3fn
    descales = dict(k_descale=torch.full((2, 2), 0.5, device="cuda"), v_descale=torch.full((2, 2), 0.25, device="cuda"))
    k8, v8 = (k * 2).to(e4m3), (v * 4).to(e4m3)
    for query in (dict(q=q.to(e4m3), q_descale=1.0), dict(q=q)):
        for blocks in lists:
            for num_splits in (1, 3):
                fas.flash_attn_with_sparse_block_table(k=k8, v=v8, sparse_block_table=blocks, num_splits=num_splits, backend="fa3",
                                                       **query, **descales)
    for num_splits in (1, 2):
        fas.flash_attn_varlen_with_sparse_blocks(qv, kv.to(e4m3), vv.to(e4m3), vblocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                 max_seqlen_q=130, max_seqlen_k=700, num_splits=num_splits, backend="fa3",
                                                 k_descale=1.0, v_descale=1.0)
    print("fa3 fp8: ok", flush=True)


def fa3_paged_cases(randn, q, blocks, vblocks, cu_q):
    """FA-3 over paged K/V (pages of 128 and 256 keys by TMA, and 16 and 64 by cp.async where the
    build has those kernels; permuted), seqused_k short of the table
    (its tail ids garbage) and longer than it (cut to the table), a bad page id in the used range
    (past the cache, negative, INT_MAX; unvalidated), and a varlen paged call with seqused_k."""
    from flash_attn_sparse.backends import fa3_ops
    for page in (128, 256) if "PAGEDKV" in fa3_ops.disabled() else (128, 256, 16, 64):
        n_cols = -(-1000 // page)
        perm = torch.randperm(2 * n_cols + 3, generator=torch.Generator().manual_seed(page)).cuda()
        page_table = perm[:2 * n_cols].view(2, n_cols).to(torch.int32).contiguous()
        page_table[1, -1] = -1
        k_cache, v_cache = randn(perm.numel(), page, 2, 128), randn(perm.numel(), page, 2, 128)
        bad = page_table.clone()
        bad[0, 0], bad[0, 1], bad[1, 0] = perm.numel() + 5, -3, 2 ** 31 - 1
        for seqused in ([1000, 1000 - page - 5], [n_cols * page + 300, 7]):
            seqused_k = torch.tensor(seqused, dtype=torch.int32, device="cuda")
            for table in (page_table, bad):
                for num_splits in (1, 3):
                    fas.flash_attn_with_sparse_block_table(q, k_cache, v_cache, blocks, num_splits=num_splits, seqused_k=seqused_k,
                                                           page_table=table, backend="fa3")
        qv = randn(int(cu_q[-1]), 8, 128)
        for num_splits in (1, 2):
            fas.flash_attn_varlen_with_sparse_blocks(qv, k_cache, v_cache, vblocks, cu_seqlens_q=cu_q,
                                                     cu_seqlens_k=torch.tensor([0, 300, 400, 1100], dtype=torch.int32, device="cuda"),
                                                     max_seqlen_q=130, max_seqlen_k=700, num_splits=num_splits, backend="fa3",
                                                     seqused_k=torch.tensor([300, 100, 700], dtype=torch.int32, device="cuda"),
                                                     page_table=torch.cat([bad, page_table[:1]]))


MANY_TILES = "fa3-many-tiles"  # the --only value of the many-tile cases
# B2 H8 (4 per K/V head) Sq4096: 512 tiles of 128 rows, packed or not; varlen: ragged sequences of
# as many rows, one empty, one of one row. Keys: 72+ fully historical blocks before the first
# tile's diagonal, so a tile can list 70 blocks causal or not.
MANY_TILE_HEADS, MANY_TILE_HEADS_K, MANY_TILE_BATCH, MANY_TILE_SEQLEN_Q = 8, 2, 2, 4096
MANY_TILE_KEYS_BEFORE_DIAGONAL = 9256
MANY_TILE_VARLEN_Q = [1600, 0, 1, 1100, 129, 1366]
MANY_TILE_VARLEN_K = [sq + MANY_TILE_KEYS_BEFORE_DIAGONAL if sq else 1000 for sq in MANY_TILE_VARLEN_Q]


def kernel_tiles(seqlens_q, table_heads) -> int:
    """FA-3's tiles of 128 rows over the many-tile cases' heads: per K/V head over packed query
    heads where the lists are shared or per K/V head, else per query head."""
    group = MANY_TILE_HEADS // MANY_TILE_HEADS_K
    heads, rows = (MANY_TILE_HEADS, 1) if table_heads == MANY_TILE_HEADS else (MANY_TILE_HEADS_K, group)
    return sum(heads * -(-sq * rows // 128) for sq in seqlens_q)


def many_tile_lists(table_heads, causal, seqlens_q, seqlens_k, seed):
    """(full, mask)[sequence][table head][tile] of helpers.skewed_rows: list lengths 0, 1, 2, 3,
    33 and 70 in random order across tiles, permuted and gapped ids."""
    rng = random.Random(seed)
    rows = [skewed_rows(rng, table_heads, sq, sk, causal) for sq, sk in zip(seqlens_q, seqlens_k)]
    return [r[0] for r in rows], [r[1] for r in rows]


def many_tile_inputs(randn):
    """The many-tile cases' tensors, for the sparse calls and upstream's dense ones alike: batched
    (q, k, v) and varlen (q, k, v, cu_seqlens_q, cu_seqlens_k)."""
    seqlen_k = MANY_TILE_SEQLEN_Q + MANY_TILE_KEYS_BEFORE_DIAGONAL
    batched = (randn(MANY_TILE_BATCH, MANY_TILE_SEQLEN_Q, MANY_TILE_HEADS, 128),
               randn(MANY_TILE_BATCH, seqlen_k, MANY_TILE_HEADS_K, 128), randn(MANY_TILE_BATCH, seqlen_k, MANY_TILE_HEADS_K, 128))
    prefix = lambda lengths: torch.tensor([sum(lengths[:i]) for i in range(len(lengths) + 1)], dtype=torch.int32, device="cuda")
    total_q, total_k = sum(MANY_TILE_VARLEN_Q), sum(MANY_TILE_VARLEN_K)
    varlen = (randn(total_q, MANY_TILE_HEADS, 128), randn(total_k, MANY_TILE_HEADS_K, 128), randn(total_k, MANY_TILE_HEADS_K, 128),
              prefix(MANY_TILE_VARLEN_Q), prefix(MANY_TILE_VARLEN_K))
    return batched, varlen


def many_tile_plan() -> list:
    """The many-tile calls in order: (layout, table heads, causal, num_splits); layout "batched" or
    "varlen". Per (table heads, causal): batched calls (a split one too where packed and causal),
    then the varlen call."""
    plan = []
    for table_heads in (MANY_TILE_HEADS_K, MANY_TILE_HEADS):
        for causal in (False, True):
            for num_splits in (1, 3) if table_heads == MANY_TILE_HEADS_K and causal else (1,):
                plan.append(("batched", table_heads, causal, num_splits))
            plan.append(("varlen", table_heads, causal, 2 if causal else 1))
    return plan


def many_tile_calls(randn) -> list:
    """FA-3's sparse kernel (backend="fa3") over more tiles than SMs, lists skewed across tiles:
    packed GQA (per-K/V-head lists) and not (per query head), causal and not; batched unsplit
    (persistent; one split call too) and varlen split and not (persistent both), as many_tile_plan
    orders them. One callable per call, each building its own lists when called, so that a tool
    that ends a launch at its first report (synccheck) can check each in a process of its own."""
    (q, k, v), (qv, kv, vv, cu_q, cu_k) = many_tile_inputs(randn)
    seqlen_k = k.shape[1]

    def call(layout, table_heads, causal, num_splits):
        if layout == "batched":
            full, mask = many_tile_lists(table_heads, causal, [MANY_TILE_SEQLEN_Q] * MANY_TILE_BATCH,
                                         [seqlen_k] * MANY_TILE_BATCH, seed=table_heads + causal)
            blocks = SparseBlocks.from_lists(full, mask if causal else None, block_size=128, q_block_size=128, device="cuda")
            fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, num_splits=num_splits, backend="fa3")
            return
        full, mask = many_tile_lists(table_heads, causal, MANY_TILE_VARLEN_Q, MANY_TILE_VARLEN_K, seed=10 + table_heads + causal)
        vblocks = pack_varlen_lists(full, mask if causal else None, 128, 128, device="cuda")
        fas.flash_attn_varlen_with_sparse_blocks(qv, kv, vv, vblocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                 max_seqlen_q=max(MANY_TILE_VARLEN_Q), max_seqlen_k=max(MANY_TILE_VARLEN_K),
                                                 causal=causal, num_splits=num_splits, backend="fa3")

    return [lambda entry=entry: call(*entry) for entry in many_tile_plan()]


def run_selected(calls: list, index=None) -> None:
    """Every call, or the one at `index` (a --case-index)."""
    for call in calls if index is None else calls[index:index + 1]:
        call()


def many_tile_cases(randn, index=None):
    """The many-tile calls (many_tile_calls), all of them or the one at `index`."""
    from flash_attn_sparse.backends import fa3_ops
    if fa3_ops.missing_build() is not None:
        print(f"fa3 many tiles: not in this build ({fa3_ops.missing_build()})", flush=True)
        return
    run_selected(many_tile_calls(randn), index)
    print("fa3 many tiles: ok", flush=True)


def upstream_fa3_cases():
    """Upstream FA-3's dense calls of the same shapes and paths (GQA packed, split, varlen), in a
    process of their own: the sparse kernel shares upstream's tile schedulers, so a report that
    these calls also give is upstream's (or the tool's), not this series'."""
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    g = torch.Generator(device="cuda").manual_seed(0)
    (q, k, v), (qv, kv, vv, cu_q, cu_k) = fa3_inputs(lambda *shape: torch.randn(*shape, generator=g, device="cuda").bfloat16())
    for causal in (False, True):  # causal: upstream's DynamicPersistentTileScheduler, as the sparse kernel's
        for num_splits in (1, 3):
            flash_attn_func(q, k, v, causal=causal, num_splits=num_splits, pack_gqa=True)
    for num_splits in (1, 2):
        flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 130, 700, num_splits=num_splits)
        flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 130, 700, causal=True, num_splits=num_splits)
    from flash_attn_sparse.backends import fa3_ops
    if "FP8" not in fa3_ops.disabled():  # upstream's e4m3 kernels, beside fa3_fp8_cases
        e4m3, descale = torch.float8_e4m3fn, torch.ones(2, 2, device="cuda")
        for num_splits in (1, 3):
            flash_attn_func(q.to(e4m3), k.to(e4m3), v.to(e4m3), q_descale=descale, k_descale=descale, v_descale=descale,
                            num_splits=num_splits, pack_gqa=True)
    torch.cuda.synchronize()
    print("upstream fa3 dense: ok", flush=True)


# Upstream's dense calls of the many-tile shapes in order: (layout, pack_gqa, causal).
UPSTREAM_MANY_TILE_PLAN = ([("batched", pack_gqa, causal) for pack_gqa in (True, False) for causal in (False, True)]
                           + [("varlen", None, causal) for causal in (False, True)])


def upstream_many_tile_calls() -> list:
    """Upstream FA-3's dense calls of the many-tile cases' shapes and paths (packed GQA and not,
    causal and not, varlen split and not), one callable per UPSTREAM_MANY_TILE_PLAN entry."""
    from flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    g = torch.Generator(device="cuda").manual_seed(0)
    (q, k, v), (qv, kv, vv, cu_q, cu_k) = many_tile_inputs(lambda *shape: torch.randn(*shape, generator=g, device="cuda").bfloat16())
    return [(lambda pack_gqa=pack_gqa, causal=causal: flash_attn_func(q, k, v, causal=causal, num_splits=1, pack_gqa=pack_gqa))
            if layout == "batched" else
            (lambda causal=causal: flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, max(MANY_TILE_VARLEN_Q), max(MANY_TILE_VARLEN_K),
                                                          causal=causal, num_splits=2 if causal else 1))
            for layout, pack_gqa, causal in UPSTREAM_MANY_TILE_PLAN]


def upstream_many_tile_cases(index=None):
    """upstream_many_tile_calls, all of them or the one at `index`, in a process of their own."""
    run_selected(upstream_many_tile_calls(), index)
    torch.cuda.synchronize()
    print("upstream fa3 dense, many tiles: ok", flush=True)


# CUDA API errors that are no kernel's: the CUDA runtime asks the driver for entry points it may
# lack (cuGetProcAddress answers "invalid argument"). Reported, counted apart, not failures.
BENIGN_API_ERRORS = ("cuGetProcAddress",)
REPORT = re.compile(r"^========= (Invalid __\w+__ \w+|Uninitialized __\w+__ memory read|Program hit \w+|Error: Race reported"
                    r"|Warning: Race reported|Misaligned|Out-of-range|Barrier error|Cuda API error)")


def short_name(signature: str) -> str:
    """A kernel or device function's name without template arguments, parameters or return type:
    `flash::DynamicPersistentTileScheduler::get_next_work`."""
    previous = None
    while previous != signature:
        previous, signature = signature, re.sub(r"<[^<>]*>", "", signature)
    signature = re.sub(r"\([^()]*\)", "", signature)
    words = [w for w in signature.split() if w not in ("const", "void")]
    return words[-1] if words else signature.strip()


def reports(output: str, first_seen: dict | None = None) -> collections.Counter:
    """(what, where) -> count of the tool's reports: the report's first line (sizes and addresses
    dropped); where: the API call, or the function (file:line where the tool gives it) and the
    innermost Python frame of the launch (whose code launched it: a test's reference or a kernel);
    a race names both its sites, "A with B". first_seen, if given, collects each key's first
    report whole (its backtrace names the caller of a shared site such as a barrier)."""
    found, lines = collections.Counter(), output.splitlines()
    for i, line in enumerate(lines):
        match = REPORT.match(line)
        if not match:
            continue
        api = re.search(r"on CUDA API call to (\w+)", line)
        if api:
            found[(match.group(1), api.group(1))] += 1
            if first_seen is not None:
                first_seen.setdefault((match.group(1), api.group(1)), line)
            continue
        body = [line]
        for following in lines[i + 1:i + 80]:
            if REPORT.match(following) or re.match(r"^========= (ERROR|RACECHECK) SUMMARY", following):
                break
            body.append(following)
        sites = [m for m in (re.search(r" at (.+?)\+0x[0-9a-f]+(?: in (\S+:\d+))?", b) for b in body) if m]
        sites = sites[:2] if "Race reported" in match.group(1) else sites[:1]
        where = " with ".join(short_name(at.group(1)) + (f" ({at.group(2)})" if at.group(2) else "") for at in sites) or "?"
        python = next((m.group(1) for m in (re.search(r"Host Frame: (\w+ in [\w.]+\.py:\d+)", b) for b in body) if m), None)
        key = (match.group(1), f"{where}, launched from {python}" if python else where)
        found[key] += 1
        if first_seen is not None:
            first_seen.setdefault(key, "\n".join(body))
    return found


TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# The tools over the many-tile cases: a CTA's hand-off from one tile to the next is ordered by
# barriers (named, and the K/V pipeline's), whose misuse synccheck and whose missing order racecheck see.
MANY_TILE_TOOLS = ("racecheck", "synccheck")
PROBE = Path(__file__).resolve().parent / "sanitizer_probes" / "named_barrier_handoff.cu"
HANDOFF_SITE = re.compile(r"^flash::(Varlen)?DynamicPersistentTileScheduler::get_next_work \(\S*tile_scheduler\.hpp:\d+\)$")


def is_scheduler_handoff(what: str, where: str) -> bool:
    """A race whose every site is upstream FA-3's tile-index hand-off (get_next_work of its dynamic
    schedulers: their only shared-memory access is that slot)."""
    return "Race reported" in what and all(HANDOFF_SITE.match(site) for site in where.split(" with "))


def racecheck_misreads_named_barriers(raw_dir=None) -> bool:
    """Build and run the probe under racecheck: True when the tool reports races in the ordered
    hand-off as well as in the racy control, i.e. it does not credit bar.arrive -> bar.sync."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / PROBE.stem
        build = subprocess.run([nvcc, "-arch=sm_90a", "-O2", "-lineinfo", "-o", str(binary), str(PROBE)],
                               capture_output=True, text=True)
        if build.returncode:
            print(f"racecheck probe: nvcc failed ({build.stderr.strip()[-300:]}); no report is set apart", flush=True)
            return False
        for form in ("ordered", "racy"):
            run = subprocess.run(["compute-sanitizer", "--tool", "racecheck", str(binary), form], capture_output=True, text=True)
            if raw_dir:
                (Path(raw_dir) / f"probe-racecheck-{form}.txt").write_text(run.stdout + run.stderr)
            counts[form] = sum(n for (what, _), n in reports(run.stdout).items() if "Race reported" in what)
            if form == "ordered" and run.returncode:
                print(f"racecheck probe: the ordered hand-off ran wrong (exit {run.returncode}); no report is set apart")
                return False
    misreads = counts["ordered"] > 0 and counts["racy"] > 0
    print(f"racecheck probe ({PROBE.name}): {counts['ordered']} race reports on the ordered named-barrier hand-off, "
          f"{counts['racy']} on the racy control -> "
          + ("the tool does not credit bar.arrive -> bar.sync; upstream's scheduler hand-off races are set apart"
             if misreads else "the probe does not excuse the scheduler hand-off"), flush=True)
    return misreads


# synccheck reports upstream's pipelines' mbarrier arrives by the thousand: every one is printed
# (device frames only, which keeps that fast), so the sites of the series' calls can be compared
# with those of upstream's dense calls.
PRINT_LIMIT = {"synccheck": 100_000}
TOOL_OPTIONS = {"synccheck": ["--show-backtrace", "device"]}


def without_launch(where: str) -> str:
    """A report's device site(s), without the Python line that launched the kernel."""
    return where.split(", launched from ")[0]


def barrier_error_sites(baseline) -> set:
    """The device sites of the barrier errors among baseline's (what, where) report keys."""
    return {without_launch(where) for what, where in baseline if what == "Barrier error"}


def at_upstream_barrier_site(what: str, where: str, sites: set) -> bool:
    """A synccheck barrier error at one of `sites` (barrier_error_sites of upstream's dense calls)."""
    return what == "Barrier error" and without_launch(where) in sites


def upstream_barrier_error(what: str, where: str, baseline) -> bool:
    """A synccheck barrier error at a site where upstream's dense calls alone get the same report
    (baseline: their (what, where) keys): the tool's reading of upstream's code, not this series'."""
    return at_upstream_barrier_site(what, where, barrier_error_sites(baseline))


# synccheck ends a launch at its first barrier report and the process's later launches then fail,
# so over commands that take --case-index it checks each call in a process of its own.
PER_CALL_TOOLS = ("synccheck",)


def run_tool(tool: str, command: list, env=None, calls: int | None = None) -> tuple:
    """(exit code, stdout, stderr) of compute-sanitizer's `tool` over `command`; for PER_CALL_TOOLS
    with `calls`, one process per call (`--case-index i`), their outputs joined, the worst exit
    kept and a last summary line totalling their errors."""
    prefix = ["compute-sanitizer", "--tool", tool, "--print-limit", str(PRINT_LIMIT.get(tool, 400)),
              *TOOL_OPTIONS.get(tool, [])]
    if tool not in PER_CALL_TOOLS or not calls:
        run = subprocess.run([*prefix, *command], capture_output=True, text=True, env=env)
        return run.returncode, run.stdout, run.stderr
    runs = [subprocess.run([*prefix, *command, "--case-index", str(i)], capture_output=True, text=True, env=env)
            for i in range(calls)]
    total = sum(int(m.group(1)) for run in runs for m in re.finditer(r"ERROR SUMMARY: (\d+) error", run.stdout))
    stdout = "".join(run.stdout for run in runs) + f"========= ERROR SUMMARY: {total} errors over {calls} processes\n"
    return max(run.returncode for run in runs), stdout, "".join(run.stderr for run in runs)


def sanitize(command, raw_dir=None, label="sanitize", excuse_handoff=False, tools=TOOLS, env=None, baseline=None,
             seen=None, calls=None) -> int:
    """Each tool over `command`: clean when it exits 0 (or, synccheck checking call by call, ends
    launches on reports all set apart) and reports nothing but benign API errors
    (their count is printed), with excuse_handoff (the probe's verdict) races of upstream's
    scheduler hand-off, and with baseline ({tool: keys of upstream's dense calls' reports}) barrier
    errors at sites upstream's calls also get (both counted apart). Prints the kinds of report and
    where, most frequent first; seen ({tool: set}) collects every report's key; calls: how many
    calls `command --case-index i` selects (see run_tool)."""
    failed = 0
    for tool in tools:
        returncode, stdout, stderr = run_tool(tool, command, env, calls)
        if raw_dir:
            (Path(raw_dir) / f"{label}-{tool}.txt").write_text(stdout[-4_000_000:] + stderr[-100_000:])
        cases = re.search(r"configurations run: (\d+)", stdout)
        if cases:
            wrong = re.search(r"failures: (\d+)", stdout)
            print(f"{tool}: {cases.group(1)} fuzz cases, {wrong.group(1) if wrong else '?'} fuzz failures "
                  f"(runner exit {returncode})")
        summary = [line for line in stdout.splitlines() if re.search(r"(ERROR|RACECHECK) SUMMARY", line)]
        first_seen = {}
        found = reports(stdout, first_seen)
        if raw_dir:  # the tail above may have lost a rare kind's backtrace: one whole report per kind
            (Path(raw_dir) / f"{label}-{tool}-first-of-each.txt").write_text(
                "\n\n".join(f"{n} x\n{first_seen[key]}" for key, n in found.most_common()))
        if seen is not None:
            seen.setdefault(tool, set()).update(found)
        upstream_sites = barrier_error_sites((baseline or {}).get(tool, ()))
        set_apart, real = collections.Counter(), {}
        for (what, where), n in found.items():  # each report kind classified once
            if what.startswith("Program hit") and where.startswith(BENIGN_API_ERRORS):
                set_apart["benign"] += n
            elif excuse_handoff and is_scheduler_handoff(what, where):
                set_apart["excused"] += n
            elif at_upstream_barrier_site(what, where, upstream_sites):
                set_apart["upstream"] += n
            else:
                real[(what, where)] = n
        benign, excused, upstream = set_apart["benign"], set_apart["excused"], set_apart["upstream"]
        # Checked call by call, synccheck ends a launch at its first report: a nonzero exit after
        # reports all set apart is the tool's (one process over many calls checks its first only).
        ended_by_tool = tool in PER_CALL_TOOLS and bool(calls) and bool(found) and not real
        clean = (returncode == 0 or ended_by_tool) and bool(summary) and not real
        failed += not clean
        print(f"{tool}: {'clean' if clean else 'FOUND ERRORS'} ({summary[-1].strip('= ') if summary else stdout[-300:]}; "
              f"{benign} benign API errors of {', '.join(BENIGN_API_ERRORS)} among the printed reports"
              + (f"; {excused} races of upstream's scheduler hand-off set apart by the probe" if excused else "")
              + (f"; {upstream} barrier errors at sites upstream's dense calls also report" if upstream else "") + ")")
        for (what, where), n in sorted(real.items(), key=lambda item: -item[1])[:8]:
            print(f"  {n} x {what} at {where}")
    return 1 if failed else 0


def option(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def fuzz_subset_command(argv) -> list:
    position = argv.index("--fuzz-subset")
    count = argv[position + 1] if len(argv) > position + 1 else "60"
    runner = str(Path(__file__).resolve().parent / "fuzz" / "run.py")
    return [sys.executable, runner, "--sanitizer-subset", "--seed", "0", "--count", count, "--budget-s", "1e9",
            "--backends", "fa2,fa3,fa4,auto", "--fa4-kernels", "6"]  # FA-4 compiles each class: a few


def raw_dir(argv):
    """--raw DIR: where each tool's whole output is written (the GPU runner's logs)."""
    if "--raw" not in argv:
        return None
    directory = Path(argv[argv.index("--raw") + 1])
    directory.mkdir(parents=True, exist_ok=True)
    return str(directory)


if __name__ == "__main__":
    # --tools a,b: a subset of TOOLS; --only fa3: FA-3's cases alone (with the many-tile ones under
    # MANY_TILE_TOOLS); --only fa3-many-tiles: the many-tile ones alone; --module-loading eager: the
    # sanitized process loads every CUDA module at start (CUDA_MODULE_LOADING=EAGER), so the tool
    # knows a lazily loaded module's functions at its first launch.
    tools = tuple(option(sys.argv, "--tools", ",".join(TOOLS)).split(","))
    raw = raw_dir(sys.argv)
    loading = option(sys.argv, "--module-loading")
    env = {**os.environ, "CUDA_MODULE_LOADING": loading.upper()} if loading else None
    index = int(option(sys.argv, "--case-index")) if "--case-index" in sys.argv else None
    if "--cases" in sys.argv:
        cases(only=option(sys.argv, "--only"), index=index)
    elif "--fuzz-subset" in sys.argv:
        excuse = "racecheck" in tools and racecheck_misreads_named_barriers(raw)  # only racecheck needs it
        sys.exit(sanitize(fuzz_subset_command(sys.argv), raw, excuse_handoff=excuse, tools=tools, env=env))
    elif "--upstream-fa3-cases" in sys.argv:
        upstream_many_tile_cases(index) if option(sys.argv, "--only") == MANY_TILES else upstream_fa3_cases()
    else:
        excuse = "racecheck" in tools and racecheck_misreads_named_barriers(raw)  # only racecheck needs it
        only = option(sys.argv, "--only")
        label = f"sanitize-{loading}" if loading else "sanitize"
        many_tools = tuple(tool for tool in tools if tool in MANY_TILE_TOOLS)
        from flash_attn_sparse.backends import fa3_ops
        fa3 = fa3_ops.missing_build() is None
        baseline = {}  # upstream's dense calls first: the sites whose barrier errors are theirs
        if fa3:
            print("upstream FA-3's dense calls, alone (what they report is not this series'):", flush=True)
            if only != MANY_TILES:
                sanitize([sys.executable, __file__, "--upstream-fa3-cases"], raw, "upstream-fa3", tools=tools,
                         env=env, seen=baseline)  # not excused
            if many_tools:
                sanitize([sys.executable, __file__, "--upstream-fa3-cases", "--only", MANY_TILES], raw,
                         f"upstream-fa3-{MANY_TILES}", tools=many_tools, env=env, seen=baseline,
                         calls=len(UPSTREAM_MANY_TILE_PLAN))  # not excused
            print("this series' calls:", flush=True)
        failed = 0
        if only != MANY_TILES:
            failed = sanitize([sys.executable, __file__, "--cases", *(["--only", only] if only else [])], raw, label,
                              excuse, tools, env, baseline=baseline)
        if fa3 and many_tools:
            print(f"FA-3 over more tiles than SMs, lists skewed across tiles ({', '.join(many_tools)}):", flush=True)
            failed |= sanitize([sys.executable, __file__, "--cases", "--only", MANY_TILES], raw,
                               f"{label}-{MANY_TILES}", excuse, many_tools, env, baseline=baseline,
                               calls=len(many_tile_plan()))
        sys.exit(failed)
