"""pytest plugin (-p collect_stubs) for collecting upstream's tests on a machine without a GPU or
flash_attn: stand-in modules for its imports and an sm_90 device capability. Collection only."""

import sys
import types

import torch


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


for _name in ("flash_attn", "flash_attn.bert_padding", "flash_attn.flash_attn_interface", "flash_attn.layers",
              "flash_attn.layers.rotary"):
    sys.modules[_name] = _Stub(_name)
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
