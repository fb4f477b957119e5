"""Global block lists -> the lists of one key shard, on the device and without a host sync.

A shard holds key positions [start, stop) of a sequence; its K/V rows are local positions
0 .. stop - start. Its lists keep the listed blocks g with start / block_size <= g <
ceil(stop / block_size), re-based to local ids g - start / block_size, in list order, and their
counts. `start` must be a multiple of block_size: the kernels can mask the end of a sequence (the
sequence-end mask of the last, partial local block) but not the start of a block, so a block that
straddles a shard start cannot be split between two ranks. Shard stops need no alignment, but a
block straddling a stop that is not the sequence end would need the next shard's start inside
it, so in practice every boundary but the sequence end falls on a block edge.

Torch ops only (masks, cumsum, scatter): capturable in a CUDA graph; the capacity of each row
(the last dim of the batched idx, n_b of the varlen layout) is kept, so no size is data-dependent.
"""

from typing import Tuple, Union

import torch
from torch import Tensor

from .metadata import SparseBlocks, cdiv, fail, int_range

Bound = Union[int, Tensor]  # an int for every sequence, or an int tensor (batch,) per sequence


def block_bounds(block_size: int, start: Bound, stop: Bound) -> Tuple[Bound, Bound]:
    """[first, end) global block ids a shard holds. An int start must be block-aligned (checked);
    a tensor start is the caller's promise (reading it would synchronise)."""
    if isinstance(start, int):
        if start < 0 or start % block_size:
            fail("key_start", f"must be a non-negative multiple of block_size={block_size}, got {start}")
        first = start // block_size
    else:
        first = torch.div(start, block_size, rounding_mode="floor")
    end = cdiv(stop, block_size) if isinstance(stop, int) else torch.div(stop + block_size - 1, block_size, rounding_mode="floor")
    return first, end


def _per_row(bound: Bound, shape_prefix: int) -> Bound:
    """A (batch,) bound shaped to broadcast over a batched (batch, heads, m_blocks[, n]) table."""
    if isinstance(bound, int):
        return bound
    return bound.view(-1, *([1] * shape_prefix))


def _split_batched(cnt: Tensor, idx: Tensor, first: Bound, end: Bound) -> Tuple[Tensor, Tensor]:
    n = idx.shape[-1]
    position = int_range(0, n, idx.device)  # a view of a cached ramp: no kernel
    ids = idx.long()
    lo, hi = _per_row(first, 3), _per_row(end, 3)
    kept = (position < cnt.unsqueeze(-1)) & (ids >= lo) & (ids < hi)
    # Kept entries go to their rank among the kept ones of the row; dropped ones to a spare column.
    destination = torch.where(kept, kept.cumsum(-1) - 1, n)
    local = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.int32, device=idx.device)
    local.scatter_(-1, destination, (ids - lo).int())
    return kept.sum(-1, dtype=torch.int32), local[..., :n].contiguous()


def _varlen_rows(blocks: SparseBlocks, total_n: int):
    """For each entry e of a varlen idx row: its sequence, its list row (a column of cnt), the
    entry where that row starts, its position in the row, and whether it lies in any row."""
    cu_m, cu_off = blocks.cu_total_m_blocks.long(), blocks.cu_block_idx_offsets.long()
    batch = cu_m.shape[0] - 1
    entry = torch.arange(total_n, device=cu_off.device)
    seq = torch.searchsorted(cu_off, entry, right=True) - 1
    in_rows = (seq >= 0) & (seq < batch)
    seq = seq.clamp(0, max(batch - 1, 0))
    tiles = cu_m[seq + 1] - cu_m[seq]
    per_row = torch.div(cu_off[seq + 1] - cu_off[seq], tiles.clamp(min=1), rounding_mode="floor").clamp(min=1)
    offset = entry - cu_off[seq]
    tile = torch.div(offset, per_row, rounding_mode="floor")
    row = (cu_m[seq] + tile).clamp(0, max(blocks.full_cnt.shape[1] - 1, 0))
    row_start = cu_off[seq] + tile * per_row
    return seq, row, row_start, offset - tile * per_row, in_rows


def _split_varlen(cnt: Tensor, idx: Tensor, rows, first: Bound, end: Bound) -> Tuple[Tensor, Tensor]:
    seq, row, row_start, position, in_rows = rows
    heads, total_n = idx.shape
    lo = first if isinstance(first, int) else first.long()[seq]
    hi = end if isinstance(end, int) else end.long()[seq]
    ids = idx.long()
    count = cnt.long()[:, row] if cnt.shape[1] else torch.zeros_like(ids)
    kept = in_rows & (position < count) & (ids >= lo) & (ids < hi)
    before = kept.long().cumsum(-1) - kept.long()  # kept entries before each entry
    rank = before - before.gather(-1, row_start.clamp(max=max(total_n - 1, 0)).expand(heads, -1))
    destination = torch.where(kept, row_start + rank, total_n)
    local = torch.zeros(heads, total_n + 1, dtype=torch.int32, device=idx.device)
    local.scatter_(-1, destination, (ids - lo).int())
    counts = torch.zeros_like(cnt, dtype=torch.int32)
    counts.scatter_add_(-1, row.expand(heads, -1), kept.int())
    return counts, local[:, :total_n].contiguous()


def shard_blocks(blocks: SparseBlocks, key_start: Bound, key_stop: Bound) -> SparseBlocks:
    """The lists of the shard holding key positions [key_start, key_stop) of each sequence, for
    every table granularity (shared, per K/V head, per query head), batched and varlen. Each is
    an int, or an int tensor (batch,) with one range per sequence. See the module docstring for
    the alignment rule. The result has the layout, shapes and offsets of `blocks`."""
    if not isinstance(blocks, SparseBlocks):
        fail("blocks", f"must be SparseBlocks, got {type(blocks).__name__}")
    first, end = block_bounds(blocks.block_size, key_start, key_stop)
    if blocks.is_varlen:
        rows = _varlen_rows(blocks, blocks.full_idx.shape[1])
        split = lambda cnt, idx: _split_varlen(cnt, idx, rows, first, end)
    else:
        split = lambda cnt, idx: _split_batched(cnt, idx, first, end)
    full_cnt, full_idx = split(blocks.full_cnt, blocks.full_idx)
    mask_cnt = mask_idx = None
    if blocks.mask_cnt is not None:
        mask_cnt, mask_idx = split(blocks.mask_cnt, blocks.mask_idx)
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, blocks.block_size, blocks.q_block_size,
                        blocks.cu_total_m_blocks, blocks.cu_block_idx_offsets)
