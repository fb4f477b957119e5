"""Context-parallel sparse attention on the GPU.

One GPU: every shard's partial computed on the one device by the package's kernels and merged
by the code that merges gathered partials (flash_attn_combine), against the fp64 oracle under
FlashAttention's tolerance and against the unsharded kernel call; the per-shard path captured
in a CUDA graph. Two or more GPUs (NCCL): run under
`torchrun --nproc-per-node 2 -m pytest tests/api/test_distributed_gpu.py -k nccl`; each rank's
result must equal the one-GPU emulation bit for bit and the oracle under the tolerance.
"""

import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distributed_cases import Case, build, oracle, shard_arguments
from flash_attn_sparse import flash_attn_varlen_with_sparse_blocks, flash_attn_with_sparse_block_table
from flash_attn_sparse.distributed import (
    combine_partials,
    head_dim_padded,
    local_attention,
    pack_partial,
    sharded_sparse_attention,
    unpack_partials,
)
from helpers import LSE_TOLERANCE, max_err, poison_allocator

pytestmark = pytest.mark.gpu

GPU_CASES = [
    Case("decode-kv", 4, [1], [8192], heads=8, heads_k=2, head_dim=128, block_size=128, causal=True, seed=21),
    Case("decode-b2-shared", 2, [1, 1], [3000, 3000], heads=8, heads_k=2, head_dim=64, block_size=64,
         table_heads="shared", causal=True, seed=22),
    Case("decode-q-empty", 3, [1], [4096], heads=4, heads_k=4, head_dim=128, block_size=128, table_heads="q",
         causal=True, empty_shard=1, seed=23),
    Case("prefill-causal-tiles", 3, [300], [1024], heads=4, heads_k=2, head_dim=64, block_size=64, q_block_size=128,
         causal=True, seed=24),
    Case("prefill-causal-one-tile", 2, [100], [700], heads=4, heads_k=1, head_dim=128, block_size=128, causal=True,
         seed=25),
    Case("paged-decode", 2, [2, 2], [2048, 2048], heads=8, heads_k=2, head_dim=128, block_size=64, paged=True,
         causal=True, seed=26),
    Case("varlen", 3, [1, 130, 5], [1500, 900, 2100], heads=4, heads_k=2, head_dim=64, block_size=64, varlen=True,
         q_block_size=64, seed=27),
]


def emulated(case, q, k, v, blocks):
    """Every shard on this GPU, merged by the merge path of sharded_sparse_attention."""
    padded = head_dim_padded(case.head_dim, q.device)
    flats = []
    for rank in range(case.world):
        args, kwargs = shard_arguments(case, rank, q, k, v, blocks)
        out, lse = local_attention(*args, **kwargs)
        flats.append(pack_partial(out, lse, padded, case.varlen))
    batch, seqlen_q = (1, q.shape[0]) if case.varlen else q.shape[:2]
    parts = unpack_partials(torch.cat(flats), case.world, batch, case.heads, seqlen_q, padded)
    out, lse = combine_partials(*parts, q.dtype, case.head_dim)
    return (out[0], lse[0]) if case.varlen else (out, lse)


def unsharded(case, q, k, v, blocks):
    if case.varlen:
        cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=q.device)
        return flash_attn_varlen_with_sparse_blocks(q, k, v, blocks, cu_seqlens_q=cu(case.seqlens_q),
                                                    cu_seqlens_k=cu(case.seqlens_k), max_seqlen_q=max(case.seqlens_q),
                                                    max_seqlen_k=max(case.seqlens_k), causal=case.causal)
    return flash_attn_with_sparse_block_table(q, k, v, blocks, causal=case.causal)


def assert_within_tolerance(case, out, lse, q, k, v, full, mask):
    """FlashAttention's convention: error vs the fp64 oracle <= 2x the input dtype's error + 1e-5."""
    want_out, want_lse = oracle(case, q, k, v, full, mask)
    low_out, _ = oracle(case, q, k, v, full, mask, dtype=q.dtype)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{case.name}: NaN (unwritten output)"
    err, low_err = max_err(out, want_out), max_err(low_out, want_out)
    assert err <= 2 * low_err + 1e-5, f"{case.name}: output error {err:.3e} > 2 x {low_err:.3e} + 1e-5"
    assert max_err(lse, want_lse) <= LSE_TOLERANCE, f"{case.name}: LSE error {max_err(lse, want_lse):.3e}"
    return err


def gpu_inputs(case):
    return build(case, dtype=torch.bfloat16, device="cuda")


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_emulated_shards_match_unsharded(case):
    q, k, v, full, mask, blocks = gpu_inputs(case)
    numel = q.numel() * 4 * case.world
    poison_allocator(((numel,), torch.float32), ((q.numel(),), q.dtype))
    out, lse = emulated(case, q, k, v, blocks)
    assert_within_tolerance(case, out, lse, q, k, v, full, mask)
    whole_out, whole_lse = unsharded(case, q, k, v, blocks)
    assert_within_tolerance(case, whole_out, whole_lse, q, k, v, full, mask)


def test_shard_forward_captures_in_a_cuda_graph():
    """List splitting and the shard's forward launch without a host sync: they capture, and a
    replay over new queries gives the eager answer."""
    case = GPU_CASES[0]
    q, k, v, _, _, blocks = gpu_inputs(case)
    args, kwargs = shard_arguments(case, 1, q, k, v, blocks)
    static_q = q.clone()
    run = lambda: local_attention(static_q, *args[1:], **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: ramps, kernels loaded
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    fresh = torch.randn_like(q)
    static_q.copy_(fresh)
    graph.replay()
    want_out, want_lse = local_attention(fresh, *args[1:], **kwargs)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.fixture
def one_rank_nccl_group():
    """A default NCCL group of this process alone (the one-GPU machine): the collective path and
    its capture, with the all-gather a copy."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        pytest.skip("a torchrun group of several ranks is running (the nccl tests cover it)")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("merge", ["all_gather", "owner"])
def test_one_rank_group_equals_unsharded(one_rank_nccl_group, merge):
    case = dataclasses.replace(GPU_CASES[3], world=1, boundaries=[])
    q, k, v, full, mask, blocks = gpu_inputs(case)
    args, kwargs = shard_arguments(case, 0, q, k, v, blocks)
    out, lse = sharded_sparse_attention(*args, group=one_rank_nccl_group, merge=merge, **kwargs)
    assert_within_tolerance(case, out, lse, q, k, v, full, mask)


def test_one_rank_group_captures_in_a_cuda_graph(one_rank_nccl_group):
    _check_graph_replay(dataclasses.replace(GPU_CASES[0], world=1, boundaries=[]), 0, one_rank_nccl_group)


def _nccl_world():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        return "needs torchrun with 2+ ranks: torchrun --nproc-per-node 2 -m pytest tests/api/test_distributed_gpu.py -k nccl"
    if torch.cuda.device_count() < world:
        return f"needs {world} GPUs, found {torch.cuda.device_count()}"
    return None


@pytest.fixture(scope="module")
def nccl_group():
    if reason := _nccl_world():
        pytest.skip(reason)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=timedelta(seconds=120))
    yield dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("merge", ["all_gather", "owner"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_nccl_equals_one_gpu(nccl_group, case, merge):
    world, rank = dist.get_world_size(), dist.get_rank()
    case = dataclasses.replace(case, world=world)
    q, k, v, full, mask, blocks = gpu_inputs(case)  # the same seed on every rank: q replicated
    args, kwargs = shard_arguments(case, rank, q, k, v, blocks)
    out, lse = sharded_sparse_attention(*args, group=nccl_group, merge=merge, owner=world - 1, **kwargs)
    if merge == "owner" and rank != world - 1:
        assert out is None and lse is None
        return
    want_out, want_lse = emulated(case, q, k, v, blocks)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"{case.name}: NCCL result differs from one GPU"
    assert_within_tolerance(case, out, lse, q, k, v, full, mask)


def test_nccl_all_gather_captures_in_a_cuda_graph(nccl_group):
    world, rank = dist.get_world_size(), dist.get_rank()
    _check_graph_replay(dataclasses.replace(GPU_CASES[0], world=world, boundaries=[]), rank, nccl_group)


def _check_graph_replay(case, rank, group):
    """The sharded call (split, forward, all-gather, combine) captured once and replayed over new
    queries gives the eager answer."""
    q, k, v, _, _, blocks = gpu_inputs(case)
    args, kwargs = shard_arguments(case, rank, q, k, v, blocks)
    static_q = q.clone()
    run = lambda: sharded_sparse_attention(static_q, *args[1:], group=group, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(q)  # the same on every rank
    static_q.copy_(fresh)
    graph.replay()
    want_out, want_lse = sharded_sparse_attention(fresh, *args[1:], group=group, **kwargs)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
