"""A ceiling for sparse decode: a Triton kernel that only reads the listed K/V blocks.

One program per (batch, KV head, list entry) loads that block's K and V rows of its head (the
same 256-byte pieces, one per key, that the sparse kernel reads) and writes one float, their
sum, so the sum cannot be optimised away. No list walk, no softmax, no matmul, no split merge:
what reading exactly these scattered blocks costs at this size, beside `copy_same_bytes` (a
contiguous copy of the same byte count). With blocks_per_program > 1 a program walks that many
consecutive entries one after another (no software pipelining), as a split of the sparse kernel
walks its share of a list: what the walk alone costs.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _read_listed_blocks(k_ptr, v_ptr, ids_ptr, out_ptr, entries, heads_k,
                        k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
                        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr):
    # Entries first .. first + BLOCKS_PER_PROGRAM of one (batch, kv head) list (entry fastest, as
    # ids is laid out; entries is a multiple of BLOCKS_PER_PROGRAM).
    first = tl.program_id(0) * BLOCKS_PER_PROGRAM
    batch_head = first // entries
    batch, head = batch_head // heads_k, batch_head % heads_k
    cols = tl.arange(0, HEAD_DIM)
    for i in tl.range(BLOCKS_PER_PROGRAM, num_stages=1):
        block = tl.load(ids_ptr + first + i).to(tl.int64)
        rows = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        k = tl.load(k_ptr + batch * k_stride_b + head * k_stride_h + rows[:, None] * k_stride_s + cols[None, :])
        v = tl.load(v_ptr + batch * v_stride_b + head * v_stride_h + rows[:, None] * v_stride_s + cols[None, :])
        tl.store(out_ptr + first + i, tl.sum(k.to(tl.float32)) + tl.sum(v.to(tl.float32)))


def block_ids(lists) -> torch.Tensor:
    """(batch, kv heads, entries) int32 on the GPU from equal-length id lists [b][hk]."""
    return torch.tensor(lists, dtype=torch.int32, device="cuda")


def read_listed_blocks(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, block: int,
                       blocks_per_program: int = 1) -> torch.Tensor:
    """Per (batch, kv head, entry): the fp32 sum of that block's K and V rows of its head.
    k, v: (batch, seqlen_k, heads_k, head_dim) with unit last stride."""
    batch, heads_k, entries = ids.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and ids.is_contiguous() and entries % blocks_per_program == 0
    out = torch.empty(ids.shape, dtype=torch.float32, device=k.device)
    _read_listed_blocks[(batch * heads_k * entries // blocks_per_program,)](
        k, v, ids, out, entries, heads_k, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        BLOCK=block, HEAD_DIM=k.shape[-1], BLOCKS_PER_PROGRAM=blocks_per_program, num_warps=8)
    return out


def read_listed_blocks_reference(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The same sums from PyTorch indexing, in fp64."""
    batch, heads_k, entries = ids.shape
    rows = (ids.long()[..., None] * block + torch.arange(block, device=ids.device)).reshape(batch, heads_k, -1)
    b = torch.arange(batch, device=ids.device)[:, None, None]
    h = torch.arange(heads_k, device=ids.device)[None, :, None]
    gathered = k[b, rows, h].double() + v[b, rows, h].double()  # (batch, heads_k, entries * block, head_dim)
    return gathered.reshape(batch, heads_k, entries, -1).sum(-1)
