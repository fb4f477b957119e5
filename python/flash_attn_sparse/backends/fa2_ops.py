"""torch custom ops over the compiled kernels, with fake (meta) implementations so that
torch.compile(fullgraph=True) traces calls to them.

The kernels live in flash_attn_2_cuda (the patched FA-2 extension): `sparse_fwd` and `combine`.
"""

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .device import graph_launch_option


@functools.lru_cache(maxsize=None)  # an import statement per launch costs host time
def _cuda_module():
    import flash_attn_2_cuda
    return flash_attn_2_cuda


HEAD_DIM_KERNELS = (32, 64, 96, 128, 192, 256)  # HEADDIM_SWITCH's kernels; a head dim runs on the first >= it


@functools.lru_cache(maxsize=None)
def _ask_extension_for_head_dims() -> Tuple[Tuple[int, ...], bool]:
    head_dims, uneven = _cuda_module().sparse_head_dims()
    return tuple(head_dims), bool(uneven)


@torch.compiler.assume_constant_result  # torch.compile cannot trace the pybind call; the answer is fixed per build
def compiled_head_dims() -> Tuple[Tuple[int, ...], bool]:
    """(head dims this build has kernels for, whether other multiples of 8 run on the next one)."""
    return _ask_extension_for_head_dims()


def head_dim_refusal(head_dim: int, compiled: Optional[Tuple[Tuple[int, ...], bool]] = None,
                     check_build: bool = True) -> Optional[str]:
    """Why head_dim cannot run (not a multiple of 8 up to 256, or not in this build), or None.
    compiled: compiled_head_dims()'s answer (asked of the extension when None and check_build)."""
    if head_dim % 8 or not 0 < head_dim <= 256:
        return f"head_dim must be a multiple of 8, at most 256, got {head_dim}"
    if not check_build:
        return None
    head_dims, uneven = compiled or compiled_head_dims()
    kernel = next(d for d in HEAD_DIM_KERNELS if d >= head_dim)
    if kernel in head_dims and (uneven or kernel == head_dim):
        return None
    runs = f"head dims {', '.join(map(str, head_dims))}"
    if uneven:
        runs += " and the multiples of 8 below each"
    return f"this build (e.g. the dev profile, which narrows head dims) runs {runs}; got {head_dim}"


def head_dim_rounded(head_dim: int) -> int:
    """The head dim the kernels pad partials to (what flash_api_sparse.cpp calls d_rounded)."""
    multiple = 32 if head_dim <= 128 else 64
    return (head_dim + multiple - 1) // multiple * multiple


# The arguments both ops pass to flash_attn_2_cuda.sparse_fwd, by the names its binding gives them
# (patch flash-attn/0005: keyword-only); `causal` is its `is_causal`, the FA-2 spelling.
EXTENSION_ARGS = ("q", "k", "v", "full_cnt", "full_idx", "mask_cnt", "mask_idx", "cu_seqlens_q", "cu_seqlens_k",
                  "seqused_k", "page_table", "cu_total_m_blocks", "cu_block_idx_offsets", "max_seqlen_q",
                  "max_seqlen_k", "block_size", "q_block_size", "softmax_scale", "num_splits", "pack_gqa",
                  "k_mask_source", "v_mask_source")


def launch_direct(extension_args: dict, out: Tensor) -> Tensor:
    """sparse_fwd into `out` straight through the extension, past the custom op's dispatch (not
    traceable; plan.run's launch). extension_args: extension_args(op_args). Returns lse."""
    return _cuda_module().sparse_fwd(**extension_args, out=out, out_partial=None, lse_partial=None, partial_offset=0)[1]


def planned_forward(extension_args: dict, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    graph_launch: Optional[bool] = None):
    """The extension's SparseForward over these arguments (checked once there; run(q, k, v, out)
    launches), or None for a call it does not plan (a second K/V source) or a build without it.
    graph_launch (None: backends/device.GRAPH_LAUNCH): its runs after the first launch the kernels
    as one CUDA graph (flash_api_sparse.h)."""
    planner = getattr(_cuda_module(), "SparseForward", None)
    if planner is None or extension_args["k_mask_source"] is not None:
        return None
    planned = {name: value for name, value in extension_args.items() if name not in ("k_mask_source", "v_mask_source")}
    return planner(**dict(planned, q=q, k=k, v=v, out=out), **graph_launch_option(planner, graph_launch))


def extension_args(op_args: dict) -> dict:
    """The extension's keyword arguments of one forward, but its out and partial buffers."""
    return dict({name: op_args[name] for name in EXTENSION_ARGS}, is_causal=op_args["causal"])


def _extension_args(op_args: dict, out: Optional[Tensor] = None) -> dict:
    """sparse_fwd's keyword arguments from an op's own (named like them)."""
    return dict({name: op_args[name] for name in EXTENSION_ARGS}, out=out, is_causal=op_args["causal"])


@torch.library.custom_op("flash_attn_sparse::fwd", mutates_args=(), device_types="cuda")
def sparse_fwd(q: Tensor, k: Tensor, v: Tensor, full_cnt: Tensor, full_idx: Tensor,
               mask_cnt: Optional[Tensor], mask_idx: Optional[Tensor],
               cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
               cu_total_m_blocks: Optional[Tensor], cu_block_idx_offsets: Optional[Tensor],
               max_seqlen_q: int, max_seqlen_k: int, block_size: int, q_block_size: int,
               softmax_scale: float, causal: bool, num_splits: int, pack_gqa: bool,
               page_table: Optional[Tensor], k_mask_source: Optional[Tensor],
               v_mask_source: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """k_mask_source / v_mask_source: the K/V the mask blocks name, when not k and v."""
    out, lse = _cuda_module().sparse_fwd(**_extension_args(locals()), out_partial=None, lse_partial=None,
                                         partial_offset=0)
    return out, lse


@sparse_fwd.register_fake
def _(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, cu_seqlens_q, cu_seqlens_k, seqused_k,
      cu_total_m_blocks, cu_block_idx_offsets, max_seqlen_q, max_seqlen_k, block_size, q_block_size,
      softmax_scale, causal, num_splits, pack_gqa, page_table, k_mask_source, v_mask_source):
    return torch.empty_like(q), _lse_like(q, cu_seqlens_q is not None)


@torch.library.custom_op("flash_attn_sparse::fwd_out", mutates_args=("out",), device_types="cuda")
def sparse_fwd_out(q: Tensor, k: Tensor, v: Tensor, full_cnt: Tensor, full_idx: Tensor,
                   mask_cnt: Optional[Tensor], mask_idx: Optional[Tensor],
                   cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
                   cu_total_m_blocks: Optional[Tensor], cu_block_idx_offsets: Optional[Tensor],
                   max_seqlen_q: int, max_seqlen_k: int, block_size: int, q_block_size: int,
                   softmax_scale: float, causal: bool, num_splits: int, pack_gqa: bool,
                   page_table: Optional[Tensor], k_mask_source: Optional[Tensor],
                   v_mask_source: Optional[Tensor], out: Tensor) -> Tensor:
    """sparse_fwd writing the output into `out` (like q, contiguous last dim); returns lse."""
    args = {name: value for name, value in locals().items() if name != "out"}
    _, lse = _cuda_module().sparse_fwd(**_extension_args(args, out), out_partial=None, lse_partial=None,
                                       partial_offset=0)
    return lse


@sparse_fwd_out.register_fake
def _(q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, cu_seqlens_q, cu_seqlens_k, seqused_k,
      cu_total_m_blocks, cu_block_idx_offsets, max_seqlen_q, max_seqlen_k, block_size, q_block_size,
      softmax_scale, causal, num_splits, pack_gqa, page_table, k_mask_source, v_mask_source, out):
    return _lse_like(q, cu_seqlens_q is not None)


def _lse_like(q: Tensor, varlen: bool) -> Tensor:
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op("flash_attn_sparse::fwd_partial", mutates_args=("out_partial", "lse_partial"), device_types="cuda")
def sparse_fwd_partial(q: Tensor, k: Tensor, v: Tensor, full_cnt: Tensor, full_idx: Tensor,
                       mask_cnt: Optional[Tensor], mask_idx: Optional[Tensor],
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], seqused_k: Optional[Tensor],
                       cu_total_m_blocks: Optional[Tensor], cu_block_idx_offsets: Optional[Tensor],
                       max_seqlen_q: int, max_seqlen_k: int, block_size: int, q_block_size: int,
                       softmax_scale: float, causal: bool, num_splits: int, pack_gqa: bool,
                       page_table: Optional[Tensor], k_mask_source: Optional[Tensor], v_mask_source: Optional[Tensor],
                       out_partial: Tensor, lse_partial: Tensor, partial_offset: int) -> None:
    """Writes fp32 partials of this call to slots [partial_offset, partial_offset + num_splits)."""
    _cuda_module().sparse_fwd(**_extension_args(locals()), out_partial=out_partial, lse_partial=lse_partial,
                              partial_offset=partial_offset)


@sparse_fwd_partial.register_fake
def _(*args):
    return None


@torch.library.custom_op("flash_attn_sparse::combine", mutates_args=(), device_types="cuda")
def combine(out_partial: Tensor, lse_partial: Tensor, out_dtype: torch.dtype, head_dim: int,
            cu_seqlens_q: Optional[Tensor], total_q: int) -> Tuple[Tensor, Tensor]:
    """Merges (S, b, h, seqlen_q, d_rounded) / (S, b, h, seqlen_q) fp32 partials."""
    out, lse = _combine_outputs(out_partial, out_dtype, head_dim, cu_seqlens_q, total_q)
    _cuda_module().combine(out_partial=out_partial, lse_partial=lse_partial, out=out, softmax_lse=lse,
                           cu_seqlens_q=cu_seqlens_q)
    return out, lse


@combine.register_fake
def _(out_partial, lse_partial, out_dtype, head_dim, cu_seqlens_q, total_q):
    return _combine_outputs(out_partial, out_dtype, head_dim, cu_seqlens_q, total_q)


def _combine_outputs(out_partial: Tensor, out_dtype: torch.dtype, head_dim: int, cu_seqlens_q: Optional[Tensor],
                     total_q: int) -> Tuple[Tensor, Tensor]:
    _, batch, heads, seqlen_q, _ = out_partial.shape
    if cu_seqlens_q is not None:
        out = out_partial.new_empty((total_q, heads, head_dim), dtype=out_dtype)
        lse = out_partial.new_empty((heads, total_q), dtype=torch.float32)
    else:
        out = out_partial.new_empty((batch, seqlen_q, heads, head_dim), dtype=out_dtype)
        lse = out_partial.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
    return out, lse


def partial_buffers(num_slots: int, batch: int, heads: int, seqlen_q: int, head_dim: int, device) -> Tuple[Tensor, Tensor]:
    """Uninitialised fp32 partial buffers in the layout the kernels and the combine use."""
    out_partial = torch.empty((num_slots, batch, heads, seqlen_q, head_dim_rounded(head_dim)), dtype=torch.float32, device=device)
    lse_partial = torch.empty((num_slots, batch, heads, seqlen_q), dtype=torch.float32, device=device)
    return out_partial, lse_partial
