"""Trees of the upstream repository that no package holds (FA-3's hopper/, upstream's tests/).

The lock file's `[[github]]` tables pin each by repository, commit, path and git tree id. A tree
missing from the cache is taken from a mirror folder when one is given (machines without
internet), else from the repository's own archive of the pinned commit,
`<repository>/archive/<commit>.tar.gz`, downloaded once for all the paths of that commit. The
scheme and host of that URL can be replaced through $FORKTOOLS_GITHUB_URL (e.g.
http://127.0.0.1:8000), so that a test serves the archive from a loopback server.

Each tree is checked by its git tree id (content, not archive bytes: the repository's archives
and a mirror's are stamped with different times) before it is cached, and again before it is
unpacked anywhere. The cache and a mirror hold a tree as `<archive>`: a gzipped tar whose members
sit under `<path>/`.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import shutil
import tarfile
import tempfile
import urllib.parse
from pathlib import Path, PurePosixPath

from forktools import ToolError, downloads, lockfile, treeid
from forktools.layout import Layout

URL_ENV = "FORKTOOLS_GITHUB_URL"
MIRROR_ENV = "FORKTOOLS_UPSTREAM_MIRROR"


@dataclasses.dataclass(frozen=True)
class GithubTree:
    name: str
    repository: str
    tag: str
    commit: str
    path: str
    tree: str
    archive: str


def load(lock: Path) -> list[GithubTree]:
    """The [[github]] tables of the lock file, in order."""
    try:
        return [GithubTree(**table) for table in lockfile.tables(lock, "github")]
    except TypeError as err:
        raise ToolError(f"{lock}: a [[github]] table is malformed: {err}") from None


def archive_url(pin: GithubTree) -> str:
    """The repository's archive of the pinned commit, its scheme and host replaced by
    $FORKTOOLS_GITHUB_URL where that is set."""
    repository = urllib.parse.urlsplit(pin.repository)
    base = os.environ.get(URL_ENV) or f"{repository.scheme}://{repository.netloc}"
    return f"{base.rstrip('/')}{repository.path.rstrip('/')}/archive/{pin.commit}.tar.gz"


def mirror_dir(mirror: Path | str | None) -> Path | None:
    mirror = mirror or os.environ.get(MIRROR_ENV)
    return Path(mirror) if mirror else None


def check(archive: Path, pin: GithubTree, hint: str = "") -> None:
    """Refuse an archive whose `<path>/` is not the pinned tree, naming the path and both ids."""
    found = treeid.tar_folder_id(archive, pin.path)
    if found != pin.tree:
        raise ToolError(_mismatch(pin, str(archive), found) + hint)


def _mismatch(pin: GithubTree, source: str, found: str) -> str:
    return (f"{pin.name}: refusing {pin.path}/ from {source}: its git tree id is {found}, "
            f"but upstream/lock.toml pins {pin.tree} ({pin.repository} commit {pin.commit})")


def fetch(layout: Layout, pins: list[GithubTree], offline: bool = False, mirror: Path | str | None = None) -> None:
    """Make every pinned tree available in the cache, verified: from the cache, the mirror
    folder, or (unless offline) the repository's archive of its commit."""
    layout.cache.mkdir(parents=True, exist_ok=True)
    mirror = mirror_dir(mirror)
    missing = []
    for pin in pins:
        cached, mirrored = layout.cache / pin.archive, mirror / pin.archive if mirror else None
        if cached.exists():
            check(cached, pin, hint="; delete it and run `nox -s upstream` to fetch it again")
            print(f"{pin.name}: {cached} verified (tree {pin.tree[:12]} of {pin.path}/)")
        elif mirrored is not None and mirrored.exists():
            check(mirrored, pin)
            _copy_into_place(mirrored, cached)
            print(f"{pin.name}: {cached} verified (tree {pin.tree[:12]} of {pin.path}/), from {mirror}")
        else:
            missing.append(pin)
    if missing and offline:
        names = ", ".join(pin.archive for pin in missing)
        raise ToolError(f"{names} missing from {layout.cache} and --offline was given: copy them there from a "
                        f"machine that ran `nox -s upstream`, or name a mirror folder holding them "
                        f"(--mirror DIR or ${MIRROR_ENV})")
    commits: dict[tuple[str, str], list[GithubTree]] = {}
    for pin in missing:
        commits.setdefault((pin.repository, pin.commit), []).append(pin)
    for group in commits.values():
        _download(layout.cache, group)


def _copy_into_place(source: Path, dest: Path) -> None:
    partial = dest.with_name(f".{dest.name}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, dest)


def _download(cache: Path, pins: list[GithubTree]) -> None:
    """Download the archive of the pins' commit, check every pinned path in it, and only then
    cache each as its own archive."""
    url = archive_url(pins[0])
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        download = Path(scratch) / "commit.tar.gz"
        downloads.http_download(url, download)
        split = split_archive(download, pins, Path(scratch), source=url)
        for pin in pins:
            os.replace(split[pin.name], cache / pin.archive)
            print(f"{pin.name}: {cache / pin.archive} verified (tree {pin.tree[:12]} of {pin.path}/), from {url}")


def split_archive(archive: Path, pins: list[GithubTree], out: Path, source: str) -> dict[str, Path]:
    """Write each pin's folder of a repository archive (one top folder, `<repo>-<commit>/`) as
    out/<pin.archive>, after checking every one of them by tree id; name → written archive."""
    prefixes = {pin.name: PurePosixPath(pin.path).parts for pin in pins}
    trees = {pin.name: treeid.Tree() for pin in pins}
    members: dict[str, list[tuple[str, bytes, bytes, int]]] = {pin.name: [] for pin in pins}
    top = None
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if not parts:
                continue
            if top is None:
                top = parts[0]
            elif parts[0] != top:
                raise ToolError(f"{source}: not one top folder ({top}/ and {parts[0]}/)")
            for name, prefix in prefixes.items():
                inside = parts[1:]
                if inside[:len(prefix)] != prefix or len(inside) == len(prefix):
                    continue
                content = treeid.member_content(tar, member, source)
                if content is not None:
                    relative = inside[len(prefix):]
                    trees[name].add(relative, *content)
                    members[name].append(("/".join(relative), *content, int(member.mtime)))
    for pin in pins:
        if not trees[pin.name].files:
            raise ToolError(f"{pin.name}: refusing {source}: it has no {pin.path}/ folder")
        found = trees[pin.name].id()
        if found != pin.tree:
            raise ToolError(_mismatch(pin, source, found))
    written = {}
    for pin in pins:
        written[pin.name] = out / pin.archive
        _write_tree_archive(written[pin.name], pin.path, members[pin.name])
    return written


def _write_tree_archive(dest: Path, path: str, members: list[tuple[str, bytes, bytes, int]]) -> None:
    """A gzipped tar of one tree, its members under path/, in name order (the same tree gives
    the same bytes)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, mode, data, mtime in sorted(members):
            info = tarfile.TarInfo(f"{path}/{relative}")
            info.mtime = mtime
            if mode == treeid.LINK:
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, data.decode(), 0o777
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755 if mode == treeid.EXECUTABLE else 0o644
                tar.addfile(info, io.BytesIO(data))
    with open(dest, "wb") as file, gzip.GzipFile(fileobj=file, mode="wb", mtime=0) as compressed:
        compressed.write(buffer.getvalue())


def unpack(layout: Layout, pin: GithubTree, dest: Path) -> None:
    """Extract the cached tree into dest (as dest/<path>/...), after checking it by tree id."""
    archive = layout.cache / pin.archive
    if not archive.exists():
        raise ToolError(f"{archive} is missing; run `nox -s upstream` first")
    check(archive, pin, hint="; delete it and run `nox -s upstream` to fetch it again")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, members=_under(tar, pin.path), filter="data")


def _under(tar: tarfile.TarFile, path: str):
    prefix = PurePosixPath(path).parts
    for member in tar:
        if PurePosixPath(member.name).parts[:len(prefix)] == prefix:
            yield member
