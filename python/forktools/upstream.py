"""Pinned upstream releases: read the lock file, fetch and verify the sdists, record local source
trees used instead of them, and unpack either into a working directory.

Nothing is unpacked from an sdist whose sha256 differs from the pin. A pin marked `composed`
(flash-attn-3) has no sdist: forktools.sources composes its tree from the GitHub tree its
`github` key names (checked by git tree id) and the pinned sdist and wheel parts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from forktools import ToolError, github, gittree, lockfile, sources
from forktools.downloads import pip_download, verify_sha256
from forktools.layout import Layout

TREES_FILE = "trees.toml"


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sdist: str = ""
    sha256: str = ""
    download_args: tuple[str, ...] = ()
    download_env: dict[str, str] = dataclasses.field(default_factory=dict)
    composed: bool = False  # no sdist: forktools.sources composes the tree
    tree: str = ""  # a composed pin's main part: the git tree id of the GitHub tree it names

    @property
    def content(self) -> str:
        """What the release is checked by, as the series header names it."""
        return f"tree:{self.tree}" if self.composed else f"sha256:{self.sha256}"


def load_pins(lock: Path) -> list[Pin]:
    """The [[upstream]] tables of the lock file, in order."""
    try:
        return [_pin(lock, table) for table in lockfile.tables(lock, "upstream")]
    except KeyError as missing:
        raise ToolError(f"{lock}: an [[upstream]] table lacks {missing}") from None


def _pin(lock: Path, table: dict) -> Pin:
    if table.get("composed", False):
        tree = lockfile.named(github.load(lock), table["github"], "github").tree
        return Pin(name=table["name"], version=table["version"], composed=True, tree=tree)
    return Pin(name=table["name"], version=table["version"], sdist=table["sdist"], sha256=table["sha256"],
               download_args=tuple(table.get("download_args", ())), download_env=dict(table.get("download_env", {})))


def fetch(layout: Layout, offline: bool = False, mirror: Path | str | None = None) -> None:
    """Make every pinned release available: verify cached sdists, download missing ones with pip
    (unless offline), or check the local tree recorded for it; then the GitHub trees (from the
    cache, the mirror folder or the repository's archive) and wheels of forktools.sources."""
    layout.cache.mkdir(parents=True, exist_ok=True)
    trees = recorded_trees(layout)
    for pin in load_pins(layout.lock):
        cached = layout.cache / pin.sdist
        if pin.composed:
            continue  # its parts are fetched and verified below
        if pin.name in trees:
            check_tree_version(pin, trees[pin.name])
            print(f"{pin.name}: using the recorded tree {trees[pin.name]}")
        elif cached.exists():
            verify_sha256(cached, pin.sha256)
            print(f"{pin.name}: {cached} verified")
        elif offline:
            raise ToolError(
                f"{pin.name}: {cached} is missing and --offline was given; copy {pin.sdist} "
                f"(sha256 {pin.sha256}) into {layout.cache}/, or record a source tree with "
                f"--tree {pin.name}=PATH")
        else:
            _download(pin, layout.cache)
            print(f"{pin.name}: fetched and verified {cached}")
    sources.fetch(layout, offline=offline, mirror=mirror)


def _download(pin: Pin, cache: Path) -> None:
    pip_download(pin.name, pin.version, pin.sdist, pin.sha256, cache, ["--no-binary", ":all:", *pin.download_args],
                 pin.download_env)


def recorded_trees(layout: Layout) -> dict[str, Path]:
    """Upstream name → local source tree recorded with `upstream --tree NAME=PATH`."""
    path = layout.cache / TREES_FILE
    if not path.exists():
        return {}
    with open(path, "rb") as file:
        return {name: Path(tree) for name, tree in tomllib.load(file).items()}


def record_tree(layout: Layout, name: str, tree: Path | str) -> None:
    """Use the source tree at `tree` (e.g. a git checkout of the pinned release) instead of the
    sdist for upstream `name`, after checking it is that release where its version can be read."""
    pin = lockfile.named(load_pins(layout.lock), name, "upstream")
    tree = Path(tree).resolve()
    if not tree.is_dir():
        raise ToolError(f"{tree} is not a directory")
    check_tree_version(pin, tree)
    trees = {**recorded_trees(layout), name: tree}
    layout.cache.mkdir(parents=True, exist_ok=True)
    lines = ["# Local source trees used instead of the pinned sdists; written by `forktools upstream --tree`."]
    lines += [f"{json.dumps(key)} = {json.dumps(str(path))}" for key, path in sorted(trees.items())]
    (layout.cache / TREES_FILE).write_text("".join(line + "\n" for line in lines))
    print(f"{name}: recorded {tree}")


def check_tree_version(pin: Pin, tree: Path) -> None:
    """Refuse a tree that declares another version than the pin; warn when none can be read."""
    if not tree.is_dir():
        raise ToolError(f"{pin.name}: the recorded tree {tree} does not exist")
    version = tree_version(pin, tree)
    if version is None:
        print(f"warning: {pin.name}: could not read a version from {tree}; make sure it is "
              f"{pin.version}", file=sys.stderr)
    elif version != pin.version:
        raise ToolError(f"{tree} is {pin.name} {version}, but the lock pins {pin.version}")


def tree_version(pin: Pin, tree: Path) -> str | None:
    """The version a source tree declares, from the first of these that has one: PKG-INFO (an
    unpacked sdist), a static version in pyproject.toml, `__version__` in the package named after
    the upstream, a release tag on the checked-out commit (flash-attn-4 takes its version from
    git tags such as fa4-v4.0.0b36)."""
    for read in (_pkg_info_version, _pyproject_version, _package_version, _tag_version):
        version = read(pin, tree)
        if version:
            return version
    return None


def _pkg_info_version(pin: Pin, tree: Path) -> str | None:
    path = tree / "PKG-INFO"
    match = path.exists() and re.search(r"^Version:\s*(\S+)", path.read_text(errors="replace"), re.M)
    return match.group(1) if match else None


def _pyproject_version(pin: Pin, tree: Path) -> str | None:
    path = tree / "pyproject.toml"
    if not path.exists():
        return None
    with open(path, "rb") as file:
        return tomllib.load(file).get("project", {}).get("version")


def _package_version(pin: Pin, tree: Path) -> str | None:
    path = tree / pin.name.replace("-", "_") / "__init__.py"
    pattern = r"""^__version__\s*=\s*["']([^"']+)["']"""
    match = path.exists() and re.search(pattern, path.read_text(errors="replace"), re.M)
    return match.group(1) if match else None


def _tag_version(pin: Pin, tree: Path) -> str | None:
    # Tags look like v2.8.3.post2 or fa4-v4.0.0b36: an optional prefix, an optional v, the version.
    versions = {match.group(1) for tag in gittree.tags_at_head(tree)
                if (match := re.fullmatch(r"(?:.*[-_/])?v?(\d[0-9A-Za-z.+]*)", tag))}
    if pin.version in versions:
        return pin.version
    return min(versions) if versions else None


def unpack(layout: Layout, name: str, dest: Path) -> None:
    """Put the pristine source of upstream `name` at `dest`, which must not exist: the contents of
    the verified sdist's single top folder, or a copy (without .git) of the recorded tree."""
    pin = lockfile.named(load_pins(layout.lock), name, "upstream")
    if dest.exists() or dest.is_symlink():
        raise ToolError(f"{dest} already exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tree = recorded_trees(layout).get(name)
    if pin.composed:
        flash_attn = lockfile.named(load_pins(layout.lock), "flash-attn", "upstream")
        verify_sha256(layout.cache / flash_attn.sdist, flash_attn.sha256)
        sources.compose_fa3(layout, layout.cache / flash_attn.sdist, dest)
    elif tree is None:
        _extract_sdist(layout.cache / pin.sdist, pin.sha256, dest)
    else:
        check_tree_version(pin, tree)
        shutil.copytree(tree, dest, symlinks=True, ignore=shutil.ignore_patterns(".git"))


def _extract_sdist(sdist: Path, sha256: str, dest: Path) -> None:
    if not sdist.exists():
        raise ToolError(f"{sdist} is missing; run `nox -s upstream` first")
    verify_sha256(sdist, sha256)
    # Extract beside dest, then rename the single top folder into place.
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".unpack-") as scratch:
        with tarfile.open(sdist) as archive:
            archive.extractall(scratch, filter="data")
        tops = os.listdir(scratch)
        if len(tops) != 1 or not (Path(scratch) / tops[0]).is_dir():
            raise ToolError(f"{sdist}: expected a single top folder, found {sorted(tops)}")
        os.replace(Path(scratch) / tops[0], dest)
