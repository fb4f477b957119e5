"""FA-3's FP8 (float8_e4m3fn) sparse forward on the GPU, through the public API: against an fp32
reference over the dequantized inputs (what the kernel reads: stored e4m3 value x descale), with
out and LSE errors no worse than 1.5x dense FA-3 FP8's (flash_attn_interface's forward over K/V
gathered to exactly the listed keys, on the same e4m3 inputs and descales).

Lists are permuted and gapped per table head, V is distinct per block, and K/V take a different
magnitude (so descale) per (batch, K/V head): a kernel that reads the wrong block, the wrong
descale entry, or no descale fails. Needs an H100/H200 and a flash_attn_3 built with
FLASH_ATTN_SPARSE_FP8=1 (`FLASH_ATTN_SPARSE_FP8=1 nox -s build`), which also builds dense FA-3's
FP8 units (the error baseline).
"""

import random

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.backends import fa3_ops
from flash_attn_sparse.fp8 import FP8_DTYPE, quantize_q
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.reference import attention_ref, block_positions, dequantize, quantize_per_kv_head, visibility_from_lists
from helpers import max_err

BLOCK = 128
NO_FP8 = "this flash_attn_3 build has no FP8 kernels (FLASH_ATTENTION_DISABLE_FP8): rebuild with FLASH_ATTN_SPARSE_FP8=1 nox -s build"


def _skip_reason():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm90 GPU"
    if reason := fa3_ops.missing_build():
        return reason
    if "FP8" in fa3_ops.disabled() or "q_descale" not in str(fa3_ops.op()._schema):
        return NO_FP8
    try:
        from flash_attn_interface import _flash_attn_forward  # noqa: F401  (dense FA-3: the error baseline)
    except Exception as error:
        return f"flash_attn_interface (the flash_attn_3 wheel's dense forward) is not importable: {error}"
    return None


SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.stage4,
              pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))]


# --- inputs -------------------------------------------------------------------------------------

def fp8_kv(batch, seqlen_k, heads_k, head_dim, gen):
    """e4m3 K and V and their descales: a magnitude per (batch, K/V head) from 0.1 to 10 (so that
    each descale entry differs), V distinct per block (off by whole units where the wrong block is read)."""
    magnitude = torch.logspace(-1, 1, batch * heads_k, device="cuda").view(batch, 1, heads_k, 1)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", generator=gen) * magnitude
    block = (torch.arange(seqlen_k, device="cuda") // BLOCK).view(1, -1, 1, 1)
    v = (torch.randn(batch, seqlen_k, heads_k, head_dim, device="cuda", generator=gen) + 0.75 * (block % 5 - 2)) * magnitude
    return (*quantize_per_kv_head(k), *quantize_per_kv_head(v))


def random_q(batch, seqlen_q, heads, head_dim, gen):
    return torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", generator=gen).bfloat16()


def table_rows(rng, batch, table_heads, n_blocks, count):
    """rows[b][hs] = `count` distinct block ids in random order (gapped: count < n_blocks)."""
    return [[rng.sample(range(n_blocks), count) for _ in range(table_heads)] for _ in range(batch)]


def blocks_of(full, mask=None, q_block_size=None):
    """SparseBlocks with one list row per (batch, table head) for every query (or per 128-row tile)."""
    wrap = lambda rows: [[[row] for row in per_b] for per_b in rows]  # noqa: E731
    return SparseBlocks.from_lists(wrap(full), wrap(mask) if mask is not None else None, block_size=BLOCK,
                                   q_block_size=q_block_size, device="cuda")


def reference(q8, q_descale, k8, k_descale, v8, v_descale, full, mask, causal, scale):
    """fp32 attention over the dequantized inputs and exactly the listed keys (one list row for every query)."""
    batch, seqlen_q, heads, _ = q8.shape
    seqlen_k = k8.shape[1]
    visible = torch.stack([visibility_from_lists([[row] for row in full[b]], [[row] for row in mask[b]] if mask else None,
                                                 BLOCK, max(seqlen_q, 1), seqlen_q, seqlen_k, heads, causal, device="cuda")
                           for b in range(batch)])
    return attention_ref(dequantize(q8, q_descale), dequantize(k8, k_descale), dequantize(v8, v_descale), visible,
                         scale, dtype=torch.float32)


def gather_per_query_head(x8, rows, heads):
    """x8's listed keys for each query head: (batch, keys, heads, dim), as uint8 indexing then viewed as e4m3."""
    group, table_heads = heads // x8.shape[2], len(rows[0])
    raw = x8.view(torch.uint8)
    per_b = []
    for b, per_table_head in enumerate(rows):
        columns = [raw[b, per_table_head[h // (heads // table_heads)].to(x8.device), h // group] for h in range(heads)]
        per_b.append(torch.stack(columns, dim=1))
    return torch.stack(per_b).view(FP8_DTYPE)


def dense_fp8_errors(q8, q_descale, k8, k_descale, v8, v_descale, full, mask, causal, scale, ref_out, ref_lse):
    """The out and LSE errors of dense FA-3 FP8 over each query head's listed keys (full ids, then
    mask ids: the diagonal block last, so that its bottom-right causal mask is the sparse call's)
    against the reference; K/V repeated per query head there, and the descales over each K/V
    head's group. Its _flash_attn_forward, as flash_attn_func returns out alone."""
    from flash_attn_interface import _flash_attn_forward
    heads, seqlen_k = q8.shape[2], k8.shape[1]
    group = heads // k8.shape[2]
    ids = [[row + (mask[b][hs] if mask else []) for hs, row in enumerate(per_b)] for b, per_b in enumerate(full)]
    rows = [[block_positions(row, BLOCK, seqlen_k) for row in per_b] for per_b in ids]
    assert len({len(row) for per_b in rows for row in per_b}) == 1, "the dense baseline needs lists of one length"
    per_head = lambda descale: descale.repeat_interleave(group, dim=1).contiguous()  # noqa: E731
    none = dict.fromkeys(("k_new", "v_new", "qv", "out", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q",
                          "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
                          "rotary_cos", "rotary_sin", "seqlens_rotary"))
    out, lse, *_ = _flash_attn_forward(q=q8, k=gather_per_query_head(k8, rows, heads), v=gather_per_query_head(v8, rows, heads),
                                       q_descale=per_head(q_descale), k_descale=per_head(k_descale),
                                       v_descale=per_head(v_descale), softmax_scale=scale, causal=causal, **none)
    return max_err(out, ref_out), max_err(lse, ref_lse)


def check_against_dense(out, lse, q8, q_descale, kv, full, mask=None, causal=False):
    """out within 1.5x dense FA-3 FP8's error of the fp32 reference; LSE close; out bfloat16."""
    k8, k_descale, v8, v_descale = kv
    scale = q8.shape[-1] ** -0.5
    ref_out, ref_lse = reference(q8, q_descale, k8, k_descale, v8, v_descale, full, mask, causal, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = max_err(out, ref_out)
    dense_err, dense_lse_err = dense_fp8_errors(q8, q_descale, k8, k_descale, v8, v_descale, full, mask, causal, scale,
                                                ref_out, ref_lse)
    assert err <= 1.5 * dense_err + 1e-5, f"sparse FP8 error {err:.3e} > 1.5 x dense FA-3 FP8's {dense_err:.3e}"
    lse_err = max_err(lse, ref_lse)  # e4m3's rounding of q and k moves large logits: judged against dense FP8's
    assert lse_err <= 1.5 * dense_lse_err + 1e-3, f"LSE error {lse_err:.3e} > 1.5 x dense FA-3 FP8's {dense_lse_err:.3e}"
    return err, dense_err


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("table", ["shared", "per_kv_head", "per_q_head"])
@pytest.mark.parametrize("q_kind", ["e4m3", "bf16"])
def test_fp8_within_dense_fa3_fp8s_error_of_the_reference(head_dim, table, q_kind):
    batch, heads, heads_k, seqlen_q, seqlen_k = 2, 8, 2, 256, 4096
    gen = torch.Generator(device="cuda").manual_seed(100 + head_dim)
    kv = fp8_kv(batch, seqlen_k, heads_k, head_dim, gen)
    q = random_q(batch, seqlen_q, heads, head_dim, gen)
    q8, q_descale = quantize_q(q, heads_k)
    table_heads = {"shared": 1, "per_kv_head": heads_k, "per_q_head": heads}[table]
    full = table_rows(random.Random(head_dim), batch, table_heads, seqlen_k // BLOCK, 11)
    k8, k_descale, v8, v_descale = kv
    given_q, given_descale = (q8, dict(q_descale=q_descale)) if q_kind == "e4m3" else (q, {})
    out, lse = fas.flash_attn_with_sparse_block_table(given_q, k8, v8, blocks_of(full), k_descale=k_descale,
                                                      v_descale=v_descale, **given_descale)
    check_against_dense(out, lse, q8, q_descale, kv, full)


def test_a_given_e4m3_q_and_the_packages_quantized_bf16_q_run_bitwise_alike():
    gen = torch.Generator(device="cuda").manual_seed(7)
    k8, k_descale, v8, v_descale = fp8_kv(2, 2048, 2, 128, gen)
    q = random_q(2, 64, 8, 128, gen)
    blocks = blocks_of(table_rows(random.Random(7), 2, 2, 16, 5))
    from_bf16 = fas.flash_attn_with_sparse_block_table(q, k8, v8, blocks, k_descale=k_descale, v_descale=v_descale)
    q8, q_descale = quantize_q(q, 2)
    from_e4m3 = fas.flash_attn_with_sparse_block_table(q8, k8, v8, blocks, q_descale=q_descale, k_descale=k_descale,
                                                       v_descale=v_descale)
    assert torch.equal(from_bf16[0], from_e4m3[0]) and torch.equal(from_bf16[1], from_e4m3[1])


def test_descales_broadcast_alike():
    gen = torch.Generator(device="cuda").manual_seed(8)
    k8, _, v8, v_descale = fp8_kv(2, 2048, 2, 128, gen)
    q = random_q(2, 64, 8, 128, gen)
    blocks = blocks_of(table_rows(random.Random(8), 2, 2, 16, 5))
    run = lambda k_descale: fas.flash_attn_with_sparse_block_table(q, k8, v8, blocks, k_descale=k_descale,  # noqa: E731
                                                                   v_descale=v_descale)
    full = run(torch.full((2, 2), 0.03125, device="cuda"))
    for k_descale in (0.03125, torch.tensor(0.03125, device="cuda"), torch.full((1, 2), 0.03125, device="cuda"),
                      torch.full((2, 1), 0.03125, device="cuda", dtype=torch.float64)):
        broadcast = run(k_descale)
        assert torch.equal(broadcast[0], full[0]) and torch.equal(broadcast[1], full[1])


@pytest.mark.parametrize("which", ["k_descale", "v_descale", "q_descale"])
def test_a_wrong_descale_changes_exactly_its_batch_and_kv_heads_rows(which):
    """Mutation check: the kernel reads each (batch, K/V head) entry, for its own rows only."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    k8, k_descale, v8, v_descale = fp8_kv(2, 2048, 2, 128, gen)
    q8, q_descale = quantize_q(random_q(2, 64, 8, 128, gen), 2)
    blocks = blocks_of(table_rows(random.Random(9), 2, 2, 16, 5))
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    right, _ = fas.flash_attn_with_sparse_block_table(q8, k8, v8, blocks, **descales)
    wrong_descale = descales[which].clone()
    wrong_descale[1, 0] *= 4
    wrong, _ = fas.flash_attn_with_sparse_block_table(q8, k8, v8, blocks, **dict(descales, **{which: wrong_descale}))
    changed = (wrong.float() - right.float()).abs().amax(dim=(1, 3))  # (batch, heads)
    assert changed[1, :4].min() > 0.05, f"a wrong {which} hardly changed its rows: {changed[1, :4]}"
    changed[1, :4] = 0
    assert not changed.any(), f"a wrong {which} entry changed other rows"


@pytest.mark.parametrize("seqlen_q", [1, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_packed_gqa_decode_split_and_not(seqlen_q, num_splits):
    """Group 4 with per-K/V-head lists: FA-3 packs the group's query heads into a tile; split-KV
    over a long list (num_splits=0: the host's choice)."""
    gen = torch.Generator(device="cuda").manual_seed(10 + seqlen_q + num_splits)
    kv = fp8_kv(2, 16384, 2, 128, gen)
    q = random_q(2, seqlen_q, 8, 128, gen)
    q8, q_descale = quantize_q(q, 2)
    full = table_rows(random.Random(seqlen_q), 2, 2, 128, 48)
    out, lse = fas.flash_attn_with_sparse_block_table(q, kv[0], kv[2], blocks_of(full), k_descale=kv[1], v_descale=kv[3],
                                                      num_splits=num_splits)
    check_against_dense(out, lse, q8, q_descale, kv, full)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_causal_mask_blocks(num_splits):
    """Full blocks gapped and permuted before the diagonal, the diagonal block a mask block (causal)."""
    gen = torch.Generator(device="cuda").manual_seed(11 + num_splits)
    seqlen_k = 2048
    kv = fp8_kv(2, seqlen_k, 2, 128, gen)
    q = random_q(2, BLOCK, 8, 128, gen)
    q8, q_descale = quantize_q(q, 2)
    diagonal = seqlen_k // BLOCK - 1
    full = table_rows(random.Random(11), 2, 2, diagonal, 6)
    mask = [[[diagonal] for _ in range(2)] for _ in range(2)]
    out, lse = fas.flash_attn_with_sparse_block_table(q, kv[0], kv[2], blocks_of(full, mask, q_block_size=BLOCK),
                                                      k_descale=kv[1], v_descale=kv[3], causal=True, num_splits=num_splits)
    check_against_dense(out, lse, q8, q_descale, kv, full, mask, causal=True)


def test_varlen_takes_a_descale_per_sequence():
    """Two sequences packed: the batched call's attention over them (per-sequence descales), within
    dense FA-3 FP8's error of the reference."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    batch, seqlen_q, seqlen_k = 2, 128, 2048
    k8, k_descale, v8, v_descale = fp8_kv(batch, seqlen_k, 2, 128, gen)
    q8, q_descale = quantize_q(random_q(batch, seqlen_q, 8, 128, gen), 2)  # one scale per (sequence, K/V head)
    full = table_rows(random.Random(12), batch, 2, seqlen_k // BLOCK, 7)
    batched = fas.flash_attn_with_sparse_block_table(q8, k8, v8, blocks_of(full), q_descale=q_descale, k_descale=k_descale,
                                                     v_descale=v_descale, backend="fa3")
    cu = lambda n: torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda")  # noqa: E731
    varlen_blocks = pack_varlen_lists([[[row] for row in per_b] for per_b in full], None, BLOCK, BLOCK, device="cuda")
    out, lse = fas.flash_attn_varlen_with_sparse_blocks(
        q8.flatten(0, 1), k8.flatten(0, 1), v8.flatten(0, 1), varlen_blocks, cu_seqlens_q=cu(seqlen_q),
        cu_seqlens_k=cu(seqlen_k), max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend="fa3")
    assert max_err(out.view_as(batched[0]), batched[0]) <= 1e-2 * batched[0].float().abs().max().item()
    check_against_dense(out.view_as(batched[0]), lse.view(8, batch, seqlen_q).transpose(0, 1), q8, q_descale,
                        (k8, k_descale, v8, v_descale), full)


def test_nan_in_q_reaches_its_own_row_only():
    gen = torch.Generator(device="cuda").manual_seed(13)
    k8, k_descale, v8, v_descale = fp8_kv(2, 2048, 2, 128, gen)
    q = random_q(2, 64, 8, 128, gen)
    blocks = blocks_of(table_rows(random.Random(13), 2, 2, 16, 5))
    poisoned = q.clone()
    poisoned[1, 5, 2, 7] = float("nan")
    out, _ = fas.flash_attn_with_sparse_block_table(poisoned, k8, v8, blocks, k_descale=k_descale, v_descale=v_descale)
    zeroed = q.clone()
    zeroed[1, 5, 2, 7] = 0
    clean, _ = fas.flash_attn_with_sparse_block_table(zeroed, k8, v8, blocks, k_descale=k_descale, v_descale=v_descale)
    bad = ~torch.isfinite(out.float()).all(-1)
    assert bad[1, 5, 2] and int(bad.sum()) == 1
    bad_rows = bad.unsqueeze(-1).expand_as(out)
    assert torch.equal(out[~bad_rows], clean[~bad_rows])  # the scale ignores the NaN, so other rows are as without it


def test_empty_lists_give_zero_out_and_minus_inf_lse():
    gen = torch.Generator(device="cuda").manual_seed(14)
    k8, k_descale, v8, v_descale = fp8_kv(2, 1024, 2, 128, gen)
    blocks = SparseBlocks(torch.zeros(2, 2, 1, dtype=torch.int32, device="cuda"),
                          torch.zeros(2, 2, 1, 4, dtype=torch.int32, device="cuda"), block_size=BLOCK)
    out, lse = fas.flash_attn_with_sparse_block_table(random_q(2, 16, 8, 128, gen), k8, v8, blocks, k_descale=k_descale,
                                                      v_descale=v_descale, num_splits=3)
    assert not out.float().any() and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_plan_and_its_cuda_graph_replay_run_bitwise_like_eager(num_splits):
    """plan.run equals the one-shot call bitwise; captured in a CUDA graph with q and k_descale
    as static tensors, a replay after updating them in place equals the one-shot call over the
    new values (q quantized and the descale copied inside the graph)."""
    gen = torch.Generator(device="cuda").manual_seed(15 + num_splits)
    k8, k_descale, v8, v_descale = fp8_kv(2, 4096, 2, 128, gen)
    q = random_q(2, 16, 8, 128, gen)
    blocks = blocks_of(table_rows(random.Random(15), 2, 2, 32, 9))
    options = dict(v_descale=v_descale, num_splits=num_splits)
    eager = fas.flash_attn_with_sparse_block_table(q, k8, v8, blocks, k_descale=k_descale, **options)
    plan = fas.plan(q, k8, v8, blocks, k_descale=k_descale, **options)
    assert plan.backend == "fa3"
    for _ in range(2):
        plan.out.fill_(float("nan"))
        out, lse = plan.run(q, k8, v8)
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    q_static, k_descale_static = q.clone(), k_descale.clone()
    plan.run(q_static, k8, v8, k_descale=k_descale_static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out, graphed_lse = plan.run(q_static, k8, v8, k_descale=k_descale_static)
    q_new, k_descale_new = random_q(2, 16, 8, 128, gen), k_descale * 1.5
    q_static.copy_(q_new)
    k_descale_static.copy_(k_descale_new)
    graph.replay()
    torch.cuda.synchronize()
    want = fas.flash_attn_with_sparse_block_table(q_new, k8, v8, blocks, k_descale=k_descale_new, **options)
    assert torch.equal(graphed_out, want[0]) and torch.equal(graphed_lse, want[1])
    assert not torch.equal(want[0], eager[0])
