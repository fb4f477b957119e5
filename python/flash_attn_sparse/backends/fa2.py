"""The FA-2 backend: this package's sparse kernels in the patched flash_attn_2_cuda (stages 3, 5),
reached through the torch custom ops of fa2_ops.py, so calls trace under torch.compile. It runs every
call that passes validation, on any GPU the wheel was built for; a head dim the build did not
compile is refused when the arguments are made (op_args).

Its tile and split rules mirror the kernel's: decode_tile is flash_sparse.h's
sparse_decode_tile, tile_n the keys per tile of run_mha_fwd_sparse_narrow_ (tests/
test_split_heuristics.py and tests/test_seam_parity.py hold them to the C++).
"""

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..metadata import cdiv, fail
from . import fa2_ops
from .device import MAX_SPLITS, for_run_with, num_sms
from .protocol import Traits

KERNEL_ROWS = 64  # query rows per CTA of the split-capable kernel
DECODE_KERNEL_ROWS = 16  # ... or of its 16-row forms: key-split, or one-warp decode over long lists when
DECODE_MIN_LIST_KEYS = 16384  # flash_sparse.h's sparse_decode_tile, which says what was measured
DECODE_MIN_TOTAL_KEYS = 1 << 20


def decode_tile(packed_rows: int, max_list_keys: int, ctas: int) -> bool:
    """Whether the kernel runs its 16-row decode tile (the same rule as sparse_decode_tile)."""
    return (packed_rows <= DECODE_KERNEL_ROWS and max_list_keys >= DECODE_MIN_LIST_KEYS
            and ctas * max_list_keys >= DECODE_MIN_TOTAL_KEYS)


def tile_n(head_dim: int, decode: bool) -> int:
    """Keys per tile of the split-capable sparse kernel: its 64-row form, or its 16-row decode form."""
    if decode:
        return 128 if head_dim <= 128 else 64
    return 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)


def choose_num_splits(batch_heads_mblocks: int, num_slots: int, num_tiles: int, max_splits: int = MAX_SPLITS) -> int:
    """Upstream's num_splits_heuristic, over the tiles of the block list instead of the dense range.

    One split if the CTAs nearly fill the GPU; else the fewest splits within 85% of the best
    wave efficiency, counting a split count as distinct only if it changes tiles per split.
    """
    if batch_heads_mblocks == 0 or batch_heads_mblocks >= 0.8 * num_slots:
        return 1  # (no CTAs: every query sequence empty)
    max_splits = min(max_splits, num_slots, num_tiles)
    candidates, efficiencies = [], []
    for splits in range(1, max_splits + 1):
        if splits > 1 and cdiv(num_tiles, splits) == cdiv(num_tiles, splits - 1):
            continue
        waves = batch_heads_mblocks * splits / num_slots
        candidates.append(splits)
        efficiencies.append(waves / math.ceil(waves))
    best = max(efficiencies)
    for splits, efficiency in zip(candidates, efficiencies):
        if efficiency >= 0.85 * best:
            return splits
    return 1


def split_slots(q: Tensor, decode: bool) -> int:
    """CTAs per wave that the split heuristic fills: two per SM, as upstream assumes, and three of
    the one-warp decode tile. The key-split tile fits three per SM too, but counted as two it
    picks fewer, longer splits, which measured faster in a split sweep (H200, lists from HBM): 4
    splits instead of 6 at B8 Sq1 1/4 and 1/16 (-1.2 us each), 29 instead of 37 at B1 1/4 (-2.2
    us), and 32 as before at B1 1/16."""
    return (3 if decode else 2) * num_sms(q.device.index or 0)


def pack_gqa(call) -> bool:
    """Whether the query heads of a K/V head share a tile, so each listed K/V block is read once
    per K/V head: when tiles would otherwise be mostly empty (short queries, decode), the lists
    are shared or per K/V head, and no tile straddles two list rows (one row covers every query,
    or a row's packed rows fill whole tiles; the C++ host checks the same)."""
    heads, heads_k = call.q.shape[-2], call.k.shape[-2]
    group = heads // heads_k
    q_block = call.blocks.resolved_q_block_size(call.max_seqlen_q)
    return (group > 1 and call.blocks.num_heads in (1, heads_k) and call.max_seqlen_q < KERNEL_ROWS
            and (q_block >= call.max_seqlen_q or (q_block * group) % KERNEL_ROWS == 0))


def split_work(call) -> Tuple[int, int, int]:
    """(CTAs per split, CTAs per wave, kernel tiles of the longest list) of the split-capable
    kernel, in the form it runs (run_mha_fwd_sparse_narrow_): the one-warp 16-row decode tile,
    else for packed rows that fit 16 rows (head dim <= 128) the 16-row tile whose warps split
    the keys, else 64-row tiles; the last two have the same CTAs and tiles here."""
    group = call.q.shape[-2] // call.k.shape[-2] if pack_gqa(call) else 1
    tile_heads = call.batch * (call.q.shape[-2] // group)
    max_list_keys = call.max_list_length() * call.blocks.block_size
    packed_rows = call.max_seqlen_q * group
    decode = decode_tile(packed_rows, max_list_keys, tile_heads)
    ctas = tile_heads * cdiv(packed_rows, KERNEL_ROWS)
    tiles = cdiv(max_list_keys, tile_n(call.q.shape[-1], decode))
    return ctas, split_slots(call.q, decode), max(tiles, 1)


def op_args(call, splits: int) -> dict:
    """The custom ops' arguments, by name; refuses a head dim this build did not compile."""
    if refusal_of_build := fa2_ops.head_dim_refusal(call.q.shape[-1]):
        fail("q", refusal_of_build)
    b = call.blocks
    mask_cnt, mask_idx = call.mask_lists or (b.mask_cnt, b.mask_idx)
    k_source, v_source = call.mask_source or (None, None)
    return dict(q=call.q, k=call.k, v=call.v, full_cnt=b.full_cnt, full_idx=b.full_idx, mask_cnt=mask_cnt,
                mask_idx=mask_idx, cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
                seqused_k=call.seqused_k, cu_total_m_blocks=b.cu_total_m_blocks,
                cu_block_idx_offsets=b.cu_block_idx_offsets, max_seqlen_q=call.max_seqlen_q,
                max_seqlen_k=call.max_seqlen_k, block_size=b.block_size,
                q_block_size=b.resolved_q_block_size(call.max_seqlen_q), softmax_scale=call.scale,
                causal=call.causal, num_splits=splits, pack_gqa=pack_gqa(call), page_table=call.page_table,
                k_mask_source=k_source, v_mask_source=v_source)


# --- the backend protocol (backends/__init__.py) ----------------------------------------------

FP8_REFUSAL = "FA-2 has no FP8 (float8_e4m3fn) kernels; FP8 K/V runs on backend='fa3' (sm90)"


def refusal(call) -> Optional[str]:
    """FA-2 runs every validated 16-bit call (a head dim outside the build is refused by op_args),
    but a second K/V source for the mask lists (the speculative one-launch form) needs blocks of
    at least one kernel tile, which the kernel reads from one source."""
    if call.fp8:
        return FP8_REFUSAL
    if call.mask_source is not None and call.blocks.block_size < tile_n(call.q.shape[-1], decode=False):
        return f"block size {call.blocks.block_size} is below the kernel tile at head dim {call.q.shape[-1]}"
    return None


def traits(call) -> Traits:
    """packed_group: the GQA group where the query heads of a K/V head share a tile (pack_gqa), else 1."""
    return Traits(packed_group=call.q.shape[-2] // call.k.shape[-2] if pack_gqa(call) else 1)


def num_splits(call) -> int:
    """The requested split count, or the heuristic's choice for 0."""
    if call.requested_splits:
        return call.requested_splits
    return choose_num_splits(*split_work(call))


def run(call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse); into `out` (checked by calls.check_out) when given."""
    if out is None:
        return fa2_ops.sparse_fwd(**op_args(call, splits))
    return out, fa2_ops.sparse_fwd_out(**op_args(call, splits), out=out)


def run_partial(call, out_partial: Tensor, lse_partial: Tensor, offset: int, splits: int) -> None:
    """Writes `splits` fp32 partials of `call` into slots [offset, offset + splits)."""
    fa2_ops.sparse_fwd_partial(**op_args(call, splits), out_partial=out_partial, lse_partial=lse_partial,
                           partial_offset=offset)


def plan(call, splits: int, out: Optional[Tensor], keep_buffers: bool = True) -> "Planned":
    """This call's forward bound once (backends/protocol.py)."""
    return Planned(call, splits, out, keep_buffers)


class Planned:
    """The call's extension arguments bound once and, where the build has it, the extension's
    SparseForward planned over them (checked once in C++; its run swaps in q, k, v and out, its
    run_with the lists too). keep_buffers=False: run_with allocates each call's LSE and split
    partials, so a cached plan holds no buffer between calls (the one-shot path). Without a
    SparseForward (or for an out of other strides) the extension's sparse_fwd runs, which checks
    and allocates per call."""

    checks_facts = True

    def __init__(self, call, splits: int, out: Optional[Tensor], keep_buffers: bool):
        args = fa2_ops.extension_args(op_args(call, splits))
        forward = fa2_ops.planned_forward(args, call.q, call.k, call.v, torch.empty_like(call.q) if out is None else out)
        # A plan keeps its lists (the caller's, updated in place); a one-shot plan keeps no tensor.
        self._args = (dict(args, q=None, k=None, v=None) if keep_buffers
                      else {name: value for name, value in args.items() if not isinstance(value, Tensor)})
        self._forward = forward if keep_buffers else for_run_with(forward)
        self.checks_facts = forward is not None  # SparseForward compares the tensors with the planned ones

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        if self._forward is not None:
            return out, self._forward.run(q, k, v, out)
        return self.run_any_out(q, k, v, out)

    def run_any_out(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        return out, fa2_ops.launch_direct(dict(self._args, q=q, k=k, v=v), out)

    def run_with(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], blocks, tensors: dict) -> Tuple[Tensor, Tensor]:
        if out is None:
            out = torch.empty_like(q)
        lists = dict(full_cnt=blocks.full_cnt, full_idx=blocks.full_idx, mask_cnt=blocks.mask_cnt, mask_idx=blocks.mask_idx,
                     cu_total_m_blocks=blocks.cu_total_m_blocks, cu_block_idx_offsets=blocks.cu_block_idx_offsets, **tensors)
        if self._forward is not None:
            return out, self._forward.run_with(q=q, k=k, v=v, out=out, **lists)  # a new LSE: the caller's to keep
        return out, fa2_ops.launch_direct(dict(self._args, q=q, k=k, v=v, **lists), out)
