"""Developer entry points; each session is a thin call into python/forktools.

Sessions run in the invoking environment (no virtualenvs are made), which must have torch
installed: fetching the flash-attn sdist runs its setup.py, and the project's tests import torch.
`nox -l` lists the sessions; pass arguments after `--`, e.g. `nox -s apply -- --force`.
A failing session stops the ones after it (`nox -s build test` runs no tests after a failed
build), and nox's last line says what failed.
"""

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "python"))

from forktools import ToolError  # noqa: E402
from forktools.__main__ import run  # noqa: E402

nox.options.default_venv_backend = "none"
nox.options.sessions = ["test"]
nox.options.stop_on_first_error = True


def _forktools(session: nox.Session, command: str, *options: str) -> None:
    try:
        code = run([command, *options, *session.posargs])
    except ToolError as err:
        message = str(err).strip()
        if "\n" in message:  # the whole of it first; nox's last line gets its first line
            print(f"error: {message}", file=sys.stderr)
        session.error(f"{command} stopped: {message.splitlines()[0]}")
    if code:
        session.error(f"forktools {command} failed (exit {code})")


@nox.session
def upstream(session: nox.Session) -> None:
    """Fetch and verify the pinned upstreams ([--offline] [--tree NAME=PATH] [--mirror DIR]; $FORKTOOLS_GITHUB_URL)."""
    _forktools(session, "upstream")


@nox.session
def apply(session: nox.Session) -> None:
    """Build build/trees/<name> from the pinned upstreams and patches/ ([--force] [--no-git])."""
    _forktools(session, "apply")


@nox.session
def export(session: nox.Session) -> None:
    """Write patches/ from the commits in build/trees."""
    _forktools(session, "export")


@nox.session(name="check-patches")
def check_patches(session: nox.Session) -> None:
    """Check patches/ against the lock file, a fresh apply and the trees in build/trees."""
    _forktools(session, "check-patches")


@nox.session
def build(session: nox.Session) -> None:
    """Fetch, verify, patch, build, then install flash_attn, flash_attn_3, flash_attn_4
    (FLASH_ATTN_SPARSE_PROFILE / _ARCH / _JOBS / _FP8)."""
    _forktools(session, "build", "--install")


@nox.session
def test(session: nox.Session) -> None:
    """Run pytest from the repo root (pytest arguments after --)."""
    _forktools(session, "test")


@nox.session
def gpu(session: nox.Session) -> None:
    """Build once, then the GPU steps named after -- on a CUDA host (nox -s gpu -- --list)."""
    _forktools(session, "gpu")


@nox.session
def review(session: nox.Session) -> None:
    """Review a stage: its notes, its patches' diffstat, its tests (nox -s review -- N)."""
    _forktools(session, "review")


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff over the tree (config in pyproject.toml; arguments after -- go to ruff check)."""
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark against SDPA, FlexAttention and FA-2 dense on a GPU; writes benchmarks/results/."""
    session.run(sys.executable, "benchmarks/bench_sparse.py", "--out", "benchmarks/results", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Differential fuzzer of every backend against the reference on a GPU (tests/fuzz/run.py --help)."""
    session.run(sys.executable, "tests/fuzz/run.py", *session.posargs)


@nox.session(name="upstream-tests")
def upstream_tests(session: nox.Session) -> None:
    """Upstream flash-attn's forward-only tests the dev build compiles, on the installed wheel (GPU)."""
    session.run(sys.executable, "tests/upstream/run_upstream.py", *session.posargs)


@nox.session
def sanitize(session: nox.Session) -> None:
    """Run compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over the sparse kernels on a GPU."""
    session.run(sys.executable, "tests/sanitize.py", *session.posargs)
