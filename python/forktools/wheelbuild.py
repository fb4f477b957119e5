"""What the FA-2 and FA-3 wheel builds share: the hash a wheel's version label names, the
patched tree re-laid file by file (so ninja recompiles only what changed), and the compile run
with its log, progress and per-unit times."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forktools import overlay, patchfile, series, wheel_fa4
from forktools.layout import Layout

SYNCED_LIST = ".forktools-synced"  # files the last re-lay wrote, to drop those that went away
NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")
FA2 = "flash-attn"


def pip_wheel_command(dist: Path) -> list[str]:
    """`pip wheel` of the tree in the working folder into dist, with the running Python's torch."""
    return [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-v", "-w", str(dist), "."]


def source_hash(layout: Layout, profile: str, archs: list[str], mutations: list[Path] = (),
                name: str = FA2) -> str:
    """A short hash of everything upstream `name`'s wheel is built from in this repo, and of how."""
    digest = hashlib.sha256(f"{profile} {','.join(archs)}\n".encode())
    names = [name, wheel_fa4.UPSTREAM] if name == FA2 else [name]  # its [hopper] extra names FA-4's label
    # The series' lines of these upstreams only: a patch added to another one rebuilds nothing here.
    for line in layout.series.read_text().splitlines():
        if any(line.startswith(f"{n}/") or line.startswith(f"# base {n} ") for n in names):
            digest.update(line.encode() + b"\n")
    inputs = [layout.lock, *(patch for n in names for patch in sorted((layout.patches / n).glob("*.patch")))]
    inputs += [Path(m).resolve() for m in mutations]
    inputs += [path for _, path in sorted(overlay.sources(layout, name).items())]
    for path in inputs:
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) if path.is_dir() else [path]
        for file in files:
            digest.update(os.path.relpath(file, layout.root).encode() + b"\0" + built_content(file))
    return digest.hexdigest()[:10]


def built_content(file: Path) -> bytes:
    """What of a file the build depends on: a patch's diff, not its description (why it exists,
    its upstream status), so that editing a header does not rebuild a wheel."""
    data = file.read_bytes()
    if file.suffix == ".patch":
        try:
            return patchfile.split_description(data)
        except patchfile.PatchError:  # no diff in it (yet): all of it
            return data
    return data


def relay_tree(layout: Layout, stage: Path, name: str = FA2) -> None:
    """Make `stage` hold exactly the patched tree of `name`, touching only files whose content changed."""
    with tempfile.TemporaryDirectory(prefix="forktools-build-") as scratch:
        fresh = Path(scratch) / name
        series.materialize(layout, name, fresh)
        wanted = sorted(p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file())
        stage.mkdir(parents=True, exist_ok=True)
        changed = 0
        for relative in wanted:
            source, target = fresh / relative, stage / relative
            if target.is_file() and target.read_bytes() == source.read_bytes():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)  # a new mtime, so ninja sees the change
            changed += 1
    synced = stage / SYNCED_LIST
    previous = set(synced.read_text().splitlines()) if synced.exists() else set()
    for relative in sorted(previous - set(wanted)):
        (stage / relative).unlink(missing_ok=True)
    synced.write_text("\n".join(wanted) + "\n")
    print(f"build: {stage} has the patched tree ({changed} of {len(wanted)} files rewritten)")


def ninja_log_lengths(tree: Path) -> dict[Path, int]:
    """Lines in each ninja log under `tree` now: what a build appends after them is its own."""
    return {log: len(log.read_text().splitlines()) for log in tree.rglob(".ninja_log")}


def unit_times(tree: Path, before: dict[Path, int]) -> list[tuple[float, str, float, float]]:
    """(seconds, unit, start, end) of each unit compiled under `tree` since `before`
    (ninja_log_lengths), slowest first, from ninja's own log (.ninja_log: start and end in ms
    since that ninja run began, so start and end say which units ran together and which came last)."""
    times = {}
    for ninja_log in tree.rglob(".ninja_log"):
        for line in ninja_log.read_text().splitlines()[before.get(ninja_log, 0):]:
            fields = line.split("\t")
            if not line.startswith("#") and len(fields) >= 4:
                times[fields[3]] = (int(fields[0]) / 1000, int(fields[1]) / 1000)
    return sorted(((end - start, Path(target).name, start, end) for target, (start, end) in times.items()), reverse=True)


def report_unit_times(tree: Path, before: dict[Path, int], out: Path) -> None:
    """Write each unit's compile time, start and end to `out` and print the sum and the slowest
    three (where the build's wall time goes: the units are compiled MAX_JOBS at a time)."""
    times = unit_times(tree, before)
    if not times:
        return
    out.write_text("".join(f"{seconds:8.1f} s  {unit}  ({start:.0f}-{end:.0f} s)\n" for seconds, unit, start, end in times))
    slowest = ", ".join(f"{unit} {seconds:.0f} s" for seconds, unit, _, _ in times[:3])
    print(f"build: {len(times)} units compiled, {sum(t[0] for t in times):.0f} s of compiler time; slowest {slowest} "
          f"(all: {out.name})", flush=True)


def run_with_progress(command: list[str], cwd: Path, env: dict, log_path: Path, prefix: str = "",
                      on_start=None) -> int:
    """Run the build, logging everything (each line after the seconds since the start, so the log
    shows where the time outside the compile units goes: setup, link, packaging) and echoing
    ninja's [n/N] progress and errors. The build runs in its own process group, which is stopped
    whole (pip, setup.py, ninja, nvcc) if the caller is interrupted; on_start gets the process."""
    start = time.monotonic()
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1,
                                                      start_new_session=True) as process:
        try:
            if on_start is not None:
                on_start(process)
            for line in process.stdout:
                log.write(f"[{time.monotonic() - start:6.1f}] {line}")
                progress = NINJA_PROGRESS.match(line)
                if progress:
                    source = re.search(r"(\S+\.(?:cu|cpp))\b", line)
                    print(f"  {prefix}[{progress[1]}/{progress[2]}] {Path(source[1]).name if source else ''}", flush=True)
                elif " error" in line or line.startswith("error") or "Error" in line:
                    print(f"  {prefix}{line.rstrip()}", flush=True)
        except BaseException:
            stop(process)
            raise
    return process.returncode


def stop(process: subprocess.Popen) -> None:
    """Stop a build started by run_with_progress, with every process it started."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
