"""bench_sparse.py's causal 128-key peer on the CPU, FA-3's varlen call replaced by a float64
reference: packing each query tile as a sequence over its own listed keys (diagonal last,
bottom-right causal) must give exactly the sparse call's attention, per K/V head and batch."""

import random
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_sparse  # noqa: E402
from flash_attn_sparse.reference import attention_ref, visibility_from_lists  # noqa: E402

BLOCK = 16


def varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    assert causal
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[i]:cu_q[i + 1]][None], k[cu_k[i]:cu_k[i + 1]][None], v[cu_k[i]:cu_k[i + 1]][None]
        assert qs.shape[1] <= max_q and ks.shape[1] <= max_k
        visible = torch.arange(ks.shape[1])[None, :] <= torch.arange(qs.shape[1])[:, None] + ks.shape[1] - qs.shape[1]
        outs.append(attention_ref(qs, ks, vs, visible)[0][0])
    return torch.cat(outs)


def test_causal_tiles_peer_attends_to_exactly_the_listed_keys(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_varlen_func=varlen_reference))
    monkeypatch.setattr(bench_sparse, "BLOCK", BLOCK)
    batch, tiles, heads = 2, 6, 2
    shape = bench_sparse.Shape("test causal", batch, tiles * BLOCK, tiles * BLOCK, heads, heads, 0.5, causal=True)
    full, mask = lists = bench_sparse.make_causal_lists(shape, random.Random(1))
    assert full[0][0] != full[0][1]  # the heads' lists differ, so a head mix-up shows
    q, k, v = (torch.randn(batch, tiles * BLOCK, heads, 16, dtype=torch.float64) for _ in range(3))
    forward = bench_sparse.fa3_dense_causal_tiles(q, k, v, lists)
    assert not isinstance(forward, str), forward
    out = forward()
    order = [(b, m) for m in reversed(range(tiles)) for b in range(batch)]  # longest tiles first
    for b in range(batch):
        visible = visibility_from_lists(full[b], mask[b], BLOCK, BLOCK, tiles * BLOCK, tiles * BLOCK, heads, True)
        expected = attention_ref(q[b:b + 1], k[b:b + 1], v[b:b + 1], visible[None])[0][0]
        for i, (tile_batch, m) in enumerate(order):
            if tile_batch == b:
                torch.testing.assert_close(out[i * BLOCK:(i + 1) * BLOCK], expected[m * BLOCK:(m + 1) * BLOCK],
                                           atol=1e-12, rtol=0)
