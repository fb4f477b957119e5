"""Build the patched FA-3 extension (upstream's own `flash_attn_3` wheel) into dist/, beside the
flash_attn one; `build.build` runs it in a second thread while FA-2 compiles.

It is kept as upstream's package (`import flash_attn_3._C`, `flash_attn_interface`, torch ops
`torch.ops.flash_attn_3.*`), not folded into the flash_attn wheel: upstream's tests and
interface then run on it unchanged, and either wheel is rebuilt and carried on its own.

The patched tree (series.materialize of upstream `flash-attn-3`: hopper/ beside csrc/cutlass) is
re-laid into build/wheel/flash-attn-3 file by file, so ninja recompiles only what changed; the
wheel's version label `+sparse.<hash>.<profile>` hashes the lock, the FA-3 patches and overlay,
the profile and archs, so `--reuse` finds a carried wheel of the same source.

Profiles (the FLASH_ATTENTION_DISABLE_* variables of hopper/setup.py, patch flash-attn-3/0001):
- dev: sm90a, forward only, head dims 64 and 128 with dv == d, fp16 and bf16, split-KV, PackGQA
  and varlen kept; no paged non-TMA K/V, softcap, local, append-KV, fp8, clusters, SM8x kernels.
  That is DEV_KERNELS (12 units) + flash_api.cpp, flash_fwd_combine.cu, flash_prepare_scheduler.cu
  (those two for sm90a alone: SM80 is off),
  and the sparse path (patches flash-attn-3/0002-0003): DEV_SPARSE_KERNELS (20 units, written by
  setup.py from generate_kernels_sparse.py) + flash_api_sparse.cpp, and cuda_driver_entry_points.cpp
  (patch flash-attn-3/0012): 37 units in all.
- full: upstream's FA-3 matrix.
FLASH_ATTN_SPARSE_FP8=1 keeps the FP8 (e4m3) kernels in the dev profile, dense and sparse
(DEV_FP8_KERNELS, 16 more units); the label then names the profile `dev.fp8`.
FLASH_ATTN_SPARSE_PAGED=1 keeps the cp.async paged kernels (pages of fewer than 128 keys; 20 more
units, 30 with FP8); the label then ends in `.paged`.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from forktools import ToolError, patchfile, toolchain
from forktools.layout import Layout
from forktools.wheelbuild import (
    ninja_log_lengths,
    pip_wheel_command,
    relay_tree,
    report_unit_times,
    run_with_progress,
    source_hash,
    stop,
)

UPSTREAM = "flash-attn-3"
PACKAGE = "flash_attn_3"
GIB_PER_JOB = 6  # one FA-3 unit peaks at ~5.3 GB (an FA-2 unit at ~5.1 GB)
GIB_FOR_FA2 = 32  # left to the FA-2 build running beside it, at most GIB_PER_JOB per FA-2 job
DEV_OFF = ["BACKWARD", "PAGEDKV", "APPENDKV", "LOCAL", "SOFTCAP", "FP8", "CLUSTER", "SM80",
           "HDIM96", "HDIM192", "HDIM256", "HDIMDIFF"]
DEV_KERNELS = [f"flash_fwd_hdim{d}_{t}{kind}_sm90.cu"
               for d in (64, 128) for t in ("bf16", "fp16") for kind in ("", "_split", "_packgqa")]
DEV_SPARSE_KERNELS = [f"flash_fwd_hdim{d}_{t}{packgqa}{split}{rows}_sparse_sm90.cu" for t in ("fp16", "bf16")
                      for d in (64, 128) for packgqa in ("", "_packgqa") for split in ("", "_split")
                      for rows in ("", "_m64") if not rows or (packgqa and split)]
# FLASH_ATTN_SPARSE_FP8=1 adds these to the dev profile: upstream's FP8 kernels (the dense peer) and the sparse ones.
DEV_FP8_KERNELS = ([f"flash_fwd_hdim{d}_e4m3{kind}_sm90.cu" for d in (64, 128) for kind in ("", "_split", "_packgqa")]
                   + [name.replace("_bf16", "_e4m3") for name in DEV_SPARSE_KERNELS if "_bf16" in name])
PROFILES = {"dev": {f"FLASH_ATTENTION_DISABLE_{flag}": "TRUE" for flag in DEV_OFF}, "full": {}}
# FLASH_ATTN_SPARSE_PAGED=1 adds these (and, with FP8 too, their e4m3 twins): upstream's cp.async
# paged kernels (dense FA-3's dispatch links them) and the packed sparse ones.
DEV_PAGED_KERNELS = ([f"flash_fwd_hdim{d}_{t}_paged{split}_sm90.cu" for d in (64, 128) for t in ("bf16", "fp16")
                      for split in ("", "_split")]
                     + [name.replace("_packgqa", "_paged_packgqa") for name in DEV_SPARSE_KERNELS if "_packgqa" in name])
FP8_OPTION = "FLASH_ATTN_SPARSE_FP8"  # "1": the dev profile keeps the FP8 kernels
PAGED_OPTION = "FLASH_ATTN_SPARSE_PAGED"  # "1": the dev profile keeps the cp.async paged kernels
DEV_OPTIONS = {FP8_OPTION: ("fp8", "FP8"), PAGED_OPTION: ("paged", "PAGEDKV")}  # option: (label part, flag lifted)


def _dev_options(profile: str) -> list[str]:
    """The DEV_OPTIONS set to "1" (in their fixed order); the full profile has every kernel already."""
    return [option for option in DEV_OPTIONS if profile == "dev" and os.environ.get(option, "") == "1"]


def profile_env(profile: str) -> dict:
    """The DISABLE flags setup.py builds `profile` under (each DEV_OPTIONS entry set lifts its flag)."""
    env = dict(PROFILES[profile])
    for option in _dev_options(profile):
        del env[f"FLASH_ATTENTION_DISABLE_{DEV_OPTIONS[option][1]}"]
    return env


def profile_name(profile: str) -> str:
    """The profile as the label names it: `dev.fp8`, `dev.paged`, `dev.fp8.paged` with the options."""
    return ".".join([profile] + [DEV_OPTIONS[option][0] for option in _dev_options(profile)])


def wheel_glob(label: str) -> str:
    return f"{PACKAGE}-*+{label}-*.whl"


def default_jobs(jobs: int | None, beside_fa2: bool = False) -> int:
    """Parallel units: the CPUs, but no more than the memory (less what FA-2's build, with as many
    jobs, takes when it runs beside) allows at ~6 GB a unit: e.g. on a 16-core, 128 GB host 16
    alone, 15 beside FA-2; on a 2-core, 24 GB one 2 either way."""
    cpus = jobs or os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    for_fa2 = min(GIB_FOR_FA2, cpus * GIB_PER_JOB) if beside_fa2 else 0
    return max(1, min(cpus, int((memory_gib - for_fa2) // GIB_PER_JOB)))


def version_label(layout: Layout, profile: str = "dev", mutations: list[Path] = ()) -> str:
    """The wheel's `+sparse.<hash>.<profile>[.mutant]`: the hash of the lock, the FA-3 patches and
    overlay, the profile and arch (not python/: a Python-only change reuses the wheel)."""
    name = profile_name(profile)
    label = f"sparse.{source_hash(layout, name, ['90a'], mutations, name=UPSTREAM)}.{name}"
    return label + (".mutant" if mutations else "")


def existing_wheel(layout: Layout, profile: str = "dev", mutations: list[Path] = ()) -> Path | None:
    """The wheel of exactly this source in dist/, if one is there."""
    existing = sorted((layout.root / "dist").glob(wheel_glob(version_label(layout, profile, mutations))))
    return existing[-1] if existing else None


def is_mutation_of_fa3(mutation: Path) -> bool:
    """Whether a tests/mutations/ diff changes FA-3's tree (its paths are upstream's hopper/...)."""
    diff = patchfile.split_description(Path(mutation).read_bytes())
    return all(file_diff.path.startswith("hopper/") for file_diff in patchfile.parse_diff(diff, str(mutation)))


def build(layout: Layout, profile: str = "dev", jobs: int | None = None, reuse: bool = False,
          mutations: list[Path] = (), beside_fa2: bool = False, tools: toolchain.Toolchain | None = None,
          on_start=None) -> Path:
    """Build (or, with reuse, find) the FA-3 wheel in dist/ and return it; mutations are diffs
    laid on the patched tree (tests/mutations/fa3-*.patch), the label then ends in `.mutant`;
    beside_fa2: FA-2's build runs at the same time (default_jobs leaves it memory); tools: the
    checked toolchain (else checked here); on_start gets the compiling process."""
    if profile not in PROFILES:
        raise ToolError(f"unknown FA-3 profile {profile!r}; choose one of {', '.join(PROFILES)}")
    label = version_label(layout, profile, mutations)
    dist = layout.root / "dist"
    existing = existing_wheel(layout, profile, mutations)
    if reuse and existing:
        print(f"build fa3: reusing {existing.relative_to(layout.root)}")
        return existing
    tools = tools or toolchain.check()
    stage = layout.root / "build" / "wheel" / UPSTREAM
    relay_tree(layout, stage, name=UPSTREAM)
    for mutation in mutations:
        patchfile.apply_diff(patchfile.split_description(Path(mutation).read_bytes()), stage, str(mutation))
        print(f"build fa3: applied mutation {mutation}", flush=True)
    env = {**os.environ, **profile_env(profile), **tools.env(),
           "FLASH_ATTENTION_FORCE_BUILD": "TRUE", "FLASH_ATTN_LOCAL_VERSION": label,
           "MAX_JOBS": str(default_jobs(jobs, beside_fa2)), "NVCC_THREADS": os.environ.get("NVCC_THREADS", "1")}
    dist.mkdir(exist_ok=True)
    log_path = layout.root / "build" / "logs" / f"build-fa3-{profile}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"build fa3: {profile_name(profile)} profile, sm90a, {env['MAX_JOBS']} jobs, version label {label}", flush=True)
    start, ninja_before = time.monotonic(), ninja_log_lengths(stage)
    returncode = run_with_progress(pip_wheel_command(dist), stage / "hopper", env, log_path, prefix="fa3 ",
                                   on_start=on_start)
    elapsed = time.monotonic() - start
    if returncode:
        raise ToolError(f"the FA-3 build failed after {elapsed:.0f} s (exit {returncode}); see {log_path}")
    wheels = sorted(dist.glob(wheel_glob(label)))
    if not wheels:
        raise ToolError(f"the FA-3 build finished but no wheel with version label {label} is in {dist}")
    print(f"build fa3: {wheels[-1].relative_to(layout.root)} ({wheels[-1].stat().st_size / 1e6:.1f} MB) "
          f"in {elapsed:.0f} s", flush=True)
    report_unit_times(stage, ninja_before, log_path.parent / f"units-{UPSTREAM}{'-mutant' if mutations else ''}.txt")
    return wheels[-1]


class Background:
    """build() in a thread; result() waits and returns the wheel or raises its error, cancel()
    stops its compile."""

    def __init__(self, layout: Layout, profile: str, jobs: int | None, reuse: bool, mutations: list[Path] = (),
                 tools: toolchain.Toolchain | None = None):
        self._wheel: Path | None = None
        self._error: Exception | None = None
        self._process: subprocess.Popen | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(layout, profile, jobs, reuse, mutations, tools),
                                        daemon=True)
        self._thread.start()

    def _run(self, layout, profile, jobs, reuse, mutations, tools) -> None:
        try:  # build.build runs FA-2's beside it
            self._wheel = build(layout, profile, jobs, reuse, mutations, beside_fa2=True, tools=tools,
                                on_start=self._started)
        except Exception as err:  # noqa: BLE001 -- handed to the caller in result()
            self._error = err

    def _started(self, process: subprocess.Popen) -> None:
        self._process = process
        if self._cancelled.is_set():
            stop(process)

    def cancel(self) -> None:
        """Stop the compile (if it started) and wait a little for the thread to see it."""
        self._cancelled.set()
        if self._process is not None:
            stop(self._process)
        self._thread.join(timeout=60)

    def result(self) -> Path:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._wheel
