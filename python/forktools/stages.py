"""Stage review: the stage's notes, the diffstat of its patches, and its tests."""

from __future__ import annotations

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
    return subprocess.call([sys.executable, "-m", "pytest", "-m", f"stage{stage}"], cwd=layout.root)
