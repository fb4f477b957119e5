"""benchmarks/host_time.py's table on the CPU: passes merge into medians with the one-shot's range,
refused rows pass through, and the fa2-direct and fa3-direct rows switch device.GRAPH_LAUNCH off for
their own measurement only (the GPU parts are faked)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import host_time  # noqa: E402
from flash_attn_sparse import interface  # noqa: E402
from flash_attn_sparse.backends import device  # noqa: E402


def row(plan_us: float, one_shot_us: float, launch_us: float) -> dict:
    return {"shape": "decode B1", "backend": "fa2", "splits": 32, "plan_run_after_sync_us": plan_us,
            "plan_run_back_to_back_us": plan_us, "one_shot_after_sync_us": one_shot_us,
            "one_shot_back_to_back_us": one_shot_us, "copy_after_sync_us": 6.0, "eager_ms": 0.018, "graph_ms": 0.012,
            "launches": [{"name": "SparseForward.run", "after_sync_us": launch_us, "back_to_back_us": launch_us}],
            "checks_us": 2.0, "runtime_calls": "cudaLaunchKernel x1 8.0"}


def test_passes_merge_into_medians_with_the_one_shot_range():
    merged = host_time.median_of_passes([row(15.0, 40.0, 12.0), row(11.0, 52.0, 9.0), row(13.0, 36.0, 30.0)])
    assert merged["plan_run_back_to_back_us"] == 13.0 and merged["one_shot_back_to_back_us"] == 40.0
    assert merged["launches"][0]["back_to_back_us"] == 12.0 and merged["passes"] == 3
    assert merged["one_shot_back_to_back_range_us"] == (36.0, 52.0)
    refused = {"shape": "decode B1", "backend": "fa4", "note": "refused: flash-attn-4 is not importable"}
    table = host_time.markdown([merged, host_time.median_of_passes([refused])], (6.0, 5.9), 0.03)
    assert "medians of 3 passes" in table and "40.0 (36.0-52.0)" in table and "refused: flash-attn-4" in table


@pytest.mark.parametrize("direct_row, plain", [("fa2-direct", "fa2"), ("fa3-direct", "fa3")])
def test_a_direct_row_turns_graph_launch_off_for_itself_only(monkeypatch, direct_row, plain):
    seen = []
    real_measure = host_time.measure

    def fake_measure(shape, backend):
        if backend == direct_row:
            return real_measure(shape, backend)
        seen.append((backend, device.GRAPH_LAUNCH))
        return row(10.0, 30.0, 8.0)

    monkeypatch.setattr(host_time, "measure", fake_measure)
    interface.one_shot_cache[("stale",)] = None
    shape = type("Shape", (), {"name": "decode B1"})()
    result = host_time.measure(shape, direct_row)
    # The one-shot cache emptied before and after: its entries planned without graph_launch.
    assert seen == [(plain, False)] and result["backend"] == direct_row and not interface.one_shot_cache
    assert device.GRAPH_LAUNCH is True
