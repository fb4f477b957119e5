"""Reliability on the GPU: CUDA-graph capture and replay, bitwise determinism, 64-bit offsets
on a 1M-key sequence."""

import random

import pytest
import torch

import flash_attn_sparse as fas
from flash_attn_sparse import SparseBlocks
from flash_attn_sparse.reference import attention_over_blocks
from helpers import max_err, random_qkv

pytestmark = pytest.mark.gpu


def test_cuda_graph_capture_and_replay_with_new_inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = random_qkv(4, 16, 8192, 32, 8, 128, torch.bfloat16, generator=g)
    table = torch.tensor([60, 3, 17, 40], dtype=torch.int32, device="cuda")
    spec = torch.tensor([61, 62, 63], dtype=torch.int32, device="cuda")
    k_spec, v_spec = k[:, -384:].contiguous(), v[:, -384:].contiguous()

    def step():
        out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, table)
        spec_out, spec_lse = fas.flash_attn_speculative_sparse(q, k_spec, v_spec, k, v, table)
        zero_out, zero_lse = fas.flash_attn_speculative_sparse_zero_copy(q, k, v, spec, table)
        return out, lse, spec_out, spec_lse, zero_out, zero_lse

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        g.manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        k_spec.copy_(k[:, -384:])
        v_spec.copy_(v[:, -384:])
        table.copy_(torch.tensor(random.Random(seed).sample(range(60), 4), dtype=torch.int32))
        graph.replay()
        eager = step()
        for got, want in zip(captured, eager):
            assert max_err(got, want) == 0.0


@pytest.mark.parametrize("num_splits", [1, 8])
def test_bitwise_deterministic(num_splits):
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = random_qkv(2, 16, 16384, 32, 8, 128, torch.bfloat16, generator=g)
    lists = [[[random.Random(b * 8 + h).sample(range(128), 20)] for h in range(8)] for b in range(2)]
    blocks = SparseBlocks.from_lists(lists, device="cuda")
    runs = [fas.flash_attn_with_sparse_block_table(q, k, v, blocks, num_splits=num_splits) for _ in range(3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


@pytest.mark.parametrize("num_splits", [1, 16])
def test_one_million_keys(num_splits):
    """seqlen_k = 2^20 with 8 K/V heads: key offsets pass 2^31 bytes, so they must be 64-bit."""
    g = torch.Generator(device="cuda").manual_seed(4)
    seqlen_k, block_size = 1 << 20, 128
    q, k, v = random_qkv(1, 4, seqlen_k, 8, 8, 128, torch.bfloat16, generator=g)
    n_blocks = seqlen_k // block_size
    blocks = [n_blocks - 1, 0, n_blocks // 2, n_blocks - 7, 4321, 8000]
    table = torch.tensor(blocks, dtype=torch.int32, device="cuda")
    out, lse = fas.flash_attn_with_sparse_block_table(q, k, v, table, num_splits=num_splits)
    ref_out, ref_lse = attention_over_blocks(q, k, v, blocks, block_size, dtype=torch.float32)
    low_out, _ = attention_over_blocks(q, k, v, blocks, block_size, dtype=torch.bfloat16)
    assert max_err(out, ref_out) <= 2 * max_err(low_out, ref_out) + 1e-5
    assert max_err(lse, ref_lse) <= 1e-3
