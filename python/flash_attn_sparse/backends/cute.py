"""flash-attn-4's side of the seam: importing its CuTe-DSL runtime, and SparseBlocks to and from
its BlockSparseTensorsTorch, laid out under its contract (see fa4.py's module docstring):

- batched tables pass as views, trimmed to ceil(seqlen_q / q_block_size) rows as it requires,
  with no launch before the kernel (decode calls are a few microseconds long);
- per-K/V-head lists stay as they are: flash-attn-4 (stage 4) packs the query heads of a K/V
  head into one tile (PackGQA), so each listed block is read once per K/V head;
- calls without mask lists get one zero count (its kernels require mask lists), viewed with the
  full lists' shape: a (1, 1, 1) count beside full lists of several query tiles failed its
  m-block check, and beside per-query-head GQA lists made it pack heads it cannot pack;
- varlen rows are re-laid at its stride, ceil(seqlen_k_b / block_size) entries per row (sorted
  and range-checked by torch ops on the way).
"""

import functools
import importlib
import traceback
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..metadata import PAST_EVERY_ID, SparseBlocks, cdiv, fail, zeros_with_layout


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


# What patches/flash-attn-4's marker module (flash_attn/cute/sparse_series.py) says in a build
# with this series' stage-4 patches; the unpatched release has no such module.
EXPECTED_SERIES = "flash-attn-sparse stage 4, format 1"
PATCHED_WHEEL_HINT = ("install the patched build: `nox -s build` writes "
                      "dist/flash_attn_4-4.0.0b36+sparse.*.whl (pip install it, or flash_attn[hopper] "
                      "from a wheel built that way)")


@functools.lru_cache(maxsize=None)
def missing_runtime() -> Optional[str]:
    """None when flash-attn-4 with this series' patches and its CuTe-DSL runtime import, else the reason."""
    try:
        import_cute("interface")
    except Exception as error:  # any import failure means no Hopper backend
        where = traceback.extract_tb(error.__traceback__)[-1]
        return (f"flash-attn-4 (the CuTe-DSL kernels, extra `[hopper]`) is not importable: "
                f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})")
    return unpatched_reason()


def unpatched_reason() -> Optional[str]:
    """None when the importable flash_attn.cute carries this series' stage-4 patches, else why not."""
    try:
        series = import_cute("sparse_series").SERIES
    except (ImportError, AttributeError):
        return (f"the installed flash-attn-4 lacks this series' stage-4 patches (no "
                f"flash_attn.cute.sparse_series: the unpatched release?); {PATCHED_WHEEL_HINT}")
    if series != EXPECTED_SERIES:
        return (f"the installed flash-attn-4 carries patch series {series!r}, this package needs "
                f"{EXPECTED_SERIES!r}; {PATCHED_WHEEL_HINT}")
    return None


_ZERO_COUNTS = {}  # (device, shape) -> the zero counts of _zero_counts


def _zero_counts(device: torch.device, shape: Tuple[int, ...]) -> Tensor:
    """Zero counts of the full lists' shape: the empty mask lists its kernels require. flash-attn-4
    matches their batch, head and m-block dims with the full lists' (it packs GQA heads by their
    head count) and needs a unit stride in the last dim, so no broadcast view will do. Made once
    per (device, shape), outside any graph capture (a tensor made during one belongs to that
    graph's pool), so a repeated decode call writes nothing before its kernel."""
    key = (device, tuple(shape))
    zero = _ZERO_COUNTS.get(key)
    if zero is None:
        zero = torch.zeros(shape, dtype=torch.int32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ZERO_COUNTS[key] = zero
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
    keys = (rows.row_of_entry << 32) + torch.where(valid, idx, PAST_EVERY_ID).to(torch.int64)
    idx_sorted = (keys.sort(dim=-1).values & 0xFFFFFFFF).to(torch.int32)
    new_cnt = torch.minimum(torch.zeros_like(cnt).scatter_add_(1, rows_of_entries, valid.to(torch.int32)),
                            rows.row_width.to(torch.int32).unsqueeze(0))
    # Entry of rank j goes to new_row_start + j; ranks past the new row's width go to a spare slot.
    target = torch.where(rows.rank < rows.row_width[rows.row_of_entry],
                         rows.new_row_start[rows.row_of_entry] + rows.rank, rows.capacity)
    new_idx = torch.full((heads, rows.capacity + 1), PAST_EVERY_ID, dtype=torch.int32, device=idx.device)
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
    else:
        mask_cnt, mask_idx = _zero_counts(full_cnt.device, full_cnt.shape), full_idx
    return to_cute_block_sparse_tensors(SparseBlocks(
        full_cnt, full_idx, mask_cnt, mask_idx, block_size=blocks.block_size, q_block_size=q_block,
        cu_total_m_blocks=blocks.cu_total_m_blocks,
        cu_block_idx_offsets=rows.new_offsets if blocks.is_varlen else None))


def to_cute_block_sparse_tensors(blocks: SparseBlocks, max_seqlen_q: Optional[int] = None):
    """flash-attn-4's BlockSparseTensorsTorch (flash_attn.cute.block_sparsity) from SparseBlocks.

    Our "full"/"mask" lists map to its full_block_*/mask_block_*; cu_total_m_blocks and
    cu_block_idx_offsets (varlen) pass through; block_size becomes (q_block_size, block_size).
    The tensors are shared, not copied. Its constructor needs mask lists: without ours, empty
    ones (zero counts) are made. q_block_size=None (one row for every query row) needs
    max_seqlen_q to name the tile size. The backward-only fields (dq_write_order, ...) stay None.
    """
    try:
        BlockSparseTensorsTorch = import_cute("block_sparsity").BlockSparseTensorsTorch
    except ImportError as error:
        raise ImportError(
            "to_cute_block_sparse_tensors needs flash-attn-4, upstream's CuTe-DSL FlashAttention "
            "(`pip install flash-attn-4`, imported as flash_attn.cute), which is not installed: "
            f"{error}") from error
    if not isinstance(blocks, SparseBlocks):
        fail("blocks", f"must be SparseBlocks, got {type(blocks).__name__}")
    q_block_size = blocks.q_block_size
    if q_block_size is None:
        if max_seqlen_q is None:
            fail("max_seqlen_q", "is needed when blocks.q_block_size is None: the CuTe kernels take the query tile size explicitly")
        q_block_size = blocks.resolved_q_block_size(max_seqlen_q)
    if blocks.mask_cnt is not None:
        mask_cnt, mask_idx = blocks.mask_cnt, blocks.mask_idx
    else:
        mask_cnt, mask_idx = zeros_with_layout(blocks.full_cnt), zeros_with_layout(blocks.full_idx)
    return BlockSparseTensorsTorch(
        mask_block_cnt=mask_cnt,
        mask_block_idx=mask_idx,
        full_block_cnt=blocks.full_cnt,
        full_block_idx=blocks.full_idx,
        cu_total_m_blocks=blocks.cu_total_m_blocks,
        cu_block_idx_offsets=blocks.cu_block_idx_offsets,
        block_size=(int(q_block_size), int(blocks.block_size)),
    )


def blocks_from_cute_block_sparse_tensors(tensors) -> SparseBlocks:
    """SparseBlocks from flash-attn-4's BlockSparseTensorsTorch, or any object with its attribute
    names (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, cu_total_m_blocks,
    cu_block_idx_offsets, block_size = (q, kv)); the tensors are shared, not copied.

    block_size must be set: without it flash-attn-4 falls back on its kernel tile sizes, which
    are not known here. Missing full lists become empty ones (zero counts) with the layout of
    the mask lists; the backward-only fields are ignored.
    """
    block_size = getattr(tensors, "block_size", None)
    if block_size is None or len(block_size) != 2:
        fail("block_size", f"must be (q_block_size, kv_block_size), got {block_size!r}")
    mask_cnt, mask_idx = tensors.mask_block_cnt, tensors.mask_block_idx
    full_cnt, full_idx = tensors.full_block_cnt, tensors.full_block_idx
    if (mask_cnt is None) != (mask_idx is None) or (full_cnt is None) != (full_idx is None):
        fail("tensors", "each *_block_cnt comes with its *_block_idx")
    if full_cnt is None:
        if mask_cnt is None:
            fail("tensors", "has neither mask nor full block lists")
        full_cnt, full_idx = zeros_with_layout(mask_cnt), zeros_with_layout(mask_idx)
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=int(block_size[1]),
                        q_block_size=int(block_size[0]), cu_total_m_blocks=tensors.cu_total_m_blocks,
                        cu_block_idx_offsets=tensors.cu_block_idx_offsets)
