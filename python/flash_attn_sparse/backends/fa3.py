"""The FA-3 backend: sparse calls run by FA-3's C++ SM90 forward (`hopper/`) with block lists
(patches/flash-attn-3, overlay hopper/flash_api_sparse.cpp; the op flash_attn_3_sparse::fwd in
this build's flash_attn_3 wheel). fa3_ops holds the op wrapper and the kernel's host rules.

Requested with backend="fa3", or chosen by `auto` for prefill-shaped calls and packed decode
(routing.py). Beyond fa3_ops.refusal it refuses, with the reason, a second K/V source for the
mask lists (the speculative one-launch form), which the op does not take.

Paged calls pass the page table and seqused_k and no cu_seqlens_k (the op's paged layout, as
upstream's): a varlen paged call's key counts are its seqused_k, which fa3_ops.refusal asks for.

FP8 (float8_e4m3fn K/V) calls pass their descales to the op, which writes a bfloat16 out. The op
takes e4m3 q, k and v alike, so a 16-bit q is quantized first (fp8.quantize_q, one Triton
launch at decode) and planned over an e4m3 q and q_descale laid out as quantize_q writes them.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..fp8 import descale_of_rows, quantize_q, quantized_q_buffers
from . import fa3_ops
from .device import for_run_with, graph_launch_option
from .protocol import Traits


def refusal(call) -> Optional[str]:
    """Why the FA-3 sparse kernel cannot run this call (shapes only, never syncs), or None."""
    if call.mask_source is not None:
        return "the FA-3 sparse op reads one K/V source (no speculative one-launch form)"
    reason = fa3_ops.refusal(call.q, call.k, call.effective_blocks(), varlen=call.varlen,
                             page_size=call.k.shape[1] if call.page_table is not None else None,
                             seqused_k=call.seqused_k is not None, max_seqlen_q=call.max_seqlen_q)
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


def _key_offsets(tensors: dict) -> Optional[Tensor]:
    """The op's cu_seqlens_k: the call's, but none with a page table (the page table places keys)."""
    return tensors.get("cu_seqlens_k") if tensors.get("page_table") is None else None


def _list_args(blocks, tensors: dict) -> dict:
    """The lists, offsets, sequence lengths, page table and FP8 descales, by the op's (and the
    extension's) argument names; tensors: the call's cu_seqlens_q, cu_seqlens_k, seqused_k,
    page_table and, for e4m3 q/k/v, q_descale, k_descale and v_descale."""
    return dict(full_cnt=blocks.full_cnt, full_idx=blocks.full_idx, mask_cnt=blocks.mask_cnt, mask_idx=blocks.mask_idx,
                cu_total_m_blocks=blocks.cu_total_m_blocks, cu_block_idx_offsets=blocks.cu_block_idx_offsets,
                cu_seqlens_q=tensors.get("cu_seqlens_q"), cu_seqlens_k=_key_offsets(tensors),
                seqused_k=tensors.get("seqused_k"), page_table=tensors.get("page_table"),
                q_descale=tensors.get("q_descale"), k_descale=tensors.get("k_descale"), v_descale=tensors.get("v_descale"))


def _call_tensors(call, q_descale: Optional[Tensor] = None) -> dict:
    """The call's sequence-length, page and descale tensors, by name (cu_seqlens_* under varlen
    only); q_descale: the one computed for a q the backend quantizes."""
    varlen = call.varlen
    return dict(cu_seqlens_q=call.cu_seqlens_q if varlen else None, cu_seqlens_k=call.cu_seqlens_k if varlen else None,
                seqused_k=call.seqused_k, page_table=call.page_table,
                q_descale=call.q_descale if q_descale is None else q_descale, k_descale=call.k_descale,
                v_descale=call.v_descale)


def _call_args(call, splits: int, q_descale: Optional[Tensor] = None) -> dict:
    """Every argument of the op but q, k, v and out, for this call."""
    return dict(_list_args(call.effective_blocks(), _call_tensors(call, q_descale)), **_bound_args(call, splits))


def _new_out(q: Tensor, dtype: torch.dtype) -> Tensor:
    """An output like q in the call's out dtype (bfloat16 for FP8 calls)."""
    return torch.empty_like(q, dtype=dtype)


def _launch_q(call, q_buffers: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(q, q_descale) a plan of this call is made over: the call's q and None, or for a q the
    backend quantizes e4m3 buffers laid out as quantize_q writes them (q_buffers, else new ones)."""
    if not call.quantizes_q:
        return call.q, None
    q_e4m3, rows = q_buffers or quantized_q_buffers(call.q, call.k.shape[-2], call.batch)
    return q_e4m3, descale_of_rows(rows, call.batch)


def _quantizes(call) -> Optional[Tuple[int, int]]:
    """(heads_k, batch) of a call whose 16-bit q the backend quantizes, else None."""
    return (call.k.shape[-2], call.batch) if call.quantizes_q else None


def _quantized(q: Tensor, quantizes: Optional[Tuple[int, int]],
               buffers: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """(the q to launch, its computed q_descale or None): q as it is, or quantized (into buffers)."""
    if quantizes is None:
        return q, None
    heads_k, batch = quantizes
    return quantize_q(q, heads_k, batch=batch, out=buffers)


def plan(call, splits: int, out: Optional[Tensor], keep_buffers: bool = True) -> "Planned":
    """This call's forward bound once (backends/protocol.py)."""
    return Planned(call, splits, out, keep_buffers)


class Planned:
    """The call's op arguments bound once and, where the build has it, flash_attn_3._C's
    SparseForward planned over them (checked once in C++; run swaps in q, k, v and out, run_with
    the lists too). keep_buffers=False: run_with allocates each call's LSE and split partials (the
    one-shot path). Otherwise, and for an out of other strides, the extension's fwd_into (or the
    op fwd_out for a build without it) runs, which checks and allocates per call."""

    checks_facts = True

    def __init__(self, call, splits: int, out: Optional[Tensor], keep_buffers: bool):
        self._bound = _bound_args(call, splits)
        self._out_dtype = call.out_dtype
        # A q the backend quantizes: each run writes it into the plan's own e4m3 buffers, which
        # the planned forward reads; a one-shot plan quantizes into new tensors per call.
        self._quantizes = _quantizes(call)
        buffers = quantized_q_buffers(call.q, *self._quantizes) if self._quantizes else None
        self._q_buffers = buffers if keep_buffers else None
        q_descale = _launch_q(call, buffers)[1]
        # A plan keeps its lists (the caller's, updated in place); a one-shot plan keeps no tensor.
        self._lists = _list_args(call.effective_blocks(), _call_tensors(call, q_descale)) if keep_buffers else None
        self._direct = fa3_ops.direct() or fa3_ops.op_out()  # both take fwd_out's arguments by name
        forward = planned(call, splits, _new_out(call.q, call.out_dtype) if out is None else out, q_buffers=buffers)
        self._forward = forward if keep_buffers else for_run_with(forward)
        # The extension compares what it launches with the planned tensors; a quantized q always
        # matches, so a caller's 16-bit q is compared by the caller (SparsePlan) instead.
        self.checks_facts = forward is not None and not call.quantizes_q
        # run_with's bound on new cu_seqlens' sequences: the planned call's (callers key plans on it).
        self._max_seqlens = (call.max_seqlen_q, call.max_seqlen_k) if call.varlen else (None, None)

    def run(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        if self._forward is not None:
            return out, self._forward.run(_quantized(q, self._quantizes, self._q_buffers)[0], k, v, out)
        return self.run_any_out(q, k, v, out)

    def run_any_out(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> Tuple[Tensor, Tensor]:
        return out, self._direct(q=_quantized(q, self._quantizes, self._q_buffers)[0], k=k, v=v, out=out, **self._lists, **self._bound)

    def run_with(self, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], blocks, tensors: dict) -> Tuple[Tensor, Tensor]:
        if out is None:
            out = _new_out(q, self._out_dtype)
        q, q_descale = _quantized(q, self._quantizes, self._q_buffers)
        if q_descale is not None:
            tensors = dict(tensors, q_descale=q_descale)
        if self._forward is not None:  # the lists by name, written out: no dict built per call
            return out, self._forward.run_with(q=q, k=k, v=v, out=out, full_cnt=blocks.full_cnt, full_idx=blocks.full_idx,
                                               mask_cnt=blocks.mask_cnt, mask_idx=blocks.mask_idx,
                                               cu_total_m_blocks=blocks.cu_total_m_blocks,
                                               cu_block_idx_offsets=blocks.cu_block_idx_offsets,
                                               cu_seqlens_q=tensors.get("cu_seqlens_q"),
                                               cu_seqlens_k=_key_offsets(tensors),
                                               max_seqlen_q=self._max_seqlens[0], max_seqlen_k=self._max_seqlens[1],
                                               seqused_k=tensors.get("seqused_k"), page_table=tensors.get("page_table"),
                                               q_descale=tensors.get("q_descale"), k_descale=tensors.get("k_descale"),
                                               v_descale=tensors.get("v_descale"))
        return out, self._direct(q=q, k=k, v=v, out=out, **_list_args(blocks, tensors), **self._bound)


def planned(call, splits: int, out: Tensor, graph_launch: Optional[bool] = None,
            q_buffers: Optional[Tuple[Tensor, Tensor]] = None):
    """The extension's SparseForward for this call into `out`, or None for a build without it.
    graph_launch (None: device.GRAPH_LAUNCH): its runs after the first launch the kernels as one
    CUDA graph. A call whose q the backend quantizes is planned over e4m3 buffers (q_buffers:
    fp8.quantized_q_buffers, else new ones), which its runs must be given."""
    planner = fa3_ops.planner()
    if planner is None:
        return None
    q, q_descale = _launch_q(call, q_buffers)
    return planner(q=q, k=call.k, v=call.v, out=out, **_call_args(call, splits, q_descale),
                   **graph_launch_option(planner, graph_launch))


def run(call, splits: int, out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) through the ops (traceable); a given `out` is written in place. A q the backend
    quantizes is quantized first (fp8.quantize_q)."""
    q, q_descale = _quantized(call.q, _quantizes(call))
    named = dict(q=q, k=call.k, v=call.v, **_call_args(call, splits, q_descale))
    if out is None:
        return fa3_ops.op()(**named)
    return out, fa3_ops.op_out()(out=out, **named)
