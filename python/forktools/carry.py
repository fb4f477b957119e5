"""Which paths each device call carries, within the device tool's limits (64 MiB a call with the
working tree, 8 carry paths). A GPU session with FA-4 needs the CuTe-DSL runtime in two parts over
two consecutive calls; the wheels, the pristine flash-attn-4 wheel, the upstream cache and .commit
go beside them. Whole, they do not fit two calls once the tree grew past about 7 MB (session 35),
but a warm machine keeps ignored files between calls, so the cache can go file by file:
`python -m forktools carry-plan` prints each call's carry list, largest first fit, or says what
does not fit."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from forktools import ToolError

LIMIT_BYTES = 64 << 20
MARGIN_BYTES = 1 << 20  # room for files written before the call (.commit, logs) and the tool's own count
MAX_PATHS = 8
RUNTIME_PARTS = (".carry/cutedsl/part1", ".carry/cutedsl/part2")  # call 1, then call 2 (part 2 completes part 1)
WHEELS = (".carry/wheel/dist-wheel.tar", ".carry/wheel/dist-fa3-wheel.tar")
PRISTINE_FA4 = ".carry/fa4pristine"
COMMIT = ".commit"


@dataclasses.dataclass
class Call:
    paths: list[str]
    bytes: int

    def fits(self, size: int, limit: int) -> bool:
        return len(self.paths) < MAX_PATHS and self.bytes + size <= limit

    def add(self, path: str, size: int) -> None:
        self.paths.append(path)
        self.bytes += size


def size_of(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes(root: Path) -> int:
    """What travels without being named: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / name.decode()).stat().st_size for name in listed if name and (root / name.decode()).is_file())


def plan(root: Path, with_fa4: bool = True, limit: int = LIMIT_BYTES - MARGIN_BYTES) -> list[Call]:
    """Each call's carry list (one call without FA-4, two with it): the runtime parts pinned to
    their calls, .commit to the last, the rest largest first into the first call with room; the
    upstream cache whole if it fits, else file by file."""
    root = Path(root)
    pinned = [[RUNTIME_PARTS[0]], [RUNTIME_PARTS[1], COMMIT]] if with_fa4 else [[COMMIT]]
    missing = [p for group in pinned for p in group if not (root / p).exists()]
    if missing:
        raise ToolError(f"carry-plan: {', '.join(missing)} missing (make-parts.sh makes the runtime parts; "
                        "`git rev-parse --short HEAD > .commit`)")
    tree = tree_bytes(root)
    others = [p for p in (*WHEELS, *((PRISTINE_FA4,) if with_fa4 else ())) if (root / p).exists()]
    cache = root / ".cache" / "upstream"
    cache_files = [str(p.relative_to(root)) for p in sorted(cache.iterdir()) if p.is_file()] if cache.is_dir() else []
    whole_cache = [".cache/upstream"] if cache_files else []
    sizes = {p: size_of(root / p) for p in [*(p for group in pinned for p in group), *others, *whole_cache, *cache_files]}
    try:
        return _first_fit(sizes, tree, pinned, others + whole_cache, limit)
    except ToolError:
        return _first_fit(sizes, tree, pinned, others + cache_files, limit)


def _first_fit(sizes: dict[str, int], tree: int, pinned: list[list[str]], loose: list[str], limit: int) -> list[Call]:
    calls = [Call([], tree) for _ in pinned]
    for call, group in zip(calls, pinned):
        for path in group:
            call.add(path, sizes[path])
    over = [i + 1 for i, c in enumerate(calls) if c.bytes > limit]
    if over:
        raise ToolError(f"carry-plan: call {over[0]} is over {limit >> 20} MiB with its fixed paths alone")
    for path in sorted(loose, key=lambda p: -sizes[p]):
        size = sizes[path]
        call = next((c for c in calls if c.fits(size, limit)), None)
        if call is None:
            raise ToolError(f"carry-plan: {path} ({size >> 20} MiB) fits no call beside a {tree >> 20} MiB tree: "
                            + "; ".join(f"call {i + 1} holds {c.bytes >> 20} MiB in {len(c.paths)} paths"
                                        for i, c in enumerate(calls)))
        call.add(path, size)
    return calls
