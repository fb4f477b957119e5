"""Stage review (the stage's notes, the diffstat of its patches, its tests) and the pytest run
behind it and `forktools test`."""

from __future__ import annotations

import os
import subprocess
import sys

from forktools.layout import Layout
from forktools.series import read_patch, read_series


def review(layout: Layout, stage: int) -> int:
    """Print stages/stage<N>.md and the diffstat of every patch whose series entry has
    stage=N, then run `pytest -m stage<N>` and return its exit code."""
    notes = layout.root / "stages" / f"stage{stage}.md"
    print(notes.read_text() if notes.exists() else f"({notes} does not exist yet)")
    entries = [entry for entry in read_series(layout.series).entries if entry.stage == stage]
    print(f"== {len(entries)} patches in stage {stage}")
    for entry in entries:
        patch = read_patch(layout, entry)
        print(f"\n{entry.path}: {patch.subject}")
        print(patch.stat.decode(errors="replace"), end="")
    print(f"\n== pytest -m stage{stage}", flush=True)
    return run_pytest(layout, ["-m", f"stage{stage}"])


def run_pytest(layout: Layout, args: list[str]) -> int:
    """Run pytest from the repo root and return its exit code. python/ is taken off PYTHONPATH,
    where running forktools put it, so an installed flash_attn_sparse wheel is what the tests
    see when there is one (tests/conftest.py falls back to python/ otherwise)."""
    source = os.path.realpath(layout.root / "python")
    kept = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if path and os.path.realpath(path) != source]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    return subprocess.call([sys.executable, "-m", "pytest", *args], cwd=layout.root, env=env)
