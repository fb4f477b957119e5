"""New files laid into the applied trees instead of being carried in patches.

patches/overlay/<upstream>/<path> goes to <path> in that upstream's tree; this fork's own
Python package goes into the flash-attn tree, and patches/overlay/shared/ files into each tree
that uses them (FROM_REPO). In a git tree each is a symlink to the repo file
(editing it in the tree edits the repo) and excluded from git, so export never sees it; in a
tree built without git they are copies.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from forktools import ToolError
from forktools.layout import Layout

# Upstream name → {path in its tree: repo file or directory laid there whole}.
_GRAPH = "patches/overlay/shared/planned_kernel_graph.h"  # both extensions' planned forwards
FROM_REPO = {"flash-attn": {"flash_attn_sparse": "python/flash_attn_sparse",
                            "csrc/flash_attn/planned_kernel_graph.h": _GRAPH},
             "flash-attn-3": {"hopper/planned_kernel_graph.h": _GRAPH}}


def sources(layout: Layout, name: str) -> dict[str, Path]:
    """Path in the tree → repo file or directory, for everything laid into upstream `name`."""
    base = layout.overlay / name
    found = {}
    if base.is_dir():
        for path in sorted(base.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                found[path.relative_to(base).as_posix()] = path
    for in_tree, in_repo in FROM_REPO.get(name, {}).items():
        if (layout.root / in_repo).exists():
            found[in_tree] = layout.root / in_repo
    return found


def lay(layout: Layout, name: str, tree: Path, link: bool) -> list[str]:
    """Lay the overlay of upstream `name` into `tree` (symlinks if `link`, else copies) and
    return the tree paths it laid."""
    laid = sources(layout, name)
    for in_tree, source in laid.items():
        target = tree / in_tree
        if target.exists() or target.is_symlink():
            raise ToolError(f"{source} would replace {in_tree}, which the patched {name} tree "
                            "already has; changes to upstream files belong in a patch")
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            target.symlink_to(os.path.relpath(source.resolve(), target.parent.resolve()),
                              target_is_directory=source.is_dir())
        elif source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    return list(laid)


def exclude_pattern(in_tree: str) -> str:
    """A .git/info/exclude line matching exactly this tree path."""
    return "/" + re.sub(r"([\\*?\[#!])", r"\\\1", in_tree)
