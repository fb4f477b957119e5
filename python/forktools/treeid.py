"""Git object ids computed from contents alone, without git: a blob's, and a folder's tree id from
the members of a tar archive.

A tree id names a folder's files, their executable bits and links, and nothing else: not the
archive's timestamps, owners or member order. So one pin checks the same tree whether it came in
the repository's own archive of a commit, in an offline mirror's archive or from `git archive`.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path, PurePosixPath

from forktools import ToolError

FILE, EXECUTABLE, LINK, FOLDER = b"100644", b"100755", b"120000", b"40000"


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Tree:
    """A folder built file by file; id() is git's tree id of it."""

    def __init__(self) -> None:
        self._root: dict = {}
        self.files = 0

    def add(self, parts: tuple[str, ...], mode: bytes, data: bytes) -> None:
        folder = self._root
        for part in parts[:-1]:
            folder = folder.setdefault(part, {})
        folder[parts[-1]] = (mode, bytes.fromhex(blob_id(data)))
        self.files += 1

    def id(self) -> str:
        return _tree_id(self._root).hex()


def _tree_id(folder: dict) -> bytes:
    # Git sorts a tree's entries by name, a folder's name as if it ended in "/".
    entries = []
    for name, value in folder.items():
        if isinstance(value, dict):
            entries.append((name + "/", FOLDER, name, _tree_id(value)))
        else:
            entries.append((name, value[0], name, value[1]))
    body = b"".join(mode + b" " + name.encode() + b"\0" + sha for _, mode, name, sha in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()


def member_content(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> tuple[bytes, bytes] | None:
    """(git mode, data) of a tar member; None for a folder, which git does not record."""
    if member.isdir():
        return None
    if member.issym():
        return LINK, member.linkname.encode()
    if member.isfile():
        return (EXECUTABLE if member.mode & 0o111 else FILE), tar.extractfile(member).read()
    raise ToolError(f"{where}: {member.name} is neither a file, a folder nor a symbolic link")


def tar_folder_id(archive: Path, folder: str) -> str:
    """The git tree id of the folder `folder` (e.g. "hopper", or "top/hopper") in a tar archive."""
    prefix = PurePosixPath(folder).parts
    tree = Tree()
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if parts[:len(prefix)] != prefix or len(parts) == len(prefix):
                continue
            content = member_content(tar, member, str(archive))
            if content is not None:
                tree.add(parts[len(prefix):], *content)
    if not tree.files:
        raise ToolError(f"{archive} holds no files under {folder}/")
    return tree.id()
