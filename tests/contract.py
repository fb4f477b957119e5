"""The sparse contract's test inputs and reference check, shared by the FA-3 op tests
(test_stage4_fa3_sparse.py) and the suite over every backend (test_contract_every_backend_gpu.py):
permuted and gapped lists, V distinct per block (a kernel reading the wrong block's V is off by
whole units), causal full / mask splits, the varlen layout, and the fp32 reference over exactly
the ids a kernel visits."""

import math

import pytest
import torch

from flash_attn_sparse import SparseBlocks, SparseInputError
from flash_attn_sparse.backends import cute, fa3_ops
from flash_attn_sparse.reference import visibility_from_lists
from helpers import assert_close_to_reference, batched_rows, random_qkv

BLOCK = 128


def make_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype, seed):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype,
                         generator=torch.Generator(device="cuda").manual_seed(seed))
    # Distinct V per block: reading the wrong block's V shifts the output by whole units.
    block_of_key = torch.arange(seqlen_k, device="cuda") // BLOCK
    v = (v.float() + 0.75 * (block_of_key % 5 - 2).view(1, -1, 1, 1)).to(dtype)
    return q, k, v


def gapped_permuted(rng, n_blocks, keep, must=()):
    """A random gapped subset of range(n_blocks) in random order (the tail block included when
    listed anywhere), plus the blocks in must."""
    chosen = set(must) | {b for b in range(n_blocks) if rng.random() < keep}
    ids = sorted(chosen)
    rng.shuffle(ids)
    return ids


def pack_rows(rows, capacity=None, pad=0):
    """rows[b][h][m] = [ids] -> (cnt (B, H, M), idx (B, H, M, N)) int32 on the GPU, idx padded with pad."""
    batch, heads, m_blocks = len(rows), len(rows[0]), len(rows[0][0])
    width = capacity or max([len(r) for per_b in rows for per_h in per_b for r in per_h] + [1])
    cnt = torch.zeros(batch, heads, m_blocks, dtype=torch.int32)
    idx = torch.full((batch, heads, m_blocks, width), pad, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            for m in range(m_blocks):
                ids = rows[b][h][m][:width]
                cnt[b, h, m] = len(ids)
                idx[b, h, m, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return cnt.cuda(), idx.cuda()


def sparse_blocks(full, mask=None, q_block=128):
    """SparseBlocks of rows[b][h][m], full and mask tables of one width; and its four tensors."""
    kinds = [full] + ([mask] if mask is not None else [])
    width = max([len(row) for rows in kinds for per_b in rows for per_h in per_b for row in per_h] + [1])
    full_cnt, full_idx = pack_rows(full, width)
    mask_cnt, mask_idx = pack_rows(mask, width) if mask is not None else (None, None)
    blocks = SparseBlocks(full_cnt, full_idx, mask_cnt, mask_idx, block_size=BLOCK, q_block_size=q_block)
    return blocks, (full_cnt, full_idx, mask_cnt, mask_idx)


def causal_split_rows(rng, batch, table_heads, m_blocks, q_block, seqlen_q, seqlen_k, keep):
    """Full blocks: fully historical for every row of the tile; mask blocks: those that touch the
    diagonal (bottom-right aligned). Each list gapped and permuted."""
    n_blocks = math.ceil(seqlen_k / BLOCK)
    full, mask = [], []
    for _ in range(batch):
        full_b, mask_b = [], []
        for _ in range(table_heads):
            full_h, mask_h = [], []
            for m in range(m_blocks):
                first_row = m * q_block
                last_row = min((m + 1) * q_block, seqlen_q) - 1
                shift = seqlen_k - seqlen_q
                f, k = [], []
                for blk in range(n_blocks):
                    if (blk + 1) * BLOCK - 1 <= first_row + shift and (blk + 1) * BLOCK <= seqlen_k:
                        f.append(blk)
                    elif blk * BLOCK <= last_row + shift:
                        k.append(blk)
                f = [b for b in f if rng.random() < keep]
                rng.shuffle(f)
                rng.shuffle(k)
                full_h.append(f)
                mask_h.append(k)
            full_b.append(full_h)
            mask_b.append(mask_h)
        full.append(full_b)
        mask.append(mask_b)
    return full, mask


def visited_rows(cnt, idx, n_blocks):
    """rows[b][h][m]: the ids the kernel visits: the count clamped to [0, capacity], ids outside
    [0, n_blocks) skipped."""
    rows = batched_rows(cnt.clamp(0, idx.shape[-1]), idx)
    return [[[[i for i in row if 0 <= i < n_blocks] for row in per_h] for per_h in per_b] for per_b in rows]


def check_batched(out, lse, q, k, v, full_cnt, full_idx, mask_cnt, mask_idx, q_block, causal, scale):
    """out (b, s, h, d) and LSE (b, h, s) against the fp32 reference (tests/helpers.py tolerance:
    twice the error of the same computation in the input dtype; -inf LSE exactly where nothing is
    visible)."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    n_blocks = math.ceil(seqlen_k / BLOCK)
    full = visited_rows(full_cnt, full_idx, n_blocks)
    mask = visited_rows(mask_cnt, mask_idx, n_blocks) if mask_cnt is not None else [None] * batch
    visible = torch.stack([visibility_from_lists(full[b], mask[b], BLOCK, q_block, seqlen_q, seqlen_k, heads, causal,
                                                 device=q.device) for b in range(batch)])
    assert_close_to_reference(out, lse, q, k, v, visible, scale)


def varlen_inputs(seqlens_q, seqlens_k, heads, heads_k, head_dim, table_heads, q_block, rng, causal):
    """Packed q/k/v and the varlen list layout; per sequence, rows of n_b = its longest list."""
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    gen = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    q = torch.randn(total_q, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total_k, heads_k, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total_k, heads_k, head_dim, device="cuda", dtype=torch.float32, generator=gen)
    offsets = torch.cat([torch.arange(s) for s in seqlens_k]).cuda() // BLOCK if total_k else torch.zeros(0, device="cuda")
    v = (v + 0.75 * (offsets % 5 - 2).view(-1, 1, 1)).to(torch.bfloat16)
    per_seq = []
    cu_m, cu_off = [0], [0]
    for sq, sk in zip(seqlens_q, seqlens_k):
        m_blocks, n_blocks = math.ceil(sq / q_block), math.ceil(sk / BLOCK)
        if causal:
            full, mask = causal_split_rows(rng, 1, table_heads, m_blocks, q_block, sq, sk, keep=0.7)
            full, mask = full[0], mask[0]
        else:
            full = [[gapped_permuted(rng, n_blocks, 0.5, must=[n_blocks - 1] if n_blocks else []) for _ in range(m_blocks)]
                    for _ in range(table_heads)]
            mask = [[[] for _ in range(m_blocks)] for _ in range(table_heads)]
        width = max([len(r) for lists in (full, mask) for ph in lists for r in ph] + [1])
        per_seq.append((full, mask, width))
        cu_m.append(cu_m[-1] + m_blocks)
        cu_off.append(cu_off[-1] + m_blocks * width)
    full_cnt = torch.zeros(table_heads, max(cu_m[-1], 1), dtype=torch.int32)
    mask_cnt = torch.zeros_like(full_cnt)
    full_idx = torch.zeros(table_heads, max(cu_off[-1], 1), dtype=torch.int32)
    mask_idx = torch.zeros_like(full_idx)
    for b, (full, mask, width) in enumerate(per_seq):
        for h in range(table_heads):
            for m in range(len(full[h])):
                start = cu_off[b] + m * width
                for cnt, idx, ids in ((full_cnt, full_idx, full[h][m]), (mask_cnt, mask_idx, mask[h][m])):
                    cnt[h, cu_m[b] + m] = len(ids)
                    idx[h, start:start + len(ids)] = torch.tensor(ids, dtype=torch.int32)
    as_gpu = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")
    cu_q = as_gpu([0] + list(torch.tensor(seqlens_q).cumsum(0).tolist()))
    cu_k = as_gpu([0] + list(torch.tensor(seqlens_k).cumsum(0).tolist()))
    varlen = (as_gpu(cu_m), as_gpu(cu_off), cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    return q, k, v, full_cnt.cuda(), full_idx.cuda(), mask_cnt.cuda(), mask_idx.cuda(), per_seq, varlen


def attend(backend, call, must_run=("fa2",)):
    """call() (a forward with backend=backend), synchronized, or a skip with the backend's
    refusal; a backend in must_run may not refuse (the case is in its contract)."""
    try:
        result = call()
    except SparseInputError as refusal:
        assert backend not in must_run, f"{backend} refused: {refusal}"
        pytest.skip(f"{backend} refuses: {refusal}")
    torch.cuda.synchronize()
    return result


def backend_present(name: str) -> None:
    """Skips the test where backend `name` is not installed."""
    if name == "fa3" and (reason := fa3_ops.missing_build()):
        pytest.skip(reason)
    if name == "fa4" and (reason := cute.missing_runtime()):
        pytest.skip(reason)


def check_varlen(out, lse, q, k, v, seqlens_q, seqlens_k, per_seq, q_block, causal, scale):
    """check_batched over each non-empty sequence of a varlen call (per_seq: varlen_inputs')."""
    q_start = k_start = 0
    for (sq, sk), (full, mask, width) in zip(zip(seqlens_q, seqlens_k), per_seq):
        if sq:
            check_batched(out[q_start:q_start + sq].unsqueeze(0), lse[:, q_start:q_start + sq].unsqueeze(0),
                          q[q_start:q_start + sq].unsqueeze(0), k[k_start:k_start + sk].unsqueeze(0),
                          v[k_start:k_start + sk].unsqueeze(0), *pack_rows([full], width), *pack_rows([mask], width),
                          q_block, causal, scale)
        q_start += sq
        k_start += sk
