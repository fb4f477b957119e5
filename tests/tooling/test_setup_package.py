"""`pip install .` installs the tooling, the `forktools` command (the product itself is the wheel
`nox -s build` makes): pyproject.toml builds a wheel of python/forktools with that console script,
and the installed command works on the checkout it is run in."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forktools.layout import checkout_root

pytestmark = pytest.mark.tooling
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="the build backend, setuptools, is absent")
def test_pyproject_builds_a_wheel_of_the_forktools_command(tmp_path):
    project = tmp_path / "project"  # a copy, so the build leaves no build/ or egg-info in the checkout
    (project / "python").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", project)
    shutil.copytree(REPO / "python" / "forktools", project / "python" / "forktools",
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-w", str(tmp_path / "dist"), "."], cwd=project, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {"forktools/__main__.py", "forktools/github.py", "forktools/toolchain.py"} <= set(names)
    assert not any(name.startswith("flash_attn_sparse/") for name in names)
    assert "forktools = forktools.__main__:main" in entry_points


def test_the_installed_command_finds_the_checkout_it_is_run_in(tmp_path):
    installed = tmp_path / "site-packages" / "forktools" / "layout.py"  # no checkout around it
    checkout = tmp_path / "clone"
    (checkout / "upstream").mkdir(parents=True)
    (checkout / "upstream" / "lock.toml").write_text("")
    (checkout / "patches").mkdir()
    assert checkout_root(checkout / "patches", package=installed) == checkout
    assert checkout_root(tmp_path / "site-packages", package=installed) == tmp_path / "site-packages"
    assert checkout_root(tmp_path, package=REPO / "python" / "forktools" / "layout.py") == REPO
