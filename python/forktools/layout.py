"""Where the project keeps things. Every forktools function takes a Layout, so tests can point
it at temporary directories."""

from __future__ import annotations

import dataclasses
from pathlib import Path

LOCK = Path("upstream") / "lock.toml"


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path
    lock: Path
    cache: Path
    trees: Path
    patches: Path

    @classmethod
    def at(cls, root: Path | str) -> Layout:
        """The standard layout of a checkout rooted at `root`."""
        root = Path(root).resolve()
        return cls(
            root=root,
            lock=root / "upstream" / "lock.toml",
            cache=root / ".cache" / "upstream",
            trees=root / "build" / "trees",
            patches=root / "patches",
        )

    @property
    def series(self) -> Path:
        return self.patches / "series"

    @property
    def overlay(self) -> Path:
        return self.patches / "overlay"

    def with_trees(self, trees: Path | str) -> Layout:
        return dataclasses.replace(self, trees=Path(trees))


def checkout_root(start: Path | str | None = None, package: Path | str = __file__) -> Path:
    """The checkout forktools works on: the one this package sits in (python/forktools), else
    (installed with pip) the first folder from `start` (default the working folder) upwards that
    holds upstream/lock.toml, else the working folder."""
    beside = Path(package).resolve().parents[2]
    if (beside / LOCK).is_file():
        return beside
    start = Path(start or Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if (folder / LOCK).is_file():
            return folder
    return start
