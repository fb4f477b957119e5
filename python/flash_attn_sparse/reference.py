"""Reference implementations (the oracles of every test), in float64 by default.

Conventions match FlashAttention: q is (batch, seqlen_q, heads, dim), k and v are
(batch, seqlen_k, heads_k, dim) with query head h reading K/V head h // (heads // heads_k);
LSE is the natural-log sum of exp(scaled scores), (batch, heads, seqlen_q). A row that sees no
key has O = 0 and LSE = -inf, the neutral element of the combine. Causal masks are aligned
bottom-right: query row i sees key positions <= i + seqlen_k - seqlen_q.
"""

import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor


def attention_ref(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, softmax_scale: Optional[float] = None,
                  dtype: torch.dtype = torch.float64) -> Tuple[Tensor, Tensor]:
    """Attention with an explicit visibility mask, computed in `dtype`.

    visible: bool, broadcastable to (batch, heads, seqlen_q, seqlen_k); True where a query row
    may attend to a key. Returns out (batch, seqlen_q, heads, dim) and lse (batch, heads, seqlen_q).
    """
    batch, seqlen_q, heads, dim = q.shape
    heads_k = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    group = heads // heads_k
    qf = q.to(dtype)
    kf = k.to(dtype).repeat_interleave(group, dim=2)
    vf = v.to(dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows that see nothing
    probs = torch.exp(scores - lse.unsqueeze(-1).masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0))
    # A non-finite V reaches only the rows that see its key (0 * NaN would reach every row).
    finite_v = torch.isfinite(vf)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf.where(finite_v, 0))
    if not finite_v.all():
        seen = visible.expand(batch, heads, seqlen_q, scores.shape[-1]).to(dtype)
        out = out.masked_fill(torch.einsum("bhqk,bkhd->bqhd", seen, (~finite_v).to(dtype)) > 0, float("nan"))
    return out, lse


def block_positions(blocks: Sequence[int], block_size: int, seqlen_k: int) -> Tensor:
    """Key positions of the listed blocks, in list order; the tail block stops at seqlen_k."""
    positions = [torch.arange(b * block_size, min((b + 1) * block_size, seqlen_k)) for b in blocks]
    return torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)


def attention_over_blocks(q: Tensor, k: Tensor, v: Tensor, blocks: Sequence[int], block_size: int,
                          causal: bool = False, softmax_scale: Optional[float] = None,
                          dtype: torch.dtype = torch.float64) -> Tuple[Tensor, Tensor]:
    """Attention of q over the listed K/V blocks only, by explicit gather of their rows.

    q: (batch, seqlen_q, heads, dim); k, v: (batch, seqlen_k, heads_k, dim); every batch and head
    uses the same list. With causal, the bottom-right causal mask applies on top (by position).
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    positions = block_positions(list(blocks), block_size, seqlen_k).to(k.device)
    k_sel, v_sel = k[:, positions], v[:, positions]
    visible = torch.ones(seqlen_q, positions.numel(), dtype=torch.bool, device=q.device)
    if causal:
        rows = torch.arange(seqlen_q, device=q.device).unsqueeze(1)
        visible = positions.unsqueeze(0) <= rows + seqlen_k - seqlen_q
    return attention_ref(q, k_sel, v_sel, visible, softmax_scale, dtype)


def quantize_per_kv_head(x: Tensor) -> Tuple[Tensor, Tensor]:
    """(x in float8_e4m3fn, descale (batch, heads_k) float32) of K or V (batch, seqlen, heads_k,
    dim): one scale per (batch, K/V head) putting its largest magnitude at 448 (not a power of
    two, as a serving engine's K/V scales need not be); dequantize inverts it."""
    descale = x.float().abs().amax(dim=(1, 3)).clamp_min(1e-6) / 448.0
    return (x.float() / descale[:, None, :, None]).to(torch.float8_e4m3fn), descale


def dequantize(x: Tensor, descale: Tensor, cu_seqlens: Optional[Tensor] = None,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """The real values of an FP8 (float8_e4m3fn) tensor: x (batch, seqlen, heads_x, dim), or
    varlen (total, heads_x, dim) with cu_seqlens, times descale (batch, heads_k) float32 per
    (sequence, K/V head); head h of x takes descale column h // (heads_x // heads_k), so q's query
    heads share their K/V head's entry. Computed in `dtype`."""
    heads_x, heads_k = x.shape[-2], descale.shape[-1]
    per_head = descale.to(dtype).repeat_interleave(heads_x // heads_k, dim=1)  # (batch, heads_x)
    if x.dim() == 4:
        return x.to(dtype) * per_head[:, None, :, None]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    sequence_of_row = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths)
    return x.to(dtype) * per_head[sequence_of_row][:, :, None]


def combine_ref(out_partials: Tensor, lse_partials: Tensor) -> Tuple[Tensor, Tensor]:
    """Exact merge of k partials: out (k, ..., seqlen_q, heads, dim), lse (k, ..., heads, seqlen_q).

    Each partial is attention over a disjoint set of keys; the result is attention over their
    union. Partials with LSE = -inf contribute nothing; if all are -inf the result is O = 0,
    LSE = -inf.
    """
    lse = torch.logsumexp(lse_partials, dim=0)
    finite = torch.isfinite(lse)
    weights = torch.exp(lse_partials - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(0))
    weights = torch.where(finite.unsqueeze(0), weights, torch.zeros_like(weights))
    # (k, ..., heads, seqlen_q) -> (k, ..., seqlen_q, heads, 1) to scale the outputs.
    out = (weights.transpose(-1, -2).unsqueeze(-1) * out_partials).sum(dim=0)
    return out, lse


def visibility_from_lists(full_lists, mask_lists, block_size: int, q_block_size: int, seqlen_q: int,
                          seqlen_k: int, heads: int, causal: bool, device=None) -> Tensor:
    """Visibility (heads, seqlen_q, seqlen_k) of one sequence from per-(head, query tile) lists.

    full_lists[hs][m] / mask_lists[hs][m] are Python lists of block ids for table head hs (query
    heads h with h // (heads // len(full_lists)) == hs) and query tile m (rows
    [m * q_block_size, (m + 1) * q_block_size)). Mask blocks get the causal mask when causal.
    """
    table_heads = len(full_lists)
    visible = torch.zeros(heads, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    rows = torch.arange(seqlen_q, device=device)
    cols = torch.arange(seqlen_k, device=device)
    causal_ok = cols.unsqueeze(0) <= rows.unsqueeze(1) + seqlen_k - seqlen_q
    for h in range(heads):
        hs = h // (heads // table_heads)
        for m in range((seqlen_q + q_block_size - 1) // q_block_size):
            r0, r1 = m * q_block_size, min((m + 1) * q_block_size, seqlen_q)
            for blocks, masked in ((full_lists[hs][m], False), (mask_lists[hs][m] if mask_lists else [], causal)):
                for b in blocks:
                    c0, c1 = b * block_size, min((b + 1) * block_size, seqlen_k)
                    if c0 >= c1:
                        continue
                    if masked:
                        visible[h, r0:r1, c0:c1] |= causal_ok[r0:r1, c0:c1]
                    else:
                        visible[h, r0:r1, c0:c1] = True
    return visible
