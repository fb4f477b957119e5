"""Stage 5 (CPU): the cached int32 ramp behind shared-list counts and speculative block ids.

Inside a CUDA graph capture each fresh `arange` would be a graph node of its own (a few us per
replay at decode sizes), so a view of the ramp made before the capture is used instead. The
capture state and the device are faked, so this runs without a GPU."""

import pytest
import torch

from flash_attn_sparse import metadata

pytestmark = pytest.mark.stage5

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CPU tensor stands in for device 0's ramp; arange calls are recorded."""
    ramp = torch.arange(4096, dtype=torch.int32)
    monkeypatch.setitem(metadata._RAMPS, CUDA0, ramp)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    aranges = []
    real_arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: aranges.append((a, k)) or real_arange(*a, **{**k, "device": "cpu"}))
    return ramp, aranges


@pytest.mark.parametrize("capturing", [False, True])
def test_a_long_enough_ramp_is_viewed_also_while_capturing(fake_cuda, monkeypatch, capturing):
    ramp, aranges = fake_cuda
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    ids = metadata.int_range(5, 9, "cuda")
    assert ids.tolist() == [5, 6, 7, 8]
    assert ids.untyped_storage().data_ptr() == ramp.untyped_storage().data_ptr() and not aranges


def test_a_ramp_too_short_while_capturing_gives_a_fresh_range(fake_cuda, monkeypatch):
    ramp, aranges = fake_cuda
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    ids = metadata.int_range(4094, 4100, "cuda:0")
    assert ids.tolist() == list(range(4094, 4100))
    assert len(aranges) == 1 and metadata._RAMPS[CUDA0] is ramp  # not grown: that would synchronise
