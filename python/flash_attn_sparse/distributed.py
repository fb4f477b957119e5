"""Context-parallel sparse attention: the keys of a sequence sharded over the ranks of a
torch.distributed process group, q replicated, each rank attending to the listed blocks it holds,
and the (O, LSE) partials merged exactly.

A rank's shard is key positions [start, stop) of every sequence (KeyShard), held as contiguous
K/V rows (batched (batch, stop - start, heads_k, head_dim), or varlen packed by the local
cu_seqlens_k), or as a paged cache whose local page_table maps local positions 0 .. stop - start.
Block ids of global lists are split per shard by shard_lists.shard_blocks (on the device, no
host sync); the alignment rule is there: shard starts on block edges.

Causal masks are bottom-right aligned to the *global* sequence: query row i sees key p iff
p <= i + seqlen_k - seqlen_q. A shard ending before the sequence end (d = seqlen_k - stop keys
after it) sees that through its local kernel call as follows: rows i >= seqlen_q - d see every
key of the shard (non-causal call), rows below that see local key j iff j <= i + (stop - start)
- (seqlen_q - d), which is the bottom-right causal mask of a call over those first seqlen_q - d
rows. So a shard runs one causal call (it ends the sequence), one non-causal call (decode, or
every row past it), or both over two row ranges. Causal varlen shards are not supported.

Merge: see docs/distributed.md for the cost model. merge="all_gather" (default) gathers every
rank's partial into one buffer (one collective, all_gather_into_tensor, CUDA-graph capturable
under NCCL) and every rank combines; merge="owner" gathers to rank `owner` only, which combines
(the others get None).
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .metadata import SparseBlocks, cdiv, fail
from .reference import attention_ref, visibility_from_lists
from .shard_lists import shard_blocks

Bound = Union[int, Tensor]
MERGES = ("all_gather", "owner")


@dataclass(frozen=True)
class KeyShard:
    """Key positions [start, stop) of each sequence held by this rank; seqlen_k is the global
    key count of each sequence (batched; needed for causal calls). Varlen shards give start and
    stop as int32 tensors (batch,)."""

    start: Bound
    stop: Bound
    seqlen_k: Optional[int] = None


def _layout_of(q: Tensor, k: Tensor, page_table: Optional[Tensor], varlen: bool) -> Tuple[int, int]:
    """(batch, local key capacity) of the shard's K/V."""
    if varlen:
        return 1, k.shape[0]
    if page_table is not None:
        return q.shape[0], page_table.shape[1] * k.shape[1]
    return q.shape[0], k.shape[1]


def gpu_local_forward(q, k, v, blocks, *, causal, softmax_scale, seqused_k=None, page_table=None,
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, backend="auto"):
    """The package's kernels over one shard: (out like q, lse fp32 (batch, heads, seqlen_q) or
    varlen (heads, total_q))."""
    from .interface import flash_attn_varlen_with_sparse_blocks, flash_attn_with_sparse_block_table
    if cu_seqlens_q is not None:
        return flash_attn_varlen_with_sparse_blocks(q, k, v, blocks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                                    causal=causal, softmax_scale=softmax_scale, backend=backend)
    return flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, softmax_scale=softmax_scale, backend=backend,
                                              seqused_k=seqused_k, page_table=page_table)


def _rows_of(cnt: Tensor, idx: Tensor, b: int, heads: int, tiles: int, varlen_row=None):
    """Python lists [head][tile] of one sequence's list rows (a host sync: reference only)."""
    if varlen_row is None:
        return [[idx[b, h, m, :int(cnt[b, h, m])].tolist() for m in range(tiles)] for h in range(heads)]
    cu_m, cu_off = varlen_row
    n_b = (cu_off[b + 1] - cu_off[b]) // max(cu_m[b + 1] - cu_m[b], 1)
    return [[idx[h, cu_off[b] + m * n_b:cu_off[b] + m * n_b + int(cnt[h, cu_m[b] + m])].tolist() for m in range(tiles)]
            for h in range(heads)]


def reference_local_forward(q, k, v, blocks: SparseBlocks, *, causal, softmax_scale, seqused_k=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, backend=None):
    """The fp64 reference over one shard, with the arguments of gpu_local_forward (any device)."""
    varlen = cu_seqlens_q is not None
    heads, table_heads = q.shape[-2], blocks.num_heads
    if varlen:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        layout = (blocks.cu_total_m_blocks.tolist(), blocks.cu_block_idx_offsets.tolist())
        sequences = [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) for b in range(len(cq) - 1)]
    else:
        layout = None
        if page_table is not None:  # gather each sequence's pages into contiguous rows
            k, v = (t[page_table.long()].flatten(1, 2) for t in (k, v))
        sequences = list(zip(q, k, v))
    used = seqused_k.tolist() if seqused_k is not None else None
    outs, lses = [], []
    for b, (qb, kb, vb) in enumerate(sequences):
        if used is not None:
            kb, vb = kb[:used[b]], vb[:used[b]]
        q_block = blocks.resolved_q_block_size(qb.shape[0])
        tiles = cdiv(qb.shape[0], q_block)
        lists = [_rows_of(cnt, idx, b, table_heads, tiles, layout) if cnt is not None else None
                 for cnt, idx in ((blocks.full_cnt, blocks.full_idx), (blocks.mask_cnt, blocks.mask_idx))]
        visible = visibility_from_lists(lists[0], lists[1], blocks.block_size, q_block, qb.shape[0], kb.shape[0], heads,
                                        causal, device=q.device)
        out, lse = attention_ref(qb[None], kb[None], vb[None], visible[None], softmax_scale)
        outs.append(out[0])
        lses.append(lse[0])
    if varlen:
        return torch.cat(outs), torch.cat(lses, dim=-1)
    return torch.stack(outs), torch.stack(lses)


def local_attention(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, shard: KeyShard, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, page_table: Optional[Tensor] = None,
                    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    local_lists: bool = False, local_forward: Optional[Callable] = None,
                    backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """Attention of q over the listed blocks this shard holds: (out, lse) as the local forward
    returns them; a row that sees no key of the shard has out = 0, lse = -inf. blocks are the
    global lists (split here) or, with local_lists, this shard's already."""
    varlen = cu_seqlens_q is not None
    if local_forward is None:
        local_forward = gpu_local_forward if q.device.type == "cuda" else reference_local_forward
    if not local_lists:
        blocks = shard_blocks(blocks, shard.start, shard.stop)
    options = dict(softmax_scale=softmax_scale, page_table=page_table, backend=backend)
    if varlen:
        if causal:
            fail("causal", "causal varlen shards are not supported (the row split depends on each sequence's lengths)")
        return local_forward(q, k, v, blocks, causal=False, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **options)
    if not (isinstance(shard.start, int) and isinstance(shard.stop, int)):
        fail("shard", "batched shards take int start and stop")
    batch, capacity = _layout_of(q, k, page_table, varlen)
    held = shard.stop - shard.start
    if not 0 <= held <= capacity:
        fail("shard", f"stop - start = {held} must be within the {capacity} keys the local K/V holds")
    if held == 0:  # nothing to launch over: the neutral partial
        lse_dtype = torch.float32 if q.device.type == "cuda" else torch.float64
        return torch.zeros_like(q), torch.full((batch, q.shape[2], q.shape[1]), float("-inf"), dtype=lse_dtype, device=q.device)
    if held < capacity:
        options["seqused_k"] = torch.full((batch,), held, dtype=torch.int32, device=q.device)
    seqlen_q = q.shape[1]
    if not causal:
        return local_forward(q, k, v, blocks, causal=False, **options)
    if shard.seqlen_k is None or shard.seqlen_k < shard.stop:
        fail("shard", f"a causal call needs seqlen_k >= stop = {shard.stop}, got {shard.seqlen_k}")
    causal_rows = seqlen_q - (shard.seqlen_k - shard.stop)  # rows that do not see every key of the shard
    if causal_rows >= seqlen_q:
        return local_forward(q, k, v, blocks, causal=True, **options)
    if causal_rows <= 0:
        return local_forward(q, k, v, blocks, causal=False, **options)
    out_head, lse_head = local_forward(q[:, :causal_rows], k, v, blocks, causal=True, **options)
    # The non-causal rows start on a query tile edge, so that their list rows are the tail tiles'.
    if blocks.q_block_size is None:  # one list row for every query row
        first, tail = causal_rows, blocks
    else:
        first = causal_rows // blocks.q_block_size * blocks.q_block_size
        tail = _tiles_from(blocks, first // blocks.q_block_size)
    out_tail, lse_tail = local_forward(q[:, first:], k, v, tail, causal=False, **options)
    skip = causal_rows - first
    return (torch.cat((out_head, out_tail[:, skip:]), dim=1), torch.cat((lse_head, lse_tail[..., skip:]), dim=-1))


def _tiles_from(blocks: SparseBlocks, tile: int) -> SparseBlocks:
    """The batched lists of query tiles tile, tile + 1, ... (views)."""
    mask = (blocks.mask_cnt[:, :, tile:], blocks.mask_idx[:, :, tile:]) if blocks.mask_cnt is not None else (None, None)
    return SparseBlocks(blocks.full_cnt[:, :, tile:], blocks.full_idx[:, :, tile:], *mask, block_size=blocks.block_size,
                        q_block_size=blocks.q_block_size)


def partial_dtype(device: torch.device) -> torch.dtype:
    """fp32 partials on the GPU (what the combine kernel takes), fp64 elsewhere (the reference)."""
    return torch.float32 if device.type == "cuda" else torch.float64


def pack_partial(out: Tensor, lse: Tensor, head_dim_padded: int, varlen: bool) -> Tensor:
    """One flat buffer: O as (batch, heads, seqlen_q, head_dim_padded), then LSE (batch, heads,
    seqlen_q); varlen (total_q, ...) outputs count as batch 1."""
    if varlen:
        out, lse = out.unsqueeze(0), lse.unsqueeze(0)
    batch, seqlen_q, heads, head_dim = out.shape
    dtype = partial_dtype(out.device)
    flat = torch.empty(batch * heads * seqlen_q * (head_dim_padded + 1), dtype=dtype, device=out.device)
    o_part = flat[:batch * heads * seqlen_q * head_dim_padded].view(batch, heads, seqlen_q, head_dim_padded)
    o_part[..., :head_dim] = out.transpose(1, 2)
    o_part[..., head_dim:] = 0
    flat[o_part.numel():].view(batch, heads, seqlen_q).copy_(lse)
    return flat


def unpack_partials(flat: Tensor, shards: int, batch: int, heads: int, seqlen_q: int, head_dim_padded: int):
    """(out_partials (S, batch, heads, seqlen_q, head_dim_padded), lse_partials (S, batch, heads,
    seqlen_q)) from S packed buffers, in flash_attn_combine's layout."""
    rows = flat.view(shards, -1)
    o_size = batch * heads * seqlen_q * head_dim_padded
    return (rows[:, :o_size].view(shards, batch, heads, seqlen_q, head_dim_padded),
            rows[:, o_size:].view(shards, batch, heads, seqlen_q))


def combine_partials(out_partials: Tensor, lse_partials: Tensor, out_dtype: torch.dtype, head_dim: int):
    """Exact merge: out (batch, seqlen_q, heads, head_dim), lse (batch, heads, seqlen_q). On the
    GPU the package's combine kernel; elsewhere an exact log-sum-exp merge in the partials' dtype
    (LSE = -inf partials contribute nothing; all -inf gives O = 0, LSE = -inf)."""
    if out_partials.device.type == "cuda":
        from .interface import flash_attn_combine
        return flash_attn_combine(out_partials.contiguous(), lse_partials.contiguous(), out_dtype=out_dtype,
                                  head_dim=head_dim)
    lse = torch.logsumexp(lse_partials, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(lse_partials - safe)  # exp(-inf) = 0 for empty partials
    out = (weights.unsqueeze(-1) * out_partials[..., :head_dim]).sum(dim=0)
    return out.transpose(1, 2).to(out_dtype), lse


def sharded_sparse_attention(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, shard: KeyShard, *,
                             group: Optional[dist.ProcessGroup] = None, causal: bool = False,
                             softmax_scale: Optional[float] = None, merge: str = "all_gather", owner: int = 0,
                             page_table: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                             cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                             max_seqlen_k: Optional[int] = None, local_lists: bool = False,
                             local_forward: Optional[Callable] = None, backend: str = "auto",
                             out_dtype: Optional[torch.dtype] = None):
    """Attention of the replicated q over the listed blocks of every rank's shard, merged exactly.

    k, v, page_table, cu_seqlens_k, max_seqlen_k describe this rank's shard (see the module
    docstring); blocks are the global lists, or this rank's with local_lists=True. Returns
    (out, lse) as flash_attn_with_sparse_block_table (varlen: as the varlen form) would over
    the whole sequence, on every rank (merge="all_gather") or on rank `owner` only ("owner":
    others get (None, None)). out_dtype defaults to q's (fp64 results on CPU stay fp64)."""
    if merge not in MERGES:
        fail("merge", f"must be one of {MERGES}, got {merge!r}")
    varlen = cu_seqlens_q is not None
    out, lse = local_attention(q, k, v, blocks, shard, causal=causal, softmax_scale=softmax_scale, page_table=page_table,
                               cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, local_lists=local_lists, local_forward=local_forward,
                               backend=backend)
    head_dim = q.shape[-1]
    padded = head_dim_padded(head_dim, q.device)
    flat = pack_partial(out, lse, padded, varlen)
    shards = dist.get_world_size(group)
    if merge == "all_gather":
        gathered = flat.new_empty(shards * flat.numel())
        dist.all_gather_into_tensor(gathered, flat, group=group)
    else:
        is_owner = dist.get_rank(group) == owner
        gathered = flat.new_empty(shards * flat.numel()) if is_owner else None
        dist.gather(flat, list(gathered.view(shards, -1).unbind(0)) if is_owner else None,
                    dst=dist.get_global_rank(group, owner) if group is not None else owner, group=group)
        if not is_owner:
            return None, None
    batch, seqlen_q = (1, q.shape[0]) if varlen else (q.shape[0], q.shape[1])
    parts = unpack_partials(gathered, shards, batch, q.shape[-2], seqlen_q, padded)
    merged, merged_lse = combine_partials(*parts, out_dtype or q.dtype, head_dim)
    return (merged[0], merged_lse[0]) if varlen else (merged, merged_lse)


def head_dim_padded(head_dim: int, device: torch.device) -> int:
    """The partials' last dim: the combine kernel's rounded head dim on the GPU, head_dim elsewhere."""
    if device.type != "cuda":
        return head_dim
    from .backends.fa2_ops import head_dim_rounded
    return head_dim_rounded(head_dim)
