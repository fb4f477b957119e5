"""Upstream parts that no sdist holds, and the pristine FA-3 tree composed from them.

- `[[github]]` tables pin trees of the upstream repository (forktools.github fetches and checks
  them by git tree id).
- `[[wheel]]` tables pin a wheel fetched with pip by name and sha256 (binary only).

The `flash-attn-3` upstream is the flash-attention repository as FA-3's hopper/setup.py builds
it, with hopper/ beside csrc/: hopper/ from its GitHub tree, csrc/cutlass/include and README.md
from the flash-attn sdist (its cutlass is the v2.8.3 submodule less every *.inl), and the two
`sm90_common.inl` files FA-3 includes from the nvidia-cutlass wheel, checked by git blob id.
"""

from __future__ import annotations

import dataclasses
import shutil
import tarfile
import zipfile
from pathlib import Path

from forktools import ToolError, downloads, github, lockfile, treeid
from forktools.layout import Layout

FA3 = "flash-attn-3"
FA3_TREE = "flash-attention-hopper"
CUTLASS_WHEEL = "nvidia-cutlass"
SDIST_PARTS = ("csrc/cutlass/include/", "README.md")
# Path in the wheel → (path in the FA-3 tree, git blob id of upstream's file).
CUTLASS_FILES = {
    "cutlass_library/source/include/cutlass/gemm/collective/builders/sm90_common.inl":
        ("csrc/cutlass/include/cutlass/gemm/collective/builders/sm90_common.inl",
         "b1f4f1fc35367ef820167d71d951ccd50a6b49fc"),
    "cutlass_library/source/include/cutlass/epilogue/collective/builders/sm90_common.inl":
        ("csrc/cutlass/include/cutlass/epilogue/collective/builders/sm90_common.inl",
         "4c259aa851e087b55aa224476e56f433ae58a935"),
}


@dataclasses.dataclass(frozen=True)
class WheelPin:
    name: str
    version: str
    wheel: str
    sha256: str


def load_wheels(lock: Path) -> list[WheelPin]:
    try:
        return [WheelPin(**table) for table in lockfile.tables(lock, "wheel")]
    except TypeError as err:
        raise ToolError(f"{lock}: a [[wheel]] table is malformed: {err}") from None


def fetch(layout: Layout, offline: bool = False, mirror: Path | str | None = None) -> None:
    """Make every pinned GitHub tree and wheel available in the cache, verified."""
    github.fetch(layout, github.load(layout.lock), offline=offline, mirror=mirror)
    mirror = github.mirror_dir(mirror)
    for pin in load_wheels(layout.lock):
        cached = layout.cache / pin.wheel
        if not cached.exists() and mirror and (mirror / pin.wheel).exists():
            downloads.verify_sha256(mirror / pin.wheel, pin.sha256, label=str(mirror / pin.wheel))
            shutil.copyfile(mirror / pin.wheel, cached)
        if cached.exists():
            downloads.verify_sha256(cached, pin.sha256)
            print(f"{pin.name}: {cached} verified")
        elif offline:
            raise ToolError(f"{pin.name}: {cached} is missing and --offline was given")
        else:
            downloads.pip_download(pin.name, pin.version, pin.wheel, pin.sha256, layout.cache, ["--only-binary=:all:"])
            print(f"{pin.name}: fetched and verified {cached}")


def compose_fa3(layout: Layout, sdist: Path, dest: Path) -> None:
    """Lay the pristine FA-3 tree at dest (which must not exist); see the module docstring."""
    hopper = lockfile.named(github.load(layout.lock), FA3_TREE, "github")
    cutlass = lockfile.named(load_wheels(layout.lock), CUTLASS_WHEEL, "wheel")
    downloads.verify_sha256(layout.cache / cutlass.wheel, cutlass.sha256)
    dest.mkdir(parents=True)
    github.unpack(layout, hopper, dest)
    with tarfile.open(sdist) as tar:
        for member in tar:
            _, _, inner = member.name.partition("/")
            if member.isfile() and (inner.startswith(SDIST_PARTS[0]) or inner == SDIST_PARTS[1]):
                target = dest / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    with zipfile.ZipFile(layout.cache / cutlass.wheel) as wheel:
        for in_wheel, (in_tree, blob) in CUTLASS_FILES.items():
            data = wheel.read(in_wheel)
            if treeid.blob_id(data) != blob:
                raise ToolError(f"{cutlass.wheel}: {in_wheel} is blob {treeid.blob_id(data)}, not upstream's {blob}")
            target = dest / in_tree
            if target.exists():
                raise ToolError(f"{in_tree} is already in the sdist's cutlass; drop it from CUTLASS_FILES")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

