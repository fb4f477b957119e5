"""GPU: SparsePlan.run against the one-shot call (bitwise) and the fp32 reference; lists updated
in place between runs and between CUDA-graph replays; out= written in place; host time printed."""

import importlib.util
import statistics
import time

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks, calls
from flash_attn_sparse.backends import fa4
from flash_attn_sparse.metadata import pack_varlen_lists
from flash_attn_sparse.options import CallOptions
from flash_attn_sparse.reference import block_positions
from helpers import assert_captured_run_equals_direct, assert_close_to_reference, one_shot_calls_on_two_streams, random_qkv

pytestmark = pytest.mark.gpu

B, SQ, SK, H, HK, D, BS = 2, 4, 2000, 8, 2, 128, 128
N_BLOCKS = -(-SK // BS)
BACKENDS = ["fa2", pytest.param("fa4", marks=pytest.mark.sm90)]


FA4_REFUSAL = fa4.refusal  # before conftest's auto_stays_on_fa2 replaces it in each test


@pytest.fixture
def needs(monkeypatch):
    """needs(backend): skips fa4 without the CuTe-DSL runtime; else lets fa4 run the calls it can
    (conftest keeps the other test files on FA-2)."""
    def check(backend):
        if backend == "fa4":
            if importlib.util.find_spec("cutlass") is None:
                pytest.skip("the CuTe-DSL runtime (nvidia-cutlass-dsl, extra [hopper]) is not installed")
            monkeypatch.setattr(fa4, "refusal", FA4_REFUSAL)
    return check


def inputs(seed, seqlen_q=SQ):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = random_qkv(B, seqlen_q, SK, H, HK, D, torch.bfloat16, generator=g)
    # Distinct V per block, so a wrong or missing block shows in the output.
    v = v + torch.arange(N_BLOCKS, device="cuda").repeat_interleave(BS)[:SK].view(1, SK, 1, 1).to(v.dtype)
    return q, k, v


def visible_for(table, seqlen_q=SQ):
    positions = block_positions(table.tolist(), BS, SK)
    visible = torch.zeros(seqlen_q, SK, dtype=torch.bool)
    visible[:, positions] = True
    return visible.cuda()


def per_kv_head_lists(seed, n=6):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(N_BLOCKS, generator=g)[:n] for _ in range(B * HK)]).view(B, HK, 1, n)
    cnt = torch.randint(1, n + 1, (B, HK, 1), generator=g)
    return SparseBlocks(cnt.int().cuda(), idx.int().cuda(), block_size=BS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lists", ["table", "per K/V head"])
def test_plan_run_equals_the_one_shot_call_bitwise(backend, lists, needs):
    needs(backend)
    q, k, v = inputs(0)
    blocks = torch.tensor([9, 2, 14, 5, 0, 15], dtype=torch.int32, device="cuda") if lists == "table" else per_kv_head_lists(1)
    plan = fas.plan(q, k, v, blocks, block_size=BS, backend=backend)
    for seed in (2, 3):
        q, k, v = inputs(seed)
        out, lse = plan.run(q, k, v)
        ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, block_size=BS, backend=backend)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        if lists == "table":
            assert_close_to_reference(out, lse, q, k, v, visible_for(blocks))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_updated_in_place_between_runs_change_the_result(backend, needs):
    needs(backend)
    q, k, v = inputs(4)
    table = torch.tensor([3, 11, 7], dtype=torch.int32, device="cuda")
    plan = fas.SparsePlan(q, k, v, table, block_size=BS, backend=backend)
    for ids in ([3, 11, 7], [15, 0, 8], [1, 2, 13]):
        table.copy_(torch.tensor(ids, dtype=torch.int32))
        out, lse = plan.run(q, k, v)
        assert_close_to_reference(out, lse, q, k, v, visible_for(table))


@pytest.mark.parametrize("num_splits", [1, 0, 4])
def test_cuda_graph_replays_plan_run_over_lists_updated_in_place(num_splits):
    q, k, v = inputs(5, seqlen_q=1)
    table = torch.tensor([6, 1, 12, 4], dtype=torch.int32, device="cuda")
    plan = fas.SparsePlan(q, k, v, table, block_size=BS, backend="fa2", num_splits=num_splits)
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture
        plan.run(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = plan.run(q, k, v, out=out)
    for ids, seed in (([6, 1, 12, 4], 6), ([0, 15, 9, 3], 7), ([14, 13, 2, 8], 8)):
        table.copy_(torch.tensor(ids, dtype=torch.int32))
        q.copy_(inputs(seed, seqlen_q=1)[0])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out, lse, q, k, v, visible_for(table, seqlen_q=1))
        eager_out, eager_lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=BS, backend="fa2",
                                                                       num_splits=num_splits)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_is_written_in_place(backend, needs):
    needs(backend)
    q, k, v = inputs(9)
    table = torch.tensor([4, 10, 1], dtype=torch.int32, device="cuda")
    expected_out, expected_lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=BS, backend=backend)
    plan = fas.SparsePlan(q, k, v, table, block_size=BS, backend=backend)
    runs = {"one-shot": lambda out: fas.flash_attn_with_sparse_block_table(q, k, v, table, block_size=BS,
                                                                          backend=backend, out=out),
            "plan": lambda out: plan.run(q, k, v, out=out)}
    for name, run in runs.items():
        out = torch.full_like(q, float("nan"))
        result, lse = run(out)
        assert result is out, name
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse), name
    # The varlen form takes out= too.
    cu = torch.arange(0, (B + 1) * SQ, SQ, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (B + 1) * SK, SK, dtype=torch.int32, device="cuda")
    varlen_blocks = pack_varlen_lists([[[table.tolist()]]] * B, block_size=BS, device="cuda")
    out = torch.full((B * SQ, H, D), float("nan"), dtype=q.dtype, device="cuda")
    result, _ = fas.flash_attn_varlen_with_sparse_blocks(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), varlen_blocks, cu_seqlens_q=cu, cu_seqlens_k=cu_k,
        max_seqlen_q=SQ, max_seqlen_k=SK, backend="fa2", out=out)
    assert result is out
    assert_close_to_reference(out.view_as(q), expected_lse, q, k, v, visible_for(table))


def _median_host_us(fn, calls=200):
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


@pytest.mark.parametrize("backend", BACKENDS)
def test_print_host_time(backend, needs):
    """Median host time (us) per plan.run and per one-shot call over 200 eager calls (printed,
    not asserted): decode B8 Sq1 H32 Hk8 Sk32768 bf16, 1/16 of the blocks per K/V head."""
    needs(backend)
    batch, heads, heads_k, seqlen_k = 8, 32, 8, 32768
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = random_qkv(batch, 1, seqlen_k, heads, heads_k, D, torch.bfloat16, generator=g)
    n = seqlen_k // BS // 16
    idx = torch.stack([torch.randperm(seqlen_k // BS, device="cuda")[:n] for _ in range(batch * heads_k)])
    blocks = SparseBlocks(torch.full((batch, heads_k, 1), n, dtype=torch.int32, device="cuda"),
                          idx.int().view(batch, heads_k, 1, n), block_size=BS)
    plan = fas.SparsePlan(q, k, v, blocks, backend=backend)
    out = torch.empty_like(q)
    plan_us = _median_host_us(lambda: plan.run(q, k, v, out=out))
    one_shot_us = _median_host_us(lambda: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend=backend, out=out))
    print(f"\nhost time per call, {backend} ({plan.backend}, {plan.num_splits} splits): plan.run {plan_us:.1f} us, "
          f"one-shot {one_shot_us:.1f} us")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_broadcast_flex_block_mask_runs_like_its_lists_per_batch(backend, needs):
    """A BlockMask made with B=None, H=None (batch and head extents 1) over a batch of 2 equals
    the same lists materialised per batch, and the causal reference."""
    needs(backend)
    from torch.nn.attention.flex_attention import create_block_mask
    seqlen = 1024
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = random_qkv(B, seqlen, seqlen, H, HK, D, torch.bfloat16, generator=g)
    mask = create_block_mask(lambda b, h, i, j: i >= j, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device="cuda")
    blocks = fas.blocks_from_flex_block_mask(mask)
    assert blocks.full_cnt.shape[:2] == (1, 1)
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, blocks, causal=True, backend=backend)
    per_batch = SparseBlocks(*(t.expand(B, *t.shape[1:]).contiguous() for t in
                               (blocks.full_cnt, blocks.full_idx, blocks.mask_cnt, blocks.mask_idx)),
                             block_size=blocks.block_size, q_block_size=blocks.q_block_size)
    ref_out, ref_lse = fas.flash_attn_with_sparse_block_table(q, k, v, per_batch, causal=True, backend=backend)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    visible = torch.ones(seqlen, seqlen, dtype=torch.bool, device="cuda").tril()
    assert_close_to_reference(out, lse, q, k, v, visible)


@pytest.mark.parametrize("form", ["zero copy", "gathered, one launch", "gathered, two passes"])
def test_the_speculative_forms_write_out_in_place(form):
    q, k, v = inputs(12, seqlen_q=16)
    spec_ids, missed_ids = [15, 14], [3, 9, 0]
    spec = torch.tensor(spec_ids, dtype=torch.int32, device="cuda")
    missed = torch.tensor(missed_ids, dtype=torch.int32, device="cuda")
    if form == "zero copy":
        def call(**out):
            return fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec, missed, block_size=BS, causal_spec=False,
                                                               backend="fa2", **out)
    else:
        positions = block_positions(spec_ids, BS, SK).cuda()
        k_spec, v_spec = k[:, positions].contiguous(), v[:, positions].contiguous()
        block_size = BS if form == "gathered, one launch" else 16  # below a kernel tile: the two-pass form

        def call(**out):
            table = missed if block_size == BS else torch.tensor([i * (BS // 16) + j for i in missed_ids
                                                                  for j in range(BS // 16)], dtype=torch.int32,
                                                                 device="cuda")
            return fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table, block_size=block_size,
                                                     causal_spec=False, backend="fa2", **out)
    expected_out, expected_lse = call()
    out = torch.full_like(q, float("nan"))
    result, lse = call(out=out)
    assert result is out and torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert_close_to_reference(out, lse, q, k, v, visible_for(torch.tensor(spec_ids + missed_ids), seqlen_q=16))


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_fa2_one_shot_calls_of_one_shape_keep_their_own_lse_on_any_stream(num_splits):
    """The one-shot cache runs one planned FA-2 forward per shape (SparseForward.run_with) over each
    call's own lists with a new LSE: a second call of the same shape with other lists, on the same
    stream and on another, leaves the first call's out and LSE as they were, and each equals the
    uncached op bitwise."""
    from flash_attn_sparse import calls, interface
    from flash_attn_sparse.backends import fa2
    q, k, v = inputs(21)
    first, second, third = per_kv_head_lists(22), per_kv_head_lists(23), per_kv_head_lists(24)
    interface.one_shot_cache.clear()
    run = lambda blocks: fas.flash_attn_with_sparse_block_table(q, k, v, blocks, backend="fa2", num_splits=num_splits)  # noqa: E731
    results = one_shot_calls_on_two_streams(run, first, second, third)
    assert len(interface.one_shot_cache) == 1
    for blocks, out, lse in results:
        call = calls.SparseCall(q, k, v, blocks, CallOptions(num_splits=num_splits, backend="fa2"))
        ref_out, ref_lse = fa2.run(call, fa2.num_splits(call))
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("num_splits", [1, 4, 8, 0])  # sm_90: 2-4 splits merge in a cluster, 8 through the combine
def test_fa2_graph_launch_runs_bitwise_like_direct_launches(num_splits):
    """SparseForward(graph_launch=True) (flash_api_sparse.h): the first run launches directly, the
    next ones launch the kernels (forward, and the combine of a split call) as one CUDA graph given
    that run's parameters. Every run, and run_with over other lists, equals the direct forward's
    bitwise; a run on a stream being captured launches directly, and its replay equals too."""
    from flash_attn_sparse.backends import fa2, fa2_ops
    q, k, v = inputs(31)
    blocks = per_kv_head_lists(32)
    plan = fas.plan(q, k, v, blocks, backend="fa2", num_splits=num_splits)
    call = calls.SparseCall(q, k, v, blocks, CallOptions(num_splits=num_splits, backend="fa2"))
    args = dict(fa2_ops.extension_args(fa2.op_args(call, plan.num_splits)), q=None, k=None, v=None)
    try:
        graphed = fa2_ops.planned_forward(args, q, k, v, torch.empty_like(q), graph_launch=True)
    except TypeError as error:  # a build before graph_launch
        pytest.skip(f"this flash_attn_2_cuda has no SparseForward graph_launch: {error}")
    direct = fa2_ops.planned_forward(args, q, k, v, torch.empty_like(q))
    other = per_kv_head_lists(33)
    for seed in range(34, 38):
        q_i, k_i, v_i = inputs(seed)
        out_graph, out_direct = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
        lse_graph = graphed.run(q_i, k_i, v_i, out_graph).clone()
        lse_direct = direct.run(q_i, k_i, v_i, out_direct).clone()
        assert torch.equal(out_graph, out_direct) and torch.equal(lse_graph, lse_direct)
        lists = dict(full_cnt=other.full_cnt, full_idx=other.full_idx, mask_cnt=None, mask_idx=None, cu_seqlens_q=None,
                     cu_seqlens_k=None, seqused_k=None, page_table=None, cu_total_m_blocks=None, cu_block_idx_offsets=None)
        lse_graph = graphed.run_with(q=q_i, k=k_i, v=v_i, out=out_graph, **lists)
        lse_direct = direct.run_with(q=q_i, k=k_i, v=v_i, out=out_direct, **lists)
        assert torch.equal(out_graph, out_direct) and torch.equal(lse_graph, lse_direct)
    visible = torch.zeros(B, H, SQ, SK, dtype=torch.bool, device="cuda")
    for b in range(B):
        for h in range(H):
            row = other.full_idx[b, h // (H // HK), 0, :int(other.full_cnt[b, h // (H // HK), 0])].tolist()
            visible[b, h, :, block_positions(row, BS, SK).cuda()] = True
    assert_close_to_reference(out_graph, lse_graph, q_i, k_i, v_i, visible)
    assert_captured_run_equals_direct(graphed, direct, q, k, v)
