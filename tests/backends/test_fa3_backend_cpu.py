"""The FA-3 backend's Python on the CPU: the host rules fa3_ops.refusal states before any op runs
(as the C++ op would refuse them, never with its error), and which entry point runs a call: the
extension's fwd_into on the eager launcher, the ops fwd (allocates out) / fwd_out (writes the
caller's out, no copy) on the traceable path. The kernel itself: test_stage4_fa3_sparse.py."""

import re
from pathlib import Path

import pytest
import torch

from flash_attn_sparse import SparseBlocks, calls
from flash_attn_sparse.backends import fa3, fa3_ops
from flash_attn_sparse.options import CallOptions

B, SQ, SK, H, HK, D = 2, 16, 1024, 8, 2, 128


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(fa3_ops, "_on_sm90", lambda q: True)


def qkv():
    return (torch.randn(B, SQ, H, D, dtype=torch.bfloat16), torch.randn(B, SK, HK, D, dtype=torch.bfloat16),
            torch.randn(B, SK, HK, D, dtype=torch.bfloat16))


def lists(width=3, mask_width=None, block_size=128):
    full_cnt = torch.ones(B, HK, 1, dtype=torch.int32)
    full_idx = torch.zeros(B, HK, 1, width, dtype=torch.int32)
    if mask_width is None:
        return SparseBlocks(full_cnt, full_idx, block_size=block_size)
    return SparseBlocks(full_cnt, full_idx, full_cnt.clone(), torch.zeros(B, HK, 1, mask_width, dtype=torch.int32),
                        block_size=block_size)


@pytest.mark.parametrize("group, list_heads, q_block_size, seqlen_q, packs", [
    (4, 1, 128, 16, True), (4, 8, 128, 16, True), (4, 32, 128, 16, False),  # per-query-head lists never pack
    (3, 8, 128, 4096, True), (5, 8, 128, 4096, True), (7, 1, 128, 4096, True),  # a 128-row list row: whole tiles
    (64, 1, 128, 4096, True), (128, 1, 128, 4096, True),  # a tile of one query position's heads
    (3, 8, 64, 13, True), (7, 8, 64, 64, True),  # one list row for every query: any group
    (3, 8, 64, 4096, False), (5, 8, 64, 4096, False),  # 64-row list rows of 192 / 320 packed rows straddle tiles
    (2, 8, 64, 4096, True), (6, 8, 64, 4096, True),  # ... of 128 / 384 rows fill them
    (1, 1, 128, 16, False),  # no GQA: nothing to pack
])
def test_query_heads_pack_where_no_tile_straddles_two_list_rows(group, list_heads, q_block_size, seqlen_q, packs):
    """The host's PackGQA rule (sparse_kernel_choice.h; test_sparse_kernel_choice.py compiles it
    and compares) for any group: lists shared by
    the group, and either one list row for every query or list rows of whole 128-row tiles."""
    num_heads = 8 * group if list_heads != 32 else 32
    assert fa3_ops._packs_query_heads(group, list_heads, num_heads, q_block_size, seqlen_q) is packs


def test_groups_1_2_4_8_16_pack_as_before_at_128_row_lists():
    """The rule only widens: where the group divides the 64-row tile, packing is unchanged."""
    for group in (2, 4, 8, 16):
        for seqlen_q in (1, 16, 4096):
            assert fa3_ops._packs_query_heads(group, 8, 8 * group, 128, seqlen_q)


def test_the_host_rules_are_refused_with_their_reason(sm90, monkeypatch):
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ())  # a build with every kernel, whatever is installed
    monkeypatch.setitem(fa3_ops._BLOCK_SIZES, "answer", (128,))  # ... of 128-key list blocks
    q, k, _ = qkv()
    assert fa3_ops.refusal(q, k, lists(), varlen=False) is None
    assert fa3_ops.refusal(q, k, lists(mask_width=3), varlen=False) is None
    assert "take block_size 128, got 64" in fa3_ops.refusal(q, k, lists(block_size=64), varlen=False)
    assert "head dims" in fa3_ops.refusal(q[..., :96], k[..., :96], lists(), varlen=False)
    assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=128) is None
    assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=64) is None  # cp.async pages, packed
    per_query_head = SparseBlocks(torch.ones(B, H, 1, dtype=torch.int32), torch.zeros(B, H, 1, 3, dtype=torch.int32),
                                  block_size=128)
    assert "per-K/V-head lists only" in fa3_ops.refusal(q, k, per_query_head, varlen=False, page_size=64)
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ("PAGEDKV",))  # a build without those kernels
    assert "DISABLE_PAGEDKV" in fa3_ops.refusal(q, k, lists(), varlen=False, page_size=64)
    assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=256) is None
    assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=256, seqused_k=True) is None
    assert "seqused_k" in fa3_ops.refusal(q, k, lists(), varlen=True, page_size=128)
    # Batched mask lists of another width (the zero-copy speculative form's) have their own layout.
    assert fa3_ops.refusal(q, k, lists(mask_width=5), varlen=False) is None


def test_a_build_reporting_64_key_blocks_takes_them_with_16_bit_kv_contiguous_or_in_pages_of_whole_blocks(sm90, monkeypatch):
    """Its 64-key units are fp16 / bf16 only, with TMA loads: FP8 and pages that split a block
    (cp.async loads) are refused by name, before any op runs."""
    monkeypatch.setitem(fa3_ops._DISABLED, "answer", ())
    monkeypatch.setitem(fa3_ops._BLOCK_SIZES, "answer", (64, 128))
    q, k, _ = qkv()
    for page_size in (None, 64, 128, 256):
        assert fa3_ops.refusal(q, k, lists(block_size=64), varlen=False, page_size=page_size) is None, page_size
    assert "pages of a multiple of 64" in fa3_ops.refusal(q, k, lists(block_size=64), varlen=False, page_size=32)
    fp8 = k.to(torch.float8_e4m3fn)
    assert "fp16 or bf16 K/V" in fa3_ops.refusal(q, fp8, lists(block_size=64), varlen=False)
    assert "got 32" in fa3_ops.refusal(q, k, lists(block_size=32), varlen=False)
    assert fa3_ops.refusal(q, k, lists(), varlen=False, page_size=64) is None  # 128-key blocks: cp.async pages as before


def test_block_sizes_without_the_report_are_128_only(monkeypatch):
    monkeypatch.setitem(fa3_ops._MISSING_BUILD, "answer", "no flash_attn_3 here")
    monkeypatch.delitem(fa3_ops._BLOCK_SIZES, "answer", raising=False)
    assert fa3_ops.block_sizes() == (128,)


def test_without_sm90_the_backend_says_so():
    q, k, _ = qkv()
    assert "sm90" in fa3_ops.refusal(q, k, lists(), varlen=False)


def fake_ops(monkeypatch, launched, with_direct):
    """The op fwd, op fwd_out and the extension's fwd_into, each recording its call and writing 1s."""
    def fwd(q, k, v, *tensors, **options):
        launched.append(("fwd", options))
        return torch.ones_like(q), torch.zeros(B, H, SQ)

    def fwd_out(q, k, v, out, *tensors, **options):
        launched.append(("fwd_out", options))
        out.fill_(1)
        return torch.zeros(B, H, SQ)

    def fwd_into(*positional, **named):
        assert not positional, "the extension's entry point takes every argument by name"
        launched.append(("fwd_into", named))
        named["out"].fill_(1)
        return torch.zeros(B, H, SQ)

    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(fa3_ops, "op", lambda: fwd)
    monkeypatch.setattr(fa3_ops, "op_out", lambda: fwd_out)
    monkeypatch.setattr(fa3_ops, "direct", lambda: fwd_into if with_direct else None)
    monkeypatch.setattr(fa3_ops, "planner", lambda: None)  # a build without SparseForward (see below)


def binding_names(entry: str):
    """The py::arg names flash_api_sparse.cpp binds `entry` (fwd_into, run_with) with, in order."""
    source = (Path(__file__).parents[2] / "patches/overlay/flash-attn-3/hopper/flash_api_sparse.cpp").read_text()
    binding = re.search(rf'\.def\("{entry}",(.*?)\)\s*(?:;|\n\s*\.def)', source, re.S)
    assert binding, f"flash_api_sparse.cpp binds {entry}"
    return re.findall(r'py::arg\("(\w+)"\)', binding.group(1))


@pytest.mark.parametrize("with_direct", [True, False])
@pytest.mark.parametrize("given_out", [False, True])
def test_the_one_shot_plan_writes_a_given_out_in_place_and_allocates_otherwise(monkeypatch, given_out, with_direct):
    """Without the extension's SparseForward a one-shot plan goes through its fwd_into (every
    argument named), or the op fwd_out for a build without it; either way into the given out,
    else a new one."""
    q, k, v = qkv()
    launched = []
    fake_ops(monkeypatch, launched, with_direct)
    call = calls.SparseCall(q, k, v, lists(), CallOptions(num_splits=2, backend="fa3"))
    out = torch.zeros_like(q) if given_out else None
    result, lse = fa3.plan(call, 2, out, keep_buffers=False).run_with(q, k, v, out, call.effective_blocks(), {})
    ((name, options),) = launched
    assert name == ("fwd_into" if with_direct else "fwd_out") and options["num_splits"] == 2
    if with_direct:
        assert set(binding_names("fwd_into")) == options.keys()
    assert (result is out) == given_out and result.shape == q.shape and bool((result == 1).all())


@pytest.mark.parametrize("given_out", [False, True])
def test_run_goes_through_the_ops(monkeypatch, given_out):
    """The uncached path (the one torch.compile traces) calls the op fwd, or fwd_out into a given out."""
    q, k, v = qkv()
    launched = []
    fake_ops(monkeypatch, launched, with_direct=True)
    call = calls.SparseCall(q, k, v, lists(), CallOptions(num_splits=2, backend="fa3"))
    out = torch.zeros_like(q) if given_out else None
    result, lse = fa3.run(call, 2, out)
    ((name, options),) = launched
    assert name == ("fwd_out" if given_out else "fwd") and options["num_splits"] == 2
    assert (result is out) == given_out and bool((result == 1).all())


def test_the_one_shot_plan_plans_once_and_passes_a_new_lse_per_call(monkeypatch):
    """With the extension's SparseForward a one-shot plan plans once (fwd_out's arguments by name,
    an out like q) and each run_with passes its tensors, lists included, by name to the
    extension's run_with and returns the new LSE it returns: an LSE a caller keeps is never
    overwritten by a later call of the same shape. A plan's run into an out of other strides
    goes through fwd_into."""
    q, k, v = qkv()
    launched, made, runs = [], [], []
    fake_ops(monkeypatch, launched, with_direct=True)

    class FakeSparseForward:
        def __init__(self, **named):
            made.append(named)
            self.released = False

        def release_run_buffers(self):
            self.released = True

        def run_with(self, *positional, **named):
            assert self.released, "a one-shot entry holds no planned buffers"
            assert not positional, "the extension's entry point takes every argument by name"
            runs.append(named)
            named["out"].fill_(1)
            q = named["q"]
            return torch.full((q.shape[0], q.shape[2], q.shape[1]), float(len(runs)))  # a new LSE per call

    monkeypatch.setattr(fa3_ops, "planner", lambda: FakeSparseForward)
    call = calls.SparseCall(q, k, v, lists(), CallOptions(num_splits=2, backend="fa3"))
    one_shot = fa3.plan(call, 2, None, keep_buffers=False)
    launch = lambda q, k, v, blocks, out: one_shot.run_with(q, k, v, out, blocks, {})  # noqa: E731
    (planned_with,) = made
    assert planned_with["out"].shape == q.shape and planned_with["num_splits"] == 2
    other = lists()
    out1, lse1 = launch(q, k, v, call.effective_blocks(), None)
    out2, lse2 = launch(q, k, v, other, None)
    assert not launched and len(made) == 1
    assert lse1.shape == (B, H, SQ) and bool((lse1 == 1).all()) and bool((lse2 == 2).all())
    assert out1 is not out2 and bool((out1 == 1).all())
    # Every binding name but softmax_lse (run_with then allocates a new LSE).
    assert runs[1]["full_idx"] is other.full_idx and set(runs[0]) == set(binding_names("run_with")) - {"softmax_lse"}
    given = torch.zeros_like(q)
    result, _ = fa3.plan(call, 2, None).run_any_out(q, k, v, given)
    assert len(made) == 2 and launched[-1][0] == "fwd_into" and result is given


def test_a_varlen_paged_call_passes_its_page_table_and_seqused_k_not_cu_seqlens_k(monkeypatch):
    """The op's paged layout (as upstream's): the page table and seqused_k by name, and no
    cu_seqlens_k (which would place keys in one packed tensor), on the plan and on run_with."""
    from flash_attn_sparse.metadata import pack_varlen_lists
    made, runs = [], []

    class FakeSparseForward:
        def __init__(self, **named):
            made.append(named)

        def release_run_buffers(self):
            pass

        def run_with(self, **named):
            runs.append(named)
            return torch.zeros(H, named["q"].shape[0])

    monkeypatch.setattr(calls, "require_cuda", lambda q: None)
    monkeypatch.setattr(fa3_ops, "planner", lambda: FakeSparseForward)
    monkeypatch.setattr(fa3_ops, "direct", lambda: lambda **named: None)  # not called: the planned forward runs
    seqlens_q, seqlens_k, page = [3, 1], [300, 700], 128
    q = torch.zeros(sum(seqlens_q), H, D, dtype=torch.bfloat16)
    k_cache = v_cache = torch.zeros(8, page, HK, D, dtype=torch.bfloat16)
    page_table = torch.arange(12, dtype=torch.int32).remainder(8).view(2, 6)
    cu = lambda lens: torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)  # noqa: E731
    blocks = pack_varlen_lists([[[[0, 2]]] * HK, [[[5]]] * HK], None, 128, 128)
    seqused_k = torch.tensor(seqlens_k, dtype=torch.int32)
    call = calls.SparseCall(q, k_cache, v_cache, blocks, CallOptions(backend="fa3"), cu_seqlens_q=cu(seqlens_q),
                            cu_seqlens_k=cu(seqlens_k), max_seqlen_q=3, max_seqlen_k=700, seqused_k=seqused_k,
                            page_table=page_table)
    one_shot = fa3.plan(call, 1, None, keep_buffers=False)
    one_shot.run_with(q, k_cache, v_cache, None, blocks, dict(cu_seqlens_q=call.cu_seqlens_q, cu_seqlens_k=call.cu_seqlens_k,
                                                               seqused_k=seqused_k, page_table=page_table))
    for named in (made[0], runs[0]):
        assert named["page_table"] is page_table and named["seqused_k"] is seqused_k and named["cu_seqlens_k"] is None
        assert named["cu_seqlens_q"] is call.cu_seqlens_q
