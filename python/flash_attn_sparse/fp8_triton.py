"""fp8.quantize_q on a CUDA q in one Triton launch (an amax pass and a quantize pass where a
(sequence, K/V head) group is large) where its torch form takes a dozen small kernels, each a
launch at decode; bitwise equal to the torch form. Used on a CUDA q outside torch.compile (whose
own fusion takes the torch form).

The scale rule, from amax's float32 bits: amax = m x 2^E with m in [0.5, 1); the largest power
of two s with amax x s <= 448 is 2^(8 - E) when m > 0.875 (mantissa bits above 0x600000), else
2^(9 - E), which puts amax x s in (224, 448].
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

# One program takes a whole group (one launch) up to this many elements; larger groups take an
# amax pass over row chunks (atomic max) and a quantize pass.
ONE_PASS_ELEMENTS = 16384
TILE_ELEMENTS = 8192


@triton.jit
def _tile(group, chunk, rows_per_seq, row_stride, group_width, heads_k, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Offsets and mask of `chunk`'s ROWS rows of `group` (= sequence * heads_k + K/V head)."""
    seq = group // heads_k
    head = group % heads_k
    rows = chunk * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WIDTH)
    offsets = (seq.to(tl.int64) * rows_per_seq + rows[:, None].to(tl.int64)) * row_stride + head * group_width + cols[None, :]
    return offsets, (rows[:, None] < rows_per_seq) & (cols[None, :] < group_width)


@triton.jit
def _finite_abs_max(x):
    a = tl.abs(x.to(tl.float32))
    return tl.max(tl.max(tl.where(a < float("inf"), a, 0.0), axis=1), axis=0)  # NaN and +-inf count as 0


@triton.jit
def _store_quantized(q_ptr, out_ptr, descale_ptr, group, chunk, offsets, mask, amax, amax_floor):
    amax = tl.where(amax >= amax_floor, amax, 448.0)
    bits = amax.to(tl.int32, bitcast=True)
    exponent = tl.where((bits & 0x7FFFFF) > 0x600000, 8, 9) - (((bits >> 23) & 0xFF) - 126)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    scaled = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
    scaled = tl.where(tl.abs(scaled) < float("inf"), scaled, float("nan"))  # NaN, never saturated +-inf
    tl.store(out_ptr + offsets, scaled.to(tl.float8e4nv), mask=mask)
    if chunk == 0:
        tl.store(descale_ptr + group, ((127 - exponent) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _quantize_one_pass(q_ptr, out_ptr, descale_ptr, rows_per_seq, row_stride, group_width, heads_k, amax_floor,
                       ROWS: tl.constexpr, WIDTH: tl.constexpr):
    group = tl.program_id(0)
    offsets, mask = _tile(group, 0, rows_per_seq, row_stride, group_width, heads_k, ROWS, WIDTH)
    amax = _finite_abs_max(tl.load(q_ptr + offsets, mask=mask, other=0.0))
    _store_quantized(q_ptr, out_ptr, descale_ptr, group, 0, offsets, mask, amax, amax_floor)


@triton.jit
def _group_amax(q_ptr, amax_ptr, rows_per_seq, row_stride, group_width, heads_k, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    group, chunk = tl.program_id(0), tl.program_id(1)
    offsets, mask = _tile(group, chunk, rows_per_seq, row_stride, group_width, heads_k, ROWS, WIDTH)
    tl.atomic_max(amax_ptr + group, _finite_abs_max(tl.load(q_ptr + offsets, mask=mask, other=0.0)))


@triton.jit
def _quantize_chunks(q_ptr, out_ptr, descale_ptr, amax_ptr, rows_per_seq, row_stride, group_width, heads_k, amax_floor,
                     ROWS: tl.constexpr, WIDTH: tl.constexpr):
    group, chunk = tl.program_id(0), tl.program_id(1)
    offsets, mask = _tile(group, chunk, rows_per_seq, row_stride, group_width, heads_k, ROWS, WIDTH)
    _store_quantized(q_ptr, out_ptr, descale_ptr, group, chunk, offsets, mask, tl.load(amax_ptr + group), amax_floor)


def quantize_into(q: Tensor, heads_k: int, q_e4m3: Tensor, rows: Tensor, amax_floor: float) -> None:
    """Writes quantize_q's q_e4m3 and descale rows for a contiguous CUDA q: (batch, seqlen, heads,
    head_dim), groups (sequence, K/V head); or varlen (total, heads, head_dim), groups K/V heads."""
    heads, head_dim = q.shape[-2], q.shape[-1]
    sequences, rows_per_seq = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
    group_width = heads // heads_k * head_dim
    width = triton.next_power_of_2(group_width)
    groups = sequences * heads_k
    if groups == 0 or rows_per_seq == 0:
        rows.fill_(1.0)  # no element: the torch form's descale for an all-zero group
        return
    common = dict(rows_per_seq=rows_per_seq, row_stride=heads * head_dim, group_width=group_width, heads_k=heads_k)
    if triton.next_power_of_2(rows_per_seq) * width <= ONE_PASS_ELEMENTS:
        _quantize_one_pass[(groups,)](q, q_e4m3, rows, amax_floor=amax_floor, ROWS=triton.next_power_of_2(rows_per_seq),
                                      WIDTH=width, num_warps=8, **common)
        return
    chunk_rows = max(1, TILE_ELEMENTS // width)
    grid = (groups, triton.cdiv(rows_per_seq, chunk_rows))
    amax = torch.zeros(groups, dtype=torch.float32, device=q.device)
    _group_amax[grid](q, amax, ROWS=chunk_rows, WIDTH=width, **common)
    _quantize_chunks[grid](q, q_e4m3, rows, amax, amax_floor=amax_floor, ROWS=chunk_rows, WIDTH=width, **common)
