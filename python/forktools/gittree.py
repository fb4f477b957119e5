"""Git plumbing for the applied trees.

Every call shuts out the caller's global and system git config, GIT_* variables and locale, so
that commit ids, diffs and diffstats (whose summary line git translates) come out the same for
everyone who runs the tooling.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

from forktools import ToolError

UPSTREAM_TAG = "upstream"
BRANCH = "main"
_FIXED_DATE = "2000-01-01T00:00:00+0000"
# A fixed identity and date make applying the same series give the same commit ids anywhere.
_IDENTITY = {
    "GIT_AUTHOR_NAME": "forktools",
    "GIT_AUTHOR_EMAIL": "forktools@localhost",
    "GIT_AUTHOR_DATE": _FIXED_DATE,
    "GIT_COMMITTER_NAME": "forktools",
    "GIT_COMMITTER_EMAIL": "forktools@localhost",
    "GIT_COMMITTER_DATE": _FIXED_DATE,
}


@dataclasses.dataclass(frozen=True)
class Commit:
    sha: str
    parents: tuple[str, ...]


def available() -> bool:
    return shutil.which("git") is not None


def is_repo(tree: Path) -> bool:
    return (tree / ".git").is_dir()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        # Never take the index lock just to refresh it: a developer may be working in the tree.
        GIT_OPTIONAL_LOCKS="0",
        LC_ALL="C",
        LANGUAGE="C",
    )
    env.update(extra or {})
    return env


def _run(tree: Path, *args: str, input: bytes | None = None,
         extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(tree), *args], input=input, capture_output=True,
                          env=_env(extra_env))


def _git(tree: Path, *args: str, input: bytes | None = None,
         extra_env: dict[str, str] | None = None) -> bytes:
    result = _run(tree, *args, input=input, extra_env=extra_env)
    if result.returncode:
        stderr = result.stderr.decode(errors="replace").strip()
        raise ToolError(f"`git {' '.join(args)}` failed in {tree}:\n{stderr}")
    return result.stdout


def init_upstream(tree: Path, message: str) -> None:
    """Make the unpacked tree a repo whose first commit, tagged `upstream`, holds all of it."""
    _git(tree, "init", "-q", "-b", BRANCH)
    commit_all(tree, message)
    _git(tree, "tag", UPSTREAM_TAG)


def commit_all(tree: Path, message: str) -> None:
    """Commit every file in the tree, ignored ones included: while applying, the tree holds only
    upstream and patch content, and an upstream .gitignore must not drop any of it."""
    _git(tree, "add", "-A", "-f", ".")
    _git(tree, "commit", "-q", "--no-verify", "--cleanup=verbatim", "-F", "-",
         input=message.rstrip("\n").encode() + b"\n", extra_env=_IDENTITY)


def write_exclude(tree: Path, patterns: list[str]) -> None:
    lines = ["# Written by forktools apply: laid-in overlay files and build outputs,",
             "# which export must never turn into patches.", *patterns]
    (tree / ".git" / "info").mkdir(exist_ok=True)
    (tree / ".git" / "info" / "exclude").write_text("".join(line + "\n" for line in lines))


def upstream_subject(tree: Path) -> str | None:
    """Subject of the commit the `upstream` tag names, or None when there is no such tag."""
    result = _run(tree, "log", "-1", "--format=%s", f"refs/tags/{UPSTREAM_TAG}", "--")
    return result.stdout.decode().strip() if result.returncode == 0 else None


def dirty_paths(tree: Path) -> list[str]:
    """Uncommitted changes to tracked files and untracked files that are not excluded, each as
    git status shows it (`XY path`)."""
    entries = iter(_git(tree, "status", "--porcelain=v1", "-z", "--untracked-files=all").split(b"\0"))
    dirty = []
    for entry in entries:
        if not entry:
            continue
        code = entry[:2].decode()
        dirty.append(f"{code} {os.fsdecode(entry[3:])}")
        if code[0] in "RC":
            next(entries, None)  # a staged rename or copy is followed by its source path
    return dirty


def commits_since_upstream(tree: Path) -> list[Commit]:
    """The commits on top of the `upstream` tag, oldest first."""
    if _run(tree, "merge-base", "--is-ancestor", UPSTREAM_TAG, "HEAD").returncode:
        raise ToolError(f"{tree}: HEAD does not descend from the `{UPSTREAM_TAG}` tag")
    listing = _git(tree, "rev-list", "--reverse", "--parents", f"{UPSTREAM_TAG}..HEAD").decode()
    return [Commit(sha, tuple(parents)) for sha, *parents in map(str.split, listing.splitlines())]


def commit_message(tree: Path, sha: str) -> str:
    """The raw commit message, without its trailing newline."""
    raw = _git(tree, "cat-file", "commit", sha)
    return raw.partition(b"\n\n")[2].decode("utf-8").rstrip("\n")


def diff(tree: Path, parent: str, sha: str) -> bytes:
    return _git(tree, "diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index", "-U3",
                parent, sha, "--")


def diffstat(tree: Path, parent: str, sha: str) -> bytes:
    return _git(tree, "diff", "--stat=80", "--no-renames", parent, sha, "--")


def tags_at_head(tree: Path) -> list[str]:
    """Tags on the commit checked out in the repo around `tree`; none outside a repo."""
    if not available():
        return []
    result = _run(tree, "tag", "--points-at", "HEAD")
    return result.stdout.decode().split() if result.returncode == 0 else []
