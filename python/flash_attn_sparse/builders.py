"""Builders of block-list metadata (SparseBlocks) on the device, and converters to and from the
block-sparsity format of FlexAttention (flash-attn-4's CuTe tensors: backends/cute.py).

Every builder here is made of plain torch ops whose output shapes depend only on input shapes
and Python ints: none reads a value back to the host (.item(), .tolist(), .cpu(), a
data-dependent shape), so each one runs on CPU and CUDA tensors alike and can be captured in a
CUDA graph. The price is padding: lists are as wide as the number of key blocks, and packed
varlen tables have the padded upper bound of rows. The kernels read only the first `cnt` entries
of a row, and only the rows the offsets name, so the padding is never attended to.

Lists come out ascending, padding entries (past `cnt`) are 0, and every table is int32 with a
contiguous last dimension. See metadata.py for the layouts.
"""

from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from .metadata import PAST_EVERY_ID, SparseBlocks, cdiv, fail, zeros_with_layout

if TYPE_CHECKING:  # imported lazily at run time: `import flash_attn_sparse` stays light
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "blocks_from_mask",
    "blocks_from_scores",
    "blocks_from_flex_block_mask",
    "flex_block_mask_from_blocks",
    "pack_varlen",
]

FLEX_DEFAULT_Q_BLOCK_SIZE = 128  # FlexAttention's default BLOCK_SIZE, used when q_block_size is None


# --- shared helpers -------------------------------------------------------------------------

def _check_tensor(t: Any, name: str, dims: int, dtype: Optional[torch.dtype] = None, floating: bool = False) -> None:
    """Shape/dtype checks only: never reads values, so never syncs."""
    if not isinstance(t, Tensor):
        fail(name, f"must be a tensor, got {type(t).__name__}")
    if t.dim() != dims:
        fail(name, f"must have {dims} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        fail(name, f"must have dtype {dtype}, got {t.dtype}")
    if floating and not t.is_floating_point():
        fail(name, f"must be a floating-point tensor, got {t.dtype}")


def _check_count(value: Any, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(name, f"must be a non-negative Python int, got {value!r}")


def _entry_positions(width: int, device) -> Tensor:
    return torch.arange(width, dtype=torch.int32, device=device)


def _lists_from_bool(block_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """(cnt, idx) of the True blocks of each row of a (..., n) boolean mask, ids ascending."""
    n = block_mask.shape[-1]
    positions = _entry_positions(n, block_mask.device)
    cnt = block_mask.sum(dim=-1, dtype=torch.int32)
    # A True block keeps its id as sort key, a False one gets n (past every id): one sort then
    # packs the chosen ids to the front, ascending. Keys of True blocks are distinct, so the
    # sort needs no stability.
    keys = torch.where(block_mask, positions, n)
    idx = keys.sort(dim=-1).values
    idx = torch.where(positions < cnt.unsqueeze(-1), idx, 0)
    return cnt.contiguous(), idx.contiguous()


def _ascending_lists(cnt: Tensor, idx: Tensor) -> Tuple[Tensor, Tensor]:
    """Sorts the first cnt entries of every row ascending and zeroes the entries past cnt."""
    cnt = cnt.to(torch.int32).contiguous()
    idx = idx.to(torch.int32)
    in_list = _entry_positions(idx.shape[-1], idx.device) < cnt.unsqueeze(-1)
    # Entries past cnt sort behind every real id, whatever garbage they held.
    keys = torch.where(in_list, idx, PAST_EVERY_ID)
    ordered = keys.sort(dim=-1).values
    return cnt, torch.where(in_list, ordered, 0).contiguous()


def _dense_from_lists(cnt: Tensor, idx: Tensor, num_blocks: int) -> Tensor:
    """Boolean (..., num_blocks) table of the blocks named by each row's first cnt entries."""
    in_list = _entry_positions(idx.shape[-1], idx.device) < cnt.unsqueeze(-1)
    # Entries past cnt are sent to one spare column, cut off afterwards.
    columns = torch.where(in_list, idx, num_blocks).long().clamp(0, num_blocks)
    dense = torch.zeros(*idx.shape[:-1], num_blocks + 1, dtype=torch.bool, device=idx.device)
    dense.scatter_(-1, columns, True)
    return dense[..., :num_blocks]


# --- from boolean block masks and from scores -------------------------------------------------

def blocks_from_mask(block_mask: Tensor, block_size: int, q_block_size: Optional[int] = None,
                     mask_block_mask: Optional[Tensor] = None) -> SparseBlocks:
    """Batched SparseBlocks listing the True blocks of boolean block masks.

    block_mask: bool (batch, heads, m_blocks, n_blocks); block_mask[b, h, m, n] says that query
    tile m of (batch b, table head h) attends to key block n as a "full" block.
    mask_block_mask: optional bool tensor of the same shape, the "mask" blocks (those that get
    the causal and sequence-end masks). It must be disjoint from block_mask: a block in both is
    listed twice and attended twice. That is not checked here (it would need a host sync);
    validate="full" on the attention call does catch it.

    Both lists are n_blocks wide, ascending, with zeros past their count. q_block_size=None
    means one list row for all query rows (m_blocks must then be 1).
    """
    _check_tensor(block_mask, "block_mask", 4, torch.bool)
    full_cnt, full_idx = _lists_from_bool(block_mask)
    mask_cnt = mask_idx = None
    if mask_block_mask is not None:
        _check_tensor(mask_block_mask, "mask_block_mask", 4, torch.bool)
        if mask_block_mask.shape != block_mask.shape:
            fail("mask_block_mask", f"must have the shape of block_mask {tuple(block_mask.shape)}, got {tuple(mask_block_mask.shape)}")
        mask_cnt, mask_idx = _lists_from_bool(mask_block_mask)
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=block_size, q_block_size=q_block_size)


def blocks_from_scores(scores: Tensor, k: int, block_size: int, q_block_size: Optional[int] = None,
                       sink_blocks: int = 0, local_blocks: int = 0, num_valid_blocks: Optional[Tensor] = None,
                       causal_diagonal: bool = False) -> SparseBlocks:
    """Quest/InfLLM-style selection: top-k key blocks by score, plus attention sinks and a local window.

    scores: float (batch, heads, m_blocks, n_blocks), an estimate of each key block's importance
    for each query tile (e.g. Quest's upper bound of q.k over the block's min/max keys).
    num_valid_blocks: how many key blocks exist, int (batch,) or broadcastable to
    (batch, heads, m_blocks) (e.g. per-tile causal limits); default n_blocks; clamped to
    [0, n_blocks]. Blocks at or past it are never chosen.

    Per row, with `valid` blocks: the first `sink_blocks` and the last `local_blocks` valid
    blocks are always kept; then the k best-scoring of the other valid blocks. A row thus lists
    exactly min(k + sink_blocks + local_blocks, valid) distinct blocks, ascending, so the tail
    block (the last valid one) comes last whenever local_blocks >= 1. Ties between equal scores
    are broken by topk (any of them may win); NaN and -inf rank as the lowest finite score and
    +inf as the highest, so such a block is still chosen rather than leaving a slot empty.

    causal_diagonal=False puts every kept block in the "full" list. causal_diagonal=True puts
    the local blocks in the "mask" list instead (they get the causal mask; so does a block
    that is both sink and local) and the rest in "full". local_blocks must then cover every
    block that some query row of the tile sees only partly: at least
    ceil(q_block_size / block_size), one more when tiles and blocks are not aligned, 1 for
    decoding; sinks and top-k blocks must be fully historical for the tile.
    """
    _check_tensor(scores, "scores", 4, floating=True)
    for name, value in (("k", k), ("sink_blocks", sink_blocks), ("local_blocks", local_blocks)):
        _check_count(value, name)
    if causal_diagonal and local_blocks < 1:
        fail("local_blocks", "causal_diagonal needs local_blocks >= 1: the local blocks are the ones that get the causal mask")
    batch, heads, m_blocks, n_blocks = scores.shape
    device = scores.device
    positions = torch.arange(n_blocks, device=device)
    if num_valid_blocks is None:
        valid_count = torch.full((1, 1, 1, 1), n_blocks, dtype=torch.long, device=device)
    else:
        if not isinstance(num_valid_blocks, Tensor) or num_valid_blocks.is_floating_point() or num_valid_blocks.dtype == torch.bool:
            fail("num_valid_blocks", "must be an integer tensor, (batch,) or broadcastable to (batch, heads, m_blocks)")
        if num_valid_blocks.device != device:
            fail("num_valid_blocks", f"must be on the device of scores ({device}), got {num_valid_blocks.device}")
        if num_valid_blocks.dim() == 1:
            if num_valid_blocks.shape[0] != batch:
                fail("num_valid_blocks", f"must have batch = {batch} entries, got {num_valid_blocks.shape[0]}")
            valid_count = num_valid_blocks.view(batch, 1, 1)
        else:
            valid_count = num_valid_blocks
        try:
            valid_count = torch.broadcast_to(valid_count, (batch, heads, m_blocks))
        except RuntimeError:
            fail("num_valid_blocks", f"shape {tuple(num_valid_blocks.shape)} does not broadcast to "
                 f"(batch, heads, m_blocks) = {(batch, heads, m_blocks)}")
        valid_count = valid_count.long().clamp(0, n_blocks).unsqueeze(-1)

    valid = positions < valid_count
    sinks = valid & (positions < sink_blocks)
    local = valid & (positions >= valid_count - local_blocks)
    forced = sinks | local
    candidates = valid & ~forced

    # Rank key: a candidate's score, made finite so that every candidate ranks above every
    # non-candidate (-inf); then the top k' = min(k, n) holds all chosen candidates, and the
    # non-candidates it picks when fewer than k exist are dropped by the key test below.
    lowest, highest = torch.finfo(scores.dtype).min, torch.finfo(scores.dtype).max
    key = torch.nan_to_num(scores, nan=lowest, posinf=highest, neginf=lowest)
    key = torch.where(candidates, key, float("-inf"))
    top_values, top_ids = key.topk(min(k, n_blocks), dim=-1)
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=device)
    chosen.scatter_(-1, top_ids, top_values > float("-inf"))

    if causal_diagonal:
        # A block both sink and local (short rows) goes to "mask" only: the lists are disjoint.
        return blocks_from_mask((chosen | sinks) & ~local, block_size, q_block_size,
                                mask_block_mask=local.expand(batch, heads, m_blocks, n_blocks))
    return blocks_from_mask(chosen | forced, block_size, q_block_size)


# --- FlexAttention ----------------------------------------------------------------------------

def blocks_from_flex_block_mask(block_mask: "BlockMask") -> SparseBlocks:
    """SparseBlocks from a FlexAttention BlockMask (batched layout).

    FlexAttention's full blocks (full_kv_num_blocks, full_kv_indices) become our "full" lists,
    its partial blocks (kv_num_blocks, kv_indices), where it applies mask_mod, our "mask" lists;
    BLOCK_SIZE (q, kv) gives q_block_size and block_size. FlexAttention does not promise any
    order, so each row's first cnt entries are sorted ascending (entries past cnt are sent
    behind every id, then zeroed). Lists are as wide as kv_indices.

    The mask_mod itself does not carry over: our "mask" blocks get only the (bottom-right)
    causal mask, when the attention call is causal, and the sequence-end mask. The result is
    exact for a causal mask_mod with seqlen_q == seqlen_k, or a mask_mod that is True in
    every partial block.
    """
    kv_cnt, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
    if kv_idx.dim() != 4:
        fail("block_mask", f"kv_indices must be (batch, heads, q_blocks, kv_blocks), got shape {tuple(kv_idx.shape)}")
    q_block_size, kv_block_size = block_mask.BLOCK_SIZE
    mask_cnt, mask_idx = _ascending_lists(kv_cnt, kv_idx)
    if block_mask.full_kv_num_blocks is None:
        full_cnt, full_idx = zeros_with_layout(mask_cnt), zeros_with_layout(mask_idx)
    else:
        full_cnt, full_idx = _ascending_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        if full_idx.shape != mask_idx.shape:
            # SparseBlocks keeps both lists in one shape: widen the narrower, broadcast batch/heads.
            width = max(full_idx.shape[-1], mask_idx.shape[-1])
            full_idx = torch.nn.functional.pad(full_idx, (0, width - full_idx.shape[-1]))
            mask_idx = torch.nn.functional.pad(mask_idx, (0, width - mask_idx.shape[-1]))
            full_cnt, mask_cnt = (t.contiguous() for t in torch.broadcast_tensors(full_cnt, mask_cnt))
            full_idx, mask_idx = (t.contiguous() for t in torch.broadcast_tensors(full_idx, mask_idx))
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=int(kv_block_size),
                        q_block_size=int(q_block_size))


def flex_block_mask_from_blocks(blocks: SparseBlocks, seqlen_q: int, seqlen_k: int, causal: bool = False,
                                num_heads: Optional[int] = None) -> "BlockMask":
    """A FlexAttention BlockMask that attends to what `blocks` lists (batched layout only).

    Our "full" lists become FlexAttention's full blocks, our "mask" lists its partial blocks.
    FlexAttention wants one row per query block of BLOCK_SIZE[0] rows and kv_indices exactly
    as wide as the number of key blocks (it derives the backward's transposed lists and the
    key length from that width): with q_block_size=None the single row is repeated over
    ceil(seqlen_q / 128) query blocks of 128 rows; otherwise extra rows are cut; lists are
    padded with zeros or cut to ceil(seqlen_k / block_size) entries, counts clamped to it.

    The mask_mod encodes the same visibility, so the mask is right also where FlexAttention
    evaluates mask_mod everywhere (eager mode): a key is visible if its block is listed "full"
    for the query's tile, or listed "mask" and (when causal) key <= query + seqlen_k - seqlen_q,
    our bottom-right causal alignment.

    num_heads: the number of query heads; a table with one row per K/V head (GQA) is repeated
    to one per query head, as FlexAttention's block mask has 1 or num_heads heads.
    The lists must be valid (ids within [0, n_blocks), no duplicates).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(blocks, SparseBlocks):
        fail("blocks", f"must be SparseBlocks, got {type(blocks).__name__}")
    if blocks.is_varlen:
        fail("blocks", "FlexAttention block masks are batched: pass the batched layout, not the varlen one")
    q_block_size = blocks.q_block_size if blocks.q_block_size is not None else FLEX_DEFAULT_Q_BLOCK_SIZE
    kv_block_size = blocks.block_size
    q_blocks, kv_blocks = cdiv(seqlen_q, q_block_size), cdiv(seqlen_k, kv_block_size)
    table_heads = blocks.full_cnt.shape[1]
    if num_heads is not None and table_heads not in (1, num_heads) and num_heads % table_heads:
        fail("num_heads", f"must be a multiple of the table's {table_heads} heads, got {num_heads}")

    def flex_lists(cnt: Tensor, idx: Tensor) -> Tuple[Tensor, Tensor]:
        batch, heads, m_blocks = cnt.shape
        if blocks.q_block_size is None:
            # One row covers every query row: repeat it for each of FlexAttention's query blocks.
            cnt = cnt[:, :, :1].expand(batch, heads, q_blocks)
            idx = idx[:, :, :1].expand(batch, heads, q_blocks, idx.shape[-1])
        else:
            if m_blocks < q_blocks:
                fail("blocks", f"has {m_blocks} query tiles, seqlen_q={seqlen_q} needs ceil({seqlen_q} / {q_block_size}) = {q_blocks}")
            cnt, idx = cnt[:, :, :q_blocks], idx[:, :, :q_blocks]
        width = idx.shape[-1]
        idx = torch.nn.functional.pad(idx, (0, kv_blocks - width)) if width < kv_blocks else idx[..., :kv_blocks]
        cnt = cnt.clamp(max=kv_blocks)  # a count past the width would read past the lists
        if num_heads is not None and heads not in (1, num_heads):
            cnt = cnt.repeat_interleave(num_heads // heads, dim=1)
            idx = idx.repeat_interleave(num_heads // heads, dim=1)
        return cnt.to(torch.int32).contiguous(), idx.to(torch.int32).contiguous()

    full_cnt, full_idx = flex_lists(blocks.full_cnt, blocks.full_idx)
    if blocks.mask_cnt is not None:
        mask_cnt, mask_idx = flex_lists(blocks.mask_cnt, blocks.mask_idx)
    else:
        mask_cnt, mask_idx = torch.zeros_like(full_cnt), torch.zeros_like(full_idx)

    # 0: not listed, 1: "full", 2: "mask" (the lists are disjoint).
    block_kind = (_dense_from_lists(full_cnt, full_idx, kv_blocks).to(torch.int8)
                  + 2 * _dense_from_lists(mask_cnt, mask_idx, kv_blocks).to(torch.int8))
    mask_mod = _listed_blocks_mask_mod(block_kind, q_block_size, kv_block_size, causal, seqlen_k - seqlen_q)
    return BlockMask.from_kv_blocks(mask_cnt, mask_idx, full_cnt, full_idx, BLOCK_SIZE=(q_block_size, kv_block_size),
                                    mask_mod=mask_mod, seq_lengths=(seqlen_q, seqlen_k))


def _listed_blocks_mask_mod(block_kind: Tensor, q_block_size: int, kv_block_size: int, causal: bool,
                            causal_offset: int) -> Callable:
    """FlexAttention mask_mod of a (batch, heads, q_blocks, kv_blocks) table of block kinds."""
    per_batch, per_head = block_kind.shape[0] > 1, block_kind.shape[1] > 1

    def listed_blocks(b, h, q_idx, kv_idx):
        # Broadcast tables (one batch or head row) are read at 0 for every batch or head.
        kind = block_kind[b if per_batch else 0, h if per_head else 0, q_idx // q_block_size, kv_idx // kv_block_size]
        in_mask_block = kind == 2
        if causal:
            in_mask_block = in_mask_block & (kv_idx <= q_idx + causal_offset)
        return (kind == 1) | in_mask_block

    return listed_blocks


# --- varlen packing ---------------------------------------------------------------------------

def pack_varlen(blocks_per_seq: SparseBlocks, cu_seqlens_q: Tensor, cu_seqlens_k: Optional[Tensor],
                max_seqlen_q: int, q_block_size: Optional[int] = None) -> SparseBlocks:
    """Varlen SparseBlocks from padded batched ones, on the device.

    blocks_per_seq: batched, cnt (batch, heads, m_max), idx (batch, heads, m_max, n); row m of
    sequence b holds the lists of its query tile m; rows past the sequence's
    ceil(seqlen_q_b / q_block_size) tiles are padding and dropped. Block ids stay relative to
    each sequence's keys, as in the varlen layout.
    cu_seqlens_q: int (batch + 1,) prefix sums of the query lengths, on the tables' device.
    cu_seqlens_k: the key prefix sums of the same call, or None; packing does not need them
    (ids are per sequence), so only their shape and device are checked.
    max_seqlen_q: an upper bound of the query lengths (a Python int, as in the attention call).
    q_block_size: defaults to blocks_per_seq's; None there means one tile of the call's
    resolved size, ceil(max_seqlen_q / 128) * 128 rows.

    Every sequence gets rows of n_b = n entries, so cu_block_idx_offsets = n * cu_total_m_blocks
    and the row of packed tile r starts at r * n. The tables have the padded upper bound,
    batch * m_max rows and batch * m_max * n entries, whatever the lengths: fixed shapes, no
    host sync; the rows past cu_total_m_blocks[-1] are zero. A sequence longer than
    max_seqlen_q is the caller's error: its tiles past m_max are dropped (validate="full" on the
    attention call reports the mismatch).
    """
    if not isinstance(blocks_per_seq, SparseBlocks):
        fail("blocks_per_seq", f"must be SparseBlocks, got {type(blocks_per_seq).__name__}")
    if blocks_per_seq.is_varlen:
        fail("blocks_per_seq", "is already in the varlen layout; pack_varlen takes the padded batched one")
    cnt, idx = blocks_per_seq.full_cnt, blocks_per_seq.full_idx
    _check_tensor(cnt, "full_cnt", 3)
    _check_tensor(idx, "full_idx", 4)
    batch, heads, m_max = cnt.shape
    n = idx.shape[-1]
    device = cnt.device
    _check_tensor(cu_seqlens_q, "cu_seqlens_q", 1)
    if cu_seqlens_q.shape[0] != batch + 1:
        fail("cu_seqlens_q", f"must have batch + 1 = {batch + 1} entries, got {cu_seqlens_q.shape[0]}")
    if cu_seqlens_q.device != device:
        fail("cu_seqlens_q", f"must be on the device of the lists ({device}), got {cu_seqlens_q.device}")
    if cu_seqlens_k is not None:
        _check_tensor(cu_seqlens_k, "cu_seqlens_k", 1)
        if cu_seqlens_k.shape[0] != batch + 1 or cu_seqlens_k.device != device:
            fail("cu_seqlens_k", f"must have {batch + 1} entries on {device}, got {tuple(cu_seqlens_k.shape)} on {cu_seqlens_k.device}")
    if blocks_per_seq.q_block_size is not None and q_block_size is not None and q_block_size != blocks_per_seq.q_block_size:
        fail("q_block_size", f"is {q_block_size}, but blocks_per_seq has q_block_size={blocks_per_seq.q_block_size}")
    if q_block_size is None:
        q_block_size = blocks_per_seq.resolved_q_block_size(max_seqlen_q)
    if m_max < cdiv(max_seqlen_q, q_block_size):
        fail("full_cnt", f"needs one row per query tile: m_max >= ceil({max_seqlen_q} / {q_block_size}), got {m_max}")

    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    # Clamped to m_max so that a bad length cannot index past the padded table.
    tiles = ((lengths + q_block_size - 1) // q_block_size).clamp(0, m_max)
    cu_tiles = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tiles.cumsum(0)])

    # For each packed row r: its sequence (the number of sequences that end at or before r)
    # and its tile within that sequence; rows past the last tile belong to none.
    rows = torch.arange(batch * m_max, dtype=torch.long, device=device)
    seq = torch.searchsorted(cu_tiles[1:].contiguous(), rows, right=True)
    in_a_sequence = seq < batch
    seq = seq.clamp(max=batch - 1)
    tile = torch.where(in_a_sequence, rows - cu_tiles[seq], 0)

    def pack(cnt_t: Tensor, idx_t: Tensor) -> Tuple[Tensor, Tensor]:
        packed_cnt = torch.where(in_a_sequence.unsqueeze(0), cnt_t[seq, :, tile].t(), 0)     # (heads, rows)
        packed_idx = torch.where(in_a_sequence.view(1, -1, 1), idx_t[seq, :, tile].transpose(0, 1), 0)  # (heads, rows, n)
        return packed_cnt.to(torch.int32).contiguous(), packed_idx.to(torch.int32).reshape(heads, batch * m_max * n)

    full_cnt, full_idx = pack(cnt, idx)
    mask_cnt = mask_idx = None
    if blocks_per_seq.mask_cnt is not None:
        mask_cnt, mask_idx = pack(blocks_per_seq.mask_cnt, blocks_per_seq.mask_idx)
    return SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=blocks_per_seq.block_size,
                        q_block_size=q_block_size, cu_total_m_blocks=cu_tiles.to(torch.int32),
                        cu_block_idx_offsets=(cu_tiles * n).to(torch.int32))
