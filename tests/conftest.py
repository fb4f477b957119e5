"""Test setup: which flash_attn_sparse is tested, and why GPU tests skip."""

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Test the installed wheel's package when there is one; else the source tree's (pure Python).
if importlib.util.find_spec("flash_attn_sparse") is None:
    sys.path.insert(0, str(ROOT / "python"))


@lru_cache(maxsize=None)
def gpu_skip_reason():
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        import flash_attn_2_cuda
    except ImportError as error:
        return f"the patched flash_attn wheel is not installed ({error}); build it with `nox -s build`"
    if not hasattr(flash_attn_2_cuda, "sparse_fwd"):
        return "the installed flash_attn_2_cuda is upstream's, not the patched build"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords or "sm90" in item.keywords:
            reason = gpu_skip_reason()
            if reason is None and "sm90" in item.keywords:
                import torch
                if torch.cuda.get_device_capability() != (9, 0):
                    reason = "needs an sm_90 (Hopper) GPU"
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


# Modules that test auto's routing themselves (its results, or a rule over every backend).
MODULES_THAT_ROUTE_AWAY_FROM_FA2 = {"test_stage4_fa4", "test_nan_propagation_gpu", "test_plan_gpu", "test_fa4_patched_marker",
                                    "test_contract_every_backend_gpu", "test_auto_routing", "test_contract_gqa_gpu"}


@pytest.fixture(autouse=True)
def auto_stays_on_fa2(request, monkeypatch):
    """Outside the modules above backend="auto" takes FA-2, so that the tests of the FA-2 kernels
    test them on a machine with the FA-3 build too, where auto sends prefill-shaped and packed
    GQA decode calls to FA-3 (test_auto_routing.py tests that rule). backend="fa3" requested stays
    available."""
    from flash_attn_sparse import interface, routing
    interface.one_shot_cache.clear()  # the one-shot cache would carry one test's routing into the next
    if request.module.__name__ not in MODULES_THAT_ROUTE_AWAY_FROM_FA2:
        monkeypatch.setattr(routing, "fa3_reason", lambda call: None)
