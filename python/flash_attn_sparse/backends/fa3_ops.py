"""The FA-3 sparse SM90 forward, torch.ops.flash_attn_3_sparse.fwd and fwd_out (into a given out;
patches/overlay/flash-attn-3/hopper/flash_api_sparse.cpp, built into upstream's flash_attn_3
wheel by forktools build), and for eager callers the same forward through flash_attn_3._C's
pybind11 entry points (planner, direct), which skip the ops' schema parsing.

sparse_fwd takes the SparseBlocks of the FA-2 path and returns (out, lse) in its layout: LSE
(batch, heads, seqlen_q) batched, (heads, total_q) varlen. refusal() states, from shapes only,
the kernel's host rules a call breaks, so a caller can route elsewhere instead of catching the
op's error; missing_build() says why the op cannot be called at all.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..fp8 import FP8_DTYPE
from ..metadata import SparseBlocks

BLOCK_SIZE = 128  # kSparseBlockSize: one K/V block is one kernel tile_n; a build may report more (block_sizes)
TILE_M = 128  # query rows of the tile packing and splitting are decided on (tile_size_fwd_sm90_sparse)
HEAD_DIMS = (64, 128)  # the instantiated head dims (generate_kernels_sparse.py)


# Answers fixed per process, in plain dicts: torch.compile traces through a functools.lru_cache
# wrapper with a warning, and these are asked on traced calls (routing).
_MISSING_BUILD: dict = {}
_CAPABILITIES: dict = {}
_BLOCK_SIZES: dict = {}
_DISABLED: dict = {}
_DESCALES: dict = {}


@torch.compiler.assume_constant_result  # an import is not traceable; the answer is fixed per process
def missing_build() -> Optional[str]:
    """None if torch.ops.flash_attn_3_sparse.fwd is callable, else why not."""
    if "answer" not in _MISSING_BUILD:
        _MISSING_BUILD["answer"] = _why_not_built()
    return _MISSING_BUILD["answer"]


def _why_not_built() -> Optional[str]:
    try:
        import flash_attn_3._C  # noqa: F401 -- loading the library registers the op
    except ImportError as error:
        return f"flash_attn_3 is not importable ({error}); build it with `nox -s build`"
    if not hasattr(torch.ops.flash_attn_3_sparse, "fwd"):
        return "this flash_attn_3 build has no flash_attn_3_sparse.fwd (built with FLASH_ATTENTION_DISABLE_SPARSE?)"
    return None


@torch.compiler.assume_constant_result
def disabled() -> Tuple[str, ...]:
    """The FLASH_ATTENTION_DISABLE_* flags (suffixes: VARLEN, PACKGQA, SPLIT, HDIM64, HDIM128, FP16, FP8, PAGEDKV)
    this flash_attn_3 build was compiled with, as its extension reports them (none for a build
    that predates the report, or no build)."""
    if "answer" not in _DISABLED:
        report = _extension_attribute("sparse_disabled") if missing_build() is None else None
        _DISABLED["answer"] = tuple(report()) if report is not None else ()
    return _DISABLED["answer"]


@torch.compiler.assume_constant_result
def block_sizes() -> Tuple[int, ...]:
    """Keys per list block this build's sparse kernels take, as its extension reports them (128 for
    a build without the report, or no build). Blocks other than 128 keys take fp16 or bf16 K/V,
    contiguous or in pages of whole blocks."""
    if "answer" not in _BLOCK_SIZES:
        report = _extension_attribute("sparse_block_sizes") if missing_build() is None else None
        _BLOCK_SIZES["answer"] = tuple(report()) if report is not None else (BLOCK_SIZE,)
    return _BLOCK_SIZES["answer"]


@torch.compiler.assume_constant_result
def _takes_descales() -> bool:
    """Whether this build's op takes q_descale, k_descale and v_descale (a build before FP8 does
    not); True without a build, whose absence missing_build reports."""
    if "answer" not in _DESCALES:
        _DESCALES["answer"] = missing_build() is not None or "q_descale" in {a.name for a in op()._schema.arguments}
    return _DESCALES["answer"]


@torch.compiler.assume_constant_result
def _capability(device_index: int) -> Tuple[int, int]:
    if device_index not in _CAPABILITIES:
        _CAPABILITIES[device_index] = torch.cuda.get_device_capability(device_index)
    return _CAPABILITIES[device_index]


def _on_sm90(q: Tensor) -> bool:
    return q.is_cuda and _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) == (9, 0)


def _packable(group: int, list_heads: int, num_heads: int, q_block_size: int, seqlen_q: int) -> bool:
    """Whether the host can pack a K/V head's query heads into shared tiles: they share lists
    (shared or per K/V head, or a group of one) and no tile straddles two list rows (one list row
    covers every query, or a list row's packed rows fill whole tiles)."""
    return ((group == 1 or list_heads != num_heads) and "PACKGQA" not in disabled()
            and (q_block_size >= seqlen_q or (q_block_size * group) % TILE_M == 0))


def _packs_query_heads(group: int, list_heads: int, num_heads: int, q_block_size: int, seqlen_q: int) -> bool:
    """The host's PackGQA choice (pack_gqa=None) for a group of more than one, any group."""
    return group > 1 and _packable(group, list_heads, num_heads, q_block_size, seqlen_q)


def packed_group(q: Tensor, k: Tensor, blocks: SparseBlocks, seqlen_q: int) -> int:
    """Query heads sharing one tile's rows under the host's PackGQA choice: the GQA group where
    the kernel packs them, else 1."""
    num_heads, num_heads_k = q.shape[-2], k.shape[-2]
    group = num_heads // max(num_heads_k, 1)
    packs = _packs_query_heads(group, blocks.num_heads, num_heads, blocks.resolved_q_block_size(seqlen_q), seqlen_q)
    return group if packs else 1


def refusal(q: Tensor, k: Tensor, blocks: SparseBlocks, *, varlen: bool, page_size: Optional[int] = None,
            seqused_k: bool = False, max_seqlen_q: Optional[int] = None) -> Optional[str]:
    """None if the FA-3 sparse kernel takes this call, else the first rule it breaks. page_size:
    a paged cache's (k.shape[1]), None for contiguous K/V; seqused_k: whether the call has one.
    float8_e4m3fn k (FP8) runs the e4m3 kernels with q e4m3, or fp16 / bf16 that the backend
    quantizes to e4m3 first."""
    if not _on_sm90(q):
        return "the FA-3 sparse kernel runs on sm90 (H100/H200) only"
    fp8 = k.dtype == FP8_DTYPE
    if fp8 and q.dtype not in (FP8_DTYPE, torch.float16, torch.bfloat16):
        return f"the FA-3 sparse kernel takes float8_e4m3fn K/V with float8_e4m3fn, fp16 or bf16 q, got {q.dtype}"
    if not fp8 and (q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype):
        return f"the FA-3 sparse kernel takes fp16 or bf16 q and k of one dtype, or float8_e4m3fn k, got {q.dtype} and {k.dtype}"
    if q.shape[-1] not in HEAD_DIMS or k.shape[-1] != q.shape[-1]:
        return f"the FA-3 sparse kernel has head dims {HEAD_DIMS} (K and V equal to Q), got {q.shape[-1]}"
    if fp8 and ("FP8" in disabled() or not _takes_descales()):
        return ("this flash_attn_3 build has no FP8 kernels (FLASH_ATTENTION_DISABLE_FP8): "
                "rebuild with FLASH_ATTN_SPARSE_FP8=1 nox -s build")
    compiled_out = [flag for flag, needed in (("FP16", q.dtype == torch.float16 and not fp8), (f"HDIM{q.shape[-1]}", True),
                                              ("VARLEN", varlen or seqused_k)) if needed and flag in disabled()]
    if compiled_out:
        return f"this flash_attn_3 build has no such kernels (FLASH_ATTENTION_DISABLE_{compiled_out[0]})"
    if blocks.block_size not in block_sizes():
        return f"this flash_attn_3 build's sparse kernels take block_size {' or '.join(map(str, block_sizes()))}, got {blocks.block_size}"
    # Pages of whole list blocks take TMA loads; others cp.async loads (packed kernels, 128-key blocks only).
    cpasync_pages = page_size is not None and page_size % blocks.block_size != 0
    if blocks.block_size != BLOCK_SIZE and (fp8 or cpasync_pages):
        return (f"the FA-3 sparse kernel takes blocks of {blocks.block_size} keys with fp16 or bf16 K/V, contiguous or in "
                f"pages of a multiple of {blocks.block_size} keys")
    if cpasync_pages and fp8:
        return (f"the FA-3 sparse kernel takes FP8 K/V in pages of a multiple of {blocks.block_size} keys only "
                f"(TMA pages), got pages of {page_size}: pages of other sizes are not supported for FP8")
    if cpasync_pages and ("PAGEDKV" in disabled() or "PACKGQA" in disabled()):
        return (f"this flash_attn_3 build has no kernels for pages of other than a multiple of {blocks.block_size} keys "
                "(FLASH_ATTENTION_DISABLE_PAGEDKV or _PACKGQA)")
    if page_size is not None and varlen and not seqused_k:
        return "the FA-3 sparse kernel takes varlen paged calls with seqused_k (the sequences' key counts)"
    if blocks.is_varlen != varlen:
        return "varlen inputs need varlen lists (cu_total_m_blocks, cu_block_idx_offsets) and batched ones batched lists"
    if varlen and blocks.mask_cnt is not None and any(a.shape != b.shape or a.stride() != b.stride() for a, b in
                                                      ((blocks.mask_cnt, blocks.full_cnt), (blocks.mask_idx, blocks.full_idx))):
        # One set of offsets for both lists in the varlen layout (batched mask lists have their own).
        return "the FA-3 sparse kernel takes varlen mask lists of the full lists' shape and strides"
    num_heads, num_heads_k = q.shape[-2], k.shape[-2]
    if num_heads_k == 0 or num_heads % num_heads_k:
        return f"num_heads {num_heads} must be a multiple of num_heads_k {num_heads_k}"
    if blocks.num_heads not in (1, num_heads_k, num_heads):
        return f"the lists' head extent must be 1, {num_heads_k} or {num_heads}, got {blocks.num_heads}"
    seqlen_q = max_seqlen_q if max_seqlen_q is not None else (q.shape[0] if varlen else q.shape[1])
    q_block_size = blocks.resolved_q_block_size(seqlen_q)
    packs = _packs_query_heads(num_heads // num_heads_k, blocks.num_heads, num_heads, q_block_size, seqlen_q)
    if q_block_size <= 0 or not (packs or q_block_size >= seqlen_q or q_block_size % TILE_M == 0):
        return (f"q_block_size {q_block_size} must be a multiple of {TILE_M} (the query rows of a tile) "
                "or cover every query row here")
    if cpasync_pages and not _packable(num_heads // num_heads_k, blocks.num_heads, num_heads, q_block_size, seqlen_q):
        # Its kernels for pages that do not hold whole blocks load K/V with cp.async, packed only.
        return (f"the FA-3 sparse kernel takes pages of other than a multiple of {blocks.block_size} keys (got {page_size}) "
                "with shared or per-K/V-head lists only, and q_block_size * group a multiple of "
                f"{TILE_M} or one list row for every query")
    return None


def op():
    """The op's one overload (past torch.ops' overload resolution on every call)."""
    return torch.ops.flash_attn_3_sparse.fwd.default


def op_out():
    """The op writing into a given out (fwd_out: no output allocation, no copy); returns the LSE."""
    return torch.ops.flash_attn_3_sparse.fwd_out.default


def _extension_attribute(name: str):
    """flash_attn_3._C's pybind11 entry point `name`, or None for a build without it."""
    try:
        import flash_attn_3._C as extension
    except ImportError:
        return None
    return getattr(extension, name, None)


def planner():
    """The extension's class SparseForward (fwd_out's arguments by name, checked once; its
    run(q, k, v, out) launches and returns the LSE), or None for a build without it."""
    return _extension_attribute("SparseForward")


def direct():
    """fwd_into(**fwd_out's arguments by name) -> LSE: fwd_out without the dispatcher's argument
    parsing, for eager callers (not traceable), or None for a build without it."""
    return _extension_attribute("fwd_into")


def static_args(q: Tensor, blocks: SparseBlocks, *, softmax_scale: Optional[float] = None, causal: bool = False,
                num_splits: int = 1, pack_gqa: Optional[bool] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_k: Optional[int] = None) -> dict:
    """The op's keyword arguments other than its tensors (max_seqlen_* given for varlen calls only)."""
    seqlen_q = max_seqlen_q if max_seqlen_q is not None else q.shape[1]
    return dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                block_size=blocks.block_size, q_block_size=blocks.resolved_q_block_size(seqlen_q or 0),
                causal=causal, num_splits=num_splits, pack_gqa=pack_gqa)


def sparse_fwd(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, *, softmax_scale: Optional[float] = None,
               causal: bool = False, num_splits: int = 1, pack_gqa: Optional[bool] = None,
               cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
               max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Attention of q over the listed K/V blocks: (out like q, lse float32). Batched q, k, v are
    (b, s, h, d); varlen ones (total, h, d) with cu_seqlens_* and max_seqlen_*. num_splits=0 lets
    the kernel's host pick a split count from shapes."""
    varlen = cu_seqlens_q is not None
    bound = static_args(q, blocks, softmax_scale=softmax_scale, causal=causal, num_splits=num_splits, pack_gqa=pack_gqa,
                        max_seqlen_q=max_seqlen_q if varlen else None, max_seqlen_k=max_seqlen_k if varlen else None)
    return op()(q, k, v, blocks.full_cnt, blocks.full_idx, blocks.mask_cnt, blocks.mask_idx,
                blocks.cu_total_m_blocks, blocks.cu_block_idx_offsets, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, **bound)
