"""benchmarks/host_time.py's table on the CPU: passes merge into medians with the one-shot's range,
refused rows pass through, and the fa2-graph and fa3-graph rows switch device.GRAPH_LAUNCH on for
their own measurement only (the GPU parts are faked)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
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
    refused = {"shape": "decode B1", "backend": "fa2-graph", "note": "refused: this build has no graph_launch"}
    table = host_time.markdown([merged, host_time.median_of_passes([refused])], (6.0, 5.9), 0.03)
    assert "medians of 3 passes" in table and "40.0 (36.0-52.0)" in table and "refused: this build" in table


@pytest.mark.parametrize("built", [True, False])
@pytest.mark.parametrize("graph_row, plain", [("fa2-graph", "fa2"), ("fa3-graph", "fa3")])
def test_a_graph_row_turns_graph_launch_on_for_itself_only(monkeypatch, built, graph_row, plain):
    seen = []
    real_measure = host_time.measure

    def fake_measure(shape, backend):
        if backend == graph_row:
            return real_measure(shape, backend)
        seen.append((backend, device.GRAPH_LAUNCH))
        return row(10.0, 30.0, 8.0)

    monkeypatch.setattr(host_time, "measure", fake_measure)
    monkeypatch.setattr(host_time, "graph_launch_built", lambda backend: built and backend == plain)
    interface._decisions[("stale",)] = None
    shape = type("Shape", (), {"name": "decode B1"})()
    result = host_time.measure(shape, graph_row)
    assert device.GRAPH_LAUNCH is False
    if built:  # the one-shot cache emptied before and after: its entries planned with graph_launch
        assert seen == [(plain, True)] and result["backend"] == graph_row and not interface._decisions
    else:
        assert seen == [] and result["note"].startswith("refused")
    interface._decisions.clear()
