"""The engine-shaped call: a serving step's ragged batch over a paged K/V cache, on each backend.

One varlen call mixes 32 decode rows with chunked-prefill chunks of 1024 and 2048 rows (causal,
at the end of their caches), over caches of 16k-64k keys per sequence (H32/8, head dim 128,
bf16), per-(sequence, K/V head) lists: in each 128-row query tile the blocks on its diagonal as
"mask" blocks and 1/8 of the blocks before them as "full" ones (a decode row's diagonal is the
cache's last block). A decode-only batch (the 32 decode rows alone) runs beside it.
For each page size it times, through the public varlen call with seqused_k and the page table:
fa3 and fa2 on the paged cache, auto, and fa3 on the same keys in one contiguous K/V
(cu_seqlens_k): the paged path's cost over contiguous K/V, and fa3 over fa2. Beside them dense
FA-3 over every key of the same cache, in these pages and in 256-key pages (TMA where its
heuristic takes it): its own cost of small pages, the peer of the sparse path's. CUDA-graph replay
with L2 flushed before each replay (median), and eager back-to-back calls, over 4 rotating list
sets, in two passes one after the other; a ratio's passes show the spread. A backend that
refuses a call (e.g. a build without FA-3's kernels for pages under 128 keys) is reported so.

    python benchmarks/bench_engine.py [--page-sizes 16,64,128] [--out DIR]

writes engine.json (every timing) and engine.md (the ratios) into --out.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flash_attn_sparse as fas  # noqa: E402
from bench_gqa import L2_FLUSH_BYTES, PASSES, eager_us, graph_replay_us  # noqa: E402
from bench_sparse import ROTATIONS, source_commit  # noqa: E402
from flash_attn_sparse.metadata import pack_varlen_lists  # noqa: E402

HEADS, HEADS_K, HEAD_DIM, BLOCK, Q_TILE = 32, 8, 128, 128, 128
DENSE_TMA_PAGE = 256  # a multiple of every dense FA-3 hdim-128 tile's keys: its TMA-paged loads
DENSITY = 1 / 8
DECODE_ROWS, CHUNKS = 32, (1024, 2048)
METHODS = ("fa3_paged", "fa2_paged", "auto_paged", "fa3_contiguous")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def step_shape(rng: random.Random, decode_only: bool):
    """(query rows, cache keys) per sequence: decode rows, then the prefill chunks."""
    rows = [1] * DECODE_ROWS + ([] if decode_only else list(CHUNKS))
    return [(sq, rng.randrange(16384, 65537)) for sq in rows]


def tile_lists(sq: int, sk: int, rng: random.Random):
    """(full, mask) rows of one (sequence, K/V head): per 128-row query tile of the chunk at the
    cache's end, the history blocks at DENSITY and its diagonal blocks (as mask blocks); a decode
    row's diagonal is the cache's last block."""
    n_blocks = cdiv(sk, BLOCK)
    if sq == 1:
        return [rng.sample(range(n_blocks - 1), max(1, int((n_blocks - 1) * DENSITY)))], [[n_blocks - 1]]
    full, mask = [], []
    for tile in range(cdiv(sq, Q_TILE)):
        first_key = tile * Q_TILE + sk - sq  # the tile's first row sees keys up to here
        last_key = min((tile + 1) * Q_TILE, sq) - 1 + sk - sq
        history = (first_key + 1) // BLOCK  # blocks every row of the tile sees whole
        full.append(rng.sample(range(history), max(1, int(history * DENSITY))))
        mask.append(list(range(history, last_key // BLOCK + 1)))
    return full, mask


def list_set(shape, rng: random.Random, device="cuda"):
    """One rotation's varlen lists: full[b][hs][m] and mask[b][hs][m] per sequence and K/V head."""
    full, mask = zip(*[zip(*[tile_lists(sq, sk, rng) for _ in range(HEADS_K)]) for sq, sk in shape])
    return pack_varlen_lists([list(f) for f in full], [list(m) for m in mask], BLOCK, Q_TILE, device=device)


def inputs(shape, page_size: int, generator):
    """q (total_q, H, D); contiguous K/V (total_k, Hk, D) with cu_seqlens; the same keys in a paged
    cache of permuted pages with its page table and seqused_k."""
    seqlens_q, seqlens_k = [sq for sq, _ in shape], [sk for _, sk in shape]
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    q = torch.randn(sum(seqlens_q), HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    k = torch.randn(sum(seqlens_k), HEADS_K, HEAD_DIM, device="cuda", generator=generator).bfloat16()
    v = torch.randn_like(k)
    k_cache, v_cache, page_table = paged_cache(k, v, seqlens_k, page_size, generator)
    varlen = dict(cu_seqlens_q=cu(seqlens_q), max_seqlen_q=max(seqlens_q), max_seqlen_k=max(seqlens_k), causal=True)
    contiguous = dict(varlen, cu_seqlens_k=cu(seqlens_k))
    paged = dict(contiguous, page_table=page_table, seqused_k=torch.tensor(seqlens_k, dtype=torch.int32, device="cuda"))
    return q, (k, v, contiguous), (k_cache, v_cache, paged)


def paged_cache(k, v, seqlens_k, page_size: int, generator):
    """The keys of k and v (packed by sequence) in a cache of permuted pages, and its page table."""
    pages_of = [cdiv(sk, page_size) for sk in seqlens_k]
    num_pages = sum(pages_of)
    perm = torch.randperm(num_pages, device="cuda", generator=generator)
    page_table = torch.zeros(len(seqlens_k), max(pages_of), dtype=torch.int32, device="cuda")
    k_cache = torch.zeros(num_pages, page_size, HEADS_K, HEAD_DIM, dtype=k.dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    start, used = 0, 0
    for b, sk in enumerate(seqlens_k):
        ids = perm[used:used + pages_of[b]]
        page_table[b, :pages_of[b]] = ids.int()
        padded = pages_of[b] * page_size
        for src, cache in ((k, k_cache), (v, v_cache)):
            rows = torch.zeros(padded, HEADS_K, HEAD_DIM, dtype=k.dtype, device="cuda")
            rows[:sk] = src[start:start + sk]
            cache[ids] = rows.view(pages_of[b], page_size, HEADS_K, HEAD_DIM)
        start, used = start + sk, used + pages_of[b]
    return k_cache, v_cache, page_table


def dense_fa3_calls(q, k, v, k_cache, v_cache, paged: dict, page_size: int):
    """Dense FA-3 (flash_attn_3's flash_attn_with_kvcache, causal) over every key of the same cache
    in these pages and in pages of DENSE_TMA_PAGE keys, which it loads by TMA where its heuristic
    takes TMA (more packed query rows than a tile: the mixed batch, not decode alone): its own cost
    of small pages, beside the sparse call's. {} without flash_attn_3; a build without its paged
    units reports the error in the method's cells."""
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError:
        return {}
    seqlens_k = paged["seqused_k"].tolist()
    k_tma, v_tma, table_tma = paged_cache(k, v, seqlens_k, DENSE_TMA_PAGE, torch.Generator(device="cuda").manual_seed(page_size))
    common = dict(cache_seqlens=paged["seqused_k"], cu_seqlens_q=paged["cu_seqlens_q"], max_seqlen_q=paged["max_seqlen_q"],
                  causal=True)
    return {"dense_fa3_paged": [lambda: flash_attn_with_kvcache(q, k_cache, v_cache, page_table=paged["page_table"], **common)],
            "dense_fa3_tma_pages": [lambda: flash_attn_with_kvcache(q, k_tma, v_tma, page_table=table_tma, **common)]}


def measure(shape, page_size: int, blocks, flush) -> dict:
    """Every method's graph and eager us per pass, or the reason it cannot run."""
    q, (k, v, contiguous), (k_cache, v_cache, paged) = inputs(shape, page_size, torch.Generator(device="cuda").manual_seed(page_size))
    call = fas.flash_attn_varlen_with_sparse_blocks
    methods = {
        "fa3_paged": [lambda b=b: call(q, k_cache, v_cache, b, backend="fa3", **paged) for b in blocks],
        "fa2_paged": [lambda b=b: call(q, k_cache, v_cache, b, backend="fa2", **paged) for b in blocks],
        "auto_paged": [lambda b=b: call(q, k_cache, v_cache, b, **paged) for b in blocks],
        "fa3_contiguous": [lambda b=b: call(q, k, v, b, backend="fa3", **contiguous) for b in blocks],
    }
    methods.update(dense_fa3_calls(q, k, v, k_cache, v_cache, paged, page_size))
    result = {"graph_us": {}, "eager_us": {}, "auto_backend": fas.choose_backend(q, k_cache, v_cache, blocks[0], **paged)[0]}
    for _ in range(PASSES):
        for name, calls in methods.items():
            if isinstance(result["graph_us"].get(name), str):
                continue
            try:
                result["graph_us"].setdefault(name, []).append(graph_replay_us(calls, flush))
                result["eager_us"].setdefault(name, []).append(eager_us(calls))
            except Exception as error:  # a method that cannot run the call is reported, not fatal
                result["graph_us"][name] = result["eager_us"][name] = f"{type(error).__name__}: {str(error)[:200]}"
    return result


def ratio(result: dict, method: str, peer: str, kind: str = "graph_us"):
    ours, theirs = result[kind].get(method), result[kind].get(peer)
    if not isinstance(ours, list) or not isinstance(theirs, list):
        return None
    per_pass = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(per_pass), per_pass


def cell(r) -> str:
    return f"{r[0]:.3f} ({'/'.join(f'{x:.3f}' for x in r[1])})" if r else "-"


def markdown(results: list, gpu: str, commit: str) -> str:
    lines = [f"# Engine-shaped call, {gpu}, {time.strftime('%Y-%m-%d')}, commit {commit}", "",
             f"{DECODE_ROWS} decode rows + chunks of {', '.join(map(str, CHUNKS))} rows (causal), caches of 16k-64k keys, "
             f"H{HEADS}/{HEADS_K} d{HEAD_DIM} bf16, per-(sequence, K/V head) lists at 1/{int(1 / DENSITY)}; graph replay, "
             "L2 flushed, median of two passes (each pass in parentheses).", "",
             "| batch | page | auto runs | fa3 paged / fa3 contiguous | dense FA-3 paged / its TMA pages | fa3 paged / fa2 paged | "
             "auto / fa2 paged | eager fa3 paged / fa2 paged | fa3 paged us |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        fa3_us = r["graph_us"].get("fa3_paged")
        lines.append(f"| {r['batch']} | {r['page_size']} | {r['auto_backend']} | {cell(ratio(r, 'fa3_paged', 'fa3_contiguous'))} | "
                     f"{cell(ratio(r, 'dense_fa3_paged', 'dense_fa3_tma_pages'))} | "
                     f"{cell(ratio(r, 'fa3_paged', 'fa2_paged'))} | {cell(ratio(r, 'auto_paged', 'fa2_paged'))} | "
                     f"{cell(ratio(r, 'fa3_paged', 'fa2_paged', 'eager_us'))} | "
                     f"{f'{statistics.median(fa3_us):.1f}' if isinstance(fa3_us, list) else fa3_us or '-'} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", type=lambda text: [int(x) for x in text.split(",")], default=[16, 64, 128])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    flush_buffer = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    for batch, decode_only in (("decode + prefill chunks", False), ("decode only", True)):
        rng = random.Random(f"engine-{decode_only}")
        shape = step_shape(rng, decode_only)
        blocks = [list_set(shape, rng) for _ in range(ROTATIONS)]
        for page_size in args.page_sizes:
            result = dict(batch=batch, page_size=page_size, **measure(shape, page_size, blocks, flush_buffer.zero_))
            print(json.dumps({key: result[key] for key in ("batch", "page_size", "auto_backend", "graph_us")}), flush=True)
            results.append(result)
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu, commit = torch.cuda.get_device_name(), source_commit()
    (args.out / "engine.json").write_text(json.dumps(dict(gpu=gpu, commit=commit, results=results), indent=1))
    (args.out / "engine.md").write_text(markdown(results, gpu, commit))
    print(markdown(results, gpu, commit))


if __name__ == "__main__":
    main()
