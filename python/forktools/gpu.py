"""`python -m forktools gpu STEP...`: one call on the GPU machine (no package index there).

It gets the wheel (built from the carried upstream cache, or a carried wheel reused), installs it
into a scratch folder, then runs the steps named, in the order given (`--list` shows them). Every
result and log goes under one output folder (default $OUT); the logs come back as one tarball,
and the last thing printed is a summary table. `--dry-run` prints the command lines instead.
The CuTe-DSL runtime (FA-4's) is unpacked by benchmarks/gpu_session.sh, which then calls this.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from forktools import build_fa3, gpu_steps
from forktools.layout import Layout

CARRIED_WHEEL = ".carry/wheel/dist-wheel.tar"
CARRIED_FA3_WHEEL = ".carry/wheel/dist-fa3-wheel.tar"  # flash_attn_3, reused like the flash-attn one
BUILD_TIME = re.compile(r"in (\d+) s")


@dataclasses.dataclass
class Session:
    """The state of one call: options, where things go, the environment the steps run in."""
    root: Path
    out: Path
    scratch: Path
    options: argparse.Namespace
    dry_run: bool = False
    env: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    commands: list = dataclasses.field(default_factory=list)
    worst_rc: int = 0
    last_rc: int = 0
    fa4_wheel: Path | None = None
    mutant_wheel: Path | None = None
    return_wheels: bool = True  # tar the wheels into $OUT (prepare_wheel: only those built here)
    # time.monotonic() past which no command starts and running ones are cut (--deadline-s)
    deadline: float | None = None

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def cutedsl_site(self) -> Path | None:
        return self.options.cutedsl_site

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def run(self, command: list, output: Path | None = None, append: bool = False, timeout: int | None = None,
            env: dict | None = None, stderr: Path | None = None, cwd: Path | None = None) -> int:
        """Run `command` from the repo root in the session's environment (plus `env`), its stdout
        (and stderr, unless `stderr` names a file) into `output`; 124 when it passed `timeout` s or
        the session's deadline (then it is killed with every process below it: a build's compilers too)."""
        words = [str(word) for word in command]
        line = shlex.join(words) + (f" {'>>' if append else '>'} {output}" if output else "")
        self.commands.append(line)
        if self.dry_run:
            print(f"+ {line}")
            return 0
        left = self.seconds_left()
        if left is not None and left <= 0:
            self.note(f"deadline: not started: {line}")
            self.worst_rc, self.last_rc = max(self.worst_rc, 124), 124
            return 124
        limits = [t for t in (timeout, left) if t is not None]
        limit = min(limits) if limits else None
        full_env = {**os.environ, **self.env, **(env or {})}
        mode = "a" if append else "w"
        with open(output, mode) if output else _Inherit() as out, open(stderr, "a") if stderr else _Inherit() as err:
            try:
                child = subprocess.Popen(words, cwd=cwd or self.root, env=full_env, stdout=out,
                                         stderr=err if stderr else (subprocess.STDOUT if output else None))
            except FileNotFoundError:  # e.g. no ncu on this machine
                print(f"{words[0]}: not found", file=out or sys.stdout)
                rc = 127
            else:
                try:
                    rc = child.wait(timeout=limit)
                except subprocess.TimeoutExpired:
                    _kill_tree(child)
                    rc = 124
                    if left is not None and limit == left:
                        self.note(f"deadline: cut after {limit:.0f} s: {line}")
        self.worst_rc, self.last_rc = max(self.worst_rc, rc), rc
        return rc

    def act(self, description: str, action, *args) -> None:
        """A file operation: done, or only shown in a dry run."""
        self.commands.append(description)
        if self.dry_run:
            print(f"+ {description}")
        else:
            action(*args)

    def forktools(self, *args: str, output: Path) -> int:
        """`python -m forktools ARGS` from this checkout (before any wheel is on the path)."""
        return self.run([sys.executable, "-m", "forktools", *args], output=output,
                        env={"PYTHONPATH": str(self.root / "python")})

    def pip_install(self, wheel: Path, target: Path, upgrade: bool = False) -> int:
        return self.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                         *(["--upgrade"] if upgrade else []), "--target", target, wheel])

    def lay_fa4_wheel(self, wheel: Path | None) -> int:
        """A flash-attn-4 wheel laid over the CuTe-DSL runtime's own."""
        if not (self.cutedsl_site and wheel):
            return 0
        return self.pip_install(wheel, self.cutedsl_site, upgrade=True)

    def newest(self, pattern: str, exclude: str | None = None) -> Path | None:
        found = [p for p in (self.root / "dist").glob(pattern) if not (exclude and exclude in p.name)]
        if self.dry_run and not found:
            return self.root / "dist" / pattern.replace("*", "X")
        return max(found, key=lambda p: p.stat().st_mtime) if found else None

    def read(self, path: Path) -> str:
        return "" if self.dry_run or not path.exists() else path.read_text(errors="replace")


def _kill_tree(child: subprocess.Popen) -> None:
    """SIGKILL the child and every process below it, parents first, then reap the child. The tree
    is read from /proc: the children stay in this process group, so a kill of the whole call
    (the device tool's, at its limit) still reaches them."""
    below: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        below.setdefault(parent, []).append(int(stat.parent.name))
    pending = [child.pid]
    while pending:
        pid = pending.pop(0)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pending += below.get(pid, [])
    child.wait()


class _Inherit:
    """A stand-in for an open file: the child inherits this process's stream."""
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _extract(tar_path: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")


def describe_machine(session: Session) -> None:
    gpu_txt = session.logs / "gpu.txt"
    session.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used", "--format=csv"],
                output=gpu_txt)
    session.run([sys.executable, "-c", "import torch, sys; print('python', sys.version.split()[0], 'torch', "
                 "torch.__version__, 'cuda', torch.version.cuda)"], output=gpu_txt, append=True)
    commit_file = session.root / ".commit"
    commit = commit_file.read_text().strip() if commit_file.exists() else "unknown"
    lines = session.read(gpu_txt).splitlines()
    session.note(f"commit {commit}, {time.strftime('%Y-%m-%d', time.gmtime())}, {lines[1] if len(lines) > 1 else '?'}")


def prepare_wheel(session: Session) -> Path | None:
    """The one way to the wheel: a given one (--wheel), the carried one beside a fresh flash-attn-4
    wheel (--reuse-fa2-wheel), or a build that reuses the carried wheel when its label (the hash
    of the patched tree and profile) is this commit's. None when that failed."""
    options, given = session.options, session.scratch / "given-wheel"
    if options.wheel or options.reuse_fa2_wheel:
        session.act(f"extract {options.wheel or CARRIED_WHEEL} into {given}", _extract,
                    session.root / (options.wheel or CARRIED_WHEEL), given)
        found = sorted(given.glob("flash_attn-*.whl")) or [given / "flash_attn-X.whl"]
        wheel = found[0]
    if options.wheel:
        session.note(f"wheel given: {wheel.name} (no build)")
        return wheel
    if session.forktools("upstream", "--offline", output=session.logs / "upstream.log"):
        session.note("upstream cache: FAILED (see upstream.log)")
        return None
    if options.reuse_fa2_wheel:
        if session.forktools("build", "--fa4-only", output=session.logs / "build.log"):
            session.note("flash-attn-4 wheel: FAILED (see build.log)")
            return None
        session.return_wheels = False  # carried: already on the other side (carried_or_built_fa3_wheel may build one)
        carried_or_built_fa3_wheel(session)
        session.env["PYTHONPATH"] = str(session.root / "python")
        session.note(f"wheel reused: {wheel.name} (no build); flash-attn-4 wheel built here; python/ first on the path")
        return wheel
    for carried_tar in (CARRIED_WHEEL, CARRIED_FA3_WHEEL):
        carried = session.root / carried_tar
        if carried.exists():
            session.act(f"extract {carried_tar} into dist/", _extract, carried, session.root / "dist")
    start = time.monotonic()
    build_log = session.logs / "build.log"
    rc = session.forktools("build", "--profile", "dev", "--jobs", str(os.cpu_count() or 1), "--reuse",
                           *(["--no-fa3"] if options.no_fa3 else []), output=build_log)
    session.act("copy build/logs/build-dev.log to logs/build-full.log", _copy_if_there,
                session.root / "build/logs/build-dev.log", session.logs / "build-full.log")
    session.act("copy build/logs/build-fa3-dev.log to logs/build-fa3-full.log", _copy_if_there,
                session.root / "build/logs/build-fa3-dev.log", session.logs / "build-fa3-full.log")
    for units in ("units-flash-attn.txt", "units-flash-attn-3.txt"):  # per-unit compile times (build.report_unit_times)
        session.act(f"copy build/logs/{units} to logs/", _copy_if_there, session.root / "build/logs" / units, session.logs / units)
    wheel = session.newest("flash_attn-*.whl", exclude="mutant")
    if rc or not wheel:
        session.note("build: FAILED (see build.log, build-full.log)")
        return None
    took = BUILD_TIME.findall(session.read(build_log))
    # The device tool returns at most 8 files from $OUT: wheels go back only when built here (a
    # carried wheel is already on the other side), leaving room for the logs and results.
    session.return_wheels = bool(took) or session.dry_run
    size = 0 if session.dry_run else wheel.stat().st_size >> 20
    session.note(f"build: {'in ' + took[-1] + ' s' if took else 'reused'} (wall {time.monotonic() - start:.0f} s),"
                 f" {wheel.name}, {size} MB")
    return wheel


def carried_or_built_fa3_wheel(session: Session) -> None:
    """With --reuse-fa2-wheel: the carried flash_attn_3 wheel into dist/ when it is this commit's
    (its label hashes the FA-3 patches and overlay, not python/), else FA-3 built here alone."""
    carried = session.root / CARRIED_FA3_WHEEL
    label = build_fa3.version_label(Layout.at(session.root))
    staged = session.scratch / "given-fa3-wheel"
    session.act(f"empty {staged}", gpu_steps.recreate, staged)
    if carried.exists():
        session.act(f"extract {CARRIED_FA3_WHEEL} into {staged}", _extract, carried, staged)
    matching = sorted(staged.glob(build_fa3.wheel_glob(label)))
    if matching or session.dry_run:
        session.act(f"copy the carried flash_attn_3 wheel ({label}) into dist/", _copy_into, matching, session.root / "dist")
        return
    names = ", ".join(p.name for p in staged.glob("*.whl")) or "none carried"
    log = session.logs / "build-fa3.log"
    rc = session.forktools("build", "--fa3-only", "--profile", "dev", "--jobs", str(os.cpu_count() or 1), "--reuse",
                           output=log)
    session.act("copy build/logs/units-flash-attn-3.txt to logs/", _copy_if_there,
                session.root / "build/logs/units-flash-attn-3.txt", session.logs / "units-flash-attn-3.txt")
    took = BUILD_TIME.findall(session.read(log))
    session.return_wheels = not rc
    session.note(f"flash_attn_3: built here ({names} is not {label}): " +
                 (f"in {took[-1]} s" if not rc and took else "FAILED (see build-fa3.log); the fa3 backend is absent"))


def _copy_into(files: list[Path], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copyfile(file, folder / file.name)


def _copy_if_there(source: Path, target: Path) -> None:
    if source.exists():
        shutil.copyfile(source, target)


def install(session: Session, wheel: Path) -> bool:
    site = session.scratch / "site"
    session.act(f"empty {site}", gpu_steps.recreate, site)
    if session.pip_install(wheel, site):
        session.note("install: FAILED")
        return False
    cutedsl = [session.cutedsl_site, session.cutedsl_site / "nvidia_cutlass_dsl/dsl_packages"] if session.cutedsl_site else []
    paths = [session.env.get("PYTHONPATH"), *map(str, cutedsl), str(site)]
    session.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    session.env.update(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="/tmp/cutedsl-cache")
    session.fa4_wheel = session.newest("flash_attn_4-*.whl")
    # Never a mutant or an fa3-variants experiment left in dist/ by an earlier warm call (run 113 was one).
    fa3_wheel = session.newest("flash_attn_3-*.whl", exclude="mutant")
    if fa3_wheel:  # built here, or carried back and laid into dist/ (with --no-fa3 too)
        rc = session.pip_install(fa3_wheel, site)
        session.note(f"flash_attn_3: {fa3_wheel.name}" if rc == 0 else "flash_attn_3 install: FAILED")
        if session.return_wheels:
            session.act(f"tar {fa3_wheel.name} into dist-fa3-wheel.tar", gpu_steps.tar_one, fa3_wheel,
                        session.out / "dist-fa3-wheel.tar")
    if session.cutedsl_site:
        rc = session.lay_fa4_wheel(session.fa4_wheel)
        wheel_name = session.fa4_wheel.name if session.fa4_wheel else "none in dist/, the runtime's own"
        session.note(f"flash-attn-4: {wheel_name}" if rc == 0 else "flash-attn-4 install: FAILED")
    availability = session.logs / "fa4-backend.txt"
    session.run([sys.executable, "-c", FA4_AVAILABILITY], output=availability)
    session.note((session.read(availability).strip().splitlines() or ["FA-4 backend: (dry run)"])[-1])
    if session.cutedsl_site:
        session.run([sys.executable, "-m", "pip", "list"], output=session.logs / "cutedsl-packages.txt")
        session.run([sys.executable, "-c", FA4_IMPORT_CHECK], output=session.logs / "cutedsl-import.log")
    if session.return_wheels:
        session.act(f"tar {wheel.name} into dist-wheel.tar", gpu_steps.tar_one, wheel, session.out / "dist-wheel.tar")
    return True


_FA4_MODULE = "import flash_attn_sparse.backends.cute as f\n"
FA4_AVAILABILITY = _FA4_MODULE + "print('FA-4 backend:', f.missing_runtime() or 'available')"
FA4_IMPORT_CHECK = (_FA4_MODULE + "import quack, cutlass\n"
                    "print('quack', quack.__file__, 'cutlass', cutlass.__file__); f.import_cute('interface')")


def _tar_logs(session: Session) -> None:
    if session.dry_run or not session.logs.exists():
        return
    with tarfile.open(session.out / "logs.tar.gz", "w:gz") as tar:
        tar.add(session.logs, arcname="logs")
    shutil.rmtree(session.logs)


def summary_table(rows: list) -> str:
    lines = ["| step | exit | seconds | result |", "|---|---|---|---|"]
    lines += [f"| {name} | {rc} | {seconds:.0f} | {note} |" for name, rc, seconds, note in rows]
    return "\n".join(lines)


def run_session(root: Path, options: argparse.Namespace) -> int:
    unknown = [name for name in options.steps if name not in gpu_steps.STEPS]
    if unknown:
        print(f"error: unknown step {', '.join(map(repr, unknown))}; `python -m forktools gpu --list` shows the steps",
              file=sys.stderr)
        return 2
    session = Session(root=root, out=options.out.resolve(), scratch=options.scratch.resolve(), options=options,
                      dry_run=options.dry_run,
                      deadline=time.monotonic() + options.deadline_s if options.deadline_s > 0 else None)
    if not options.dry_run:
        session.logs.mkdir(parents=True, exist_ok=True)
    session.env["PYTHONUNBUFFERED"] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    rows = []
    try:
        describe_machine(session)
        wheel = prepare_wheel(session)
        if wheel is None or not install(session, wheel):
            return 1
        for name in options.steps:
            left = session.seconds_left()
            if left is not None and left <= 0:
                rows.append((name, 124, 0, "not started: past --deadline-s"))
                continue
            print(f"== {time.strftime('%H:%M:%S')} {name}", flush=True)
            session.worst_rc, start = 0, time.monotonic()
            note = gpu_steps.STEPS[name][1](session)
            rows.append((name, session.worst_rc, time.monotonic() - start, note))
    finally:
        table = summary_table(rows)
        text = "\n".join([*session.notes, "", table]) + "\n"
        if not options.dry_run:
            (session.out / "summary.txt").write_text(text)
        _tar_logs(session)
        print("== summary\n" + text, end="")
    return 1 if any(rc for _, rc, _, _ in rows) and not options.dry_run else 0


def list_steps() -> str:
    width = max(map(len, gpu_steps.STEPS))
    return "\n".join(f"{name:<{width}}  {help_text}" for name, (help_text, _) in gpu_steps.STEPS.items())


def add_parser(commands) -> None:
    command = commands.add_parser("gpu", help="run steps on the GPU machine (tests, benchmarks, profiles)",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("steps", nargs="*", default=["tests"], metavar="STEP", help="steps in order, together (default: tests)")
    command.add_argument("--list", action="store_true", help="list the steps and exit")
    command.add_argument("--dry-run", action="store_true", help="print the command lines instead of running them")
    command.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu-session-out")),
                         help="results and logs go here (default $OUT)")
    command.add_argument("--scratch", type=Path, default=Path("/tmp/forktools-gpu"),
                         help="installed wheels and variant test folders (not returned)")
    wheel = command.add_mutually_exclusive_group()
    wheel.add_argument("--wheel", type=Path, metavar="TAR",
                       help="install the flash-attn wheel in TAR (e.g. a variant's), no build")
    wheel.add_argument("--reuse-fa2-wheel", action="store_true",
                       help=f"install {CARRIED_WHEEL} unbuilt (and {CARRIED_FA3_WHEEL} when it is this commit's), "
                            "build only flash-attn-4's wheel, python/ first on the path (for a commit whose flash-attn "
                            "patches and overlay are the wheel's: a Python-only change)")
    command.add_argument("--cutedsl-site", type=Path, help="the unpacked CuTe-DSL runtime (gpu_session.sh passes it)")
    command.add_argument("--pytest-args", dest="test_selection", default="tests",
                         help="what the tests step runs (files, -k; default tests)")
    command.add_argument("--pytest-timeout", type=int, default=900, metavar="S")
    command.add_argument("--bench-shapes", default="B8 Sq16", help="bench step's shapes (e.g. decode)")
    command.add_argument("--bench-methods", help="bench/fullbench methods, comma-separated")
    command.add_argument("--no-profile-ncu", action="store_true", help="profile step without ncu")
    command.add_argument("--sweep-args", default="", help="extra profile_decode.py --split-sweep arguments")
    command.add_argument("--variant", dest="variants", action="append", type=Path, metavar="DIFF",
                         help="variants step: this diff (repeatable; default .carry/variants/*.diff)")
    command.add_argument("--variant-tests", default="all", metavar="NAMES",
                         help="variants whose GPU tests run: all, none, or names")
    command.add_argument("--ncu-targets", default="B8_Sq1 B1_Sq1", help="ncu-dense's shapes")
    command.add_argument("--no-fa3", action="store_true", help="build and install without the FA-3 (flash_attn_3) wheel")
    command.add_argument("--fa3-variant", dest="fa3_variants", action="append", type=Path, metavar="DIFF",
                         help="fa3-variants step: a hopper/ diff on the patched tree (e.g. benchmarks/experiments/fa3-*.diff), "
                              "or several joined by + built together as one variant")
    command.add_argument("--upstream-fa3-k", default="test_flash_attn_output and not paged",
                         help="upstream-fa3 step: pytest -k over hopper/test_flash_attn.py")
    command.add_argument("--sanitize-args", default="", metavar="ARGS",
                         help="sanitize step: more tests/sanitize.py arguments (--tools, --only fa3, --module-loading eager)")
    command.add_argument("--sanitize-fuzz-count", type=int, default=30, metavar="N",
                         help="sanitize-fuzz's configurations (30 took 237 s for the three tools on the H200, run 96)")
    command.add_argument("--deadline-s", type=float, default=560, metavar="S",
                         help="S seconds after the start no command starts and running ones are killed, so the summary "
                              "and logs.tar.gz are written before the device tool's 600 s limit kills the call (run 157 "
                              "lost both); 0: none")
    command.add_argument("--fuzz-seed", type=int, default=0)
    command.add_argument("--fuzz-budget-s", type=int, default=240,
                         help="fuzz: seconds after which no configuration is drawn (2,000 took 89 s, run 89)")
    command.set_defaults(run=_command)


def _command(layout, args: argparse.Namespace) -> int:
    if args.list:
        print(list_steps())
        return 0
    return run_session(layout.root, args)
