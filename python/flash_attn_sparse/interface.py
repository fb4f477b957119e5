"""Public API of speculative sparse attention: the entry points over one sparse forward, and the
one-shot cache of their decisions (auto's choice itself: routing.py). The speculative forms are in
speculative.py."""

import logging
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .backends import BACKENDS
from .backends.device import MAX_SPLITS
from .backends.fa2_ops import combine, head_dim_refusal, head_dim_rounded, partial_buffers
from .calls import BlockTable, SparseCall, as_blocks, broadcast_batch, check_out, facts
from .fp8 import Descale, normalize_descale, refuse_fp8
from .metadata import SparseBlocks, exhaustive_validation_requested, fail
from .options import CallOptions
from .routing import choose

logger = logging.getLogger("flash_attn_sparse")


class Decision:
    """What planning a call decides: its backend (and why) and the split count."""

    def __init__(self, call: SparseCall):
        self.backend, self.why = choose(call)
        self.num_splits = BACKENDS[self.backend].num_splits(call)

    def log(self) -> None:
        if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparse forward on %s (%s)", self.backend, self.why)


def run(call: SparseCall, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Routes and runs one validated call through its backend's traceable path (no cache)."""
    decision = Decision(call)
    decision.log()
    return BACKENDS[decision.backend].run(call, decision.num_splits, out)


class _CachedCall:
    """A one-shot call's plan, kept by the cache: the decision, the backend's Planned (holding no
    buffer between calls) and what validation changed of the caller's tensors (a contiguous copy,
    batch-broadcast lists), to do again for tensors of the same facts."""

    def __init__(self, call: SparseCall, q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, out: Optional[Tensor]):
        self.decision = Decision(call)
        self.planned = BACKENDS[self.decision.backend].plan(call, self.decision.num_splits, out, keep_buffers=False)
        self.contiguous = call.q is not q or call.k is not k or call.v is not v
        self.batch = call.batch if not call.varlen and call.blocks is not blocks else None
        self.descale_shape = (call.batch, call.k.shape[-2])

    def run(self, q, k, v, blocks: SparseBlocks, out: Optional[Tensor], tensors: dict,
            descales: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
        if self.contiguous:
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if self.batch is not None:
            blocks = broadcast_batch(blocks, self.batch)
        if descales is not None:  # each call's own, in the layout their facts (the key) planned
            batch, heads_k = self.descale_shape
            tensors = dict(tensors, **{name: None if value is None else normalize_descale(name, value, batch, heads_k, q.device)
                                       for name, value in descales.items()})
        if logger.isEnabledFor(logging.DEBUG):
            self.decision.log()
        return self.planned.run_with(q, k, v, out, blocks, tensors)


def partials_backend():
    """The backend that writes fp32 (O, LSE) partials (the protocol's run_partial): FA-2's kernels."""
    return next(backend for backend in BACKENDS.values() if hasattr(backend, "run_partial"))


def blocks_facts(b: SparseBlocks) -> tuple:
    """The lists' facts, written out (no generator): this is on every cached call's path."""
    mask_cnt, mask_idx, cu_m, cu_offsets = b.mask_cnt, b.mask_idx, b.cu_total_m_blocks, b.cu_block_idx_offsets
    return (b.block_size, b.q_block_size, facts(b.full_cnt), facts(b.full_idx),
            None if mask_cnt is None else facts(mask_cnt), None if mask_idx is None else facts(mask_idx),
            None if cu_m is None else facts(cu_m), None if cu_offsets is None else facts(cu_offsets))


def cache_key(q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], blocks: SparseBlocks, options: CallOptions,
              cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, max_seqlens, descales: Optional[dict] = None) -> tuple:
    """The one-shot cache's key: the facts of every tensor of the call (out's too; a descale's
    type where it is a number) and the options, never their data. Written out flat, q, k and v
    inline: it runs on every cached call."""
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            v.shape, v.stride(), v.dtype, v.device, None if out is None else facts(out), blocks_facts(blocks), options,
            None if cu_seqlens_q is None else facts(cu_seqlens_q), None if cu_seqlens_k is None else facts(cu_seqlens_k),
            None if seqused_k is None else facts(seqused_k), None if page_table is None else facts(page_table), max_seqlens,
            None if descales is None else tuple(facts(d) for d in descales.values()))


CACHE_SIZE = 64
# The one-shot cache: a plain dict, oldest entry evicted first (an LRU's move_to_end would hash the
# key a second time on every hit). Its entries hold no caller's tensor.
one_shot_cache: "dict[tuple, _CachedCall]" = {}


def run_cached(q, k, v, blocks: SparseBlocks, out: Optional[Tensor], options: CallOptions, *,
               cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
               max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
               seqused_k: Optional[Tensor] = None, page_table: Optional[Tensor] = None,
               table_name: str = "sparse_block_table", q_descale: Optional[Descale] = None,
               k_descale: Optional[Descale] = None, v_descale: Optional[Descale] = None) -> Tuple[Tensor, Tensor]:
    """The one-shot forward through a cache of plans keyed on the tensors' facts (out's and the
    FP8 descales' too) and the options (never their data): a repeated shape skips validation,
    routing, the split choice and the argument building, and launches through its
    Planned.run_with (each call's descales normalized and passed with its tensors). Calls that
    ask for exhaustive validation, are traced, or pass odd inputs are not cached."""
    tensors = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, page_table=page_table)
    shapes = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, table_name=table_name)
    descales = None
    if q_descale is not None or k_descale is not None or v_descale is not None:
        descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    cacheable = (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
                 and isinstance(blocks, SparseBlocks)
                 and (cu_seqlens_q is None or isinstance(cu_seqlens_q, Tensor))
                 and (cu_seqlens_k is None or isinstance(cu_seqlens_k, Tensor))
                 and (seqused_k is None or isinstance(seqused_k, Tensor))
                 and (page_table is None or isinstance(page_table, Tensor))
                 and not torch.compiler.is_compiling() and not exhaustive_validation_requested(options.validate))
    if not cacheable:
        call = SparseCall(q, k, v, blocks, options, **tensors, **shapes, **(descales or {}))
        check_out(out, call.q, call.out_dtype)
        return run(call, out)
    key = cache_key(q, k, v, out, blocks, options, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                    (max_seqlen_q, max_seqlen_k), descales)
    cached = one_shot_cache.get(key)
    if cached is None:
        call = SparseCall(q, k, v, blocks, options, **tensors, **shapes, **(descales or {}))
        check_out(out, call.q, call.out_dtype)
        cached = _CachedCall(call, q, k, v, blocks, out)
        if len(one_shot_cache) >= CACHE_SIZE:
            del one_shot_cache[next(iter(one_shot_cache))]
        one_shot_cache[key] = cached
    return cached.run(q, k, v, blocks, out, tensors, descales)


def flash_attn_with_sparse_block_table(q: Tensor, k: Tensor, v: Tensor, sparse_block_table: BlockTable, *,
                                       block_size: int = 128, softmax_scale: Optional[float] = None,
                                       causal: bool = False, num_splits: int = 0, backend: str = "auto",
                                       validate: Optional[str] = None, seqused_k: Optional[Tensor] = None,
                                       page_table: Optional[Tensor] = None, out: Optional[Tensor] = None,
                                       q_descale: Optional[Descale] = None, k_descale: Optional[Descale] = None,
                                       v_descale: Optional[Descale] = None) -> Tuple[Tensor, Tensor]:
    """Attention of q over the K/V blocks named by sparse_block_table. Returns (out, lse).

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_k, head_dim), fp16/bf16.
    sparse_block_table: a 1-D int32 tensor of block ids shared by every batch, head and query
    row (all "full" blocks, any order, no duplicates), or SparseBlocks for per-(batch, head,
    query tile) lists with "mask" blocks. A block is block_size keys (SparseBlocks carries its
    own block size). causal applies the bottom-right causal mask to "mask" blocks.
    num_splits=0 picks the split-KV count from the list length and the GPU; 1 disables it.
    Returns out like q and lse (batch, heads, seqlen_q) fp32; a row that sees no key has
    out = 0, lse = -inf. validate="full" (or FLASH_ATTN_SPARSE_VALIDATE=full) also checks the
    list contents, at the cost of one host sync.
    seqused_k: optional int32 (batch,), the keys each sequence uses (default: all of k).
    page_table: paged K/V (vLLM-style), an int32 (batch, max_pages) tensor; k and v are then
    (num_pages, page_size, heads_k, head_dim) caches, key position p of batch b is row
    p % page_size of page page_table[b, p // page_size], and the lists still name logical
    blocks of key positions. page_size is a multiple of 16 that divides block_size or is a
    multiple of it; seqlen_k is seqused_k, else max_pages * page_size.
    backend: "fa2" (this package's kernels), "fa3" (FA-3's SM90 kernel, the flash_attn_3
    wheel), "fa4" (flash-attn-4's SM90 kernel, extra `[hopper]`) or "auto": on SM90 fa3 where
    it takes the call and the call has 128+ query rows per sequence or packs the GQA query heads
    of a K/V head into its tiles, else fa2; the same choice eagerly, in a CUDA-graph capture and under
    torch.compile (routing.py). `choose_backend` tells which and `choose_num_splits_for` the
    split count, and the "flash_attn_sparse" logger says so at DEBUG.
    out: optional tensor like q (contiguous last dim) that receives the output (FA-4: by a copy).
    Repeated calls of one shape reuse the planning (run_cached); SparsePlan plans explicitly.
    FP8 (fa3 on sm90 only, a flash_attn_3 built with FLASH_ATTN_SPARSE_FP8=1): k and v
    float8_e4m3fn with k_descale and v_descale, and q float8_e4m3fn with q_descale, or float16 /
    bfloat16 without one (quantized to e4m3 per (sequence, K/V head) by the package:
    fp8.quantize_q). A descale is a float or a tensor of shape (batch, heads_k), or broadcast to
    it from (), (1, 1), (batch, 1) or (1, heads_k) (any float dtype, made float32): the real
    value is the stored e4m3 value x descale, query head h taking K/V head h // group's. Out is
    bfloat16 (an out= must be), lse float32. auto runs FP8 calls on fa3 or refuses them.
    """
    blocks = as_blocks(sparse_block_table, block_size, q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1,
                        "sparse_block_table")
    options = CallOptions(causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                          validate=validate)
    return run_cached(q, k, v, blocks, out, options, seqused_k=seqused_k, page_table=page_table, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale)


def flash_attn_varlen_with_sparse_blocks(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, *, cu_seqlens_q: Tensor,
                                         cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                         softmax_scale: Optional[float] = None, causal: bool = False,
                                         num_splits: int = 0, backend: str = "auto", validate: Optional[str] = None,
                                         seqused_k: Optional[Tensor] = None, page_table: Optional[Tensor] = None,
                                         out: Optional[Tensor] = None, q_descale: Optional[Descale] = None,
                                         k_descale: Optional[Descale] = None,
                                         v_descale: Optional[Descale] = None) -> Tuple[Tensor, Tensor]:
    """Varlen form: q (total_q, heads, head_dim), k, v (total_k, heads_k, head_dim) packed by
    cu_seqlens; blocks in the varlen layout. Returns out like q and lse (heads, total_q).
    With page_table (batch, max_pages) k and v are paged caches (num_pages, page_size, heads_k,
    head_dim) as in flash_attn_with_sparse_block_table, and cu_seqlens_k counts each sequence's
    keys (its logical positions 0..n-1); max_seqlen_k <= max_pages * page_size (the engine-shaped
    call: ragged queries, a paged cache, sparse lists and out= in one call; FA-2 backend).
    backend and out as in flash_attn_with_sparse_block_table. FP8 as there, batch being the
    number of sequences (a descale entry per sequence and K/V head); a 16-bit q is quantized with
    one scale per K/V head shared by every sequence."""
    options = CallOptions(causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend,
                          validate=validate)
    return run_cached(q, k, v, blocks, out, options, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                      page_table=page_table, table_name="blocks", q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale)


def _call_to_choose_for(q, k, v, blocks: BlockTable, block_size: int, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, num_splits: int = 0, backend: str = "auto",
                        **tensors) -> SparseCall:
    """The call that flash_attn_with_sparse_block_table, or with cu_seqlens_q in tensors
    flash_attn_varlen_with_sparse_blocks, would make: what the choose_* functions ask."""
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 and "cu_seqlens_q" not in tensors else 1
    options = CallOptions(causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, backend=backend)
    return SparseCall(q, k, v, as_blocks(blocks, block_size, batch, "blocks"), options, **tensors)


def choose_num_splits_for(q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, *, block_size: int = 128,
                          backend: str = "fa2", **options) -> int:
    """The split-KV count that flash_attn_with_sparse_block_table (options as in choose_backend)
    would use on `backend` ("fa2" or "fa4") with num_splits=0. Never syncs."""
    call = _call_to_choose_for(q, k, v, blocks, block_size, backend=backend, **options)
    if backend not in BACKENDS:
        fail("backend", f"must be one of {tuple(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend].num_splits(call)


def choose_backend(q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, *, block_size: int = 128,
                   num_splits: int = 0, backend: str = "auto", **options) -> Tuple[str, str]:
    """(backend, why) that flash_attn_with_sparse_block_table would use for these arguments, or,
    given cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k as keywords,
    flash_attn_varlen_with_sparse_blocks. options also takes causal, softmax_scale, seqused_k,
    page_table and the FP8 descales. The answer holds eagerly and inside a CUDA-graph capture alike. Never syncs."""
    return choose(_call_to_choose_for(q, k, v, blocks, block_size, num_splits=num_splits, backend=backend, **options))


def flash_attn_sparse_partials(q: Tensor, k: Tensor, v: Tensor, block_groups: Sequence[BlockTable], *,
                               block_size: int = 128, softmax_scale: Optional[float] = None,
                               causal: bool = False, validate: Optional[str] = None,
                               seqused_k: Optional[Tensor] = None,
                               page_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One (O, LSE) partial per group of blocks, unmerged: out_partials (G, batch, heads,
    seqlen_q, head_dim_rounded) fp32 and lse_partials (G, batch, heads, seqlen_q) fp32, in the
    layout flash_attn_combine takes. Groups should be disjoint for the merge to be attention
    over their union. seqused_k and page_table (paged K/V caches) as in
    flash_attn_with_sparse_block_table. Not yet for FP8 inputs (refused)."""
    refuse_fp8("flash_attn_sparse_partials", q=q, k=k, v=v)
    if not isinstance(block_groups, (list, tuple)) or not block_groups:
        fail("block_groups", "must be a non-empty list of block tables")
    if len(block_groups) > MAX_SPLITS:
        fail("block_groups", f"at most {MAX_SPLITS} groups, got {len(block_groups)}")
    options = CallOptions(causal=causal, softmax_scale=softmax_scale, backend="fa2", validate=validate)
    calls = [SparseCall(q, k, v, as_blocks(g, block_size, q.shape[0] if q.dim() == 4 else 1, f"block_groups[{i}]"),
                        options, table_name=f"block_groups[{i}]", seqused_k=seqused_k, page_table=page_table)
             for i, g in enumerate(block_groups)]
    first = calls[0]
    out_partial, lse_partial = partial_buffers(len(calls), first.batch, first.q.shape[2], first.max_seqlen_q,
                                                   first.q.shape[3], first.q.device)
    for slot, call in enumerate(calls):
        partials_backend().run_partial(call, out_partial, lse_partial, slot, 1)
    return out_partial, lse_partial


def flash_attn_combine(out_partials: Tensor, lse_partials: Tensor, out_dtype: torch.dtype = torch.bfloat16,
                       head_dim: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Exact k-way merge of (O, LSE) partials with the sparse combine kernel (flash_sparse_combine.h).

    out_partials (S, batch, heads, seqlen_q, head_dim_rounded) fp32, lse_partials (S, batch,
    heads, seqlen_q) fp32, S <= 128; partials with LSE = -inf contribute nothing. Returns out
    (batch, seqlen_q, heads, head_dim) in out_dtype and lse (batch, heads, seqlen_q).
    """
    for name, t, dims in (("out_partials", out_partials, 5), ("lse_partials", lse_partials, 4)):
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.dim() != dims:
            fail(name, f"must be a {dims}-D float32 tensor")
    if lse_partials.shape != out_partials.shape[:4]:
        fail("lse_partials", f"must have shape {tuple(out_partials.shape[:4])}, got {tuple(lse_partials.shape)}")
    if not 1 <= out_partials.shape[0] <= MAX_SPLITS:
        fail("out_partials", f"must hold 1 to {MAX_SPLITS} partials, got {out_partials.shape[0]}")
    if out_dtype not in (torch.float16, torch.bfloat16):
        fail("out_dtype", f"must be float16 or bfloat16, got {out_dtype}")
    head_dim = out_partials.shape[-1] if head_dim is None else head_dim
    if head_dim_rounded(head_dim) != out_partials.shape[-1]:
        fail("head_dim", f"{head_dim} does not round to the partials' last dim {out_partials.shape[-1]}")
    for name, t in (("out_partials", out_partials), ("lse_partials", lse_partials)):
        if t.device.type != "cuda":
            fail(name, f"must be on a CUDA device, got {t.device}")
    if refusal := head_dim_refusal(head_dim):
        fail("head_dim", refusal)
    return combine(out_partials.contiguous(), lse_partials.contiguous(), out_dtype, head_dim, None, 0)
