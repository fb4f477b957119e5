"""What the backends ask of the device, cached: its SM count; and the split limit they share."""

import torch

MAX_SPLITS = 128  # slots of the combine kernels (flash_sparse_combine.h and flash-attn-4's)

_SM_COUNTS = {}


@torch.compiler.assume_constant_result
def num_sms(device_index: int) -> int:
    if device_index not in _SM_COUNTS:
        _SM_COUNTS[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return _SM_COUNTS[device_index]
