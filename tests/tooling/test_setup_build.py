"""The set-up command's order and failure behaviour: wheels are installed together only once every
one of them is built, a failed compile stops the other one (its whole process group), and
`nox -s build test` stops at a failed build with a non-zero exit and a last line that says why."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from forktools import ToolError, build, github, sources, toolchain, upstream, wheelbuild
from forktools.layout import Layout

pytestmark = pytest.mark.tooling
REPO = Path(__file__).resolve().parents[2]
TOOLS = toolchain.Toolchain(Path("/opt/cuda"), (13, 0), "2.14.1+cu130", "c++20")


class FakeFa3Build:
    """build_fa3.Background's interface: result() gives the wheel or raises; cancel() is recorded."""

    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    def result(self) -> Path:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """build.build with its toolchain check, wheel writers and installer faked; returns what it saw."""
    seen = {"installed": [], "fa3": None}
    monkeypatch.setattr(build.toolchain, "check", lambda: TOOLS)
    monkeypatch.setattr(build.wheel_fa4, "build", lambda layout: tmp_path / "flash_attn_4.whl")
    monkeypatch.setattr(build, "install_wheels", seen["installed"].append)

    def fa3_outcome(outcome):
        def background(*args):
            seen["fa3"] = FakeFa3Build(outcome)
            return seen["fa3"]
        monkeypatch.setattr(build.build_fa3, "Background", background)
    seen["fa3_outcome"] = fa3_outcome
    return seen


def test_wheels_are_installed_together_once_every_one_is_built(faked, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_compile", lambda *args: tmp_path / "flash_attn.whl")
    faked["fa3_outcome"](tmp_path / "flash_attn_3.whl")
    assert build.build(Layout.at(REPO), archs=["90"], install=True) == tmp_path / "flash_attn.whl"
    assert faked["installed"] == [[tmp_path / "flash_attn_4.whl", tmp_path / "flash_attn.whl", tmp_path / "flash_attn_3.whl"]]


def test_nothing_is_installed_when_the_fa3_build_fails(faked, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "_compile", lambda *args: tmp_path / "flash_attn.whl")
    faked["fa3_outcome"](ToolError("the FA-3 build failed after 9 s (exit 1); see build/logs/build-fa3-dev.log"))
    with pytest.raises(ToolError, match="the FA-3 build failed"):
        build.build(Layout.at(REPO), archs=["90"], install=True)
    assert faked["installed"] == []


def test_a_failed_fa2_compile_cancels_the_fa3_one_and_installs_nothing(faked, monkeypatch, tmp_path):
    def failing(*args):
        raise ToolError("the build failed after 5 s (exit 1); see build/logs/build-dev.log")
    monkeypatch.setattr(build, "_compile", failing)
    faked["fa3_outcome"](tmp_path / "flash_attn_3.whl")
    with pytest.raises(ToolError, match="the build failed after 5 s"):
        build.build(Layout.at(REPO), archs=["90"], install=True)
    assert faked["fa3"].cancelled and faked["installed"] == []


def test_stopping_a_build_stops_every_process_it_started(tmp_path):
    """A compile is pip -> setup.py -> ninja -> nvcc: stop() ends the whole process group."""
    grandchild = tmp_path / "grandchild.pid"
    script = f"sleep 120 & echo $! > {grandchild}; echo started; wait"
    processes = []
    runner = threading.Thread(target=wheelbuild.run_with_progress,
                              args=(["sh", "-c", script], tmp_path, dict(os.environ), tmp_path / "log"),
                              kwargs={"on_start": processes.append}, daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while not (grandchild.exists() and grandchild.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    wheelbuild.stop(processes[0])
    runner.join(timeout=30)
    assert not runner.is_alive()
    pid = int(grandchild.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


def _cache_is_complete() -> bool:
    layout = Layout.at(REPO)
    names = [pin.sdist for pin in upstream.load_pins(layout.lock) if not pin.composed]
    names += [pin.archive for pin in github.load(layout.lock)] + [pin.wheel for pin in sources.load_wheels(layout.lock)]
    return all((layout.cache / name).is_file() for name in names)


@pytest.mark.skipif(not _cache_is_complete(), reason="the upstream cache is incomplete (`nox -s upstream` fills it)")
def test_nox_build_test_stops_at_a_failed_build_with_its_reason_last(tmp_path):
    """No tests run after a failed build and nothing reads as success; the cache is complete, so
    the build's fetch only verifies it."""
    env = {**os.environ, "FLASH_ATTN_SPARSE_ARCH": "90", "CUDA_HOME": str(tmp_path / "not-cuda")}
    result = subprocess.run([sys.executable, "-m", "nox", "-s", "build", "test"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    output = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode != 0
    assert output[-1] == (f"nox > Session build aborted: build stopped: no nvcc at {tmp_path}/not-cuda/bin/nvcc "
                          f"(CUDA_HOME={tmp_path}/not-cuda, from $CUDA_HOME); set CUDA_HOME to the CUDA toolkit "
                          "(the folder holding bin/nvcc and include/cuda.h).")
    assert not any("Running session test" in line or "success" in line for line in output)
