"""FP8 (float8_e4m3fn) inputs of the sparse forward, which runs them on FA-3 (sm90) only: the
descale arguments, normalized to the kernel's float32 (batch, heads_k) layout, and the
quantization of a 16-bit q to e4m3 with one scale per (sequence, K/V head).

A descale says what an e4m3 tensor means: its real value is the stored e4m3 value x descale, one
float32 factor per (batch, K/V head) (query head h reads entry h // group). FP8 calls return a
bfloat16 out and a float32 LSE.

Quantization error of quantize_q: e4m3 keeps 3 mantissa bits, so an element in e4m3's normal
range is off by at most 2^-4 of its magnitude (round to nearest); the scale puts a group's
largest magnitude (amax) in (224, 448], so no element saturates, and one below e4m3's normal
range is off by at most 2^-10 x descale; every element is off by at most 2^-4 x amax.
"""

import functools
import importlib.util
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .metadata import fail

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# Groups whose largest magnitude is below this take descale 1 (all-zero ones included), so the
# scale stays finite; their elements quantize to 0, off by less than 2^-100.
AMAX_FLOOR = 2.0 ** -100
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")

Descale = Union[float, Tensor]


def is_fp8(t) -> bool:
    return isinstance(t, Tensor) and t.dtype == FP8_DTYPE


def normalize_descale(name: str, value: Descale, batch: int, heads_k: int, device) -> Tensor:
    """value as the kernel reads it: a float32 (batch, heads_k) tensor on `device`. value: a
    Python float, a 0-d tensor, or a tensor of shape (1, 1), (batch, 1), (1, heads_k) or
    (batch, heads_k), of any floating dtype (converted to float32); broadcast by expand (stride
    0, no copy). Never syncs."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
        fail(name, f"must be a float or a float32 tensor of shape (batch, heads_k) = ({batch}, {heads_k}), "
                   f"got {type(value).__name__}")
    if not isinstance(value, Tensor):
        if value != value or value in (float("inf"), float("-inf")):
            fail(name, f"must be finite, got {value}")
        return torch.full((1, 1), float(value), dtype=torch.float32, device=device).expand(batch, heads_k)
    if not value.is_floating_point():
        fail(name, f"must be a floating-point tensor (float32 preferred), got {value.dtype}")
    if value.device != torch.device(device):
        fail(name, f"must be on the device of q ({device}), got {value.device}")
    shape = tuple(value.shape)
    if not (shape == () or (len(shape) == 2 and shape[0] in (1, batch) and shape[1] in (1, heads_k))):
        fail(name, f"must be (batch, heads_k) = ({batch}, {heads_k}) or broadcast to it from (), (1, 1), "
                   f"({batch}, 1) or (1, {heads_k}), got shape {shape}")
    if value.dtype != torch.float32:
        value = value.to(torch.float32)
    if shape == (batch, heads_k):
        return value
    return value.reshape(1, 1).expand(batch, heads_k) if not shape else value.expand(batch, heads_k)


def call_descales(q: Tensor, k: Tensor, batch: int, q_descale: Optional[Descale], k_descale: Optional[Descale],
                  v_descale: Optional[Descale]) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """A call's descales, normalized: k_descale and v_descale with e4m3 k and v (required),
    q_descale with e4m3 q (required; a 16-bit q with e4m3 K/V is quantized by the package, which
    computes its descale); none with 16-bit K/V."""
    given = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if k.dtype != FP8_DTYPE:
        for name, value in given.items():
            if value is not None:
                fail(name, f"goes with float8_e4m3fn k and v only, got {k.dtype} k and v")
        return None, None, None
    for name in ("k_descale", "v_descale"):
        if given[name] is None:
            fail(name, "is required with float8_e4m3fn k and v (real value = stored e4m3 value x descale); "
                       "pass 1.0 for unscaled values")
    if q.dtype == FP8_DTYPE and q_descale is None:
        fail("q_descale", "is required with float8_e4m3fn q (real value = stored e4m3 value x descale); "
                          "pass 1.0 for unscaled values")
    if q.dtype != FP8_DTYPE and q_descale is not None:
        fail("q_descale", f"goes with float8_e4m3fn q only: a {q.dtype} q is quantized by the package, "
                          "which computes its descale")
    heads_k = k.shape[-2]
    return tuple(None if value is None else normalize_descale(name, value, batch, heads_k, q.device)
                 for name, value in given.items())


def refuse_fp8(entry: str, **tensors) -> None:
    """Refuses e4m3 inputs to an entry point that does not take them yet."""
    for name, t in tensors.items():
        if is_fp8(t):
            fail(name, f"{entry} is not yet for FP8 K/V (float8_e4m3fn); FP8 runs through "
                       "flash_attn_with_sparse_block_table, flash_attn_varlen_with_sparse_blocks and plan on backend 'fa3'")


def quantized_q_buffers(q: Tensor, heads_k: int, batch: int) -> Tuple[Tensor, Tensor]:
    """(q_e4m3, descale_rows): empty buffers laid out as quantize_q writes them (q_e4m3
    contiguous; descale_rows float32 (batch, heads_k) batched, (heads_k,) varlen)."""
    rows = (q.shape[0], heads_k) if q.dim() == 4 else (heads_k,)
    return (torch.empty(q.shape, dtype=FP8_DTYPE, device=q.device),
            torch.empty(rows, dtype=torch.float32, device=q.device))


def descale_of_rows(rows: Tensor, batch: int) -> Tensor:
    """A descale in the call's (batch, heads_k) layout from quantize_q's rows (varlen: one row
    shared by every sequence, stride 0)."""
    return rows if rows.dim() == 2 else rows.expand(batch, rows.shape[0])


def quantize_q(q: Tensor, heads_k: int, cu_seqlens_q: Optional[Tensor] = None, batch: Optional[int] = None, *,
               out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """(q_e4m3, q_descale) of a float16 / bfloat16 q: q_e4m3 contiguous like q, and q_descale
    float32 (batch, heads_k), one power-of-two scale per (sequence, K/V head) of a batched q
    (batch, seqlen, heads, head_dim), or per K/V head shared by every sequence of a varlen q
    (total, heads, head_dim) (batch: cu_seqlens_q's sequences, or given). The scale puts the
    group's largest finite magnitude in (224, 448]; q ~= q_e4m3 x q_descale within the error
    the module docstring states. NaN and +-inf in q become NaN in q_e4m3 (the scale ignores
    them), so they reach the output rows they reach in a 16-bit call. out: (q_e4m3, descale
    rows) buffers of quantized_q_buffers to write into. On a CUDA q one Triton launch (groups of
    over 16k elements: an amax pass, then the quantize pass; fp8_triton), else torch ops: no
    host sync, capturable in a CUDA graph."""
    varlen = q.dim() == 3
    if not varlen:
        batch = q.shape[0]
    elif batch is None:
        if cu_seqlens_q is None:
            raise TypeError("quantize_q: a varlen q needs cu_seqlens_q or batch")
        batch = cu_seqlens_q.shape[0] - 1
    if q.is_cuda and not torch.compiler.is_compiling() and _triton_available() and \
            (out is None or (out[0].is_contiguous() and out[1].is_contiguous())):
        from .fp8_triton import quantize_into
        q_e4m3, rows = out if out is not None else quantized_q_buffers(q, heads_k, batch)
        quantize_into(q.contiguous(), heads_k, q_e4m3, rows, AMAX_FLOOR)
        return q_e4m3, descale_of_rows(rows, batch)
    return _quantize_q_torch(q, heads_k, batch, out)


def _quantize_q_torch(q: Tensor, heads_k: int, batch: int, out: Optional[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
    """quantize_q in torch ops (CPU, torch.compile, no Triton); fp8_triton's kernels equal it bitwise."""
    varlen = q.dim() == 3
    group = q.shape[-2] // heads_k
    grouped = q.unflatten(-2, (heads_k, group))  # (..., heads_k, group, head_dim)
    reduced = (1, 3, 4) if not varlen else (0, 2, 3)
    rows_shape = (q.shape[0], heads_k) if not varlen else (heads_k,)
    if q.numel() == 0:
        amax = torch.zeros(rows_shape, dtype=torch.float32, device=q.device)
    else:
        amax = grouped.abs().nan_to_num_(nan=0.0, posinf=0.0).amax(dim=reduced).float()
    amax = torch.where(amax >= AMAX_FLOOR, amax, E4M3_MAX)
    # The largest power of two s with amax x s <= 448, from amax = m x 2^E, m in [0.5, 1): 2^(8 - E)
    # for m > 0.875, else 2^(9 - E). Built from its exponent bits, so s and 1 / s are exact, and
    # q x s is exact (in bfloat16, whose exponent range is float32's; fp16's is too narrow for s,
    # so float32 there).
    mantissa, exponent = torch.frexp(amax)
    power = (torch.where(mantissa > 0.875, 8, 9) - exponent).to(torch.int32)
    scale = ((power + 127) << 23).view(torch.float32)
    work = torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32
    view = (q.shape[0], 1, heads_k, 1, 1) if not varlen else (1, heads_k, 1, 1)
    scaled = grouped * scale.to(work).view(view)
    # NaN explicitly: some torch releases saturate +-inf to +-448 when casting to e4m3fn.
    scaled = scaled.masked_fill(~torch.isfinite(scaled), float("nan"))
    descale = ((127 - power) << 23).view(torch.float32)
    if out is None:
        q_e4m3 = scaled.to(FP8_DTYPE, memory_format=torch.contiguous_format).flatten(-3, -2)
        rows = descale
    else:
        q_e4m3, rows = out
        q_e4m3.unflatten(-2, (heads_k, group)).copy_(scaled)
        rows.copy_(descale)
    return q_e4m3, descale_of_rows(rows, batch)


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
