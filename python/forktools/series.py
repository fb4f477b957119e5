"""The patch series: apply it onto the pristine upstream releases, export the applied trees back
into patch files, and check that the two agree.

patches/series lists every patch with its stage, grouped by upstream in lock-file order, under a
header naming the releases the patches are made against. Export writes it; nobody edits it.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
from pathlib import Path

from forktools import ToolError, gittree, lockfile, overlay, patchfile, upstream
from forktools.layout import Layout
from forktools.patchfile import Patch, PatchError
from forktools.upstream import Pin

SERIES_HEADER = ("# Patch series over pinned upstream releases, applied in this order. "
                 "Written by `nox -s export`.\n")
# A release is named by what checks it: an sdist's sha256, or a composed tree's git tree id.
_BASE_LINE = re.compile(r"# base (\S+) (\S+) (sha256:[0-9a-f]{64}|tree:[0-9a-f]{40})")
_ENTRY_LINE = re.compile(r"([^/\s]+)/([^/\s]+\.patch) stage=(\d+)")
# Build outputs a developer may leave in a tree; excluded so they never block export.
BUILD_OUTPUTS = ["__pycache__/", "/build/", "/dist/", "*.so"]
_PAST = {"add": "added", "change": "changed", "remove": "removed"}


@dataclasses.dataclass(frozen=True)
class Entry:
    upstream: str
    file: str
    stage: int

    @property
    def path(self) -> str:
        """Where the patch file is, relative to patches/."""
        return f"{self.upstream}/{self.file}"


@dataclasses.dataclass(frozen=True)
class Series:
    bases: list[tuple[str, str, str]] | None  # (name, version, Pin.content); None: no series file yet
    entries: list[Entry]


def read_series(path: Path) -> Series:
    """The series file; a missing one is the empty series."""
    if not path.exists():
        return Series(bases=None, entries=[])
    bases, entries = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if base := _BASE_LINE.fullmatch(line):
            bases.append(base.groups())
        elif entry := _ENTRY_LINE.fullmatch(line):
            entries.append(Entry(entry[1], entry[2], int(entry[3])))
        elif line.strip() and not line.startswith("#"):
            raise ToolError(f"{path}:{number}: cannot read {line!r}")
    return Series(bases=bases, entries=entries)


def render_series(pins: list[Pin], entries: list[Entry]) -> bytes:
    lines = [f"# base {pin.name} {pin.version} {pin.content}\n" for pin in pins]
    lines += [f"{entry.path} stage={entry.stage}\n" for entry in entries]
    return (SERIES_HEADER + "".join(lines)).encode()


def read_patch(layout: Layout, entry: Entry) -> Patch:
    return patchfile.parse(_patch_bytes(layout, entry), entry.path)


def _patch_bytes(layout: Layout, entry: Entry) -> bytes:
    path = layout.patches / entry.path
    if not path.exists():
        raise ToolError(f"the series lists {entry.path}, but patches/{entry.path} does not exist")
    return path.read_bytes()


def apply(layout: Layout, force: bool = False, use_git: bool | None = None) -> None:
    """Build trees/<name> for every upstream: the pristine release committed and tagged
    `upstream`, one commit per patch in series order (fixed identity and dates, so commit ids are
    reproducible), then the overlay. Without git (none on PATH, or use_git=False) the trees are
    plain patched copies.

    An existing tree is replaced only when it holds nothing beyond the committed patches, or
    when `force` says to discard it.
    """
    use_git = gittree.available() if use_git is None else use_git
    pins = upstream.load_pins(layout.lock)
    series = read_series(layout.series)
    problems = _base_problems(series, pins)
    if problems:
        raise ToolError(_bullets(problems))
    trees = {pin.name: layout.trees / pin.name for pin in pins}
    if not force:  # refuse before any tree is touched
        for pin in pins:
            _refuse_to_discard_work(layout, pin, trees[pin.name])
    for pin in pins:
        if trees[pin.name].exists():
            shutil.rmtree(trees[pin.name])  # does not follow the overlay's symlinks into the repo
        entries = [entry for entry in series.entries if entry.upstream == pin.name]
        _build_tree(layout, pin, trees[pin.name], entries, use_git)


def materialize(layout: Layout, name: str, dest: Path) -> None:
    """A plain patched copy of upstream `name` (committed series plus overlay, no git) at dest,
    which must not exist: what a build compiles."""
    pins = upstream.load_pins(layout.lock)
    pin = lockfile.named(pins, name, "upstream")
    series = read_series(layout.series)
    problems = _base_problems(series, pins)
    if problems:
        raise ToolError(_bullets(problems))
    _build_tree(layout, pin, dest, [entry for entry in series.entries if entry.upstream == name], use_git=False)


def export(layout: Layout) -> None:
    """Write patches/<name>/NNNN-<slug>.patch for the commits upstream..HEAD of every tree, delete
    stale patch files and rewrite patches/series; an upstream without a tree keeps its committed
    patches. Refuses (writing nothing) while any tree has uncommitted changes or a commit that
    cannot become a patch. Exporting twice gives the same bytes."""
    pins = upstream.load_pins(layout.lock)
    exported = _exported_files(layout, pins)
    for change, path in _differences(exported, _committed_files(layout, pins)):
        target = layout.patches / path
        if change == "remove":
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(exported[path])
        print(f"  {_PAST[change]} patches/{path}")
    print(f"export: {len(exported) - 1} patches over {len(pins)} upstreams")


def check(layout: Layout) -> None:
    """Fail (ToolError with a summary) unless (a) the series header names the pinned releases,
    (b) applying the series to the pristine releases and exporting it reproduces patches/ byte
    for byte, and (c) no existing tree under layout.trees holds uncommitted changes or commits
    that would export differently."""
    pins = upstream.load_pins(layout.lock)
    series = read_series(layout.series)
    committed = _committed_files(layout, pins)
    committed.setdefault("series", render_series(pins, []))  # no series file yet: the empty series
    problems = _base_problems(series, pins)
    if not problems:
        problems += _reapply_problems(layout, pins, committed)
    for pin in pins:
        tree = layout.trees / pin.name
        if tree.exists():
            problems += _tree_problems(pin, tree, committed, check_base=True)
    if problems:
        raise ToolError("check-patches: FAILED\n" + _bullets(problems))
    print(f"check-patches: OK ({len(series.entries)} patches over {len(pins)} upstreams)")


def _bullets(lines: list[str]) -> str:
    return "\n".join(f"  - {line}" for line in lines)


def _upstream_message(pin: Pin) -> str:
    return f"upstream: {pin.name} {pin.version}"


def _base_problems(series: Series, pins: list[Pin]) -> list[str]:
    """Where the series header disagrees with the lock file."""
    if series.bases is None:
        return []
    problems = []
    pinned = [(pin.name, pin.version, pin.content) for pin in pins]
    if series.bases != pinned:
        problems.append(f"the series is made against {_describe(series.bases)}, "
                        f"but the lock pins {_describe(pinned)}")
    unknown = sorted({entry.upstream for entry in series.entries} - {pin.name for pin in pins})
    if unknown:
        problems.append(f"the series has patches for upstreams the lock does not pin: {', '.join(unknown)}")
    return problems


def _describe(bases: list[tuple[str, str, str]]) -> str:
    return "; ".join(f"{name} {version} {content}" for name, version, content in bases) or "nothing"


def _refuse_to_discard_work(layout: Layout, pin: Pin, tree: Path) -> None:
    if not tree.exists():
        return
    unsaved = _tree_problems(pin, tree, _committed_files(layout, [pin]), check_base=False)
    if unsaved:
        raise ToolError(f"{tree} holds work that is not in patches/:\n{_bullets(unsaved)}\n"
                        "Export it (`nox -s export`) or pass --force to discard it.")


def _build_tree(layout: Layout, pin: Pin, tree: Path, entries: list[Entry], use_git: bool) -> None:
    upstream.unpack(layout, pin.name, tree)
    if use_git:
        gittree.init_upstream(tree, _upstream_message(pin))
    for entry in entries:
        patch = read_patch(layout, entry)
        try:
            patchfile.apply_diff(patch.diff, tree, entry.path)
        except PatchError as err:
            raise PatchError(f"{err}\n{tree} is left with the patches before it applied.") from None
        if use_git:
            gittree.commit_all(tree, patch.message)
    laid = overlay.lay(layout, pin.name, tree, link=use_git)
    if use_git:
        gittree.write_exclude(tree, [overlay.exclude_pattern(path) for path in laid] + BUILD_OUTPUTS)
    print(f"{pin.name}: {tree} ({len(entries)} patches, {len(laid)} overlay paths)")


def _export_tree(pin: Pin, tree: Path, check_base: bool = True) -> list[tuple[Entry, bytes]]:
    """The series entries and patch files of the commits upstream..HEAD of `tree`."""
    if not gittree.is_repo(tree):
        raise ToolError(f"{tree} is not a git tree (applied with --no-git?), so its edits cannot "
                        "be told from the patches; re-apply it with git")
    base = gittree.upstream_subject(tree)
    if base is None:
        raise ToolError(f"{tree} has no `{gittree.UPSTREAM_TAG}` tag, so it was not made by "
                        "`forktools apply`")
    if check_base and base != _upstream_message(pin):
        raise ToolError(f"{tree} is based on `{base}`, but the lock pins {pin.name} {pin.version}")
    dirty = gittree.dirty_paths(tree)
    if dirty:
        raise ToolError(f"{tree} has uncommitted changes; commit each into the patch it belongs "
                        f"to first:\n{_bullets(dirty)}")
    exported = []
    for number, commit in enumerate(gittree.commits_since_upstream(tree), 1):
        patch = _patch_of(tree, commit)
        entry = Entry(pin.name, patchfile.file_name(number, patch.title), patch.stage)
        exported.append((entry, patchfile.render(patch)))
    return exported


def _patch_of(tree: Path, commit: gittree.Commit) -> Patch:
    message = gittree.commit_message(tree, commit.sha)
    subject = message.partition("\n")[0]
    where = f"{tree}: commit {commit.sha[:12]} ({subject})"
    if len(commit.parents) != 1:
        raise ToolError(f"{where} is a merge; the series must be a straight line of commits")
    try:
        patchfile.stage_and_title(message)
    except ValueError as err:
        raise ToolError(f"{where}: {err}; a patch commit needs the message `[stage N] Title`, a "
                        "body saying why, and a `Stage: N` trailer") from None
    parent = commit.parents[0]
    diff = gittree.diff(tree, parent, commit.sha)
    if not diff:
        raise ToolError(f"{where} changes nothing")
    patchfile.parse_diff(diff, where)  # export only what the applier can apply
    return Patch(message=message, stat=gittree.diffstat(tree, parent, commit.sha), diff=diff)


def _exported_files(layout: Layout, pins: list[Pin]) -> dict[str, bytes]:
    """patches/ as exporting the trees would write it: path under patches/ → content. An
    upstream without a tree keeps its committed patches."""
    committed = read_series(layout.series).entries
    files, entries = {}, []
    for pin in pins:
        tree = layout.trees / pin.name
        if tree.exists():
            exported = _export_tree(pin, tree)
        else:
            print(f"{pin.name}: no tree at {tree}; keeping its committed patches")
            exported = [(entry, _patch_bytes(layout, entry))
                        for entry in committed if entry.upstream == pin.name]
        for entry, data in exported:
            entries.append(entry)
            files[entry.path] = data
    files["series"] = render_series(pins, entries)
    return files


def _committed_files(layout: Layout, pins: list[Pin]) -> dict[str, bytes]:
    """patches/ as it is: the series file, if any, and the patch files of every upstream."""
    files = {"series": layout.series.read_bytes()} if layout.series.exists() else {}
    for pin in pins:
        for path in sorted((layout.patches / pin.name).glob("*.patch")):
            files[f"{pin.name}/{path.name}"] = path.read_bytes()
    return files


def _differences(wanted: dict[str, bytes], present: dict[str, bytes]) -> list[tuple[str, str]]:
    """(change, path) turning `present` into `wanted`: "add", "change" or "remove"."""
    changes = []
    for path in sorted(wanted.keys() | present.keys()):
        if path not in present:
            changes.append(("add", path))
        elif path not in wanted:
            changes.append(("remove", path))
        elif wanted[path] != present[path]:
            changes.append(("change", path))
    return changes


def _reapply_problems(layout: Layout, pins: list[Pin], committed: dict[str, bytes]) -> list[str]:
    """How applying the series to the pristine releases and exporting it differs from patches/."""
    upstream.fetch(layout)
    with tempfile.TemporaryDirectory(prefix="forktools-check-") as scratch:
        scratch_layout = layout.with_trees(scratch)
        try:
            apply(scratch_layout, use_git=True)
            exported = _exported_files(scratch_layout, pins)
        except ToolError as err:
            return [f"applying the series to the pristine releases failed: {err}"]
    wording = {
        "change": "patches/{} is not what applying and exporting the series gives "
                  "(apply, then export, to rewrite it)",
        "add": "patches/{} is missing, though applying and exporting the series gives it",
        "remove": "patches/{} is stale: the series does not produce it",
    }
    return [wording[change].format(path) for change, path in _differences(exported, committed)]


def _tree_problems(pin: Pin, tree: Path, committed: dict[str, bytes], check_base: bool) -> list[str]:
    """How `tree` holds work that the committed patches of its upstream lack."""
    try:
        exported = {entry.path: data for entry, data in _export_tree(pin, tree, check_base)}
    except ToolError as err:
        return [str(err)]
    own = {path: data for path, data in committed.items() if path.startswith(f"{pin.name}/")}
    return [f"{tree}: exporting would {change} patches/{path}"
            for change, path in _differences(exported, own)]
