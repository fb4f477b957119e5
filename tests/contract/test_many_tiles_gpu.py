"""GPU: calls of thousands of kernel tiles, many more than the GPU has SMs, so that each CTA of
FA-3's persistent kernel runs tile after tile: a tile that claims its successor early and warms
its list, the K/V pipeline phase carried from a tile of 0, 1 or 2 entries into the next, and the
output barrier and work-index parity after empty tiles. Per-tile list lengths are drawn from
0, 1, 2, 3, 33 and 70 blocks in random order across tiles (helpers.skewed_rows), ids permuted and
gapped, V distinct per block; causal (full blocks historical, mask blocks on a diagonal that
crosses blocks) and not, lists shared, per K/V head (packed GQA query heads) and per query head,
split and not, batched (B2 H32 Sq4096: 2,048 tiles of 128 rows) and varlen of about the same size
with ragged and empty sequences. Outputs are poisoned with NaN first; each call is checked
against the fp32 reference, computed one K/V head at a time (a few GB at most) once per case and
kept for its other backend and split count, and rows whose lists are empty must give exactly
O = 0 and LSE = -inf.
"""

import math
import random

import pytest
import torch

import flash_attn_sparse as fas
from contract import BLOCK, attend, backend_present, make_qkv, sparse_blocks
from flash_attn_sparse.backends import fa3_ops
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.reference import attention_ref
from helpers import LSE_TOLERANCE, max_err, random_qkv, skewed_rows

pytestmark = pytest.mark.gpu

BATCH, H, HK, D = 2, 32, 8, 128
GROUP = H // HK
Q_TILE = 128  # query rows of one list row, and of one FA-3 kernel tile
SEQLEN_Q = 4096
# Every tile can list 70 blocks: 72 key blocks, the last of 88 keys; causal: 72+ fully
# historical blocks before the first tile's diagonal, which is 40 keys off the block grid.
SEQLEN_K = {False: 9176, True: SEQLEN_Q + 9256}
TABLES = {"shared": 1, "per_kv_head": HK, "per_q_head": H}
# Ragged sequences of 8,192 query rows in all (an empty one, one of one row, a partial last tile).
VARLEN_Q = [2900, 0, 1, 2200, 129, 2962]
VARLEN_K = {False: [9176, 1000, 9000, 9300, 0, 9216],  # 129 rows over no keys: empty rows too
            True: [sq + 9256 if sq else 1000 for sq in VARLEN_Q]}


@pytest.fixture(params=["fa2", pytest.param("fa3", marks=pytest.mark.sm90)])
def backend(request):
    """FA-3's persistent kernel is the point; FA-2 runs the same cases as the contract's baseline."""
    backend_present(request.param)
    return request.param


def kernel_tiles(seqlens_q, table):
    """FA-3's tiles of 128 rows: per query head, or per K/V head over packed GQA rows."""
    packed = TABLES[table] != H
    heads, rows_per_query = (HK, GROUP) if packed else (H, 1)
    return sum(heads * math.ceil(sq * rows_per_query / Q_TILE) for sq in seqlens_q)


def visibility(full, mask, seqlen_q, seqlen_k, causal, device):
    """(seqlen_q, seqlen_k) bool of one table head's lists, by the rule of
    reference.visibility_from_lists (listed full blocks whole, mask blocks under the causal mask),
    built from a (tile, block) table in a few tensor ops instead of one per listed block."""
    n_blocks = math.ceil(seqlen_k / BLOCK)
    listed = torch.zeros(2, len(full), n_blocks, dtype=torch.bool)
    for kind, rows in enumerate((full, mask)):
        for m, ids in enumerate(rows):
            listed[kind, m, ids] = True
    listed = listed.to(device)
    rows = torch.arange(seqlen_q, device=device)
    keys = torch.arange(seqlen_k, device=device)
    seen = listed[:, rows // Q_TILE][:, :, keys // BLOCK]
    if causal:
        seen[1] &= keys[None, :] <= rows[:, None] + seqlen_k - seqlen_q
    return seen[0] | seen[1]


class Errors:
    """The largest errors over every chunk, so that the bound is FlashAttention's over the whole
    call (tests/helpers.py's assert_close_to_reference), not a tighter one per chunk."""

    def __init__(self):
        self.out = self.low = self.lse = 0.0
        self.empty_rows = self.rows = 0

    def check(self):
        assert self.out <= 2 * self.low + 1e-5, f"output error {self.out:.3e} > 2 x low-precision error {self.low:.3e} + 1e-5"
        assert self.lse <= LSE_TOLERANCE, f"LSE error {self.lse:.3e} > {LSE_TOLERANCE}"
        assert 0 < self.empty_rows < self.rows, "the lists should give some empty rows, not only"


def reference_chunks(q, k, v, full, mask, causal):
    """One sequence's fp32 reference, one K/V head at a time (q (seqlen_q, H, D), k and v
    (seqlen_k, HK, D), full / mask [table head][tile]): per K/V head its query heads, reference
    out and LSE, the error of the same computation in the input dtype, and the rows that see no key."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    if seqlen_q == 0:
        return []
    table_heads, scale = len(full), q.shape[-1] ** -0.5
    of_table = lambda t: visibility(full[t], mask[t], seqlen_q, seqlen_k, causal, q.device)
    shared = of_table(0)[None] if table_heads == 1 else None
    chunks = []
    for kv_head in range(HK):
        heads = slice(kv_head * GROUP, (kv_head + 1) * GROUP)
        if shared is not None:
            visible = shared
        elif table_heads == HK:
            visible = of_table(kv_head)[None]
        else:
            visible = torch.stack([of_table(h) for h in range(heads.start, heads.stop)])
        args = (q[None, :, heads], k[None, :, kv_head:kv_head + 1], v[None, :, kv_head:kv_head + 1], visible[None])
        ref_out, ref_lse = attention_ref(*args, scale, dtype=torch.float32)
        low_out, _ = attention_ref(*args, scale, dtype=q.dtype)
        chunks.append((heads, ref_out[0], ref_lse[0], max_err(low_out[0], ref_out[0]), ~visible.any(-1).expand(GROUP, seqlen_q)))
        del low_out, visible
    return chunks


def check_sequence(errors, out, lse, chunks):
    """One sequence's out (seqlen_q, H, D) and lse (H, seqlen_q) against its reference_chunks: no
    NaN anywhere (the output was poisoned), rows that see no key exactly O = 0 and LSE = -inf,
    the rest within the reference's bound (Errors)."""
    if not chunks:
        return
    assert not torch.isnan(out).any(), "output has NaN (unwritten or poisoned elements)"
    assert not torch.isnan(lse).any(), "LSE has NaN"
    for heads, ref_out, ref_lse, low_err, empty in chunks:
        got_out, got_lse = out[:, heads], lse[heads]
        errors.out = max(errors.out, max_err(got_out, ref_out))
        errors.low = max(errors.low, low_err)
        errors.lse = max(errors.lse, max_err(got_lse, ref_lse))
        assert not (got_out.transpose(0, 1)[empty] != 0).any(), "a row that sees no key has O != 0"
        assert torch.isneginf(got_lse[empty]).all(), "a row that sees no key has LSE != -inf"
        errors.empty_rows += int(empty.sum())
        errors.rows += empty.numel()


@pytest.fixture(scope="module")
def references():
    """Reference chunks by (layout, table, causal): the backends and split counts of a case share
    its inputs and lists, so its reference (most of this module's GPU time) is computed once."""
    cache = {}
    yield cache
    cache.clear()


def varlen_qkv(seqlens_q, seqlens_k, seed):
    """Packed q, k, v; V distinct per block of each sequence, as contract.make_qkv makes it."""
    q, k, v = random_qkv(1, sum(seqlens_q), sum(seqlens_k), H, HK, D, torch.bfloat16,
                         generator=torch.Generator(device="cuda").manual_seed(seed))
    block_of_key = torch.cat([torch.arange(sk) // BLOCK for sk in seqlens_k]).cuda()
    v = (v[0].float() + 0.75 * (block_of_key % 5 - 2)[:, None, None]).to(torch.bfloat16)
    return q[0], k[0], v


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table", TABLES)
def test_batched_many_tiles_with_skewed_lists(backend, references, table, causal, num_splits):
    seqlen_k = SEQLEN_K[causal]
    q, k, v = make_qkv(BATCH, SEQLEN_Q, seqlen_k, H, HK, D, torch.bfloat16, seed=TABLES[table] + 100 * causal)
    rng = random.Random(f"batched-{table}-{causal}")
    rows = [skewed_rows(rng, TABLES[table], SEQLEN_Q, seqlen_k, causal) for _ in range(BATCH)]
    full, mask = [r[0] for r in rows], [r[1] for r in rows]
    blocks, _ = sparse_blocks(full, mask if causal else None, q_block=Q_TILE)
    assert kernel_tiles([SEQLEN_Q] * BATCH, table) >= 10 * torch.cuda.get_device_properties(q.device).multi_processor_count
    if backend == "fa3":
        assert fa3_ops.packed_group(q, k, blocks, SEQLEN_Q) == (1 if table == "per_q_head" else GROUP)
    out = torch.full_like(q, float("nan"))
    out, lse = attend(backend, lambda: fas.flash_attn_with_sparse_block_table(
        q, k, v, blocks, causal=causal, num_splits=num_splits, backend=backend, out=out), must_run=("fa2", "fa3"))
    key = ("batched", table, causal)
    if key not in references:
        references[key] = [reference_chunks(q[b], k[b], v[b], full[b], mask[b], causal) for b in range(BATCH)]
    errors = Errors()
    for b in range(BATCH):
        check_sequence(errors, out[b], lse[b], references[key][b])
    errors.check()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table", ["per_kv_head", "per_q_head"])
def test_varlen_many_tiles_with_skewed_lists(backend, references, table, causal, num_splits):
    seqlens_k = VARLEN_K[causal]
    q, k, v = varlen_qkv(VARLEN_Q, seqlens_k, seed=TABLES[table] + 100 * causal)
    rng = random.Random(f"varlen-{table}-{causal}")
    rows = [skewed_rows(rng, TABLES[table], sq, sk, causal) for sq, sk in zip(VARLEN_Q, seqlens_k)]
    full, mask = [r[0] for r in rows], [r[1] for r in rows]
    blocks = pack_varlen_lists(full, mask if causal else None, BLOCK, Q_TILE, device="cuda")
    assert kernel_tiles(VARLEN_Q, table) >= 10 * torch.cuda.get_device_properties(q.device).multi_processor_count
    if backend == "fa3":
        assert fa3_ops.packed_group(q, k, blocks, max(VARLEN_Q)) == (1 if table == "per_q_head" else GROUP)
    cumulative = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                              device="cuda")
    out = torch.full_like(q, float("nan"))
    out, lse = attend(backend, lambda: fas.flash_attn_varlen_with_sparse_blocks(
        q, k, v, blocks, cu_seqlens_q=cumulative(VARLEN_Q), cu_seqlens_k=cumulative(seqlens_k),
        max_seqlen_q=max(VARLEN_Q), max_seqlen_k=max(seqlens_k), causal=causal, num_splits=num_splits,
        backend=backend, out=out), must_run=("fa2", "fa3"))
    q_starts, k_starts = cumulative(VARLEN_Q).tolist(), cumulative(seqlens_k).tolist()
    rows_q = [slice(start, start + sq) for start, sq in zip(q_starts, VARLEN_Q)]
    rows_k = [slice(start, start + sk) for start, sk in zip(k_starts, seqlens_k)]
    key = ("varlen", table, causal)
    if key not in references:
        references[key] = [reference_chunks(q[rq], k[rk], v[rk], full_b, mask_b, causal)
                           for rq, rk, full_b, mask_b in zip(rows_q, rows_k, full, mask)]
    errors = Errors()
    for rq, chunks in zip(rows_q, references[key]):
        check_sequence(errors, out[rq], lse[:, rq], chunks)
    errors.check()

