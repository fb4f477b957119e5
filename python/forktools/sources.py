"""Upstream parts that no sdist holds: trees of the GitHub repository and files of a wheel,
pinned in the lock file, fetched into the cache, verified by content, and composed into the
pristine FA-3 tree.

- `[[github]]` tables pin a tree of the repository at a release (repository, tag, commit, path,
  git tree id) as an archive made by `git archive --prefix=<path>/ <tag>:<path> | gzip -n -9`
  (deterministic) and its sha256. The archive is taken from a mirror folder (`upstream
  --mirror DIR`, else $FORKTOOLS_UPSTREAM_MIRROR, else ../shared/upstream beside the checkout
  where it exists, as in CI; on the GPU machine the carried .cache/upstream already holds it),
  and its members must hash to the pinned git tree id.
- `[[wheel]]` tables pin a wheel fetched with pip by name and hash (binary only).

The `flash-attn-3` upstream is the flash-attention repository as FA-3's hopper/setup.py builds
it, with hopper/ beside csrc/: hopper/ from its GitHub tree, csrc/cutlass/include and README.md
from the flash-attn sdist (its cutlass is the v2.8.3 submodule less every *.inl), and the two
`sm90_common.inl` files FA-3 includes from the nvidia-cutlass wheel, checked by git blob id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tarfile
import tomllib
import zipfile
from pathlib import Path

from forktools import ToolError
from forktools.layout import Layout

MIRROR_ENV = "FORKTOOLS_UPSTREAM_MIRROR"
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
class GithubTree:
    name: str
    repository: str
    tag: str
    commit: str
    path: str
    tree: str
    archive: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class WheelPin:
    name: str
    version: str
    wheel: str
    sha256: str


def load(lock: Path) -> tuple[list[GithubTree], list[WheelPin]]:
    with open(lock, "rb") as file:
        tables = tomllib.load(file)
    try:
        trees = [GithubTree(**table) for table in tables.get("github", [])]
        wheels = [WheelPin(**table) for table in tables.get("wheel", [])]
    except TypeError as err:
        raise ToolError(f"{lock}: a [[github]] or [[wheel]] table is malformed: {err}") from None
    return trees, wheels


def _named(items: list, name: str):
    for item in items:
        if item.name == name:
            return item
    raise ToolError(f"the lock file pins no {name!r}")


def mirror_dir(mirror: Path | str | None) -> Path | None:
    mirror = mirror or os.environ.get(MIRROR_ENV)
    return Path(mirror) if mirror else None


def _beside_checkout(layout: Layout) -> Path | None:
    shared = layout.root.parent / "shared" / "upstream"
    return shared if shared.is_dir() else None


def fetch(layout: Layout, offline: bool = False, mirror: Path | str | None = None) -> None:
    """Make every pinned GitHub tree and wheel available in the cache, verified."""
    from forktools.upstream import verify_sha256

    trees, wheels = load(layout.lock)
    mirror = mirror_dir(mirror) or _beside_checkout(layout)
    layout.cache.mkdir(parents=True, exist_ok=True)
    for pin in trees:
        cached = layout.cache / pin.archive
        if not cached.exists():
            source = mirror / pin.archive if mirror else None
            if source is None or not source.exists():
                raise ToolError(
                    f"{pin.name}: {pin.archive} is in neither {layout.cache} nor a mirror "
                    f"(--mirror DIR or ${MIRROR_ENV}; e.g. ../shared/upstream). Make it from a "
                    f"clone of {pin.repository}: git archive --format=tar --prefix={pin.path}/ "
                    f"{pin.tag}:{pin.path} | gzip -n -9 > {pin.archive}")
            verify_sha256(source, pin.sha256, label=str(source))
            shutil.copyfile(source, cached)
        verify_sha256(cached, pin.sha256)
        actual = archive_tree_id(cached, pin.path)
        if actual != pin.tree:
            raise ToolError(f"{pin.name}: {cached} holds git tree {actual}, not the pinned {pin.tree}")
        print(f"{pin.name}: {cached} verified (tree {pin.tree[:12]} of {pin.repository} {pin.tag}:{pin.path})")
    for pin in wheels:
        cached = layout.cache / pin.wheel
        if not cached.exists() and mirror and (mirror / pin.wheel).exists():
            verify_sha256(mirror / pin.wheel, pin.sha256, label=str(mirror / pin.wheel))
            shutil.copyfile(mirror / pin.wheel, cached)
        if cached.exists():
            verify_sha256(cached, pin.sha256)
            print(f"{pin.name}: {cached} verified")
        elif offline:
            raise ToolError(f"{pin.name}: {cached} is missing and --offline was given")
        else:
            _download_wheel(pin, layout.cache)


def _download_wheel(pin: WheelPin, cache: Path) -> None:
    from forktools.upstream import pip_download  # upstream imports this module
    pip_download(pin.name, pin.version, pin.wheel, pin.sha256, cache, ["--only-binary=:all:"])
    print(f"{pin.name}: fetched and verified {cache / pin.wheel}")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def archive_tree_id(archive: Path, path: str) -> str:
    """The git tree id of the folder `path` in a tar archive (files, executable bits, links)."""
    root: dict = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if parts[:1] != (path,) or len(parts) == 1 or member.isdir():
                continue
            if member.issym():
                mode, data = b"120000", member.linkname.encode()
            elif member.isfile():
                mode = b"100755" if member.mode & 0o111 else b"100644"
                data = tar.extractfile(member).read()
            else:
                raise ToolError(f"{archive}: {member.name} is neither a file nor a link")
            folder = root
            for part in parts[1:-1]:
                folder = folder.setdefault(part, {})
            folder[parts[-1]] = (mode, bytes.fromhex(git_blob_id(data)))
    return _tree_id(root).hex()


def _tree_id(folder: dict) -> bytes:
    entries = []
    for name, value in folder.items():
        if isinstance(value, dict):
            entries.append((name + "/", b"40000", name, _tree_id(value)))
        else:
            entries.append((name, value[0], name, value[1]))
    body = b"".join(mode + b" " + name.encode() + b"\0" + sha for _, mode, name, sha in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()


def compose_fa3(layout: Layout, sdist: Path, dest: Path) -> None:
    """Lay the pristine FA-3 tree at dest (which must not exist); see the module docstring."""
    trees, wheels = load(layout.lock)
    hopper = _named(trees, FA3_TREE)
    cutlass = _named(wheels, CUTLASS_WHEEL)
    dest.mkdir(parents=True)
    with tarfile.open(layout.cache / hopper.archive) as tar:
        tar.extractall(dest, filter="data")
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
            if git_blob_id(data) != blob:
                raise ToolError(f"{cutlass.wheel}: {in_wheel} is blob {git_blob_id(data)}, not upstream's {blob}")
            target = dest / in_tree
            if target.exists():
                raise ToolError(f"{in_tree} is already in the sdist's cutlass; drop it from CUTLASS_FILES")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

