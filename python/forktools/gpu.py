"""`python -m forktools gpu STEP...`: the project's GPU CI on any CUDA host with the build toolchain.

It gets the wheels (built from the verified upstream cache, or prebuilt ones from `--wheels` whose
labels match this checkout), installs them into a scratch folder, then runs the steps named, in
the order given (`--list` shows them). Every result and log goes under one output folder
(`--out`, default ./gpu-out): results as files, the logs as one tarball, the wheels built here as
tar files that a later run takes back with `--wheels`; the last thing printed is a summary table.
`--dry-run` prints the command lines instead. FA-4 runs where `--cutedsl-site` names a folder
holding its CuTe-DSL runtime (`pip install --target DIR --group fa4-compile`); without it the FA-4
tests skip. `--budget-s` bounds the whole run, so that the summary and the logs are written before
a CI job's own timeout would kill it.

    PYTHONPATH=python python -m forktools gpu --out DIR [--cutedsl-site SITE] [--wheels DIR] STEP... [options]
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from forktools import build_fa3, gpu_steps, wheel_fa4
from forktools.layout import Layout

BUILD_TIME = re.compile(r"in (\d+) s")
# The wheel a `forktools build` printed as reused or built (dist/ may hold others, e.g. from --wheels).
BUILT_WHEEL = re.compile(r"^build: (?:reusing )?(\S*flash_attn-\S+\.whl)", re.M)
# Wheels built here go into --out as tar files: a local version label's "+" is not safe in every
# artifact store's file names, and a tar keeps it. --wheels takes these tars or loose wheels.
WHEEL_TARS = {"flash_attn": "flash-attn-wheel.tar", "flash_attn_3": "flash-attn-3-wheel.tar"}
DEFAULT_OUT = Path("gpu-out")
DEFAULT_SCRATCH = Path(tempfile.gettempdir()) / "forktools-gpu"


@dataclasses.dataclass
class Session:
    """The state of one run: options, where things go, the environment the steps run in."""
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
    fa3_wheel: Path | None = None
    mutant_wheel: Path | None = None
    # Wheel names that came from --wheels: they are not written to --out again.
    given_wheels: set = dataclasses.field(default_factory=set)
    # time.monotonic() past which no command starts and running ones are cut (--budget-s)
    deadline: float | None = None

    @property
    def logs(self) -> Path:
        return self.out / "logs"

    @property
    def cutedsl_site(self) -> Path | None:
        return getattr(self.options, "cutedsl_site", None)

    @property
    def kernel_cache(self) -> Path:
        """CuTe-DSL's compiled-kernel cache, kept between runs (FA-4's first compile of a shape is slow)."""
        return self.scratch / "cutedsl-cache"

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def run(self, command: list, output: Path | None = None, append: bool = False, timeout: int | None = None,
            env: dict | None = None, stderr: Path | None = None, cwd: Path | None = None) -> int:
        """Run `command` from the repo root in the session's environment (plus `env`), its stdout
        (and stderr, unless `stderr` names a file) into `output`; 124 when it passed `timeout` s or
        the run's --budget-s (then it is killed with every process below it: a build's compilers too)."""
        words = [str(word) for word in command]
        line = shlex.join(words) + (f" {'>>' if append else '>'} {output}" if output else "")
        self.commands.append(line)
        if self.dry_run:
            print(f"+ {line}")
            return 0
        left = self.seconds_left()
        if left is not None and left <= 0:
            self.note(f"budget: not started: {line}")
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
                        self.note(f"budget: cut after {limit:.0f} s: {line}")
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
    is read from /proc: the children stay in this process group, so a kill of the whole run (a CI
    job's timeout) still reaches them."""
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


def source_commit(root: Path) -> str:
    """git's short HEAD, or what .commit says in a tree exported without .git."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        marker = root / ".commit"
        return marker.read_text().strip() if marker.exists() else "unknown"


def describe_machine(session: Session) -> None:
    gpu_txt = session.logs / "gpu.txt"
    session.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used", "--format=csv"],
                output=gpu_txt)
    session.run([sys.executable, "-c", "import torch, sys; print('python', sys.version.split()[0], 'torch', "
                 "torch.__version__, 'cuda', torch.version.cuda)"], output=gpu_txt, append=True)
    lines = session.read(gpu_txt).splitlines()
    session.note(f"commit {source_commit(session.root)}, {time.strftime('%Y-%m-%d', time.gmtime())}, "
                 f"{lines[1] if len(lines) > 1 else '?'}")


def wheels_in(folder: Path | None) -> dict[str, Path]:
    """The wheels of a --wheels folder by file name: loose *.whl files, and those inside *.tar files
    (what a run writes to --out), each mapped to the file that holds it."""
    found: dict[str, Path] = {}
    if folder is None or not folder.is_dir():
        return found
    for path in sorted(folder.glob("*.whl")):
        found[path.name] = path
    for path in sorted(folder.glob("*.tar")):
        with tarfile.open(path) as archive:
            for member in archive.getmembers():
                if member.isfile() and member.name.endswith(".whl") and "/" not in member.name:
                    found.setdefault(member.name, path)
    return found


def lay_wheels(folder: Path, names: list[str], into: Path) -> None:
    """Put the named wheels of a --wheels folder into `into`, their modification times kept."""
    into.mkdir(parents=True, exist_ok=True)
    holders = wheels_in(folder)
    for name in names:
        holder = holders[name]
        if holder.suffix == ".whl":
            shutil.copy2(holder, into / name)
        else:
            with tarfile.open(holder) as archive:
                archive.extract(name, into, filter="data")


def _given_wheel(session: Session, given: Path) -> Path:
    """--wheel: a .whl, or a .tar holding one (a variants step's result), staged in the scratch folder."""
    staged = session.scratch / "given-wheel"
    session.act(f"empty {staged}", gpu_steps.recreate, staged)
    if given.suffix == ".whl":
        session.act(f"copy {given} into {staged}", shutil.copy2, given, staged / given.name)
        return staged / given.name
    session.act(f"extract {given} into {staged}", _extract, given, staged)
    found = sorted(staged.glob("flash_attn-*.whl")) or [staged / "flash_attn-X.whl"]
    return found[0]


def prepare_wheel(session: Session) -> Path | None:
    """The one way to the flash-attn wheel: a given one (--wheel, no build), the one in --wheels
    beside a fresh flash-attn-4 wheel (--reuse-fa2-wheel), or a build that reuses any wheel of
    --wheels whose label (the hash of the patched tree and profile) is this checkout's. None when
    that failed."""
    options = session.options
    given = wheels_in(options.wheels)
    session.given_wheels = set(given)
    if options.wheel:
        wheel = _given_wheel(session, options.wheel)
        session.given_wheels.add(wheel.name)
        session.note(f"wheel given: {wheel.name} (no build)")
        return wheel
    if session.forktools("upstream", "--offline", output=session.logs / "upstream.log"):
        session.note("upstream cache: FAILED (see upstream.log)")
        return None
    if options.reuse_fa2_wheel:
        return _reuse_fa2_wheel(session, given)
    # A build with --reuse takes those of its label; a mutant's label never is a checkout's.
    reusable = sorted(name for name in given if "mutant" not in name)
    if reusable:
        session.act(f"copy {', '.join(reusable)} from {options.wheels} into dist/", lay_wheels, options.wheels, reusable,
                    session.root / "dist")
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
    log = session.read(build_log)
    named = BUILT_WHEEL.findall(log)
    wheel = session.root / named[-1] if named else session.newest("flash_attn-*.whl", exclude="mutant")
    if rc or not wheel:
        session.note("build: FAILED (see build.log, build-full.log)")
        return None
    took = BUILD_TIME.findall(log)
    size = 0 if session.dry_run or not wheel.exists() else wheel.stat().st_size >> 20
    session.note(f"build: {'in ' + took[-1] + ' s' if took else 'reused'} (wall {time.monotonic() - start:.0f} s),"
                 f" {wheel.name}, {size} MB")
    return wheel


def _reuse_fa2_wheel(session: Session, given: dict[str, Path]) -> Path | None:
    """--reuse-fa2-wheel: the flash-attn wheel of --wheels installed unbuilt though its label differs
    (it hashes python/, which a Python-only change moves), python/ first on the path; flash-attn-4's
    wheel built here (seconds) and FA-3's taken from --wheels when its label matches."""
    names = sorted(name for name in given if name.startswith("flash_attn-") and "mutant" not in name)
    if not names and not session.dry_run:
        session.note(f"--reuse-fa2-wheel: no flash_attn wheel in {session.options.wheels}")
        return None
    staged = session.scratch / "given-wheel"
    session.act(f"empty {staged}", gpu_steps.recreate, staged)
    name = names[-1] if names else "flash_attn-X.whl"
    session.act(f"copy {name} of {session.options.wheels} into {staged}", lay_wheels, session.options.wheels, [name], staged)
    if session.forktools("build", "--fa4-only", output=session.logs / "build.log"):
        session.note("flash-attn-4 wheel: FAILED (see build.log)")
        return None
    given_or_built_fa3_wheel(session, given)
    session.env["PYTHONPATH"] = str(session.root / "python")
    session.note(f"wheel reused: {name} (no build); flash-attn-4 wheel built here; python/ first on the path")
    return staged / name


def given_or_built_fa3_wheel(session: Session, given: dict[str, Path]) -> None:
    """The flash_attn_3 wheel of --wheels into dist/ when its label is this checkout's (it hashes
    the FA-3 patches and overlay, not python/), else FA-3 built here alone."""
    label = build_fa3.version_label(Layout.at(session.root))
    matching = sorted(name for name in given if fnmatch.fnmatch(name, build_fa3.wheel_glob(label)))
    if matching:
        session.act(f"copy {matching[-1]} ({label}) into dist/", lay_wheels, session.options.wheels, matching[-1:],
                    session.root / "dist")
        return
    names = ", ".join(name for name in given if name.startswith("flash_attn_3-")) or "none given"
    log = session.logs / "build-fa3.log"
    rc = session.forktools("build", "--fa3-only", "--profile", "dev", "--jobs", str(os.cpu_count() or 1), "--reuse",
                           output=log)
    session.act("copy build/logs/units-flash-attn-3.txt to logs/", _copy_if_there,
                session.root / "build/logs/units-flash-attn-3.txt", session.logs / "units-flash-attn-3.txt")
    took = BUILD_TIME.findall(session.read(log))
    session.note(f"flash_attn_3: built here ({names} is not {label}): " +
                 (f"in {took[-1]} s" if not rc and took else "FAILED (see build-fa3.log); the fa3 backend is absent"))


def _copy_if_there(source: Path, target: Path) -> None:
    if source.exists():
        shutil.copyfile(source, target)


def labelled_wheel(session: Session, pattern: str) -> Path | None:
    """The wheel of dist/ that matches `pattern` (it names the checkout's label), newest first."""
    found = sorted((session.root / "dist").glob(pattern), key=lambda p: p.stat().st_mtime)
    if session.dry_run and not found:
        return session.root / "dist" / pattern.replace("*", "X")
    return found[-1] if found else None


def install(session: Session, wheel: Path) -> bool:
    site = session.scratch / "site"
    session.act(f"empty {site}", gpu_steps.recreate, site)
    if session.pip_install(wheel, site):
        session.note("install: FAILED")
        return False
    cutedsl = [session.cutedsl_site, session.cutedsl_site / "nvidia_cutlass_dsl/dsl_packages"] if session.cutedsl_site else []
    paths = [session.env.get("PYTHONPATH"), *map(str, cutedsl), str(site)]
    session.env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    session.env.update(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="1", FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=str(session.kernel_cache))
    layout = Layout.at(session.root)
    # By label, not by date: dist/ may hold other builds' wheels, --wheels' or a mutant's.
    session.fa4_wheel = labelled_wheel(session, f"flash_attn_4-*+{wheel_fa4.label(layout)}-*.whl")
    session.fa3_wheel = labelled_wheel(session, build_fa3.wheel_glob(build_fa3.version_label(layout)))
    if session.fa3_wheel:  # built here, or taken from --wheels (with --no-fa3 too)
        rc = session.pip_install(session.fa3_wheel, site)
        session.note(f"flash_attn_3: {session.fa3_wheel.name}" if rc == 0 else "flash_attn_3 install: FAILED")
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
    for kind, built in (("flash_attn", wheel), ("flash_attn_3", session.fa3_wheel)):
        if built and built.name not in session.given_wheels:
            session.act(f"tar {built.name} into {WHEEL_TARS[kind]}", gpu_steps.tar_one, built, session.out / WHEEL_TARS[kind])
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
    if options.reuse_fa2_wheel and not options.wheels:
        print("error: --reuse-fa2-wheel takes the flash-attn wheel from --wheels DIR", file=sys.stderr)
        return 2
    session = Session(root=root, out=options.out.resolve(), scratch=options.scratch.resolve(), options=options,
                      dry_run=options.dry_run,
                      deadline=time.monotonic() + options.budget_s if options.budget_s > 0 else None)
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
                rows.append((name, 124, 0, "not started: past --budget-s"))
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


def _name_and_wheel(text: str) -> tuple[str, Path]:
    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f"expected NAME=WHEEL, got {text!r}")
    return name, Path(path)


def add_parser(commands) -> None:
    command = commands.add_parser("gpu", help="run the GPU steps on a CUDA host (tests, benchmarks, profiles)",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_argument("steps", nargs="*", default=["tests"], metavar="STEP", help="steps in order, together (default: tests)")
    command.add_argument("--list", action="store_true", help="list the steps and exit")
    command.add_argument("--dry-run", action="store_true", help="print the command lines instead of running them")
    command.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                         help=f"results, summary.txt, logs.tar.gz and the wheels built here go here (default ./{DEFAULT_OUT})")
    command.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, metavar="DIR",
                         help=f"installed wheels, kernel caches and variant test folders (default {DEFAULT_SCRATCH})")
    command.add_argument("--wheels", type=Path, metavar="DIR",
                         help="prebuilt wheels (loose, or in the tar files an earlier run wrote to --out): those whose "
                              "label is this checkout's are installed instead of built")
    wheel = command.add_mutually_exclusive_group()
    wheel.add_argument("--wheel", type=Path, metavar="FILE",
                       help="install this flash-attn wheel (a .whl, or a .tar holding one, e.g. a variant's), no build")
    wheel.add_argument("--reuse-fa2-wheel", action="store_true",
                       help="install the flash-attn wheel of --wheels unbuilt whatever its label (and FA-3's when its label "
                            "matches), build only flash-attn-4's wheel, python/ first on the path (for a checkout whose "
                            "flash-attn patches and overlay are the wheel's: a Python-only change)")
    command.add_argument("--cutedsl-site", type=Path, metavar="DIR",
                         help="a folder holding FA-4's CuTe-DSL runtime (pip install --target DIR); without it FA-4 is absent")
    command.add_argument("--budget-s", type=float, default=0, metavar="S",
                         help="S seconds after the start no command starts and running ones are killed with their "
                              "children, so the summary and logs.tar.gz are written within S (default 0: no limit)")
    command.add_argument("--pytest-args", dest="test_selection", default="tests",
                         help="what the tests step runs (files, -k; default tests)")
    command.add_argument("--pytest-timeout", type=int, default=900, metavar="S")
    command.add_argument("--bench-shapes", default="B8 Sq16", help="bench step's shapes (e.g. decode)")
    command.add_argument("--bench-methods", help="bench/fullbench methods, comma-separated")
    command.add_argument("--no-profile-ncu", action="store_true", help="profile step without ncu")
    command.add_argument("--sweep-args", default="", help="extra profile_decode.py --split-sweep arguments")
    command.add_argument("--gqa-args", default="", help="extra benchmarks/bench_gqa.py arguments (e.g. \"--batches 1,8\")")
    command.add_argument("--variant", dest="variants", action="append", type=Path, metavar="DIFF",
                         help="variants step: a diff made by `forktools variant` (repeatable)")
    command.add_argument("--variant-tests", default="all", metavar="NAMES",
                         help="variants whose GPU tests run: all, none, or names")
    command.add_argument("--ncu-targets", default="B8_Sq1 B1_Sq1", help="ncu-dense's shapes")
    command.add_argument("--no-fa3", action="store_true", help="build and install without the FA-3 (flash_attn_3) wheel")
    command.add_argument("--fa3-variant", dest="fa3_variants", action="append", type=Path, metavar="DIFF",
                         help="fa3-variants step: a hopper/ diff on the patched tree (e.g. benchmarks/experiments/fa3-*.diff), "
                              "or several joined by + built together as one variant")
    command.add_argument("--fa4-variant", dest="fa4_variants", action="append", type=_name_and_wheel, default=[],
                         metavar="NAME=WHEEL", help="fa4-prefill-check step: also this flash-attn-4 wheel (repeatable)")
    command.add_argument("--upstream-fa3-k", default="test_flash_attn_output and not paged",
                         help="upstream-fa3 step: pytest -k over hopper/test_flash_attn.py")
    command.add_argument("--sanitize-args", default="", metavar="ARGS",
                         help="sanitize step: more tests/sanitize.py arguments (--tools, --only fa3, --module-loading eager)")
    command.add_argument("--sanitize-fuzz-count", type=int, default=30, metavar="N",
                         help="sanitize-fuzz's configurations (30 fit the step's 420 s)")
    command.add_argument("--fuzz-seed", type=int, default=0)
    command.add_argument("--fuzz-budget-s", type=int, default=240,
                         help="fuzz: seconds after which no configuration is drawn")
    command.set_defaults(run=_command)


def _command(layout, args: argparse.Namespace) -> int:
    if args.list:
        print(list_steps())
        return 0
    return run_session(layout.root, args)
