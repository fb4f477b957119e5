"""What the backends share: the device's SM count (cached), the split limit, and the one-shot
launcher's use of an extension's planned forward (fa2 and fa3 alike)."""

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
