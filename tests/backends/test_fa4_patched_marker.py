"""Only flash-attn-4 with this series' stage-4 patches may serve backend="fa4".

CPU: the marker module patches/flash-attn-4/0008 adds is in the patched tree and not in the
pristine sdist; the FA-2 wheel's [hopper] extra pins the patched wheel's local label when built
through forktools (and does not exist otherwise); missing_runtime() names how to install the
patched wheel when the importable flash_attn.cute lacks the marker or carries another series.
GPU (SM90 with the patched flash-attn-4): a fake pristine flash_attn.cute makes backend="fa4"
refuse with that reason and auto take FA-2.
"""

import ast
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import flash_attn_sparse as fas
from flash_attn_sparse import SparseInputError
from flash_attn_sparse.backends import cute, fa3_ops

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "python"))  # for forktools; appended, so an installed flash_attn_sparse still wins

from forktools import build, series, wheel_fa4  # noqa: E402
from forktools.layout import Layout  # noqa: E402

CACHE = REPO / ".cache" / "upstream"
FA4_SDIST = CACHE / "flash_attn_4-4.0.0b36.tar.gz"
FA2_SDIST = CACHE / "flash_attn-2.8.3.post2.tar.gz"
needs_sdists = pytest.mark.skipif(not (FA4_SDIST.exists() and FA2_SDIST.exists()),
                                  reason="upstream sdists absent (run `nox -s upstream`)")


@pytest.fixture
def layout(tmp_path) -> Layout:
    return Layout.at(REPO).with_trees(tmp_path / "trees")


@pytest.fixture
def fresh_runtime_check():
    cute.missing_runtime.cache_clear()
    yield
    cute.missing_runtime.cache_clear()


@needs_sdists
def test_marker_in_the_patched_tree_only(layout, tmp_path):
    series.materialize(layout, "flash-attn-4", tmp_path / "cute")
    namespace = {}
    exec((tmp_path / "cute" / "sparse_series.py").read_text(), namespace)
    assert namespace["SERIES"] == cute.EXPECTED_SERIES
    with tarfile.open(FA4_SDIST) as sdist:
        assert not [name for name in sdist.getnames() if name.endswith("sparse_series.py")]


def _hopper_extra(setup_py: Path, environ: dict) -> dict:
    """The value setup.py passes as extras_require, evaluated under `environ`."""
    call = next(node for node in ast.walk(ast.parse(setup_py.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    value = next(keyword.value for keyword in call.keywords if keyword.arg == "extras_require")
    fake_os = types.SimpleNamespace(environ=environ)
    return eval(compile(ast.Expression(value), str(setup_py), "eval"), {"os": fake_os})


@needs_sdists
def test_hopper_extra_pins_the_patched_wheel_only(layout, tmp_path):
    series.materialize(layout, "flash-attn", tmp_path / "fa2")
    env = build.build_env(layout, "dev", ["90"], "sparse.x.dev")
    label = wheel_fa4.label(layout)
    assert env["FLASH_ATTN_SPARSE_FA4_LABEL"] == label
    (requirement,) = _hopper_extra(tmp_path / "fa2" / "setup.py", env)["hopper"]
    requirement = Requirement(requirement)
    assert requirement.name == "flash-attn-4"
    assert requirement.specifier.contains(f"4.0.0b36+{label}", prereleases=True)
    assert not requirement.specifier.contains("4.0.0b36", prereleases=True)  # the unpatched release
    assert not requirement.specifier.contains("4.0.0b36+sparse.0000000000", prereleases=True)
    assert _hopper_extra(tmp_path / "fa2" / "setup.py", {}) == {}  # built elsewhere: no extra


class _Stub(types.ModuleType):
    pass


def _fake_cute(monkeypatch, series_value=None):
    """flash_attn.cute as the unpatched release (no marker) or with a marker of `series_value`."""
    def import_cute(module):
        if module == "interface":
            return _Stub("flash_attn.cute.interface")
        if module == "sparse_series" and series_value is not None:
            marker = _Stub("flash_attn.cute.sparse_series")
            marker.SERIES = series_value
            return marker
        raise ModuleNotFoundError(f"No module named 'flash_attn.cute.{module}'")
    monkeypatch.setattr(cute, "import_cute", import_cute)


def test_pristine_flash_attn_4_is_refused_with_how_to_install(monkeypatch, fresh_runtime_check):
    _fake_cute(monkeypatch)
    reason = cute.missing_runtime()
    assert reason is not None and "stage-4 patches" in reason
    assert "nox -s build" in reason and "flash_attn_4-4.0.0b36+sparse." in reason


def test_another_series_is_refused(monkeypatch, fresh_runtime_check):
    _fake_cute(monkeypatch, "flash-attn-sparse stage 4, format 0")
    reason = cute.missing_runtime()
    assert reason is not None and "format 0" in reason and "nox -s build" in reason


def test_patched_flash_attn_4_passes(monkeypatch, fresh_runtime_check):
    _fake_cute(monkeypatch, cute.EXPECTED_SERIES)
    assert cute.missing_runtime() is None


@pytest.mark.gpu
@pytest.mark.sm90
def test_fa4_refuses_and_auto_routes_around_pristine_flash_attn_4(monkeypatch, fresh_runtime_check):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    _fake_cute(monkeypatch)
    q = torch.randn(1, 256, 4, 128, dtype=torch.bfloat16, device="cuda")
    k = v = torch.randn(1, 1024, 4, 128, dtype=torch.bfloat16, device="cuda")
    blocks = torch.arange(8, dtype=torch.int32, device="cuda")
    with pytest.raises(SparseInputError, match="nox -s build"):
        fas.flash_attn_with_sparse_block_table(q, k, v, blocks, block_size=128, backend="fa4")
    # A prefill-shaped call (256 query rows): FA-3 where its wheel is installed, else FA-2; never FA-4.
    expected = "fa2" if fa3_ops.missing_build() else "fa3"
    assert fas.choose_backend(q, k, v, blocks, block_size=128)[0] == expected
