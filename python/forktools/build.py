"""Build the patched flash_attn wheel into dist/, and beside it the patched flash-attn-4 one.

The wheel is compiled from a plain patched copy of flash-attn (the committed series plus the
overlay, as `apply --no-git` lays it) kept in build/wheel/flash-attn. Each build re-lays that copy
file by file, rewriting only files whose content changed, so ninja recompiles only what a change
touched. The wheel's local version, `+sparse.<hash>.<profile>`, names the exact series, overlay,
Python package, profile and archs it was built from. The flash-attn-4 wheel (pure Python, the
`[hopper]` extra's package with the stage-4 patches) is written by forktools.wheel_fa4, and the
FA-3 extension (upstream's `flash_attn_3` wheel) by forktools.build_fa3, in parallel with FA-2.

Profiles:
- dev: head dims 64 and 128, fp16 and bf16, forward only, no dropout/alibi/softcap/local/uneven
  head dims, one arch (sm_90 unless --arch says otherwise): what the tests need.
- full: upstream's matrix (all head dims, backward, every feature, sm_80/90/100/120).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forktools import ToolError, build_fa3, overlay, patchfile, series, wheel_fa4
from forktools.layout import Layout

UPSTREAM = "flash-attn"
DEV_FEATURES_OFF = ["BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL"]
DEV_HEAD_DIMS_OFF = [32, 96, 192, 256]
PROFILES = {
    "dev": {
        "archs": ["90"],
        "env": {**{f"FLASH_ATTENTION_DISABLE_{f}": "TRUE" for f in DEV_FEATURES_OFF},
                **{f"FLASH_ATTENTION_DISABLE_HDIM{d}": "TRUE" for d in DEV_HEAD_DIMS_OFF}},
    },
    "full": {"archs": ["80", "90", "100", "120"], "env": {}},
}
SYNCED_LIST = ".forktools-synced"  # files the last re-lay wrote, to drop those that went away
NINJA_PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def build(layout: Layout, profile: str = "dev", archs: list[str] | None = None,
          jobs: int | None = None, reuse: bool = False, mutations: list[Path] = (), install: bool = False,
          fa3: bool = True) -> Path:
    """Build the wheel into layout.root / "dist" and return its path.

    profile: "dev" or "full" (see the module docstring). archs: compute capabilities, e.g.
    ["90"]; None takes the profile's. jobs: parallel compile jobs, default one per CPU.
    reuse: if dist/ already holds the wheel of this exact series, profile and archs, return it
    without building.
    mutations: diffs applied on top of the patched tree, to check that the tests catch the
    defect they plant (tests/mutations/); the version label ends in `.mutant`.
    install: pip-install the wheels (without dependencies) into the running Python afterwards.
    fa3: also build the FA-3 wheel of the same profile (forktools.build_fa3), in a second thread.
    A mutation of hopper/ paths goes to that FA-3 build alone (FA-2 then builds unmutated); a
    flash-attn mutation alone leaves FA-3 out.
    """
    if profile not in PROFILES:
        raise ToolError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    archs = archs or PROFILES[profile]["archs"]
    fa3_mutations = [m for m in mutations if build_fa3.is_mutation_of_fa3(m)]
    mutations = [m for m in mutations if m not in fa3_mutations]
    label = f"sparse.{source_hash(layout, profile, archs, mutations)}.{profile}" + (".mutant" if mutations else "")
    dist = layout.root / "dist"
    fa4_wheel = wheel_fa4.build(layout)
    if install:
        install_wheel(fa4_wheel)
    fa3_build = (build_fa3.Background(layout, profile, jobs, reuse, fa3_mutations)
                 if fa3 and (fa3_mutations or not mutations) else None)
    if reuse:
        existing = sorted(dist.glob(f"flash_attn-*+{label}-*.whl"))
        if existing:
            print(f"build: reusing {existing[-1].relative_to(layout.root)}")
            _finish_fa3(fa3_build, install)
            if install:
                install_wheel(existing[-1])
            return existing[-1]
    stage = layout.root / "build" / "wheel" / UPSTREAM
    relay_tree(layout, stage)
    for mutation in mutations:
        patchfile.apply_diff(patchfile.split_description(Path(mutation).read_bytes()), stage, str(mutation))
        print(f"build: applied mutation {mutation}")
    env = build_env(layout, profile, archs, label, jobs)
    dist.mkdir(exist_ok=True)
    log_path = layout.root / "build" / "logs" / f"build-{profile}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-v",
               "-w", str(dist), "."]
    print(f"build: {profile} profile, archs {','.join(archs)}, {env['MAX_JOBS']} jobs, version label {label}")
    start, ninja_before = time.monotonic(), ninja_log_lengths(stage)
    returncode = _run_with_progress(command, stage, env, log_path)
    elapsed = time.monotonic() - start
    if returncode:
        raise ToolError(f"the build failed after {elapsed:.0f} s (exit {returncode}); see {log_path}")
    wheels = sorted(dist.glob(f"flash_attn-*+{label}-*.whl"))
    if not wheels:
        raise ToolError(f"the build finished but no wheel with version label {label} is in {dist}")
    size_mb = wheels[-1].stat().st_size / 1e6
    print(f"build: {wheels[-1].relative_to(layout.root)} ({size_mb:.1f} MB) in {elapsed:.0f} s")
    report_unit_times(stage, ninja_before, log_path.parent / f"units-{UPSTREAM}.txt")
    _finish_fa3(fa3_build, install)
    if install:
        install_wheel(wheels[-1])
    return wheels[-1]


def build_env(layout: Layout, profile: str, archs: list[str], label: str, jobs: int | None = None) -> dict:
    """The environment the patched setup.py builds the `profile` wheel under."""
    env = dict(os.environ)
    env.update(PROFILES[profile]["env"])
    env.update({
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",  # else setup.py downloads upstream's wheel
        "FLASH_ATTN_CUDA_ARCHS": ";".join(archs),
        "FLASH_ATTN_LOCAL_VERSION": label,
        "FLASH_ATTN_SPARSE_PROFILE": profile,  # recorded in flash_attn/_build_profile.py (patch 0006)
        # the [hopper] extra pins exactly the flash-attn-4 wheel build() writes (patch 0004)
        "FLASH_ATTN_SPARSE_FA4_LABEL": wheel_fa4.label(layout),
        "MAX_JOBS": str(jobs or os.cpu_count() or 1),
        "NVCC_THREADS": env.get("NVCC_THREADS", "1"),
    })
    return env


def _finish_fa3(fa3_build: build_fa3.Background | None, install: bool) -> None:
    if fa3_build is not None:
        wheel = fa3_build.result()
        if install:
            install_wheel(wheel)


def install_wheel(wheel: Path) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", str(wheel)]
    if subprocess.call(command):
        raise ToolError(f"could not install {wheel}")
    print(f"build: installed {wheel.name} into {sys.prefix}")


def source_hash(layout: Layout, profile: str, archs: list[str], mutations: list[Path] = (),
                name: str = UPSTREAM) -> str:
    """A short hash of everything upstream `name`'s wheel is built from in this repo, and of how."""
    digest = hashlib.sha256(f"{profile} {','.join(archs)}\n".encode())
    names = [name, wheel_fa4.UPSTREAM] if name == UPSTREAM else [name]  # its [hopper] extra names FA-4's label
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


def relay_tree(layout: Layout, stage: Path, name: str = UPSTREAM) -> None:
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


def _run_with_progress(command: list[str], cwd: Path, env: dict, log_path: Path, prefix: str = "") -> int:
    """Run the build, logging everything (each line after the seconds since the start, so the log
    shows where the time outside the compile units goes: setup, link, packaging) and echoing
    ninja's [n/N] progress and errors."""
    start = time.monotonic()
    with open(log_path, "w") as log, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True, bufsize=1) as process:
        for line in process.stdout:
            log.write(f"[{time.monotonic() - start:6.1f}] {line}")
            progress = NINJA_PROGRESS.match(line)
            if progress:
                source = re.search(r"(\S+\.(?:cu|cpp))\b", line)
                print(f"  {prefix}[{progress[1]}/{progress[2]}] {Path(source[1]).name if source else ''}", flush=True)
            elif " error" in line or line.startswith("error") or "Error" in line:
                print(f"  {prefix}{line.rstrip()}", flush=True)
    return process.returncode
