"""Bad input is refused with an error naming the argument, before any kernel runs.

These run on CPU tensors: every check except "q must be on a CUDA device" comes first, and the
kernels are never reached (the custom ops have no CPU implementation, so reaching one would fail
differently)."""

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks, SparseInputError
from flash_attn_sparse.backends import fa2_ops
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.options import CallOptions

pytestmark = pytest.mark.stage5

B, SQ, SK, H, HK, D, BS = 2, 16, 1000, 8, 2, 64, 128
N_BLOCKS = -(-SK // BS)


def qkv(dtype=torch.bfloat16, batch=B, seqlen_q=SQ, seqlen_k=SK, heads=H, heads_k=HK, dim=D):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, heads_k, dim, generator=g).to(dtype)
    return q, k, torch.randn_like(k)


def table(*blocks, dtype=torch.int32):
    return torch.tensor(blocks, dtype=dtype)


def lists(count=3, batch=B, heads=HK, m_blocks=1, n=4, block_size=BS, q_block_size=None):
    cnt = torch.full((batch, heads, m_blocks), count, dtype=torch.int32)
    idx = torch.arange(n, dtype=torch.int32).expand(batch, heads, m_blocks, n).contiguous()
    return SparseBlocks(cnt, idx, block_size=block_size, q_block_size=q_block_size)


def call(q=None, k=None, v=None, blocks=None, **kwargs):
    dq, dk, dv = qkv()
    q, k, v = (dq if q is None else q), (dk if k is None else k), (dv if v is None else v)
    return fas.flash_attn_with_sparse_block_table(q, k, v, table(0, 2, 5) if blocks is None else blocks, **kwargs)


def full_check(blocks, causal=False, **shapes):
    q, k, v = qkv(**shapes)
    return fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=causal, validate="full")


def varlen_call(blocks=None, cu_seqlens_q=None, **kwargs):
    """Two sequences (q 5 and 130 rows, k 300 and 700 keys), packed."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(135, H, D, generator=g).bfloat16()
    k = torch.randn(1000, HK, D, generator=g).bfloat16()
    cu_q = torch.tensor([0, 5, 135], dtype=torch.int32) if cu_seqlens_q is None else cu_seqlens_q
    cu_k = torch.tensor([0, 300, 1000], dtype=torch.int32)
    if blocks is None:
        blocks = pack_varlen_lists([[[[0, 1]] for _ in range(HK)], [[[2], [5]] for _ in range(HK)]], None, BS, 128)
    return fas.flash_attn_varlen_with_sparse_blocks(q, k, torch.randn_like(k), blocks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                    max_seqlen_q=130, max_seqlen_k=700, **kwargs)


def with_offsets(cu_total_m_blocks, cu_block_idx_offsets):
    good = pack_varlen_lists([[[[0, 1]] for _ in range(HK)], [[[2], [5]] for _ in range(HK)]], None, BS, 128)
    return SparseBlocks(good.full_cnt, good.full_idx, block_size=BS, q_block_size=128,
                        cu_total_m_blocks=torch.tensor(cu_total_m_blocks, dtype=torch.int32),
                        cu_block_idx_offsets=torch.tensor(cu_block_idx_offsets, dtype=torch.int32))


PAGES, PAGE = 40, 64  # paged caches: 40 pages of 64 keys; each sequence's table row names 16 pages


def paged_call(page_table=None, k=None, v=None, page_size=PAGE, blocks=None, block_size=BS, **kwargs):
    q = qkv()[0]
    g = torch.Generator().manual_seed(2)
    if k is None:
        k = torch.randn(PAGES, page_size, HK, D, generator=g).bfloat16()
    if v is None:
        v = torch.randn(PAGES, page_size, HK, D, generator=g).bfloat16()
    if page_table is None:
        page_table = torch.randperm(PAGES, generator=g)[:2 * 16].view(2, 16).to(torch.int32)
    blocks = table(0, 2, 5) if blocks is None else blocks
    return fas.flash_attn_with_sparse_block_table(q, k, v, blocks, block_size=block_size, page_table=page_table, **kwargs)


def paged_varlen_call(max_seqlen_k=700):
    """Varlen queries over a paged cache (the engine-shaped call), through the call object."""
    from flash_attn_sparse.calls import SparseCall
    g = torch.Generator().manual_seed(1)
    q = torch.randn(135, H, D, generator=g).bfloat16()
    k = torch.randn(PAGES, PAGE, HK, D, generator=g).bfloat16()
    blocks = pack_varlen_lists([[[[0, 1]] for _ in range(HK)], [[[2], [5]] for _ in range(HK)]], None, BS, 128)
    return SparseCall(q, k, torch.randn_like(k), blocks, CallOptions(),
                 cu_seqlens_q=torch.tensor([0, 5, 135], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 300, 1000], dtype=torch.int32),
                 max_seqlen_q=130, max_seqlen_k=max_seqlen_k, page_table=torch.zeros(2, 16, dtype=torch.int32))


def interleaved_kv(page_size=PAGE):
    kv = torch.randn(PAGES, 2, page_size, HK, D).bfloat16()
    return kv[:, 0], kv[:, 1]


def padded_pages():
    """Pages 8 elements apart beyond their rows: a page stride that is no whole number of rows."""
    return torch.randn(PAGES, PAGE * HK * D + 8).bfloat16()[:, :PAGE * HK * D].view(PAGES, PAGE, HK, D)


BAD_CALLS = {
    "q dtype float32": (lambda: call(q=qkv()[0].float()), "q"),
    "k dtype differs": (lambda: call(k=qkv(torch.float16)[1]), "k"),
    "q not 4-D": (lambda: call(q=qkv()[0][0]), "q"),
    "v shape differs from k": (lambda: call(v=qkv(seqlen_k=SK + 1)[2]), "v"),
    "head_dim not a multiple of 8": (lambda: call(*qkv(dim=60)), "q"),
    "head_dim above 256": (lambda: call(*qkv(dim=264)), "q"),
    "heads_k does not divide heads": (lambda: call(*qkv(heads=6, heads_k=4)), "k"),
    "k batch differs": (lambda: call(k=qkv(batch=3)[1], v=qkv(batch=3)[2]), "k"),
    "table dtype int64": (lambda: call(blocks=table(0, 1, dtype=torch.int64)), "sparse_block_table"),
    "table 2-D": (lambda: call(blocks=table(0, 1).view(1, 2)), "sparse_block_table"),
    "table not a tensor": (lambda: call(blocks=[0, 1]), "sparse_block_table"),
    "block_size 100": (lambda: call(block_size=100), "block_size"),
    "block_size 512": (lambda: call(block_size=512), "block_size"),
    "num_splits negative": (lambda: call(num_splits=-1), "num_splits"),
    "num_splits above 128": (lambda: call(num_splits=129), "num_splits"),
    "softmax_scale nan": (lambda: call(softmax_scale=float("nan")), "softmax_scale"),
    "causal not a bool": (lambda: call(causal="yes"), "causal"),
    "lists batch extent": (lambda: call(blocks=lists(batch=3)), "full_cnt"),
    "lists head extent 3": (lambda: call(blocks=lists(heads=3)), "full_cnt"),
    "lists too few query tiles": (lambda: call(blocks=lists(q_block_size=64, m_blocks=1), q=qkv(seqlen_q=200)[0]), "full_cnt"),
    "q_block_size not a multiple of 64": (lambda: call(blocks=lists(q_block_size=100)), "q_block_size"),
    "idx int64": (lambda: call(blocks=SparseBlocks(lists().full_cnt, lists().full_idx.long())), "full_idx"),
    "idx last dim not contiguous": (lambda: call(blocks=SparseBlocks(lists().full_cnt, lists(n=4).full_idx.transpose(2, 3))), "full_idx"),
    "mask lists without counts": (lambda: call(blocks=SparseBlocks(lists().full_cnt, lists().full_idx, mask_idx=lists().full_idx)), "mask_cnt"),
    "mask lists of another shape": (lambda: call(blocks=SparseBlocks(lists().full_cnt, lists().full_idx, lists(heads=1).full_cnt, lists(heads=1).full_idx)), "mask_cnt"),
    "varlen layout for batched call": (lambda: call(blocks=SparseBlocks(torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 9, dtype=torch.int32),
                                                                       cu_total_m_blocks=torch.zeros(3, dtype=torch.int32),
                                                                       cu_block_idx_offsets=torch.zeros(3, dtype=torch.int32))), "blocks"),
    "count above the row (full check)": (lambda: full_check(lists(count=5, n=4)), "full_cnt"),
    "negative count (full check)": (lambda: full_check(lists(count=-1)), "full_cnt"),
    "block id past the sequence (full check)": (lambda: full_check(SparseBlocks.from_block_table(table(0, N_BLOCKS), BS, B)), "full_idx"),
    "negative block id (full check)": (lambda: full_check(SparseBlocks.from_block_table(table(-1, 2), BS, B)), "full_idx"),
    "duplicate block id (full check)": (lambda: full_check(SparseBlocks.from_block_table(table(3, 1, 3), BS, B)), "full_idx"),
    "full block not historical when causal (full check)": (lambda: full_check(SparseBlocks.from_block_table(table(0, N_BLOCKS - 1), BS, B), causal=True), "full_idx"),
    "combine: partials not float32": (lambda: fas.flash_attn_combine(torch.zeros(2, 1, 1, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 1, 1, 4)), "out_partials"),
    "combine: lse shape": (lambda: fas.flash_attn_combine(torch.zeros(2, 1, 1, 4, 64), torch.zeros(2, 1, 1, 5)), "lse_partials"),
    "partials: no groups": (lambda: fas.flash_attn_sparse_partials(*qkv(), []), "block_groups"),
    "speculative: k_spec not 4-D": (lambda: fas.flash_attn_speculative_sparse(*qkv()[:1], qkv()[1][0], qkv()[2][0], *qkv()[1:], table(0)), "k_spec"),
    "speculative: causal_spec not a bool": (lambda: fas.flash_attn_speculative_sparse(
        qkv()[0], qkv(dim=D)[1][:, :128].contiguous(), qkv()[2][:, :128].contiguous(), *qkv()[1:], table(0), causal_spec="yes"),
        "causal_spec"),
    "zero-copy: spec table int64": (lambda: fas.flash_attn_speculative_sparse_zero_copy(*qkv(), table(7, dtype=torch.int64), table(0)), "spec_block_table"),
    "varlen: cu_seqlens_q int64": (lambda: varlen_call(cu_seqlens_q=torch.tensor([0, 5, 135])), "cu_seqlens_q"),
    "varlen: batched lists": (lambda: varlen_call(blocks=lists()), "blocks"),
    "varlen: offsets of the wrong length": (lambda: varlen_call(blocks=with_offsets([0, 1], [0, 2])), "cu_total_m_blocks"),
    "varlen: tiles disagree with cu_seqlens_q (full check)": (lambda: varlen_call(blocks=with_offsets([0, 2, 3], [0, 4, 6]), validate="full"), "cu_total_m_blocks"),
    "varlen: offsets not a multiple of the tiles (full check)": (lambda: varlen_call(blocks=with_offsets([0, 1, 3], [0, 2, 5]), validate="full"), "cu_block_idx_offsets"),
    "paged: page_table int64": (lambda: paged_call(page_table=torch.zeros(2, 16, dtype=torch.int64)), "page_table"),
    "paged: page_table not a tensor": (lambda: paged_call(page_table=[[0, 1]] * 2), "page_table"),
    "paged: page_table on another device": (lambda: paged_call(page_table=torch.zeros(2, 16, dtype=torch.int32, device="meta")), "page_table"),
    "paged: page_table 1-D": (lambda: paged_call(page_table=torch.zeros(32, dtype=torch.int32)), "page_table"),
    "paged: page_table batch differs from q": (lambda: paged_call(page_table=torch.zeros(3, 16, dtype=torch.int32)), "page_table"),
    "paged: page_table last dim not contiguous": (lambda: paged_call(page_table=torch.zeros(16, 2, dtype=torch.int32).t()), "page_table"),
    "paged varlen: max_seqlen_k past the page table": (lambda: paged_varlen_call(max_seqlen_k=16 * PAGE + 1), "max_seqlen_k"),
    "paged: page size not a multiple of 16": (lambda: paged_call(page_size=40, block_size=128), "k"),
    "paged: page and block sizes do not divide": (lambda: paged_call(page_size=48, block_size=32, blocks=table(0, 2)), "k"),
    "paged: v's page stride differs from k's": (lambda: paged_call(k=interleaved_kv()[0]), "v"),
    "paged: k's page stride not a multiple of its row stride": (lambda: paged_call(k=padded_pages(), v=padded_pages()), "k"),
    "paged: page id past the cache (full check)": (lambda: paged_call(page_table=torch.full((2, 16), PAGES, dtype=torch.int32), validate="full"), "page_table"),
    "paged: negative page id (full check)": (lambda: paged_call(page_table=torch.full((2, 16), -1, dtype=torch.int32), validate="full"), "page_table"),
    "paged: seqused_k past the table (full check)": (lambda: paged_call(seqused_k=torch.tensor([16 * PAGE + 1, 5], dtype=torch.int32), validate="full"), "seqused_k"),
    "seqused_k past the keys (full check)": (lambda: call(seqused_k=torch.tensor([SK + 1, 5], dtype=torch.int32), validate="full"), "seqused_k"),
    "seqused_k int64": (lambda: call(seqused_k=torch.tensor([5, 5])), "seqused_k"),
    "q on the CPU": (lambda: call(), "q"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_refused_naming_the_argument(case):
    thunk, argument = BAD_CALLS[case]
    with pytest.raises(SparseInputError) as raised:
        thunk()
    assert str(raised.value).startswith(f"{argument}:"), str(raised.value)


def test_enough_distinct_bad_inputs():
    assert len(BAD_CALLS) >= 25


DEV_BUILD = ((64, 128), False)  # what fa2_ops.compiled_head_dims() answers for the dev profile
FULL_BUILD = ((32, 64, 96, 128, 192, 256), True)


@pytest.mark.parametrize("head_dim,compiled,runs", [
    (128, DEV_BUILD, True), (64, DEV_BUILD, True), (112, DEV_BUILD, False), (96, DEV_BUILD, False),
    (32, DEV_BUILD, False), (256, DEV_BUILD, False), (112, FULL_BUILD, True), (40, FULL_BUILD, True),
    (248, FULL_BUILD, True), (112, ((64,), True), False), (56, ((64,), True), True),
])
def test_head_dims_run_only_on_a_kernel_the_build_compiled(head_dim, compiled, runs):
    """HEADDIM_SWITCH runs a head dim on the first kernel at least as wide, and only builds with
    uneven head dims may run one narrower than its kernel."""
    refusal = fa2_ops.head_dim_refusal(head_dim, compiled)
    assert (refusal is None) == runs, refusal
    if not runs:
        assert f"got {head_dim}" in refusal


def test_full_validation_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLASH_ATTN_SPARSE_VALIDATE", "full")
    q, k, v = qkv()
    with pytest.raises(SparseInputError, match="^full_idx:.*listed twice"):
        fas.flash_attn_with_sparse_block_table(q, k, v, table(1, 1))


def test_cheap_validation_does_not_read_the_lists(monkeypatch):
    """Without the exhaustive check, a content error is not looked for (no host sync); the call
    only stops at the device check."""
    monkeypatch.delenv("FLASH_ATTN_SPARSE_VALIDATE", raising=False)
    q, k, v = qkv()
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
        fas.flash_attn_with_sparse_block_table(q, k, v, table(1, 1))


def test_valid_lists_pass_full_validation_before_the_device_check():
    q, k, v = qkv()
    causal_ok = SparseBlocks.from_block_table(table(0, 2, 5), BS, B)
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
        fas.flash_attn_with_sparse_block_table(q, k, v, causal_ok, causal=True, validate="full")


@pytest.mark.parametrize("choose", [fas.choose_backend, fas.choose_num_splits_for])
def test_choosers_take_the_call_options(choose):
    """choose_backend and choose_num_splits_for accept what the call takes (causal and
    softmax_scale included) and check it as the call does: here up to the device check."""
    q, k, v = qkv()
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
        choose(q, k, v, table(0, 2, 5), causal=True, softmax_scale=0.1, seqused_k=None)


@pytest.mark.parametrize("page_size,block_size", [(16, 128), (64, 64), (256, 64), (48, 16)])
def test_valid_paged_calls_pass_every_check_before_the_device_check(page_size, block_size):
    """Pages of any size that divides or is a multiple of the block size, an unrelated number of
    pages, seqused_k short of the table, unused table entries out of range, interleaved K/V."""
    g = torch.Generator().manual_seed(page_size)
    n_cols = -(-1000 // page_size)
    pages = 2 * n_cols + 3
    page_table = torch.randperm(pages, generator=g)[:2 * n_cols].view(2, n_cols).to(torch.int32)
    page_table[1, -1] = -1  # past seqused_k[1]: never read, so not checked
    seqused_k = torch.tensor([1000, 1000 - page_size], dtype=torch.int32)
    kv = torch.randn(pages, 2, page_size, HK, D, generator=g).bfloat16()
    blocks = table(0, 2, (1000 - page_size - 1) // block_size)
    with pytest.raises(SparseInputError, match="^q: must be on a CUDA device"):
        fas.flash_attn_with_sparse_block_table(qkv()[0], kv[:, 0], kv[:, 1], blocks, block_size=block_size, seqused_k=seqused_k,
                                               page_table=page_table, validate="full")


@pytest.mark.parametrize("change,refused_by", [
    (None, None),
    ("other_strides", "layout"),
    ("head_dim_64", "fa2"),  # 128-key blocks below the 256-key tile at head dim 64
    ("block_64", "fa2"),
    ("missed_mask_lists", "layout"),
    ("other_dtype", "layout"),
])
def test_speculative_one_launch_conditions(monkeypatch, change, refused_by):
    """Which speculative calls run as one launch over both K/V sources: the layout the form needs
    (speculative._one_launch_refusal), then a backend that takes the second source (fa2.refusal:
    blocks of at least one kernel tile, as mha_fwd_sparse checks). Otherwise two passes run,
    which refuse bad input themselves."""
    from flash_attn_sparse import calls
    from flash_attn_sparse.backends import fa2
    from flash_attn_sparse.options import CallOptions
    from flash_attn_sparse.speculative import _every_block_of, _one_launch_refusal
    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    q, k, v = qkv(dim=64 if change == "head_dim_64" else 128)
    k_spec, v_spec = k[:, :256].contiguous(), v[:, :256].contiguous()
    missed = SparseBlocks.from_block_table(table(1, 3), 64 if change == "block_64" else BS, B,
                                           kind="mask" if change == "missed_mask_lists" else "full")
    if change == "other_strides":
        k_spec = torch.cat([k_spec, k_spec], dim=-1)[..., :k.shape[-1]]
    if change == "other_dtype":
        k_spec = k_spec.half()
    reason = _one_launch_refusal(q, k_spec, v_spec, k, v, missed)
    assert (reason is not None) == (refused_by == "layout"), reason
    if reason is None:
        call = calls.SparseCall(q, k, v, missed, CallOptions(backend="fa2"))
        call.use_mask_lists(_every_block_of(k_spec, B, "mask", missed.block_size), source=(k_spec, v_spec))
        assert (fa2.refusal(call) is not None) == (refused_by == "fa2")


@pytest.mark.parametrize("entry, positional", [
    ("flash_attn_with_sparse_block_table", ["q", "k", "v", "sparse_block_table"]),
    ("flash_attn_varlen_with_sparse_blocks", ["q", "k", "v", "blocks"]),
    ("flash_attn_speculative_sparse", ["q", "k_spec", "v_spec", "k", "v", "sparse_block_table"]),
    ("flash_attn_speculative_sparse_zero_copy", ["q", "k", "v", "spec_block_table", "missed_block_table"]),
    ("flash_attn_sparse_partials", ["q", "k", "v", "block_groups"]),
    ("choose_backend", ["q", "k", "v", "blocks"]),
    ("choose_num_splits_for", ["q", "k", "v", "blocks"]),
])
def test_entry_points_take_options_by_keyword_only(entry, positional):
    """The tensors and the lists by position, every option by keyword."""
    import inspect
    parameters = inspect.signature(getattr(fas, entry)).parameters.values()
    assert [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD] == positional
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters)
    with pytest.raises(TypeError, match="positional"):
        getattr(fas, entry)(*[None] * (len(positional) + 1))  # one more, e.g. a block_size by position
