"""Patch files and a small applier for the unified diffs git writes.

A patch file is byte-stable (no dates, no commit ids):

    Subject: <commit message: `[stage N] Title`, blank line, body, blank line, `Stage: N`>
    ---
    <git diff --stat>
    (blank line)
    <git diff --full-index>

The applier matches context exactly (no fuzz; a hunk may sit at another line, as with
`git apply`), handles modified, new, deleted files, mode changes and `\\ No newline at end of
file`, and writes nothing unless every file of the patch applies. It lets the series be applied
inside the git-backed trees and on machines without git alike.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path, PurePosixPath

from forktools import ToolError

_SUBJECT = b"Subject: "
_STAGE_SUBJECT = re.compile(r"\[stage (\d+)\] (\S.*)")
_STAGE_TRAILER = re.compile(r"Stage: *(\d+)")
_HUNK_HEADER = re.compile(rb"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_REGULAR, _EXECUTABLE = 0o100644, 0o100755


class PatchError(ToolError):
    """A patch that cannot be read or does not apply."""


@dataclasses.dataclass(frozen=True)
class Patch:
    message: str  # the commit message, without a trailing newline
    stat: bytes
    diff: bytes

    @property
    def subject(self) -> str:
        return self.message.partition("\n")[0]

    @property
    def stage(self) -> int:
        return stage_and_title(self.message)[0]

    @property
    def title(self) -> str:
        return stage_and_title(self.message)[1]


def stage_and_title(message: str) -> tuple[int, str]:
    """Stage and title of a `[stage N] Title` ... `Stage: N` message; ValueError says what is wrong."""
    paragraphs = message.rstrip("\n").split("\n\n")
    trailers = paragraphs[-1].split("\n") if len(paragraphs) > 1 else []
    stages = [int(match.group(1)) for line in trailers if (match := _STAGE_TRAILER.fullmatch(line))]
    if len(stages) != 1:
        raise ValueError("it has no `Stage: N` trailer" if not stages else "it has several Stage trailers")
    subject = _STAGE_SUBJECT.fullmatch(paragraphs[0].partition("\n")[0])
    if not subject:
        raise ValueError(f"its subject is not `[stage {stages[0]}] Title`")
    if int(subject.group(1)) != stages[0]:
        raise ValueError(f"its subject says stage {subject.group(1)} but its trailer says Stage: {stages[0]}")
    return stages[0], subject.group(2)


def slug(title: str, limit: int = 50) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:limit].rstrip("-") or "patch"


def file_name(number: int, title: str) -> str:
    return f"{number:04d}-{slug(title)}.patch"


def render(patch: Patch) -> bytes:
    return _SUBJECT + patch.message.encode() + b"\n---\n" + patch.stat + b"\n" + patch.diff


def parse(data: bytes, name: str) -> Patch:
    """Read a patch file; `name` is how errors refer to it."""
    diff_at = data.find(b"\ndiff --git ") + 1
    separator = data.rfind(b"\n---\n", 0, diff_at)
    if not data.startswith(_SUBJECT) or diff_at == 0 or separator < 0:
        raise PatchError(f"{name}: not a patch file (`Subject: ` message, `---`, diffstat, git diff)")
    try:
        message = data[len(_SUBJECT):separator].decode()
        stage_and_title(message)
    except (UnicodeDecodeError, ValueError) as err:
        raise PatchError(f"{name}: bad commit message: {err}") from None
    stat = data[separator + len(b"\n---\n"):diff_at]
    return Patch(message=message, stat=stat[:-1] if stat.endswith(b"\n") else stat, diff=data[diff_at:])


@dataclasses.dataclass(frozen=True)
class Hunk:
    header: str
    old_start: int
    old: list[bytes]  # the lines it expects: context and removed
    new: list[bytes]  # the lines it leaves: context and added


@dataclasses.dataclass(frozen=True)
class FileDiff:
    path: str
    kind: str  # "modify", "create" or "delete"
    mode: int | None  # the mode the diff sets, if any
    hunks: list[Hunk]


def split_lines(data: bytes) -> list[bytes]:
    """Lines split on \\n only (a \\r stays part of its line), each keeping its \\n."""
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def split_description(data: bytes) -> bytes:
    """The diff part of a file that starts with free text (a description) and then a git diff."""
    at = data.find(b"diff --git ")
    if at < 0:
        raise PatchError("no `diff --git` section in the file")
    return data[at:]


def parse_diff(diff: bytes, name: str) -> list[FileDiff]:
    lines = split_lines(diff)
    files, at = [], 0
    while at < len(lines):
        if not lines[at].startswith(b"diff --git "):
            raise PatchError(f"{name}: unexpected line in the diff: {lines[at]!r}")
        at, file_diff = _parse_file(lines, at, name)
        files.append(file_diff)
    return files


def _parse_file(lines: list[bytes], at: int, name: str) -> tuple[int, FileDiff]:
    git_line, at = lines[at].rstrip(b"\n"), at + 1
    kind, mode, paths = "modify", None, []
    while at < len(lines) and not lines[at].startswith((b"diff --git ", b"@@ ")):
        line, at = lines[at].rstrip(b"\n"), at + 1
        if line.startswith(b"new file mode "):
            kind, mode = "create", int(line[14:], 8)
        elif line.startswith(b"deleted file mode "):
            kind = "delete"
        elif line.startswith(b"new mode "):
            mode = int(line[9:], 8)
        elif line.startswith((b"--- ", b"+++ ")):
            paths.append(_diff_path(line[4:]))
        elif not line.startswith((b"old mode ", b"index ")):
            raise PatchError(f"{name}: unsupported diff line {line!r} (binary, rename, copy, "
                             "symlink and submodule changes cannot be applied)")
    path = next((path for path in reversed(paths) if path), None) or _path_of_git_line(git_line)
    if mode not in (None, _REGULAR, _EXECUTABLE):
        raise PatchError(f"{name}: {path}: unsupported file mode {mode:o}")
    hunks = []
    while at < len(lines) and lines[at].startswith(b"@@ "):
        at, hunk = _parse_hunk(lines, at, f"{name}: {path}: hunk #{len(hunks) + 1}")
        hunks.append(hunk)
    return at, FileDiff(path=path, kind=kind, mode=mode, hunks=hunks)


def _diff_path(raw: bytes) -> str | None:
    """The tree path in a ---/+++ line; None for /dev/null."""
    raw = raw.rstrip(b"\t")  # git adds a tab after names that contain a space
    if raw == b"/dev/null":
        return None
    if raw.startswith(b'"'):
        raw = _unquote(raw)
    return os.fsdecode(raw[2:])  # drop a/ or b/


def _path_of_git_line(line: bytes) -> str:
    # Without ---/+++ lines (a mode change only) both names are the same: `a/X b/X`.
    names = line[len(b"diff --git "):]
    return _diff_path(names[:(len(names) - 1) // 2])


def _unquote(quoted: bytes) -> bytes:
    """Undo git's C-style quoting of unusual path names."""
    escapes = {b"a": b"\a", b"b": b"\b", b"t": b"\t", b"n": b"\n", b"v": b"\v", b"f": b"\f",
               b"r": b"\r", b'"': b'"', b"\\": b"\\"}
    return re.sub(rb'\\([0-7]{3}|.)', lambda m: bytes([int(m[1], 8)]) if len(m[1]) == 3
                  else escapes[m[1]], quoted[1:-1])


def _parse_hunk(lines: list[bytes], at: int, where: str) -> tuple[int, Hunk]:
    header = lines[at].rstrip(b"\n")
    match = _HUNK_HEADER.match(header)
    if not match:
        raise PatchError(f"{where}: malformed header {header!r}")
    old_left, new_left = int(match[2] or 1), int(match[4] or 1)
    old, new = [], []
    at += 1
    while old_left or new_left:
        if at == len(lines):
            raise PatchError(f"{where} ({header.decode()}) is cut short")
        line, at = lines[at], at + 1
        # An editor may have stripped the leading space of an empty context line.
        tag, text = (b" ", line) if line == b"\n" else (line[:1], line[1:])
        if tag not in (b" ", b"-", b"+"):
            raise PatchError(f"{where} ({header.decode()}): unexpected line {line!r}")
        if tag != b"+":
            old.append(text)
            old_left -= 1
        if tag != b"-":
            new.append(text)
            new_left -= 1
        if old_left < 0 or new_left < 0:
            raise PatchError(f"{where} ({header.decode()}) has more lines than its header counts")
        if at < len(lines) and lines[at].startswith(b"\\"):  # \ No newline at end of file
            at += 1
            if tag != b"+":
                old[-1] = old[-1].removesuffix(b"\n")
            if tag != b"-":
                new[-1] = new[-1].removesuffix(b"\n")
    return at, Hunk(header=header.decode(), old_start=int(match[1]), old=old, new=new)


def apply_diff(diff: bytes, tree: Path, name: str) -> list[str]:
    """Apply a git diff to the files under `tree`; `name` (the patch) is named in errors. Nothing
    is written unless every file applies. Returns the paths it changed."""
    planned = [(file_diff, _patched(file_diff, tree, name)) for file_diff in parse_diff(diff, name)]
    for file_diff, content in planned:
        _write(tree, file_diff, content)
    return [file_diff.path for file_diff, _ in planned]


def _target(tree: Path, path: str, name: str) -> Path:
    parts = PurePosixPath(path).parts
    if not parts or PurePosixPath(path).is_absolute() or ".." in parts:
        raise PatchError(f"{name}: {path}: path leaves the tree")
    return tree.joinpath(*parts)


def _patched(file_diff: FileDiff, tree: Path, name: str) -> bytes | None:
    """The file's new content, or None when the diff deletes it."""
    target = _target(tree, file_diff.path, name)
    if file_diff.kind == "create":
        if target.exists() or target.is_symlink():
            raise PatchError(f"{name}: {file_diff.path}: the patch creates it but it already exists")
        current = []
    elif target.is_file() and not target.is_symlink():
        current = split_lines(target.read_bytes())
    else:
        raise PatchError(f"{name}: {file_diff.path}: no such file in the tree")
    lines = _apply_hunks(current, file_diff, name)
    if file_diff.kind == "delete":
        if lines:
            raise PatchError(f"{name}: {file_diff.path}: the file holds lines the deletion does not list")
        return None
    return b"".join(lines)


def _apply_hunks(lines: list[bytes], file_diff: FileDiff, name: str) -> list[bytes]:
    result, cursor, offset = [], 0, 0
    for number, hunk in enumerate(file_diff.hunks, 1):
        # A hunk that only adds lines names the line after which they go.
        base = hunk.old_start - 1 if hunk.old else hunk.old_start
        at = _find(lines, hunk.old, base + offset, cursor)
        if at is None:
            raise PatchError(f"{name}: {file_diff.path}: hunk #{number} ({hunk.header}) does not "
                             "apply: its context and removed lines are not in the file")
        result += lines[cursor:at] + hunk.new
        cursor, offset = at + len(hunk.old), at - base
    return result + lines[cursor:]


def _find(lines: list[bytes], wanted: list[bytes], expected: int, lowest: int) -> int | None:
    """Where `wanted` occurs at or after `lowest`, nearest to `expected` first."""
    highest = len(lines) - len(wanted)
    for distance in range(max(expected - lowest, highest - expected) + 1):
        for at in (expected - distance, expected + distance):
            if lowest <= at <= highest and lines[at:at + len(wanted)] == wanted:
                return at
    return None


def _write(tree: Path, file_diff: FileDiff, content: bytes | None) -> None:
    target = tree.joinpath(*PurePosixPath(file_diff.path).parts)
    if content is None:
        target.unlink()
        # Like git apply, drop directories the deletion leaves empty.
        for parent in target.parents:
            if parent == tree or any(parent.iterdir()):
                break
            parent.rmdir()
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(content)
    if file_diff.mode is not None:
        target.chmod(0o755 if file_diff.mode == _EXECUTABLE else 0o644)
