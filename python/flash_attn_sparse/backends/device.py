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
# of one runtime launch per kernel. For plans and the one-shot launcher; an experiment of sessions
# 25-26, off until measured (benchmarks/host_time.py turns it on for its fa2-graph and fa3-graph rows).
GRAPH_LAUNCH = False


def graph_launch_option(graph_launch=None) -> dict:
    """SparseForward's keyword for graph_launch (None: GRAPH_LAUNCH), given only when true, so a
    build before it plans as ever."""
    return {"graph_launch": True} if (GRAPH_LAUNCH if graph_launch is None else graph_launch) else {}
