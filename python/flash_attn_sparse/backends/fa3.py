"""The FA-3 backend: sparse calls run by FA-3's C++ SM90 forward (`hopper/`) with block lists
(patches/flash-attn-3, overlay hopper/flash_api_sparse.cpp; the op flash_attn_3_sparse::fwd in
this build's flash_attn_3 wheel). fa3_ops holds the op wrapper and the kernel's host rules.

Requested with backend="fa3", or chosen by `auto` for prefill-shaped calls and packed decode
(routing.py). Beyond fa3_ops.refusal it refuses, with the reason: seqused_k, and a second K/V
source for the mask lists (the speculative one-launch form), which the op does not take.
"""

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import fa3_ops
from .device import for_run_with, graph_launch_option
from .protocol import Traits


def refusal(call) -> Optional[str]:
    """Why the FA-3 sparse kernel cannot run this call (shapes only, never syncs), or None."""
    if call.seqused_k is not None:
        return "the FA-3 sparse op takes no seqused_k"
    if call.mask_source is not None:
        return "the FA-3 sparse op reads one K/V source (no speculative one-launch form)"
    reason = fa3_ops.refusal(call.q, call.k, call.effective_blocks(), varlen=call.varlen,
                             paged=call.page_table is not None, max_seqlen_q=call.max_seqlen_q)
    return reason or fa3_ops.missing_build()


def traits(call) -> Traits:
    """packed_group: the GQA group where the host packs a K/V head's query heads into one tile
    (shared or per-K/V-head lists, any group), else 1."""
    return Traits(packed_group=fa3_ops.packed_group(call.q, call.k, call.effective_blocks(), call.max_seqlen_q))


def num_splits(call) -> int:
    """The requested split count, or 0: the op's host picks one from shapes."""
    return call.requested_splits


def _bound_args(call, splits: int) -> dict:
    """The op's arguments other than its tensors, for this call (fa3_ops.static_args)."""
    return fa3_ops.static_args(call.q, call.effective_blocks(), softmax_scale=call.scale, causal=call.causal,
                               num_splits=splits, max_seqlen_q=call.max_seqlen_q if call.varlen else None,
                               max_seqlen_k=call.max_seqlen_k if call.varlen else None)


def _list_args(blocks, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor]) -> dict:
    """The lists and offsets, by the op's (and the extension's) argument names."""
    return dict(full_cnt=blocks.full_cnt, full_idx=blocks.full_idx, mask_cnt=blocks.mask_cnt, mask_idx=blocks.mask_idx,
                cu_total_m_blocks=blocks.cu_total_m_blocks, cu_block_idx_offsets=blocks.cu_block_idx_offsets,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def _call_args(call, splits: int) -> dict:
    """Every argument of the op but q, k, v and out, for this call."""
    varlen = call.varlen
    return dict(_list_args(call.effective_blocks(), call.cu_seqlens_q if varlen else None,
                           call.cu_seqlens_k if varlen else None), **_bound_args(call, splits))


def launcher(call, splits: int, out: Optional[Tensor] = None, reuse_plan: bool = True) -> Callable:
    """launch(q, k, v, blocks, out, **tensors) -> (out, lse): this call's forward over new tensors
    of the same facts (as fa2.launcher); eager only (the one-shot cache's hit path, and a plan's
    run into an out of other strides). With reuse_plan and the extension's SparseForward: planned
    here once, for an out like `out` (None: a new one per launch, like q), each launch swapping in
    its tensors, lists included, and getting a new LSE (run_with: no checks or parameters rebuilt
    per call; the LSE and split partials from the allocator, so no buffer is held between calls).
    Else through the extension's fwd_into, or the op fwd_out for a build without it."""
    bound = _bound_args(call, splits)
    forward = fa3_ops.direct() or fa3_ops.op_out()  # both take fwd_out's arguments by name
    reused = for_run_with(planned(call, splits, torch.empty_like(call.q) if out is None else out)) if reuse_plan else None

    def launch(q, k, v, blocks, out, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, page_table=None):
        if out is None:
            out = torch.empty_like(q)
        if reused is not None:  # the lists by name, written out: no dict built per call
            return out, reused.run_with(q=q, k=k, v=v, out=out, full_cnt=blocks.full_cnt, full_idx=blocks.full_idx,
                                        mask_cnt=blocks.mask_cnt, mask_idx=blocks.mask_idx,
                                        cu_total_m_blocks=blocks.cu_total_m_blocks,
                                        cu_block_idx_offsets=blocks.cu_block_idx_offsets,
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)  # a new LSE: the caller's
        return out, forward(q=q, k=k, v=v, out=out, **_list_args(blocks, cu_seqlens_q, cu_seqlens_k), **bound)
    return launch


def planned(call, splits: int, out: Tensor, graph_launch: Optional[bool] = None):
    """The extension's SparseForward for this call into `out`, made once (a plan's: run(q, k, v,
    out) only launches), or None for a build without it. graph_launch (None:
    device.GRAPH_LAUNCH): its runs after the first launch the kernels as one CUDA graph."""
    planner = fa3_ops.planner()
    if planner is None:
        return None
    return planner(q=call.q, k=call.k, v=call.v, out=out, **_call_args(call, splits),
                   **graph_launch_option(planner, graph_launch))


def run(call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) through the ops (traceable); a given `out` is written in place."""
    named = dict(q=call.q, k=call.k, v=call.v, **_call_args(call, splits))
    if out is None:
        return fa3_ops.op()(**named)
    return out, fa3_ops.op_out()(out=out, **named)
