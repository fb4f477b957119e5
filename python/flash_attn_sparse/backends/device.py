"""What the backends share: the device's SM count (cached), the split limit, the one-shot
launcher's use of an extension's planned forward and the planned forwards' graph launch (fa2
and fa3 alike)."""

import torch

MAX_SPLITS = 128  # slots of the combine kernels (flash_sparse_combine.h and flash-attn-4's)

_SM_COUNTS = {}


@torch.compiler.assume_constant_result
def num_sms(device_index: int) -> int:
    if device_index not in _SM_COUNTS:
        _SM_COUNTS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _SM_COUNTS[device_index]


def for_run_with(planned):
    """An extension's SparseForward for the one-shot launcher: run's buffers dropped (run_with
    takes its LSE and split partials per call, so the cache entry holds none), or None where
    there is none or the build predates run_with."""
    if planned is None or not hasattr(planned, "run_with"):
        return None
    planned.release_run_buffers()
    return planned


# The extensions' SparseForward graph_launch (flash_api_sparse.cpp, FA-2 and FA-3): after its first
# run a planned forward launches its kernels as one CUDA graph given each run's parameters instead
# of one runtime launch per kernel, for plans and one-shot calls (a split call's plan.run
# 11.7-13.6 -> 6.2-9.7 us of host time, one-shot 34-37 -> 28-33 us, same run).
# benchmarks/host_time.py turns it off for its fa2-direct and fa3-direct rows.
GRAPH_LAUNCH = True


def graph_launch_option(planner, graph_launch=None) -> dict:
    """SparseForward's keyword for graph_launch, asked for by name when graph_launch is true, or
    when it is None, GRAPH_LAUNCH is on and this build's planner takes it (its pybind11 signature
    says so: a build before graph_launch plans as ever)."""
    if graph_launch is None:
        graph_launch = GRAPH_LAUNCH and "graph_launch" in (getattr(planner.__init__, "__doc__", None) or "")
    return {"graph_launch": True} if graph_launch else {}
