"""Public API of speculative sparse attention over the FA-2 kernels."""

import logging
import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import fa4, ops
from .metadata import (BLOCK_SIZES, SparseBlocks, cdiv, exhaustive_validation_requested, fail, int_range,
                       validate_block_contents, validate_blocks)

BlockTable = Union[Tensor, SparseBlocks]
MAX_SPLITS = 128
BACKENDS = ("auto", "fa2", "fa4")
# auto sends a fixed-length call to the Hopper (FA-4) backend when the query heads of a K/V head
# share its tiles (GQA packing: shared or per-K/V-head lists), or when its 128-row tiles hold at
# least FA4_MIN_TILE_ROWS query rows. Both backends split the lists; since patch flash-attn-4/0004
# the FA-4 API costs what its kernel costs; through this rule (run 68, H200) packed decode on
# FA-4 vs FA-2: B8 Sq1 H32/8 1/16 20.9 vs 24.1 us, 1/4 68.8 vs 70.5, every block 0.245 vs 0.249
# ms; B1 Sq1 128k 15.4 vs 16.1, but 1/4 40.2 vs 39.9 and every block 0.134 vs 0.132 (FA-2 ahead
# by 1%); ahead at B8 Sq16 and every crossover point (run 56). Unpacked calls with fewer rows (per
# query head lists at decode) were not timed on FA-4 and stay on FA-2. A varlen call goes
# to FA-4 when its tiles are full and keep most of the GPU busy without splitting (FA-4 cannot
# split varlen calls): at least FA4_MIN_QUERY_ROWS rows per sequence and tiles for
# FA4_MIN_SM_SHARE of the SMs (crossover measured before split-KV, H200 B1 H32 Sk16k: FA-2
# ahead at 64 tiles, FA-4 at 128; stages/stage4.md).
FA4_MIN_TILE_ROWS = 64
FA4_MIN_QUERY_ROWS = 128
FA4_MIN_SM_SHARE = 0.75

logger = logging.getLogger("flash_attn_sparse")


_SM_COUNTS = {}


@torch.compiler.assume_constant_result
def _num_sms(device_index: int) -> int:
    if device_index not in _SM_COUNTS:
        _SM_COUNTS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _SM_COUNTS[device_index]


KERNEL_ROWS = 64  # query rows per CTA of the split-capable kernel
DECODE_KERNEL_ROWS = 16  # ... or of its 16-row forms: key-split, or one-warp decode over long lists when
DECODE_MIN_LIST_KEYS = 16384  # flash_sparse.h's sparse_decode_tile, which says what was measured
DECODE_MIN_TOTAL_KEYS = 1 << 20


def _decode_tile(packed_rows: int, max_list_keys: int, ctas: int) -> bool:
    """Whether the kernel runs its 16-row decode tile (the same rule as sparse_decode_tile)."""
    return (packed_rows <= DECODE_KERNEL_ROWS and max_list_keys >= DECODE_MIN_LIST_KEYS
            and ctas * max_list_keys >= DECODE_MIN_TOTAL_KEYS)


def _tile_n(head_dim: int, decode_tile: bool) -> int:
    """Keys per tile of the split-capable sparse kernel: its 64-row form, or its 16-row decode form."""
    if decode_tile:
        return 128 if head_dim <= 128 else 64
    return 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)


def choose_num_splits(batch_heads_mblocks: int, num_sms: int, num_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Upstream's num_splits_heuristic, over the tiles of the block list instead of the dense range.

    One split if the CTAs nearly fill the GPU; else the fewest splits within 85% of the best
    wave efficiency, counting a split count as distinct only if it changes tiles per split.
    """
    if batch_heads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_tiles)
    candidates, efficiencies = [], []
    for splits in range(1, max_splits + 1):
        if splits > 1 and cdiv(num_tiles, splits) == cdiv(num_tiles, splits - 1):
            continue
        waves = batch_heads_mblocks * splits / num_sms
        candidates.append(splits)
        efficiencies.append(waves / math.ceil(waves))
    best = max(efficiencies)
    for splits, efficiency in zip(candidates, efficiencies):
        if efficiency >= 0.85 * best:
            return splits
    return 1


def _split_slots(q: Tensor, decode_tile: bool) -> int:
    """CTAs per wave that the split heuristic fills: two per SM, as upstream assumes, and three of
    the one-warp decode tile. The key-split tile fits three per SM too, but counted as two it
    picks fewer, longer splits, which measured faster: run 41's sweep (H200, lists from HBM), 4
    splits instead of 6 at B8 Sq1 1/4 and 1/16 (-1.2 us each), 29 instead of 37 at B1 1/4 (-2.2
    us), and 32 as before at B1 1/16."""
    return (3 if decode_tile else 2) * _num_sms(q.device.index or 0)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, varlen: bool, paged: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            fail(name, f"must be a tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            fail(name, f"must be float16 or bfloat16, got {t.dtype}")
        if t.dim() != (3 if varlen else 4):
            layout = "(total, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
            fail(name, f"must be {layout}, got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail("k", f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        fail("v", f"must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    head_dim, heads, heads_k = q.shape[-1], q.shape[-2], k.shape[-2]
    if refusal := ops.head_dim_refusal(head_dim, check_build=False):  # the FA-2 build's head dims: op_args
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


def _resolve_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if not math.isfinite(softmax_scale):
        fail("softmax_scale", f"must be finite, got {softmax_scale}")
    return float(softmax_scale)


def _as_blocks(table: BlockTable, block_size: int, batch: int, name: str) -> SparseBlocks:
    if isinstance(table, SparseBlocks):
        return table
    if not isinstance(table, Tensor):
        fail(name, f"must be a 1-D int32 tensor or SparseBlocks, got {type(table).__name__}")
    if table.dtype != torch.int32:
        fail(name, f"must have dtype torch.int32, got {table.dtype}")
    if block_size not in BLOCK_SIZES:
        fail("block_size", f"must be one of {BLOCK_SIZES}, got {block_size}")
    return SparseBlocks.from_block_table(table, block_size, batch_size=batch)


def _check_num_splits(num_splits) -> None:
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


class _Call:
    """One validated sparse forward: the arguments of the custom ops."""

    def __init__(self, q, k, v, blocks: SparseBlocks, *, causal: bool, softmax_scale, num_splits: int = 0,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, page_table=None,
                 validate=None, table_name="sparse_block_table", backend="fa2"):
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        if backend not in BACKENDS:
            fail("backend", f"must be one of {BACKENDS}, got {backend!r}")
        self.requested_backend = backend
        _check_num_splits(num_splits)
        self.requested_splits = num_splits
        if varlen and page_table is not None:
            fail("page_table", "paged K/V is batched only; varlen calls cannot take a page_table")
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
            if not isinstance(seqused_k, Tensor) or seqused_k.dtype != torch.int32 or seqused_k.shape != (batch,) or seqused_k.device != q.device:
                fail("seqused_k", f"must be an int32 tensor of shape ({batch},) on the device of q")
        if not isinstance(causal, bool):
            fail("causal", f"must be a bool, got {causal!r}")
        if not isinstance(blocks, SparseBlocks):
            fail(table_name, f"must be SparseBlocks, got {type(blocks).__name__}")
        validate_blocks(blocks, batch_size=batch, num_heads=q.shape[-2], num_heads_k=k.shape[-2],
                        max_seqlen_q=max_seqlen_q, device=q.device, varlen=varlen)
        if page_table is not None:
            max_seqlen_k = _check_page_table(page_table, q, k, v, blocks.block_size, batch)
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
        self.scale = _resolve_scale(softmax_scale, q.shape[-1])
        # Last, so that every other check also runs (and is tested) on CPU tensors.
        if q.device.type != "cuda":
            fail("q", f"must be on a CUDA device, got {q.device}")
        self.q, self.k, self.v, self.blocks = q, k, v, blocks
        self.batch, self.varlen = batch, varlen
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.causal = causal
        self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k = cu_seqlens_q, cu_seqlens_k, seqused_k
        self.page_table = page_table
        self.mask_lists = None  # (mask_cnt, mask_idx) replacing the blocks' own; see use_mask_lists
        self.mask_source = None  # (k, v) the mask lists name blocks of, when not self.k / self.v

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

    @property
    def pack_gqa(self) -> bool:
        """Whether the query heads of a K/V head share a tile, so each listed K/V block is read
        once per K/V head: when tiles would otherwise be mostly empty (short queries, decode),
        and the lists are shared or per K/V head."""
        heads, heads_k = self.q.shape[-2], self.k.shape[-2]
        group = heads // heads_k
        q_block = self.blocks.resolved_q_block_size(self.max_seqlen_q)
        return (group > 1 and self.blocks.num_heads in (1, heads_k) and KERNEL_ROWS % group == 0
                and q_block % (KERNEL_ROWS // group) == 0 and self.max_seqlen_q < KERNEL_ROWS)

    def op_args(self, num_splits: int):
        """The FA-2 kernels' arguments; refuses a head dim this build did not compile."""
        if refusal := ops.head_dim_refusal(self.q.shape[-1]):
            fail("q", refusal)
        b = self.blocks
        mask_cnt, mask_idx = self.mask_lists or (b.mask_cnt, b.mask_idx)
        k_source, v_source = self.mask_source or (None, None)
        return (self.q, self.k, self.v, b.full_cnt, b.full_idx, mask_cnt, mask_idx,
                self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, b.cu_total_m_blocks, b.cu_block_idx_offsets,
                self.max_seqlen_q, self.max_seqlen_k, b.block_size, b.resolved_q_block_size(self.max_seqlen_q),
                self.scale, self.causal, num_splits, self.pack_gqa, self.page_table, k_source, v_source)

    def split_work(self) -> Tuple[int, int, int]:
        """(CTAs per split, CTAs per wave, kernel tiles of the longest list) of the split-capable
        kernel, in the form it runs (run_mha_fwd_sparse_narrow_): the one-warp 16-row decode
        tile, else for packed rows that fit 16 rows (head dim <= 128) the 16-row tile whose warps
        split the keys, else 64-row tiles; the last two have the same CTAs and tiles here."""
        group = self.q.shape[-2] // self.k.shape[-2] if self.pack_gqa else 1
        tile_heads = self.batch * (self.q.shape[-2] // group)
        max_list_keys = self.max_list_length() * self.blocks.block_size
        packed_rows = self.max_seqlen_q * group
        decode_tile = _decode_tile(packed_rows, max_list_keys, tile_heads)
        ctas = tile_heads * cdiv(packed_rows, KERNEL_ROWS)
        tiles = cdiv(max_list_keys, _tile_n(self.q.shape[-1], decode_tile))
        return ctas, _split_slots(self.q, decode_tile), max(tiles, 1)

    def num_splits(self) -> int:
        """The requested split count, or the heuristic's choice for 0."""
        if self.requested_splits:
            return self.requested_splits
        return choose_num_splits(*self.split_work())

    def fa4_num_splits(self) -> int:
        """The requested split count, or for 0 the least modelled time (fa4.choose_num_splits)
        over FA-4's tiles, the longest list and the fp32 partials of one split."""
        if self.varlen:
            return 1  # see fa4.SPLIT_KV_UNSUPPORTED
        if self.requested_splits:
            return self.requested_splits
        return fa4.choose_num_splits(max_splits=MAX_SPLITS, **fa4.split_work(
            tiles=fa4.tiles(self.q, self.k, self.blocks, batch=self.batch, max_seqlen_q=self.max_seqlen_q),
            list_blocks=self.max_list_length(), batch=self.batch, seqlen_q=self.max_seqlen_q, heads=self.q.shape[-2],
            head_dim=self.q.shape[-1], block_size=self.blocks.block_size, element_size=self.q.element_size(),
            small_tile=fa4.small_tile(self.q, self.k, self.blocks, max_seqlen_q=self.max_seqlen_q),
            num_sms=_num_sms(self.q.device.index or 0)))

    def backend(self) -> Tuple[str, str]:
        """(backend, why): the requested one, or auto's choice. A requested "fa4" that cannot
        run this call is an error."""
        if self.requested_backend == "fa2":
            return "fa2", "requested"
        if torch.compiler.is_compiling():  # the FA-2 path is a custom op; the FA-4 one is not traceable
            if self.requested_backend == "fa4":
                fail("backend", "'fa4' cannot be traced by torch.compile; use 'fa2' or 'auto' there")
            return "fa2", "traced by torch.compile"
        unsupported = fa4.unsupported_reason(self.q, self.blocks, max_seqlen_q=self.max_seqlen_q, varlen=self.varlen,
                                             paged=self.page_table is not None)
        if self.requested_backend == "fa4":
            if unsupported:
                fail("backend", f"'fa4' cannot run this call: {unsupported}")
            if self.requested_splits > 1 and self.varlen:
                fail("num_splits", f"the Hopper backend cannot split this call: {fa4.SPLIT_KV_UNSUPPORTED}")
            return "fa4", "requested"
        if unsupported:
            return "fa2", unsupported
        if not self.varlen:  # both backends split the lists: FA-4 where it packs heads or fills half a tile
            rows = fa4.rows_per_tile(self.q, self.k, self.blocks, max_seqlen_q=self.max_seqlen_q)
            if fa4.packs_query_heads(self.q, self.k, self.blocks):
                return "fa4", f"query heads packed per K/V head, {rows} rows per FA-4 tile"
            if rows < FA4_MIN_TILE_ROWS:
                return "fa2", f"{rows} query rows per FA-4 tile of {fa4.TILE_ROWS}: FA-2's smaller tiles"
            return "fa4", f"{rows} query rows per FA-4 tile of {fa4.TILE_ROWS}"
        if self.requested_splits > 1:
            return "fa2", "split-KV requested (FA-4 splits fixed-length calls only)"
        if self.max_seqlen_q < FA4_MIN_QUERY_ROWS:
            return "fa2", f"max_seqlen_q {self.max_seqlen_q} < {FA4_MIN_QUERY_ROWS}: decode-shaped, FA-2 splits the list"
        # Varlen: the tiles of an average sequence (total_q / batch) stand for each sequence's.
        rows = self.q.shape[0] / max(self.batch, 1) if self.varlen else self.max_seqlen_q
        ctas = self.batch * self.q.shape[-2] * math.ceil(rows / fa4.TILE_ROWS)
        sms = _num_sms(self.q.device.index or 0)
        if ctas < FA4_MIN_SM_SHARE * sms:
            return "fa2", f"{ctas} FA-4 tiles for {sms} SMs: FA-2 splits the list to fill the GPU"
        return "fa4", f"{ctas} FA-4 tiles of {fa4.TILE_ROWS} rows for {sms} SMs"

    def run(self) -> Tuple[Tensor, Tensor]:
        backend, why = self.backend()
        if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparse forward on %s (%s)", backend, why)
        if backend == "fa4":
            return fa4.run(self.q, self.k, self.v, self.effective_blocks(), softmax_scale=self.scale, causal=self.causal,
                           batch=self.batch, max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k,
                           cu_seqlens_q=self.cu_seqlens_q, cu_seqlens_k=self.cu_seqlens_k, seqused_k=self.seqused_k,
                           num_splits=self.fa4_num_splits(), mask_source=self.mask_source)
        return ops.sparse_fwd(*self.op_args(self.num_splits()))

    def run_partial(self, out_partial: Tensor, lse_partial: Tensor, offset: int, num_splits: int) -> None:
        ops.sparse_fwd_partial(*self.op_args(num_splits), out_partial, lse_partial, offset)


def flash_attn_with_sparse_block_table(q: Tensor, k: Tensor, v: Tensor, sparse_block_table: BlockTable,
                                       block_size: int = 128, softmax_scale: Optional[float] = None,
                                       num_splits: int = 0, causal: bool = False,
                                       validate: Optional[str] = None, backend: str = "auto", *,
                                       seqused_k: Optional[Tensor] = None,
                                       page_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
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
    backend: "fa2" (this package's kernels), "fa4" (flash-attn-4's SM90 kernel, extra
    `[hopper]`) or "auto" (on SM90 FA-4 where it can run the call and packs GQA query heads or
    its 128-row tiles hold 64+ query rows, else FA-2; stages/stage4.md);
    `choose_backend` tells which and `choose_num_splits_for` the split count, and the
    "flash_attn_sparse" logger says so at DEBUG.
    """
    blocks = _as_blocks(sparse_block_table, block_size, q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1,
                        "sparse_block_table")
    call = _Call(q, k, v, blocks, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, validate=validate,
                 backend=backend, seqused_k=seqused_k, page_table=page_table)
    return call.run()


def flash_attn_varlen_with_sparse_blocks(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                         max_seqlen_q: int, max_seqlen_k: int, blocks: SparseBlocks,
                                         causal: bool = False, softmax_scale: Optional[float] = None,
                                         num_splits: int = 0, seqused_k: Optional[Tensor] = None,
                                         validate: Optional[str] = None, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Varlen form: q (total_q, heads, head_dim), k, v (total_k, heads_k, head_dim) packed by
    cu_seqlens; blocks in the varlen layout. Returns out like q and lse (heads, total_q).
    backend as in flash_attn_with_sparse_block_table."""
    call = _Call(q, k, v, blocks, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                 max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, validate=validate, table_name="blocks",
                 backend=backend)
    return call.run()


def _call_to_choose_for(q, k, v, blocks: BlockTable, block_size: int, *, causal: bool = False,
                        softmax_scale: Optional[float] = None, **options) -> _Call:
    """The _Call that flash_attn_with_sparse_block_table, or with cu_seqlens_q in options
    flash_attn_varlen_with_sparse_blocks, would make: what the choose_* functions ask."""
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 and "cu_seqlens_q" not in options else 1
    return _Call(q, k, v, _as_blocks(blocks, block_size, batch, "blocks"), causal=causal, softmax_scale=softmax_scale,
                 **options)


def choose_num_splits_for(q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, block_size: int = 128,
                          backend: str = "fa2", **options) -> int:
    """The split-KV count that flash_attn_with_sparse_block_table (options as in choose_backend)
    would use on `backend` ("fa2" or "fa4") with num_splits=0. Never syncs."""
    call = _call_to_choose_for(q, k, v, blocks, block_size, backend=backend, **options)
    return call.fa4_num_splits() if backend == "fa4" else call.num_splits()


def choose_backend(q: Tensor, k: Tensor, v: Tensor, blocks: BlockTable, block_size: int = 128,
                   num_splits: int = 0, backend: str = "auto", **options) -> Tuple[str, str]:
    """(backend, why) that flash_attn_with_sparse_block_table would use for these arguments, or,
    given cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k as keywords,
    flash_attn_varlen_with_sparse_blocks. options also takes causal, softmax_scale, seqused_k and
    page_table. Never syncs."""
    return _call_to_choose_for(q, k, v, blocks, block_size, num_splits=num_splits, backend=backend,
                               **options).backend()


def flash_attn_sparse_partials(q: Tensor, k: Tensor, v: Tensor, block_groups: Sequence[BlockTable],
                               block_size: int = 128, softmax_scale: Optional[float] = None,
                               causal: bool = False, validate: Optional[str] = None, *,
                               seqused_k: Optional[Tensor] = None,
                               page_table: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One (O, LSE) partial per group of blocks, unmerged: out_partials (G, batch, heads,
    seqlen_q, head_dim_rounded) fp32 and lse_partials (G, batch, heads, seqlen_q) fp32, in the
    layout flash_attn_combine takes. Groups should be disjoint for the merge to be attention
    over their union. seqused_k and page_table (paged K/V caches) as in
    flash_attn_with_sparse_block_table."""
    if not isinstance(block_groups, (list, tuple)) or not block_groups:
        fail("block_groups", "must be a non-empty list of block tables")
    if len(block_groups) > MAX_SPLITS:
        fail("block_groups", f"at most {MAX_SPLITS} groups, got {len(block_groups)}")
    calls = [_Call(q, k, v, _as_blocks(g, block_size, q.shape[0] if q.dim() == 4 else 1, f"block_groups[{i}]"),
                   causal=causal, softmax_scale=softmax_scale, validate=validate, table_name=f"block_groups[{i}]",
                   seqused_k=seqused_k, page_table=page_table)
             for i, g in enumerate(block_groups)]
    first = calls[0]
    out_partial, lse_partial = ops.partial_buffers(len(calls), first.batch, first.q.shape[2], first.max_seqlen_q,
                                                   first.q.shape[3], first.q.device)
    for slot, call in enumerate(calls):
        call.run_partial(out_partial, lse_partial, slot, num_splits=1)
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
    if ops.head_dim_rounded(head_dim) != out_partials.shape[-1]:
        fail("head_dim", f"{head_dim} does not round to the partials' last dim {out_partials.shape[-1]}")
    for name, t in (("out_partials", out_partials), ("lse_partials", lse_partials)):
        if t.device.type != "cuda":
            fail(name, f"must be on a CUDA device, got {t.device}")
    if refusal := ops.head_dim_refusal(head_dim):
        fail("head_dim", refusal)
    return ops.combine(out_partials.contiguous(), lse_partials.contiguous(), out_dtype, head_dim, None, 0)


def _one_launch_refusal(q: Tensor, k_spec, v_spec, k: Tensor, v: Tensor, missed: SparseBlocks,
                        paged: bool = False) -> Optional[str]:
    """Why the speculative call cannot run as one launch over both sources (None if it can).
    The same conditions as mha_fwd_sparse's checks of a mask-block source; the two-pass form
    runs otherwise (and reports bad input)."""
    if paged:
        return "paged k and v (the kernel pages every tile alike)"
    if not all(isinstance(t, Tensor) and t.dim() == 4 for t in (q, k_spec, v_spec, k, v)):
        return "not batched 4-D tensors"
    if missed.is_varlen or missed.mask_cnt is not None:
        return "the missed set has mask lists or the varlen layout"
    if missed.block_size < _tile_n(q.shape[-1], decode_tile=False):
        return f"block size {missed.block_size} is below the kernel tile at head dim {q.shape[-1]}"
    for t in (k_spec, v_spec):
        if t.dtype != q.dtype or t.device != q.device or t.shape[0] != q.shape[0] or t.shape[2:] != k.shape[2:] or t.shape[1] == 0:
            return "k_spec / v_spec differ from k / v in dtype, device, batch, heads or head dim, or are empty"
    if (k_spec.stride()[1:] != k.stride()[1:] or v_spec.stride()[1:] != v.stride()[1:] or k.stride(-1) != 1
            or v.stride(-1) != 1):
        return "k_spec / v_spec have other row or head strides than k / v"
    return None


def flash_attn_speculative_sparse(q: Tensor, k_spec: Tensor, v_spec: Tensor, k: Tensor, v: Tensor,
                                  sparse_block_table: BlockTable, softmax_scale: Optional[float] = None,
                                  causal_spec: bool = True, block_size: int = 128, num_splits: int = 0,
                                  validate: Optional[str] = None, *, seqused_k: Optional[Tensor] = None,
                                  page_table: Optional[Tensor] = None, backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Speculative + repair: attention over the caller-gathered speculative K/V (k_spec, v_spec;
    it holds the diagonal, causal when causal_spec) merged exactly with attention over the
    missed blocks of the full K/V (sparse_block_table, all "full": every key visible to every
    query row). Returns (out, lse) like flash_attn_with_sparse_block_table. seqused_k and
    page_table describe k and v (paged caches) as in flash_attn_with_sparse_block_table; k_spec
    and v_spec stay contiguous (batch, seqlen_spec, heads_k, head_dim).

    Where the missed pass goes to FA-4 at prefill (seqlen_q >= 128), it runs there over every
    row, and the speculative pass only over the rows that see a speculative key (with
    causal_spec, the last seqlen_spec rows), merged into those rows. Otherwise, where the kernels
    allow (see _one_launch_refusal: k_spec/v_spec strided like k/v, a block size of at least one
    kernel tile, no mask lists in the missed set), one launch on the missed pass's backend: the
    missed blocks are the call's "full" blocks and the speculative ones its "mask" blocks, read
    from k_spec / v_spec. Otherwise two passes write fp32 partials into one buffer and the sparse
    combine kernel merges them (on FA-4: the prefill form). The same attention every way."""
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1
    missed = _as_blocks(sparse_block_table, block_size, batch, "sparse_block_table")
    if not isinstance(k_spec, Tensor) or k_spec.dim() != 4:
        fail("k_spec", "must be a (batch, seqlen_spec, heads_k, head_dim) tensor")
    if not isinstance(causal_spec, bool):
        fail("causal_spec", f"must be a bool, got {causal_spec!r}")
    # Missed blocks are all visible, so the missed pass is not causal (and is validated so).
    missed_call = _Call(q, k, v, missed, causal=False, softmax_scale=softmax_scale, num_splits=num_splits,
                        validate=validate, seqused_k=seqused_k, page_table=page_table, backend=backend)
    # At prefill on FA-4 the speculative pass runs over the rows that see k_spec only (measured
    # 0.82-0.93x one pass over the union, run 33); elsewhere one launch, on the backend the missed
    # pass takes (FA-4 reads k_spec through a second pair of TMA descriptors, patch
    # flash-attn-4/0006; FA-2 through its second source pointers).
    one_launch = _one_launch_refusal(q, k_spec, v_spec, k, v, missed, paged=page_table is not None) is None
    on_fa4 = missed_call.backend()[0] == "fa4"
    if on_fa4 and (missed_call.max_seqlen_q >= FA4_MIN_QUERY_ROWS or not one_launch):
        return _speculative_over_missed_on_fa4(missed_call, k_spec, v_spec, causal_spec, validate, backend)
    if one_launch:
        # "mask" blocks whatever causal_spec: they name the second source; the flag masks them.
        spec = _every_block_of(k_spec, batch, "mask", missed.block_size)
        missed_call.use_mask_lists(spec, source=(k_spec, v_spec), causal=causal_spec)
        return missed_call.run()
    spec_blocks = _every_block_of(k_spec, batch, "mask" if causal_spec else "full")
    spec_call = _Call(q, k_spec, v_spec, spec_blocks, causal=causal_spec, softmax_scale=softmax_scale,
                      num_splits=num_splits, validate=validate, table_name="k_spec")
    spec_splits = spec_call.num_splits()
    missed_splits = missed_call.num_splits()
    if spec_splits + missed_splits > MAX_SPLITS:
        spec_splits, missed_splits = min(spec_splits, MAX_SPLITS // 2), min(missed_splits, MAX_SPLITS // 2)
    out_partial, lse_partial = ops.partial_buffers(spec_splits + missed_splits, spec_call.batch, q.shape[2],
                                                   q.shape[1], q.shape[3], q.device)
    spec_call.run_partial(out_partial, lse_partial, 0, spec_splits)
    missed_call.run_partial(out_partial, lse_partial, spec_splits, missed_splits)
    return ops.combine(out_partial, lse_partial, q.dtype, q.shape[3], None, 0)


def _every_block_of(k_spec: Tensor, batch: int, kind: str, block_size: int = 128) -> SparseBlocks:
    """Every block of k_spec as `kind` ("mask" or "full") blocks, one list shared by every row."""
    table = int_range(0, cdiv(k_spec.shape[1], block_size), k_spec.device)
    return SparseBlocks.from_block_table(table, block_size, batch, kind=kind)


def _speculative_over_missed_on_fa4(missed_call: _Call, k_spec: Tensor, v_spec: Tensor, causal_spec: bool,
                                    validate: Optional[str], backend: str) -> Tuple[Tensor, Tensor]:
    """The speculative call with its missed pass on FA-4 (prefill): that pass over every row, the
    speculative pass over the rows that see a speculative key, and the two merged there. With
    causal_spec, row r sees speculative key j iff j <= r + seqlen_spec - seqlen_q, so rows before
    the last seqlen_spec see none and keep the missed pass's answer: at prefill the merge touches a
    few rows, not every row of a second full-size output."""
    q, batch = missed_call.q, missed_call.batch
    out, lse = missed_call.run()
    seqlen_q, seqlen_spec = q.shape[1], k_spec.shape[1]
    rows = min(seqlen_q, seqlen_spec) if causal_spec else seqlen_q
    if rows == 0:
        return out, lse
    spec_blocks = _every_block_of(k_spec, batch, "mask" if causal_spec else "full")
    spec_call = _Call(q[:, seqlen_q - rows:], k_spec, v_spec, spec_blocks, causal=causal_spec,
                      softmax_scale=missed_call.scale, validate=validate, table_name="k_spec", backend=backend)
    out_spec, lse_spec = spec_call.run()
    # Both partials of those rows as the combine's fp32 (2, b, h, rows, d_rounded) and (2, b, h, rows).
    head_dim = q.shape[-1]
    parts = torch.stack((out[:, seqlen_q - rows:], out_spec)).transpose(2, 3).float()
    pad = ops.head_dim_rounded(head_dim) - head_dim
    parts = torch.nn.functional.pad(parts, (0, pad)) if pad else parts
    lses = torch.stack((lse[:, :, seqlen_q - rows:], lse_spec))
    merged, merged_lse = ops.combine(parts.contiguous(), lses.contiguous(), q.dtype, head_dim, None, 0)
    out[:, seqlen_q - rows:] = merged
    lse[:, :, seqlen_q - rows:] = merged_lse
    return out, lse


def flash_attn_speculative_sparse_zero_copy(q: Tensor, k: Tensor, v: Tensor, spec_block_table: BlockTable,
                                            missed_block_table: BlockTable, block_size: int = 128,
                                            softmax_scale: Optional[float] = None, causal_spec: bool = True,
                                            num_splits: int = 0, validate: Optional[str] = None,
                                            backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Speculative + repair without gathering: the speculative set is a block list over the same
    K/V (as "mask" blocks, so the diagonal gets the causal mask when causal_spec) and the missed
    set another ("full" blocks). One pass over both lists gives attention over their union.
    Both tables are 1-D int32 block-id tensors shared by every batch, head and query row.
    backend as in flash_attn_with_sparse_block_table: calls that auto sends to FA-4 run there as the
    union pass does."""
    batch = q.shape[0] if isinstance(q, Tensor) and q.dim() == 4 else 1
    for name, t in (("spec_block_table", spec_block_table), ("missed_block_table", missed_block_table)):
        if not isinstance(t, Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            fail(name, "must be a 1-D int32 tensor of block ids")
        if isinstance(q, Tensor) and t.device != q.device:
            fail(name, f"must be on the device of q ({q.device}), got {t.device}")
    spec = SparseBlocks.from_block_table(spec_block_table, block_size, batch, kind="mask")
    missed = SparseBlocks.from_block_table(missed_block_table, block_size, batch)
    call = _Call(q, k, v, missed, causal=causal_spec, softmax_scale=softmax_scale, num_splits=num_splits,
                 validate=validate, backend=backend)
    if exhaustive_validation_requested(validate):  # the two lists together: ids in range, no block twice
        n = max(spec_block_table.shape[0], missed_block_table.shape[0])
        pad = lambda t: torch.nn.functional.pad(t, (0, n - t.shape[0])).view(1, 1, 1, n).expand(batch, 1, 1, n)
        union = SparseBlocks(missed.full_cnt, pad(missed_block_table), spec.mask_cnt, pad(spec_block_table), block_size)
        validate_block_contents(union, causal=causal_spec, seqlens_q=[call.max_seqlen_q] * batch,
                                seqlens_k=[call.max_seqlen_k] * batch)
    call.use_mask_lists(spec)  # views of the two tables, not a padded union (two copies and a fill)
    return call.run()
