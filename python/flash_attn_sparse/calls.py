"""Argument checks of the sparse forward, in one place: SparseCall validates one call (with
metadata.validate_blocks / validate_block_contents for the lists) and holds what the backends
decide from. routing.py routes it; backends/ run it."""

import copy
import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .backends import BACKENDS
from .backends.device import MAX_SPLITS
from .backends.fa2_ops import head_dim_refusal
from .fp8 import FP8_DTYPE, call_descales
from .metadata import BLOCK_SIZES, SparseBlocks, cdiv, exhaustive_validation_requested, fail, validate_block_contents, validate_blocks
from .options import CallOptions

BlockTable = Union[Tensor, SparseBlocks]
BACKEND_NAMES = ("auto",) + tuple(BACKENDS)
DTYPES = (torch.float16, torch.bfloat16, FP8_DTYPE)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, varlen: bool, paged: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            fail(name, f"must be a tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            fail(name, f"must be float16, bfloat16 or float8_e4m3fn, got {t.dtype}")
        packed = varlen and not (paged and name != "q")  # a paged cache is 4-D in either layout
        if t.dim() != (3 if packed else 4):
            layout = ("(total, heads, head_dim)" if packed else "(num_pages, page_size, heads, head_dim)" if paged and name != "q"
                      else "(batch, seqlen, heads, head_dim)")
            fail(name, f"must be {layout}, got shape {tuple(t.shape)}")
    if k.dtype != q.dtype and k.dtype != FP8_DTYPE:  # e4m3 K/V take an e4m3 q, or a 16-bit one the package quantizes
        fail("k", f"q, k and v must have the same dtype (or float8_e4m3fn k and v), got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.dtype != k.dtype:
        fail("v", f"must have the dtype of k ({k.dtype}), got {v.dtype}")
    if k.shape != v.shape:
        fail("v", f"must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    head_dim, heads, heads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if refusal := head_dim_refusal(head_dim, check_build=False):  # the FA-2 build's head dims: op_args
        fail("q", refusal)
    if k.shape[-1] != head_dim:
        fail("k", f"head_dim must be q's {head_dim}, got {k.shape[-1]}")
    if heads % heads_k:
        fail("k", f"num_heads_k={heads_k} must divide num_heads={heads}")
    if not varlen and not paged and k.shape[0] != q.shape[0]:
        fail("k", f"batch must be q's {q.shape[0]}, got {k.shape[0]}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            fail(name, f"must be on the device of q ({q.device}), got {t.device}")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def resolve_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if not math.isfinite(softmax_scale):
        fail("softmax_scale", f"must be finite, got {softmax_scale}")
    return float(softmax_scale)


def as_blocks(table: BlockTable, block_size: int, batch: int, name: str) -> SparseBlocks:
    if isinstance(table, SparseBlocks):
        return table
    if not isinstance(table, Tensor):
        fail(name, f"must be a 1-D int32 tensor or SparseBlocks, got {type(table).__name__}")
    if table.dtype != torch.int32:
        fail(name, f"must have dtype torch.int32, got {table.dtype}")
    if block_size not in BLOCK_SIZES:
        fail("block_size", f"must be one of {BLOCK_SIZES}, got {block_size}")
    return SparseBlocks.from_block_table(table, block_size, batch_size=batch)


def broadcast_batch(blocks: SparseBlocks, batch: int) -> SparseBlocks:
    """Batched lists of batch extent 1 (e.g. a FlexAttention BlockMask made with B=None) as
    stride-0 views over `batch` sequences; other lists as they are."""
    tables = [t for t in (blocks.full_cnt, blocks.full_idx, blocks.mask_cnt, blocks.mask_idx) if t is not None]
    if (blocks.is_varlen or batch == 1 or not all(isinstance(t, Tensor) and t.dim() in (3, 4) and t.shape[0] == 1
                                                   for t in tables)):
        return blocks  # nothing to broadcast, or malformed lists that validate_blocks reports
    def expand(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else t.expand(batch, *t.shape[1:])
    return SparseBlocks(expand(blocks.full_cnt), expand(blocks.full_idx), expand(blocks.mask_cnt), expand(blocks.mask_idx),
                        block_size=blocks.block_size, q_block_size=blocks.q_block_size)


def check_num_splits(num_splits) -> None:
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= MAX_SPLITS:
        fail("num_splits", f"must be an int in [0, {MAX_SPLITS}] (0 picks automatically), got {num_splits!r}")


INT_MAX = 2 ** 31 - 1


def _check_page_table(page_table, q: Tensor, k: Tensor, v: Tensor, block_size: int, batch: int) -> int:
    """Paged K/V: k, v are (num_pages, page_size, heads_k, head_dim) caches and key position p of
    batch b is row p % page_size of page page_table[b, p // page_size]. Returns max_seqlen_k."""
    if not isinstance(page_table, Tensor):
        fail("page_table", f"must be an int32 tensor (batch, max_pages), got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        fail("page_table", f"must have dtype torch.int32, got {page_table.dtype}")
    if page_table.device != q.device:
        fail("page_table", f"must be on the device of q ({q.device}), got {page_table.device}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        fail("page_table", f"must be (batch={batch}, max_pages), got shape {tuple(page_table.shape)}")
    if page_table.numel() > 0 and page_table.stride(-1) != 1:
        fail("page_table", f"must have a contiguous last dimension, got strides {page_table.stride()}")
    num_pages, page_size = k.shape[0], k.shape[1]
    if page_size <= 0 or page_size % 16 or (page_size % block_size and block_size % page_size):
        fail("k", f"page size (k.shape[1]) must be a multiple of 16 that divides block_size={block_size} "
                  f"or is a multiple of it, got {page_size}")
    # The kernel places a key at (page * rows_per_page + row) * row_stride, for K and V alike.
    rows_per_page = k.stride(0) // k.stride(1) if k.stride(1) > 0 else 0
    if rows_per_page < page_size or k.stride(0) != rows_per_page * k.stride(1):
        fail("k", f"a paged cache's page stride must be a multiple (>= page_size) of its row stride, got strides {k.stride()}")
    if v.stride(0) != rows_per_page * v.stride(1):
        fail("v", f"page stride / row stride must be k's {rows_per_page}, got strides {v.stride()}")
    if (num_pages - 1) * rows_per_page + page_size > INT_MAX:
        fail("k", f"a paged cache must span fewer than 2^31 rows, got {num_pages} pages of {rows_per_page} rows")
    max_seqlen_k = page_table.shape[1] * page_size
    if max_seqlen_k > INT_MAX:
        fail("page_table", f"max_pages * page_size must fit in int32, got {page_table.shape[1]} x {page_size}")
    return max_seqlen_k


def _validate_seqused_and_pages(seqused_k: Optional[Tensor], page_table: Optional[Tensor], seqlens_k, num_pages: int,
                                page_size: int) -> None:
    """The exhaustive checks of seqused_k (within the keys K/V hold) and of the page ids a
    sequence uses (within the cache); one host sync."""
    if seqused_k is not None:
        for b, used in enumerate(seqused_k.tolist()):
            if not 0 <= used <= seqlens_k[b]:
                fail("seqused_k", f"batch {b}: {used} outside [0, {seqlens_k[b]}]")
    if page_table is not None:
        used = seqused_k.tolist() if seqused_k is not None else seqlens_k
        pages = page_table.cpu()
        for b in range(pages.shape[0]):
            ids = pages[b, :cdiv(used[b], page_size)]
            bad = ids[(ids < 0) | (ids >= num_pages)]
            if bad.numel():
                fail("page_table", f"batch {b}: page id {int(bad[0])} outside [0, {num_pages})")


def require_cuda(q: Tensor) -> None:
    if q.device.type != "cuda":
        fail("q", f"must be on a CUDA device, got {q.device}")


def check_out(out: Optional[Tensor], q: Tensor, dtype: Optional[torch.dtype] = None) -> None:
    """out= of the entry points: a tensor like q (shape, device; dtype: the call's out_dtype,
    bfloat16 for FP8 calls, else q's) with a contiguous last dimension, which the forward overwrites."""
    if out is None:
        return
    dtype = q.dtype if dtype is None else dtype
    if not isinstance(out, Tensor):
        fail("out", f"must be a tensor, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        fail("out", f"must be like q ({tuple(q.shape)}, {dtype}, {q.device}), got ({tuple(out.shape)}, {out.dtype}, {out.device})")
    if out.numel() and out.stride(-1) != 1:
        fail("out", f"must have a contiguous last dimension, got strides {out.stride()}")


TENSOR_FIELDS = ("q", "k", "v", "blocks", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale", "k_descale",
                 "v_descale")


def facts(t) -> tuple:
    """A tensor's identity facts (what a plan or the one-shot cache compares): shape, strides, dtype, device."""
    if not isinstance(t, Tensor):
        return None if t is None else (type(t),)
    return t.shape, t.stride(), t.dtype, t.device


class SparseCall:
    """One validated sparse forward: every argument check of the entry points, and the shapes the
    backends decide from (nothing here launches or syncs, unless validate="full" asks). FP8:
    fp8 (float8_e4m3fn k and v), quantizes_q (a 16-bit q the backend quantizes), out_dtype, and
    q_descale / k_descale / v_descale as float32 (batch, heads_k) tensors (fp8.call_descales)."""

    def __init__(self, q, k, v, blocks: SparseBlocks, options: CallOptions, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, page_table=None, table_name="sparse_block_table",
                 q_descale=None, k_descale=None, v_descale=None):
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if not isinstance(options, CallOptions):
            raise TypeError(f"SparseCall takes its options as CallOptions, got {type(options).__name__}")
        causal, validate = options.causal, options.validate
        if options.backend not in BACKEND_NAMES:
            fail("backend", f"must be one of {BACKEND_NAMES}, got {options.backend!r}")
        self.options = options
        self.requested_backend = options.backend
        check_num_splits(options.num_splits)
        self.requested_splits = options.num_splits
        q, k, v = _check_qkv(q, k, v, varlen, paged=page_table is not None)
        if varlen:
            for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
                if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.device != q.device:
                    fail(name, "must be a 1-D int32 tensor on the device of q")
            if cu_seqlens_k.shape != cu_seqlens_q.shape:
                fail("cu_seqlens_k", f"must have the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)}, got {tuple(cu_seqlens_k.shape)}")
            for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
                if not isinstance(value, int) or value < 0:
                    fail(name, f"must be a non-negative int, got {value!r}")
            batch = cu_seqlens_q.shape[0] - 1
        else:
            batch, max_seqlen_q, max_seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        if seqused_k is not None:
            if (not isinstance(seqused_k, Tensor) or seqused_k.dtype != torch.int32 or seqused_k.shape != (batch,)
                    or seqused_k.device != q.device):
                fail("seqused_k", f"must be an int32 tensor of shape ({batch},) on the device of q")
        if not isinstance(causal, bool):
            fail("causal", f"must be a bool, got {causal!r}")
        if not isinstance(blocks, SparseBlocks):
            fail(table_name, f"must be SparseBlocks, got {type(blocks).__name__}")
        if not varlen:
            blocks = broadcast_batch(blocks, batch)
        validate_blocks(blocks, batch_size=batch, num_heads=q.shape[-2], num_heads_k=k.shape[-2],
                        max_seqlen_q=max_seqlen_q, device=q.device, varlen=varlen)
        if page_table is not None:
            capacity = _check_page_table(page_table, q, k, v, blocks.block_size, batch)
            if varlen and max_seqlen_k > capacity:
                fail("max_seqlen_k", f"must be at most max_pages * page_size = {capacity} with a page_table, got {max_seqlen_k}")
            max_seqlen_k = max_seqlen_k if varlen else capacity
        if exhaustive_validation_requested(validate):
            if varlen:
                seqlens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
                seqlens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
                if max(seqlens_q + [0]) > max_seqlen_q or max(seqlens_k + [0]) > max_seqlen_k:
                    fail("max_seqlen_q", "max_seqlen_q / max_seqlen_k must bound the sequence lengths in cu_seqlens")
            else:
                seqlens_q, seqlens_k = [max_seqlen_q] * batch, [max_seqlen_k] * batch
            _validate_seqused_and_pages(seqused_k, page_table, seqlens_k, k.shape[0], k.shape[1])
            if seqused_k is not None:
                seqlens_k = seqused_k.tolist()
            validate_block_contents(blocks, causal=causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k)
        self.scale = resolve_scale(options.softmax_scale, q.shape[-1])
        self.q_descale, self.k_descale, self.v_descale = call_descales(q, k, batch, q_descale, k_descale, v_descale)
        self.fp8 = k.dtype == FP8_DTYPE  # e4m3 K/V: FA-3 only, bfloat16 out
        self.quantizes_q = self.fp8 and q.dtype != FP8_DTYPE  # a 16-bit q the backend quantizes per (sequence, K/V head)
        self.out_dtype = torch.bfloat16 if self.fp8 else q.dtype
        require_cuda(q)  # last, so that every other check also runs (and is tested) on CPU tensors
        self.q, self.k, self.v, self.blocks = q, k, v, blocks
        self.batch, self.varlen = batch, varlen
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.causal = causal
        self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k = cu_seqlens_q, cu_seqlens_k, seqused_k
        self.page_table = page_table
        self.mask_lists = None  # (mask_cnt, mask_idx) replacing the blocks' own; see use_mask_lists
        self.mask_source = None  # (k, v) the mask lists name blocks of, when not self.k / self.v

    def rebind(self, **tensors) -> "SparseCall":
        """A copy of this validated call over other tensors (TENSOR_FIELDS) of the same shapes,
        strides, dtypes and devices (the caller has compared them): what a plan or the one-shot
        cache runs without validating again. None of TENSOR_FIELDS passed stays as it is."""
        bound = copy.copy(self)
        for name, value in tensors.items():
            if name not in TENSOR_FIELDS:
                raise TypeError(f"rebind: unknown field {name!r}")
            setattr(bound, name, value)
        return bound

    def use_mask_lists(self, shared: SparseBlocks, source: Optional[Tuple[Tensor, Tensor]] = None,
                       causal: Optional[bool] = None) -> None:
        """Take the mask lists of `shared` (a from_block_table list, shared by every row) as this
        call's mask blocks, as stride-0 views (no padded copy), naming blocks of `source` (K, V)
        if given: the speculative forms' one launch. `causal` (if given) replaces the call's
        causal flag, which applies to mask blocks only. The caller has checked what the kernel
        needs (batched, unpaged, no mask lists of its own; for a source: its strides and a
        block size of at least one kernel tile)."""
        if causal is not None:
            self.causal = causal
        full_cnt, full_idx = self.blocks.full_cnt, self.blocks.full_idx
        self.mask_lists = (shared.mask_cnt.expand(full_cnt.shape),
                           shared.mask_idx.expand(*full_idx.shape[:3], shared.mask_idx.shape[-1]))
        self.mask_source = source

    def effective_blocks(self) -> SparseBlocks:
        """The lists this call runs: its blocks, with the shared mask lists of use_mask_lists."""
        if self.mask_lists is None:
            return self.blocks
        b = self.blocks
        return SparseBlocks(b.full_cnt, b.full_idx, *self.mask_lists, block_size=b.block_size, q_block_size=b.q_block_size)

    def max_list_length(self) -> int:
        """A bound of a row's total count from shapes, as sparse_decode_tile computes it."""
        full = self.blocks.max_list_length(self.max_seqlen_k)
        if self.mask_lists is None:
            return full
        mask_capacity, block_size = self.mask_lists[1].shape[-1], self.blocks.block_size
        if self.mask_source is not None:  # its blocks add to k's
            return full + min(mask_capacity, cdiv(self.mask_source[0].shape[1], block_size))
        return min(full + mask_capacity, cdiv(self.max_seqlen_k, block_size))
