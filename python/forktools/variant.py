"""An experiment branch as one diff over a base's patched tree: the form `forktools build
--mutation` applies, so `python -m forktools gpu variants` can build, test and profile
a branch beside the base in one GPU run. Both trees are laid as a build lays them
(series.materialize), so the diff shows changes to patches, overlay files and the Python package
alike. The branch must contain the base (rebase it first), and the diff is checked before it is
returned: applied to the base tree it must give the branch tree, file for file."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from forktools import ToolError, patchfile, series
from forktools.layout import Layout

# git diff --no-index names the two trees' directories ("a/base/x", "b/branch/x"); the diff that
# `build --mutation` applies names tree paths ("a/x", "b/x").
_TREE_PREFIX = re.compile(rb"^(diff --git a/|--- a/|\+\+\+ b/|rename from |rename to )(?:base|branch)/", re.M)
_SECOND_PATH = re.compile(rb"^(diff --git a/\S+ b/)(?:base|branch)/", re.M)


def diff(layout: Layout, branch: str, base: str = "HEAD", name: str = "flash-attn") -> bytes:
    """The diff that turns upstream `name` patched as at `base` into it patched as at `branch`,
    which must contain `base` (else the diff would also undo what `base` added since)."""
    if subprocess.run(["git", "-C", str(layout.root), "merge-base", "--is-ancestor", base, branch]).returncode:
        raise ToolError(f"{branch} does not contain {base}: rebase it onto {base} first, or the "
                        f"diff would also undo {base}'s newer changes")
    with tempfile.TemporaryDirectory(prefix="forktools-variant-") as scratch:
        scratch = Path(scratch)
        for label, rev in (("base", base), ("branch", branch)):
            _materialize_at(layout, rev, name, scratch / label, scratch / f"{label}-checkout")
        result = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff", "base", "branch"],
                                cwd=scratch, capture_output=True)
        if result.returncode not in (0, 1):
            raise ToolError(f"git diff failed: {result.stderr.decode(errors='replace').strip()}")
        text = _SECOND_PATH.sub(rb"\1", _TREE_PREFIX.sub(rb"\1", result.stdout))
        if not text:
            raise ToolError(f"{branch} lays the same {name} tree as {base}: nothing to build")
        check = scratch / "check"
        shutil.copytree(scratch / "base", check, symlinks=True)
        patchfile.apply_diff(text, check, f"{branch} over {base}")
        if _files(check) != _files(scratch / "branch"):
            raise ToolError(f"the diff of {branch} over {base} does not reproduce {branch}'s tree "
                            "(a binary file or a mode change?)")
        return text


def _materialize_at(layout: Layout, rev: str, name: str, dest: Path, checkout: Path) -> None:
    _git(layout.root, "worktree", "add", "--detach", "--force", str(checkout), rev)
    try:
        # The checkout has no fetched sources; the repo's cache holds the pinned ones.
        series.materialize(dataclasses.replace(Layout.at(checkout), cache=layout.cache), name, dest)
    finally:
        _git(layout.root, "worktree", "remove", "--force", str(checkout))


def _git(repo: Path, *args: str) -> None:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if result.returncode:
        raise ToolError(f"git {' '.join(args)}: {result.stderr.strip()}")


def _files(tree: Path) -> dict[str, bytes]:
    return {path.relative_to(tree).as_posix(): path.read_bytes() for path in sorted(tree.rglob("*")) if path.is_file()}
