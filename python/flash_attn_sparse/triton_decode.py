"""The list-parallel decode backend: a Triton kernel for short-query calls over block lists.

At decode the work is reading the listed K/V blocks once, and a kernel gets near the copy rate
only with many loads in flight on every SM. The FA-2 and FA-4 kernels give each CTA a split of
a list to walk, one block after another (FA-4's SM90 decode tile is one CTA per SM), so at B=1
with ~64 blocks per K/V head they reach half the roofline where a reader of the same blocks,
one per program, reaches 78% (run 68). Here a program takes `entries` consecutive entries of
one (batch, head) list (one entry at short lists), with the query heads of a K/V head packed
into the rows of its tile when the lists are shared or per K/V head (GQA packing: each listed
block is read once per K/V head), and writes an fp32 (O, LSE) partial; the last program of a
list to finish (an atomic counter, zeroed per call) merges that list's partials in the same
launch. With one program per list it writes the output directly.

It runs fixed-length calls whose query rows fit one list row per (batch, head), at most
MAX_TILE_ROWS packed query rows, head dims in HEAD_DIMS, any block size, fp16 / bf16, with
seqused_k and causal "mask" blocks; `unsupported_reason` names what it does not run.
"""

import functools
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from .metadata import SparseBlocks, cdiv

MAX_TILE_ROWS = 64
HEAD_DIMS = (32, 64, 128, 256)
PROGRAMS_PER_SM = 4  # programs the split choice aims for: enough loads in flight on every SM
MERGE_REGISTERS = 4096  # fp32 partial values a merge step holds (32 per thread at 4 warps)


@functools.lru_cache(maxsize=None)
def missing_triton() -> Optional[str]:
    """None when Triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not importable: {error}"
    return None


def packing(num_heads: int, num_heads_k: int, list_heads: int) -> Tuple[int, int]:
    """(program heads, query heads per program): the K/V heads with their query heads packed
    when the lists are shared or per K/V head, else every query head on its own."""
    if list_heads in (1, num_heads_k):
        return num_heads_k, num_heads // num_heads_k
    return num_heads, 1


def unsupported_reason(q: Tensor, k: Tensor, blocks: SparseBlocks, *, max_seqlen_q: int, varlen: bool,
                       paged: bool) -> Optional[str]:
    """Why this call cannot run on the list-parallel decode kernel, or None. Shapes only."""
    if varlen:
        return "varlen calls are not run by the list-parallel decode kernel"
    if paged:
        return "paged K/V is not run by the list-parallel decode kernel"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of the decode kernel's {HEAD_DIMS}"
    if blocks.full_cnt.shape[-1] != 1:
        return "the decode kernel takes one list row per (batch, head): query rows within one query tile"
    _, per_program = packing(q.shape[-2], k.shape[-2], blocks.num_heads)
    if per_program * max_seqlen_q > MAX_TILE_ROWS:
        return f"{per_program * max_seqlen_q} packed query rows > the decode kernel's {MAX_TILE_ROWS}"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 8:
        return "the list-parallel decode kernel needs an sm80+ GPU"
    return missing_triton()


def list_capacity(blocks: SparseBlocks) -> int:
    """Entries a list row can hold (full + mask): the bound of every count after clamping."""
    return blocks.full_idx.shape[-1] + (blocks.mask_idx.shape[-1] if blocks.mask_idx is not None else 0)


def choose_entries(capacity: int, lists: int, num_sms: int) -> int:
    """Entries per program: one while lists * capacity programs fit PROGRAMS_PER_SM per SM, else
    the fewest that bring the program count down to that."""
    return max(1, cdiv(lists * capacity, PROGRAMS_PER_SM * num_sms))


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sparse_decode(Q, K, V, Out, Lse, FullCnt, FullIdx, MaskCnt, MaskIdx, SeqUsedK, OPart, LsePart, Counter,
                      q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh, lse_sb, lse_sh,
                      fc_sb, fc_sh, fi_sb, fi_sh, mc_sb, mc_sh, mi_sb, mi_sh,
                      seqlen_q, seqlen_k, group, full_cap, mask_cap, splits, entries, scale_log2,
                      PROGRAM_HEADS: tl.constexpr, PER_PROGRAM: tl.constexpr, ROWS: tl.constexpr,
                      MERGE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_N: tl.constexpr, SUBTILES: tl.constexpr,
                      NUM_STAGES: tl.constexpr, HEAD_DIM: tl.constexpr,
                      SPLITS_POW2: tl.constexpr, MERGE_CHUNK: tl.constexpr, HAS_MASK: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_SEQUSED: tl.constexpr, DIAG: tl.constexpr):
        split = tl.program_id(0)
        list_id = tl.program_id(1)  # (batch, program head)
        batch = (list_id // PROGRAM_HEADS).to(tl.int64)
        program_head = list_id % PROGRAM_HEADS
        head0 = program_head * PER_PROGRAM
        kv_head = head0 // group
        rows = tl.arange(0, ROWS)  # packed rows: query position major, query head minor
        row_q = rows // PER_PROGRAM
        row_head = head0 + rows % PER_PROGRAM
        row_valid = row_q < seqlen_q
        cols = tl.arange(0, HEAD_DIM)
        keys = tl.arange(0, CHUNK_N)

        if HAS_SEQUSED:
            seqlen = tl.load(SeqUsedK + batch)
        else:
            seqlen = seqlen_k
        n_blocks = tl.cdiv(seqlen, BLOCK_N)
        # Counts clamped to the row, as the other kernels do (bad lists stay memory safe).
        full_cnt = tl.minimum(tl.maximum(tl.load(FullCnt + batch * fc_sb + program_head * fc_sh), 0), full_cap)
        total = full_cnt
        if HAS_MASK:
            mask_cnt = tl.minimum(tl.maximum(tl.load(MaskCnt + batch * mc_sb + program_head * mc_sh), 0), mask_cap)
            total = full_cnt + mask_cnt
        first = split * entries
        count = tl.minimum(tl.maximum(total - first, 0), entries)

        q = tl.load(Q + batch * q_sb + row_q[:, None] * q_ss + row_head[:, None] * q_sh + cols[None, :],
                    mask=row_valid[:, None], other=0.0)
        k_base = K + batch * k_sb + kv_head * k_sh
        v_base = V + batch * v_sb + kv_head * v_sh
        causal_limit = row_q + seqlen - seqlen_q  # bottom-right: a row sees positions <= this
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        # One flat loop over key chunks of the program's entries, software-pipelined: the K/V
        # chunks of the next NUM_STAGES - 1 iterations load into shared memory (cp.async) while
        # one is computed, instead of whole blocks staged through registers.
        for it in tl.range(0, count * SUBTILES, num_stages=NUM_STAGES):
            entry = first + it // SUBTILES
            is_full = entry < full_cnt
            block = tl.load(FullIdx + batch * fi_sb + program_head * fi_sh + entry, mask=is_full, other=0)
            if HAS_MASK:
                mask_block = tl.load(MaskIdx + batch * mi_sb + program_head * mi_sh + (entry - full_cnt),
                                     mask=entry >= full_cnt, other=0)
                block = tl.where(is_full, block, mask_block)
            # An id outside the sequence is skipped; the tail block stops at the sequence end.
            positions = block.to(tl.int64) * BLOCK_N + (it % SUBTILES) * CHUNK_N + keys
            key_valid = tl.where((block >= 0) & (block < n_blocks), positions < seqlen, False)
            k = tl.load(k_base + positions[:, None] * k_ss + cols[None, :], mask=key_valid[:, None], other=0.0)
            v = tl.load(v_base + positions[:, None] * v_ss + cols[None, :], mask=key_valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale_log2
            visible = key_valid[None, :] & row_valid[:, None]
            if CAUSAL:  # on "mask" blocks only
                visible = visible & tl.where(is_full, True, positions[None, :] <= causal_limit[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # log2 domain

        out_ptrs = Out + batch * o_sb + row_q[:, None] * o_ss + row_head[:, None] * o_sh + cols[None, :]
        lse_ptrs = Lse + batch * lse_sb + row_head * lse_sh + row_q
        if splits == 1:
            tl.store(out_ptrs, o.to(Out.dtype.element_ty), mask=row_valid[:, None])
            tl.store(lse_ptrs, lse2 * 0.6931471805599453, mask=row_valid)
        else:
            part = list_id * splits + split
            tl.store(OPart + (part * ROWS + rows[:, None]) * HEAD_DIM + cols[None, :], o, mask=row_valid[:, None])
            tl.store(LsePart + part * ROWS + rows, lse2, mask=row_valid)
            # Every thread's partial is written before one thread releases the count (the
            # CTA barrier, then a gpu-scope release); the last program acquires it.
            tl.debug_barrier()
            if DIAG == 2:
                finished = 0
            else:
                finished = tl.atomic_add(Counter + list_id, 1, sem="acq_rel", scope="gpu")
            if finished == splits - 1 and DIAG == 0:
                merge_rows = tl.arange(0, MERGE_ROWS)
                merge_q = merge_rows // PER_PROGRAM
                merge_valid = merge_q < seqlen_q
                base = list_id * splits
                split_ids = tl.arange(0, SPLITS_POW2)
                lse_all = tl.load(LsePart + (base + split_ids[:, None]) * ROWS + merge_rows[None, :],
                                  mask=(split_ids[:, None] < splits) & merge_valid[None, :], other=float("-inf"),
                                  cache_modifier=".cg")
                top = tl.max(lse_all, 0)
                top = tl.where(top == float("-inf"), 0.0, top)
                denom = tl.sum(tl.exp2(lse_all - top[None, :]), 0)
                merged = tl.zeros([MERGE_ROWS, HEAD_DIM], tl.float32)
                for s0 in range(0, splits, MERGE_CHUNK):
                    chunk = s0 + tl.arange(0, MERGE_CHUNK)
                    ok = (chunk[:, None] < splits) & merge_valid[None, :]
                    weight = tl.exp2(tl.load(LsePart + (base + chunk[:, None]) * ROWS + merge_rows[None, :], mask=ok,
                                             other=float("-inf"), cache_modifier=".cg") - top[None, :])
                    partial = tl.load(OPart + ((base + chunk[:, None, None]) * ROWS + merge_rows[None, :, None]) * HEAD_DIM
                                      + cols[None, None, :], mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
                    merged += tl.sum(weight[:, :, None] * partial, 0)
                merge_seen = denom > 0
                merged = merged / tl.where(merge_seen, denom, 1.0)[:, None]
                merge_lse = tl.where(merge_seen, top + tl.log2(tl.where(merge_seen, denom, 1.0)), float("-inf"))
                merge_head = head0 + merge_rows % PER_PROGRAM
                tl.store(Out + batch * o_sb + merge_q[:, None] * o_ss + merge_head[:, None] * o_sh + cols[None, :],
                         merged.to(Out.dtype.element_ty), mask=merge_valid[:, None])
                tl.store(Lse + batch * lse_sb + merge_head * lse_sh + merge_q, merge_lse * 0.6931471805599453,
                         mask=merge_valid)

    return sparse_decode


def run(q: Tensor, k: Tensor, v: Tensor, blocks: SparseBlocks, *, softmax_scale: float, causal: bool,
        seqused_k: Optional[Tensor] = None, entries: int = 0, num_sms: int = 132, num_warps: int = 4,
        chunk_keys: int = 64, num_stages: int = 3, diag: int = 0) -> Tuple[Tensor, Tensor]:
    """(out, lse) of a call unsupported_reason accepted. entries=0 picks entries per program
    (choose_entries); lse is (batch, heads, seqlen_q) fp32."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    program_heads, per_program = packing(heads, heads_k, blocks.num_heads)
    lists = batch * program_heads
    capacity = list_capacity(blocks)
    entries = entries or choose_entries(capacity, lists, num_sms)
    splits = max(1, cdiv(capacity, entries))
    rows = max(16, _pow2(per_program * seqlen_q))  # tl.dot takes 16+ rows
    merge_rows = _pow2(per_program * seqlen_q)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    if splits > 1:
        o_part = torch.empty(lists * splits * rows * head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(lists * splits * rows, dtype=torch.float32, device=q.device)
        counter = torch.zeros(lists, dtype=torch.int32, device=q.device)
    else:
        o_part = lse_part = counter = lse  # not read
    has_mask = blocks.mask_idx is not None
    chunk = min(chunk_keys, blocks.block_size)

    def list_strides(t: Optional[Tensor]) -> Tuple[int, int]:
        if t is None:
            return 0, 0
        return t.stride(0), (t.stride(1) if t.shape[1] > 1 else 0)  # a shared list: every head reads row 0

    mask_cnt = blocks.mask_cnt if has_mask else blocks.full_cnt
    mask_idx = blocks.mask_idx if has_mask else blocks.full_idx
    _kernel()[(splits, lists)](
        q, k, v, out, lse, blocks.full_cnt, blocks.full_idx, mask_cnt, mask_idx,
        seqused_k if seqused_k is not None else lse, o_part, lse_part, counter,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        *list_strides(blocks.full_cnt), *list_strides(blocks.full_idx), *list_strides(mask_cnt), *list_strides(mask_idx),
        seqlen_q, seqlen_k, heads // heads_k, blocks.full_idx.shape[-1], mask_idx.shape[-1] if has_mask else 0,
        splits, entries, softmax_scale * 1.4426950408889634,
        PROGRAM_HEADS=program_heads, PER_PROGRAM=per_program, ROWS=rows, MERGE_ROWS=merge_rows,
        BLOCK_N=blocks.block_size, CHUNK_N=chunk, SUBTILES=blocks.block_size // chunk, NUM_STAGES=num_stages,
        HEAD_DIM=head_dim, SPLITS_POW2=_pow2(splits),
        MERGE_CHUNK=max(1, min(_pow2(splits), MERGE_REGISTERS // (merge_rows * head_dim))),
        HAS_MASK=has_mask, CAUSAL=causal and has_mask, HAS_SEQUSED=seqused_k is not None, DIAG=diag, num_warps=num_warps)
    return out, lse
