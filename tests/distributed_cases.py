"""Inputs of the context-parallel tests: random lists over a sequence cut into key shards, each
rank's arguments to sharded_sparse_attention, and the unsharded fp64 oracle (reference.py)."""

import random
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.distributed import KeyShard
from flash_attn_sparse.metadata import cdiv, pack_varlen_lists
from flash_attn_sparse.reference import attention_ref, visibility_from_lists


@dataclass
class Case:
    """One sequence layout. varlen: seqlens per sequence; batched: seqlen_q / seqlen_k."""

    name: str
    world: int
    seqlens_q: List[int]
    seqlens_k: List[int]
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 16
    block_size: int = 16
    q_block_size: Optional[int] = None
    table_heads: str = "kv"  # "shared", "kv" or "q"
    causal: bool = False
    varlen: bool = False
    paged: bool = False
    empty_shard: Optional[int] = None  # a rank whose blocks no list names
    seed: int = 0
    boundaries: List[List[int]] = field(default_factory=list)  # per sequence: world + 1 key positions (drawn if empty)


def _boundaries(rng: random.Random, seqlen_k: int, world: int, block_size: int) -> List[int]:
    """Uneven block-aligned cuts, the last at the sequence end; empty shards allowed."""
    edges = sorted(rng.randrange(0, seqlen_k // block_size + 1) * block_size for _ in range(world - 1))
    return [0] + edges + [seqlen_k]


def build(case: Case, dtype=torch.float64, device="cpu"):
    """(q, k, v, full lists, mask lists, blocks): global tensors and lists; boundaries filled in."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.seqlens_q)
    if case.boundaries:  # cuts given
        pass
    elif case.varlen:
        case.boundaries = [_boundaries(rng, sk, case.world, case.block_size) for sk in case.seqlens_k]
    else:  # one cut for every sequence of a batch
        case.boundaries = [_boundaries(rng, case.seqlens_k[0], case.world, case.block_size)] * batch
    heads_of_table = {"shared": 1, "kv": case.heads_k, "q": case.heads}[case.table_heads]
    full, mask = [], []
    for b in range(batch):
        n_blocks = cdiv(case.seqlens_k[b], case.block_size)
        q_block = case.q_block_size or cdiv(max(case.seqlens_q[b], 1), 128) * 128
        tiles = cdiv(case.seqlens_q[b], q_block) if case.varlen else cdiv(max(case.seqlens_q), q_block)
        allowed = list(range(n_blocks))
        if case.empty_shard is not None and case.empty_shard < case.world:
            lo, hi = case.boundaries[b][case.empty_shard], case.boundaries[b][case.empty_shard + 1]
            allowed = [g for g in allowed if not lo // case.block_size <= g < cdiv(hi, case.block_size)]
        full.append([]), mask.append([])
        for _ in range(heads_of_table):
            rows_f, rows_m = [], []
            for _ in range(tiles):
                chosen = rng.sample(allowed, rng.randrange(0, len(allowed) + 1)) if allowed else []
                cut = rng.randrange(0, len(chosen) + 1)
                rows_f.append(chosen[:cut])
                rows_m.append(chosen[cut:])
            full[b].append(rows_f), mask[b].append(rows_m)
    if case.varlen:
        blocks = pack_varlen_lists(full, mask, case.block_size, case.q_block_size or 128, device=device)
        q = torch.randn(sum(case.seqlens_q), case.heads, case.head_dim, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(sum(case.seqlens_k), case.heads_k, case.head_dim, generator=gen).to(dtype).to(device)
                for _ in range(2))
    else:
        blocks = SparseBlocks.from_lists(full, mask, case.block_size, case.q_block_size, device=device)
        q = torch.randn(batch, case.seqlens_q[0], case.heads, case.head_dim, generator=gen).to(dtype).to(device)
        k, v = (torch.randn(batch, case.seqlens_k[0], case.heads_k, case.head_dim, generator=gen).to(dtype).to(device)
                for _ in range(2))
    return q, k, v, full, mask, blocks


def oracle(case: Case, q, k, v, full, mask, dtype=torch.float64):
    """Unsharded attention over the lists in `dtype` (fp64: the oracle; the inputs' dtype: the
    low-precision error of FlashAttention's tolerance): (out, lse) in the sparse calls' layout."""
    outs, lses = [], []
    cq = [0] + torch.tensor(case.seqlens_q).cumsum(0).tolist()
    ck = [0] + torch.tensor(case.seqlens_k).cumsum(0).tolist()
    for b in range(len(case.seqlens_q)):
        qb, kb, vb = (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) if case.varlen else (q[b], k[b], v[b])
        q_block = case.q_block_size or (128 if case.varlen else cdiv(max(qb.shape[0], 1), 128) * 128)
        visible = visibility_from_lists(full[b], mask[b], case.block_size, q_block, qb.shape[0], kb.shape[0],
                                        case.heads, case.causal, device=q.device)
        out, lse = attention_ref(qb[None], kb[None], vb[None], visible[None], dtype=dtype)
        outs.append(out[0]), lses.append(lse[0])
    if case.varlen:
        return torch.cat(outs), torch.cat(lses, dim=-1)
    return torch.stack(outs), torch.stack(lses)


def shard_arguments(case: Case, rank: int, q, k, v, blocks):
    """(args, kwargs) of sharded_sparse_attention for `rank`: its K/V rows (or pages), its shard."""
    bounds = [edges[rank:rank + 2] for edges in case.boundaries]
    kwargs = dict(causal=case.causal)
    if case.varlen:
        ck = [0] + torch.tensor(case.seqlens_k).cumsum(0).tolist()
        rows = [torch.arange(ck[b] + lo, ck[b] + hi) for b, (lo, hi) in enumerate(bounds)]
        rows = torch.cat(rows).to(k.device)
        lens = [hi - lo for lo, hi in bounds]
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=q.device)
        shard = KeyShard(as_int32([lo for lo, _ in bounds]), as_int32([hi for _, hi in bounds]))
        kwargs.update(cu_seqlens_q=as_int32([0] + torch.tensor(case.seqlens_q).cumsum(0).tolist()),
                      cu_seqlens_k=as_int32([0] + torch.tensor(lens).cumsum(0).tolist()),
                      max_seqlen_q=max(case.seqlens_q), max_seqlen_k=max(lens + [0]))
        return (q, k[rows], v[rows], blocks, shard), kwargs
    lo, hi = bounds[0]
    shard = KeyShard(lo, hi, seqlen_k=case.seqlens_k[0])
    k_local, v_local = k[:, lo:hi].contiguous(), v[:, lo:hi].contiguous()
    if case.paged:  # pages of block_size // 2 rows, shuffled, one spare page of noise
        page = case.block_size // 2
        pages_per_seq = cdiv(hi - lo, page)
        pad = pages_per_seq * page - (hi - lo)
        k_local, v_local = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).reshape(-1, page, *t.shape[2:])
                            for t in (k_local, v_local))
        order = torch.randperm(k_local.shape[0] + 1, generator=torch.Generator().manual_seed(rank))
        noise = torch.randn(1, *k_local.shape[1:], dtype=k_local.dtype, device=k_local.device)
        k_cache, v_cache = (torch.empty(order.numel(), *k_local.shape[1:], dtype=k.dtype, device=k.device)
                            for _ in range(2))
        k_cache[order] = torch.cat((k_local, noise))
        v_cache[order] = torch.cat((v_local, noise))
        table = order[:-1].view(len(case.seqlens_q), pages_per_seq).to(torch.int32).to(q.device)
        if pages_per_seq == 0:
            table = torch.zeros(len(case.seqlens_q), 1, dtype=torch.int32, device=q.device)
        kwargs["page_table"] = table
        k_local, v_local = k_cache, v_cache
    return (q, k_local, v_local, blocks, shard), kwargs
