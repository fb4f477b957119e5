"""bench_gqa.py on the CPU: the head-major layout keeps values and the cache's strides, the
summary groups points by list kind and K/V layout, and a ratio is the median of the passes'."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import bench_gqa  # noqa: E402


def test_the_peer_copy_in_head_major_layout_has_the_caches_values_and_strides():
    cache = torch.randn(2, 4, 16, 8).transpose(1, 2)  # head-major memory, (batch, seqlen_k, heads_k, dim) view
    copy = bench_gqa.in_layout(cache.contiguous(), "hnd")
    assert torch.equal(copy, cache) and copy.stride() == cache.stride()
    key_major = torch.randn(2, 16, 4, 8)
    assert bench_gqa.in_layout(key_major, "nhd") is key_major


def point(lists="per-kv-head", layout="nhd", fa3=(10.0, 10.4), dense=(10.0, 10.0)):
    p = bench_gqa.Point(1, 1, 4, 32768, 0.125, lists, layout, auto_backend="fa3")
    p.graph_us = {"fa3": list(fa3), "dense_fa3_listed": list(dense)}
    return p


def test_a_ratio_is_the_median_of_the_passes_and_a_missing_side_gives_none():
    median, passes = bench_gqa.ratio(point(fa3=(10.0, 10.4)), "fa3")
    assert passes == [1.0, 1.04] and abs(median - 1.02) < 1e-12
    assert bench_gqa.ratio(point(), "fa2") is None


def test_the_summary_has_a_row_per_list_kind_and_layout():
    points = [point(), point("shared"), point(layout="hnd", fa3=(9.0, 9.0))]
    assert [p.name.split("0.125")[1] for p in points] == ["", " shared", " HND"]
    rows = [line for line in bench_gqa.markdown(points, "cpu", "x").splitlines() if line.startswith("| ") and " | 4 | 1 | " in line]
    assert [row.split(" | ")[0] for row in rows] == ["| per-kv-head", "| shared", "| per-kv-head, HND"]
    assert "| 0.900 / 0.900 |" in rows[2]  # fa3 over its dense peer, median / worst
