"""The Hopper backend: sparse calls run by flash-attn-4's CuTe-DSL SM90 forward (stage 4).

flash-attn-4 (imported as `flash_attn.cute`, the `[hopper]` extra) already walks per-tile
"mask"/"full" block lists on SM90 with TMA and WGMMA. Upstream's contract is narrower than this
project's (the partial tail block last in its list, every id in range, counts within the row);
patch flash-attn-4/0004 widens its SM90 kernel to ours instead (counts clamped to the row, an id
out of range read as the block past the end, the sequence-end mask on every block of a list that
names the tail block or such an id: 0007), so `block_sparse_tensors`
- passes batched tables as views, trimmed to ceil(seqlen_q / q_block_size) rows as it requires,
  with no launch before the kernel (decode calls are a few microseconds long);
- keeps per-K/V-head lists as they are: flash-attn-4 (stage 4) then packs the query heads of a
  K/V head into one tile (PackGQA), so each listed block is read once per K/V head;
- gives calls without mask lists one zero count (its kernels require mask lists), viewed with the
  full lists' shape: a (1, 1, 1) count beside full lists of several query tiles failed its
  m-block check, and beside per-query-head GQA lists made it pack heads it cannot pack;
- re-lays varlen rows at its stride, ceil(seqlen_k_b / block_size) entries per row (sorted and
  range-checked by torch ops on the way).
Empty lists keep their meaning (O = 0, LSE = -inf) and LSE comes back in the FA-2 path's layout.

Split-KV (stage 4), fixed-length calls only (SPLIT_KV_UNSUPPORTED): each of `num_splits` CTAs
per tile walks an even share of the tile's lists and writes an fp32 partial; flash-attn-4's
combine kernel merges them.

What it cannot run (`unsupported_reason` says why): GPUs other than SM90, head dims above 128,
logical block sizes other than 64 and 128 (its SM90 tile_n must equal the block size), varlen
query tiles other than 64 and 128 rows, paged K/V.
"""

import functools
import importlib
import traceback
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .builders import _PAST_EVERY_ID, to_cute_block_sparse_tensors
from .metadata import SparseBlocks, cdiv

BLOCK_SIZES = (64, 128)
VARLEN_Q_BLOCK_SIZES = (64, 128)
MAX_HEAD_DIM = 128
TILE_ROWS = 128  # query rows of its SM90 tile at these head dims
SMALL_TILE_ROWS = 64  # ... or of its one-warpgroup tile, which decode calls take (small_tile)
SPLIT_KV_UNSUPPORTED = ("split-KV runs on fixed-length calls only (varlen splits would need the per-sequence "
                        "split counts of flash-attn-4's varlen scheduler, which its SM90 kernel does not read)")


def import_cute(module: str):
    """Import flash_attn.cute.<module>.

    flash-attn-4 ships `flash_attn/cute/` without a `flash_attn/__init__.py`. Installed in the
    same site-packages as this wheel it lands inside our flash_attn package; installed elsewhere
    (e.g. `pip install --target`), our regular flash_attn package hides it, so its folder is
    added to flash_attn's search path.
    """
    try:
        return importlib.import_module(f"flash_attn.cute.{module}")
    except ModuleNotFoundError:
        import pkgutil
        import flash_attn
        flash_attn.__path__ = pkgutil.extend_path(list(flash_attn.__path__), "flash_attn")
        return importlib.import_module(f"flash_attn.cute.{module}")


@functools.lru_cache(maxsize=None)
def missing_runtime() -> Optional[str]:
    """None when flash-attn-4 and its CuTe-DSL runtime import, else the reason."""
    try:
        import_cute("interface")
    except Exception as error:  # any import failure means no Hopper backend
        where = traceback.extract_tb(error.__traceback__)[-1]
        return (f"flash-attn-4 (the CuTe-DSL kernels, extra `[hopper]`) is not importable: "
                f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})")
    return None


def unsupported_reason(q: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int, varlen: bool,
                       paged: bool = False) -> Optional[str]:
    """Why this call cannot run on the Hopper backend, or None. Shapes only: never syncs."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "the Hopper backend runs on SM90 GPUs (H100/H200) only"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    if blocks.block_size not in BLOCK_SIZES:
        return f"block_size {blocks.block_size} not in {BLOCK_SIZES} (SM90 tile_n must equal the block size)"
    if varlen and blocks.resolved_q_block_size(max_seqlen_q) not in VARLEN_Q_BLOCK_SIZES:
        return f"varlen q_block_size must be one of {VARLEN_Q_BLOCK_SIZES}"
    if paged:
        return "paged K/V with block lists is not handled by flash-attn-4's sparse producer"
    return missing_runtime()


_ZERO_COUNTS = {}  # device -> the (1, 1, 1) zero count of _zero_counts


def _zero_counts(device: torch.device) -> Tensor:
    """A (1, 1, 1) zero, viewed with the full lists' shape for every tile: the counts of the empty mask
    lists its kernels require. Made once per device, outside any graph capture (a tensor made
    during one belongs to that graph's pool), so a decode call writes nothing before its kernel."""
    zero = _ZERO_COUNTS.get(device)
    if zero is None:
        zero = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ZERO_COUNTS[device] = zero
    return zero


@dataclass(frozen=True)
class _VarlenRows:
    """Where each entry of a varlen idx table sits, in our layout and in flash-attn-4's.

    Our rows of sequence b are n_b = (its entries) / (its query tiles) long, whatever the caller
    chose; flash-attn-4 places row m of sequence b at offset'[b] + m * ceil(seqlen_k_b / tile_n).
    Computed once per call, on the device, and shared by the mask and full lists.
    """
    row_of_entry: Tensor   # (total_n,) the table row each entry belongs to
    rank: Tensor           # (total_n,) its position within that row
    in_row: Tensor         # (total_n,) whether that position is within the row
    entry_blocks: Tensor   # (total_n,) K/V blocks of its sequence: valid ids are below
    row_width: Tensor      # (total_m,) entries a re-laid row holds
    new_row_start: Tensor  # (total_m,) where a re-laid row starts
    new_offsets: Tensor    # (batch + 1,) cu_block_idx_offsets of the re-laid table
    capacity: int          # entries of the re-laid table (an upper bound known on the host)

    @staticmethod
    def of(blocks: SparseBlocks, seqlens_k: Tensor, max_seqlen_k: int) -> "_VarlenRows":
        device = blocks.full_idx.device
        total_m, total_n = blocks.full_cnt.shape[1], blocks.full_idx.shape[1]
        batch = blocks.cu_total_m_blocks.shape[0] - 1
        cu_m = blocks.cu_total_m_blocks.to(torch.int64)
        offsets = blocks.cu_block_idx_offsets.to(torch.int64)
        m_per_seq = cu_m[1:] - cu_m[:-1]
        n_per_seq = torch.where(m_per_seq > 0, (offsets[1:] - offsets[:-1]) // m_per_seq.clamp(min=1), 0)
        blocks_per_seq = (seqlens_k.to(torch.int64) + blocks.block_size - 1) // blocks.block_size
        new_offsets = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        new_offsets[1:] = (m_per_seq * blocks_per_seq).cumsum(0)
        # Row r (of total_m) belongs to sequence b; its entries start at offset[b] + m * n_b.
        row = torch.arange(total_m, device=device)
        seq_of_row = (torch.searchsorted(cu_m, row, right=True) - 1).clamp(0, max(batch - 1, 0))
        m_in_seq = row - cu_m[seq_of_row]
        row_start = offsets[seq_of_row] + m_in_seq * n_per_seq[seq_of_row]
        entry = torch.arange(total_n, device=device)
        row_of_entry = (torch.searchsorted(row_start, entry, right=True) - 1).clamp(0, max(total_m - 1, 0))
        seq_of_entry = seq_of_row[row_of_entry]
        rank = entry - row_start[row_of_entry]
        return _VarlenRows(row_of_entry=row_of_entry, rank=rank, in_row=rank < n_per_seq[seq_of_entry],
                           entry_blocks=blocks_per_seq[seq_of_entry],
                           row_width=torch.minimum(n_per_seq, blocks_per_seq)[seq_of_row],
                           new_row_start=new_offsets[seq_of_row] + m_in_seq * blocks_per_seq[seq_of_row],
                           new_offsets=new_offsets.to(torch.int32),
                           capacity=total_m * cdiv(max_seqlen_k, blocks.block_size))


def _varlen_lists(cnt: Tensor, idx: Tensor, rows: _VarlenRows) -> Tuple[Tensor, Tensor]:
    """Sorted, range-checked varlen lists re-laid in flash-attn-4's layout (see _VarlenRows)."""
    heads = cnt.shape[0]
    rows_of_entries = rows.row_of_entry.unsqueeze(0).expand(heads, -1)
    valid = rows.in_row & (rows.rank < cnt.gather(1, rows_of_entries)) & (idx >= 0) & (idx < rows.entry_blocks)
    # One sort over (row, id) keys orders each row, valid ids first, and keeps the rows in place.
    keys = (rows.row_of_entry << 32) + torch.where(valid, idx, _PAST_EVERY_ID).to(torch.int64)
    idx_sorted = (keys.sort(dim=-1).values & 0xFFFFFFFF).to(torch.int32)
    new_cnt = torch.minimum(torch.zeros_like(cnt).scatter_add_(1, rows_of_entries, valid.to(torch.int32)),
                            rows.row_width.to(torch.int32).unsqueeze(0))
    # Entry of rank j goes to new_row_start + j; ranks past the new row's width go to a spare slot.
    target = torch.where(rows.rank < rows.row_width[rows.row_of_entry],
                         rows.new_row_start[rows.row_of_entry] + rows.rank, rows.capacity)
    new_idx = torch.full((heads, rows.capacity + 1), _PAST_EVERY_ID, dtype=torch.int32, device=idx.device)
    new_idx.scatter_(1, target.unsqueeze(0).expand(heads, -1), idx_sorted)
    return new_cnt.contiguous(), new_idx[:, :max(rows.capacity, 1)].contiguous()


def block_sparse_tensors(blocks: SparseBlocks, *, batch: int, max_seqlen_q: int,
                         max_seqlen_k: int, cu_seqlens_k: Optional[Tensor] = None,
                         seqused_k: Optional[Tensor] = None, q_block_size: Optional[int] = None):
    """flash-attn-4's BlockSparseTensorsTorch for these lists, under its contract (module doc).
    q_block_size overrides the lists' query tile as flash-attn-4 sees it (its SM90 tile_m
    follows it): 64 for calls whose queries fit one 64-row tile."""
    q_block = q_block_size or blocks.resolved_q_block_size(max_seqlen_q)
    if blocks.is_varlen:
        seqlens_k = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        rows = _VarlenRows.of(blocks, seqlens_k, max_seqlen_k)
        adapt = lambda cnt, idx: _varlen_lists(cnt, idx, rows)
    else:  # views: its SM90 kernel (patch flash-attn-4/0004) reads batched lists as they are
        m_blocks, n_blocks = cdiv(max_seqlen_q, q_block), cdiv(max_seqlen_k, blocks.block_size)
        adapt = lambda cnt, idx: (cnt[:, :, :m_blocks], idx[:, :, :m_blocks, :n_blocks])

    full_cnt, full_idx = adapt(blocks.full_cnt, blocks.full_idx)
    if blocks.mask_cnt is not None:
        mask_cnt, mask_idx = adapt(blocks.mask_cnt, blocks.mask_idx)
    elif blocks.is_varlen:  # empty mask lists, whose ids are never read
        mask_cnt, mask_idx = torch.zeros_like(full_cnt), full_idx
    else:  # the counts' view must have the full lists' shape: flash-attn-4 matches their m-block and head dims
        mask_cnt, mask_idx = _zero_counts(full_cnt.device).expand(full_cnt.shape), full_idx
    return to_cute_block_sparse_tensors(SparseBlocks(
        full_cnt, full_idx, mask_cnt, mask_idx, block_size=blocks.block_size, q_block_size=q_block,
        cu_total_m_blocks=blocks.cu_total_m_blocks,
        cu_block_idx_offsets=rows.new_offsets if blocks.is_varlen else None))


def _packed(q: Tensor, k: Tensor, blocks: SparseBlocks) -> Tuple[int, int]:
    """(tile heads, query heads per tile): the query heads of a K/V head share a tile when the
    lists are shared or per K/V head (the interface's PackGQA rule)."""
    heads, heads_k = q.shape[-2], k.shape[-2]
    if heads > heads_k and blocks.num_heads in (1, heads_k):
        return heads_k, heads // heads_k
    return heads, 1


def packs_query_heads(q: Tensor, k: Tensor, blocks: SparseBlocks) -> bool:
    """Whether the query heads of a K/V head share a tile (GQA with shared or per-K/V-head lists)."""
    return _packed(q, k, blocks)[1] > 1


def tiles(q: Tensor, k: Tensor, blocks: SparseBlocks, *, batch: int, max_seqlen_q: int) -> int:
    """CTAs of one split: 128-row tiles of each sequence's (packed) query rows (a call that takes
    64-row tiles, small_tile, fits one either way)."""
    tile_heads, group = _packed(q, k, blocks)
    return batch * tile_heads * cdiv(max_seqlen_q * group, TILE_ROWS)


def rows_per_tile(q: Tensor, k: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int) -> int:
    """Query rows of real work in one of its 128-row tiles (packed rows, up to 128)."""
    return min(TILE_ROWS, max_seqlen_q * _packed(q, k, blocks)[1])


# FA-4's split-KV cost model, fitted to run 55's sweep and refitted to run 60's (H200, graph time
# against blocks per list for 1-8 splits at B8 and B1 decode, benchmarks/profile_decode.py
# --backend fa4; benchmarks/fit_split_model.py picks each table's split count from the model and
# reports how far that is from the measured best: 0% on run 60's 27 points): one CTA walks its
# list at ~62 GB/s (one 128-key K/V block pair of d128 per ~1.06 us, whatever the CTA count up to
# ~64), all CTAs together at ~4.4 TB/s, and splitting costs the combine launch plus the fp32
# partials written and read. A CTA's block also takes its tile's matmuls at about the per-SM
# share of flash-attn-4's dense prefill rate (652 TFLOP/s / 132 SMs, DESIGN 7): 1.7 us for a
# 128-row tile, more than its bytes, so query tiles of a few hundred rows still split.
# Upstream's wave heuristic split B8 Sq16 1/16 in two, 27.5 us where one split takes 23.6: 64
# CTAs already stream at full bandwidth there, so the merge was pure cost.
CTA_READ_BYTES_PER_US = 62e3
CTA_FLOP_PER_US = 4.9e6
HBM_READ_BYTES_PER_US = 4.4e6
SPLIT_MERGE_US = 3.0


def split_time_us(splits: int, *, tiles: int, list_blocks: int, block_bytes: int, block_flops: int,
                  partial_bytes: int, num_sms: int) -> float:
    """Modelled time of `splits` splits: the longer of one CTA's chain of blocks (each its bytes
    or its tile's matmuls, in waves of one CTA per SM) and all listed bytes at full bandwidth,
    plus the merge when split."""
    waves = cdiv(tiles * splits, num_sms)
    per_block = max(block_bytes / CTA_READ_BYTES_PER_US, block_flops / CTA_FLOP_PER_US)
    chain = waves * cdiv(list_blocks, splits) * per_block
    stream = tiles * list_blocks * block_bytes / HBM_READ_BYTES_PER_US
    merge = 0.0 if splits == 1 else SPLIT_MERGE_US + 2 * splits * partial_bytes / HBM_READ_BYTES_PER_US
    return max(chain, stream) + merge


def split_work(*, tiles: int, list_blocks: int, batch: int, seqlen_q: int, heads: int, head_dim: int,
               block_size: int, element_size: int, small_tile: bool, num_sms: int) -> dict:
    """split_time_us's work for one call: its tiles, longest list, one K/V block's bytes and one
    tile's matmuls per block, and one split's fp32 partials (O and LSE of every query row)."""
    return dict(tiles=tiles, list_blocks=max(list_blocks, 1), block_bytes=2 * block_size * head_dim * element_size,
                block_flops=4 * (SMALL_TILE_ROWS if small_tile else TILE_ROWS) * block_size * head_dim,
                partial_bytes=batch * seqlen_q * heads * (head_dim + 1) * 4, num_sms=num_sms)


@functools.lru_cache(maxsize=1024)  # every argument is an int from shapes; ~135 us to evaluate at 256 blocks
def choose_num_splits(*, max_splits: int, list_blocks: int, **work) -> int:
    """The split count of least modelled time (split_time_us over `work`), the fewest on a tie;
    at most one split per listed block."""
    candidates = range(1, max(1, min(max_splits, list_blocks)) + 1)
    return min(candidates, key=lambda s: (split_time_us(s, list_blocks=list_blocks, **work), s))


def small_tile(q: Tensor, k: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int) -> bool:
    """Whether a fixed-length call runs 64-row tiles (one consumer warpgroup): its packed query
    rows fit 64, so a 128-row tile would compute at least half of its WGMMA rows for nothing."""
    return not blocks.is_varlen and max_seqlen_q <= SMALL_TILE_ROWS and \
        rows_per_tile(q, k, blocks, max_seqlen_q=max_seqlen_q) <= SMALL_TILE_ROWS


def run(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, *, softmax_scale: float, causal: bool,
        batch: int, max_seqlen_q: int, max_seqlen_k: int, cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_k: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
        num_splits: int = 1, mask_source: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """The sparse forward on flash-attn-4's SM90 kernel. Returns (out, lse) as the FA-2 path does.
    mask_source (K, V): the tensors the mask lists name blocks of, in the same launch (patch
    flash-attn-4/0006: the speculative call's gathered blocks); fixed-length calls only."""
    interface = import_cute("interface")
    small = small_tile(q, k, blocks, max_seqlen_q=max_seqlen_q)
    tensors = block_sparse_tensors(blocks, batch=batch, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
                                   q_block_size=SMALL_TILE_ROWS if small else None)
    if blocks.is_varlen:
        out, lse = interface.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
            block_sparse_tensors=tensors, return_lse=True, num_splits=num_splits)
    elif mask_source is not None:  # forward only, as this package is: its autograd wrapper does not take it
        out, lse, *_ = interface._flash_attn_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                                 block_sparse_tensors=tensors, return_lse=True, num_splits=num_splits,
                                                 mask_block_kv=mask_source)
    else:
        out, lse = interface.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                             block_sparse_tensors=tensors, return_lse=True, num_splits=num_splits)
    return out, lse
