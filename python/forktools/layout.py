"""Where the project keeps things. Every forktools function takes a Layout, so tests can point
it at temporary directories."""

from __future__ import annotations

import dataclasses
from pathlib import Path


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
