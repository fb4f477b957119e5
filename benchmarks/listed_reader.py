"""A ceiling for sparse decode: a Triton kernel that only reads the listed K/V blocks.

One program per (batch, KV head, list entry) loads that block's K and V rows of its head (the
same 256-byte pieces, one per key, that the sparse kernel reads) and writes one float, their
sum, so the sum cannot be optimised away. No list walk, no softmax, no matmul, no split merge:
what reading exactly these scattered blocks costs at this size, beside `copy_same_bytes` (a
contiguous copy of the same byte count).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _read_listed_blocks(k_ptr, v_ptr, ids_ptr, out_ptr, entries, heads_k,
                        k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s, v_stride_h,
                        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    program = tl.program_id(0)  # (batch, kv head, entry), entry fastest, as ids is laid out
    batch_head = program // entries
    batch, head = batch_head // heads_k, batch_head % heads_k
    block = tl.load(ids_ptr + program).to(tl.int64)
    rows = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + batch * k_stride_b + head * k_stride_h + rows[:, None] * k_stride_s + cols[None, :])
    v = tl.load(v_ptr + batch * v_stride_b + head * v_stride_h + rows[:, None] * v_stride_s + cols[None, :])
    tl.store(out_ptr + program, tl.sum(k.to(tl.float32)) + tl.sum(v.to(tl.float32)))


def block_ids(lists) -> torch.Tensor:
    """(batch, kv heads, entries) int32 on the GPU from equal-length id lists [b][hk]."""
    return torch.tensor(lists, dtype=torch.int32, device="cuda")


def read_listed_blocks(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Per (batch, kv head, entry): the fp32 sum of that block's K and V rows of its head.
    k, v: (batch, seqlen_k, heads_k, head_dim) with unit last stride."""
    batch, heads_k, entries = ids.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and ids.is_contiguous()
    out = torch.empty(ids.shape, dtype=torch.float32, device=k.device)
    _read_listed_blocks[(batch * heads_k * entries,)](
        k, v, ids, out, entries, heads_k, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        BLOCK=block, HEAD_DIM=k.shape[-1], num_warps=8)
    return out


def read_listed_blocks_reference(k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """The same sums from PyTorch indexing, in fp64."""
    batch, heads_k, entries = ids.shape
    rows = (ids.long()[..., None] * block + torch.arange(block, device=ids.device)).reshape(batch, heads_k, -1)
    b = torch.arange(batch, device=ids.device)[:, None, None]
    h = torch.arange(heads_k, device=ids.device)[None, :, None]
    gathered = k[b, rows, h].double() + v[b, rows, h].double()  # (batch, heads_k, entries * block, head_dim)
    return gathered.reshape(batch, heads_k, entries, -1).sum(-1)
