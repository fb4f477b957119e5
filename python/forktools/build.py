"""Build the patched flash_attn wheel into dist/, and beside it the patched flash-attn-4 one.

The wheel is compiled from a plain patched copy of flash-attn (the committed series plus the
overlay, as `apply --no-git` lays it) kept in build/wheel/flash-attn. Each build re-lays that copy
file by file, rewriting only files whose content changed, so ninja recompiles only what a change
touched. The wheel's local version, `+sparse.<hash>.<profile>`, names the exact series, overlay,
Python package, profile and archs it was built from. The flash-attn-4 wheel (pure Python, the
`[hopper]` extra's package with the stage-4 patches) is written by forktools.wheel_fa4, and the
FA-3 extension (upstream's `flash_attn_3` wheel) by forktools.build_fa3, in parallel with FA-2.
The toolchain is checked before anything compiles (forktools.toolchain), and with install the
wheels go into the environment together, once every one of them is built.

Profiles:
- dev: head dims 64 and 128, fp16 and bf16, forward only, no dropout/alibi/softcap/local/uneven
  head dims, the visible GPU's arch unless --arch or FLASH_ATTN_SPARSE_ARCH names one: what the
  tests need.
- full: upstream's matrix (all head dims, backward, every feature, sm_80/90/100/120).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from forktools import ToolError, build_fa3, patchfile, toolchain, wheel_fa4
from forktools.layout import Layout
from forktools.wheelbuild import (
    FA2,
    ninja_log_lengths,
    pip_wheel_command,
    relay_tree,
    report_unit_times,
    run_with_progress,
    source_hash,
)

UPSTREAM = FA2
DEV_FEATURES_OFF = ["BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP", "UNEVEN_K", "LOCAL"]
DEV_HEAD_DIMS_OFF = [32, 96, 192, 256]
PROFILES = {
    "dev": {
        "archs": None,  # the visible GPU's
        "env": {**{f"FLASH_ATTENTION_DISABLE_{f}": "TRUE" for f in DEV_FEATURES_OFF},
                **{f"FLASH_ATTENTION_DISABLE_HDIM{d}": "TRUE" for d in DEV_HEAD_DIMS_OFF}},
    },
    "full": {"archs": ["80", "90", "100", "120"], "env": {}},
}


def build(layout: Layout, profile: str = "dev", archs: list[str] | None = None,
          jobs: int | None = None, reuse: bool = False, mutations: list[Path] = (), install: bool = False,
          fa3: bool = True) -> Path:
    """Build the wheel into layout.root / "dist" and return its path.

    profile: "dev" or "full" (see the module docstring). archs: compute capabilities, e.g.
    ["90"]; None takes the profile's, else the visible GPU's. jobs: parallel compile jobs,
    default one per CPU.
    reuse: if dist/ already holds the wheel of this exact series, profile and archs, return it
    without building.
    mutations: diffs applied on top of the patched tree, to check that the tests catch the
    defect they plant (tests/mutations/); the version label ends in `.mutant`.
    install: pip-install the wheels (without dependencies) into the running Python, once all of
    them are built.
    fa3: also build the FA-3 wheel of the same profile (forktools.build_fa3), in a second thread.
    A mutation of hopper/ paths goes to that FA-3 build alone (FA-2 then builds unmutated); a
    flash-attn mutation alone leaves FA-3 out.
    """
    if profile not in PROFILES:
        raise ToolError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    archs = toolchain.build_archs(archs, PROFILES[profile]["archs"])
    fa3_mutations = [m for m in mutations if build_fa3.is_mutation_of_fa3(m)]
    mutations = [m for m in mutations if m not in fa3_mutations]
    label = f"sparse.{source_hash(layout, profile, archs, mutations)}.{profile}" + (".mutant" if mutations else "")
    dist = layout.root / "dist"
    reusable = sorted(dist.glob(f"flash_attn-*+{label}-*.whl")) if reuse else []
    with_fa3 = fa3 and bool(fa3_mutations or not mutations)
    fa3_reusable = with_fa3 and reuse and build_fa3.existing_wheel(layout, profile, fa3_mutations) is not None
    tools = toolchain.check() if not reusable or (with_fa3 and not fa3_reusable) else None
    if tools:
        print(f"build: CUDA {tools.cuda_version[0]}.{tools.cuda_version[1]} at {tools.cuda_home}, "
              f"torch {tools.torch_version}, {tools.cxx_standard}, archs {','.join(archs)}", flush=True)
    wheels = [wheel_fa4.build(layout)]
    fa3_build = build_fa3.Background(layout, profile, jobs, reuse, fa3_mutations, tools) if with_fa3 else None
    try:
        if reusable:
            print(f"build: reusing {reusable[-1].relative_to(layout.root)}")
            wheels.append(reusable[-1])
        else:
            wheels.append(_compile(layout, profile, archs, label, jobs, mutations, tools))
        if fa3_build is not None:
            wheels.append(fa3_build.result())
    except BaseException:
        if fa3_build is not None:
            fa3_build.cancel()  # no compile outlives a failed or interrupted build
        raise
    if install:
        install_wheels(wheels)
    return wheels[1]


def _compile(layout: Layout, profile: str, archs: list[str], label: str, jobs: int | None, mutations: list[Path],
             tools: toolchain.Toolchain) -> Path:
    dist = layout.root / "dist"
    stage = layout.root / "build" / "wheel" / UPSTREAM
    relay_tree(layout, stage)
    for mutation in mutations:
        patchfile.apply_diff(patchfile.split_description(Path(mutation).read_bytes()), stage, str(mutation))
        print(f"build: applied mutation {mutation}")
    env = {**build_env(layout, profile, archs, label, jobs), **tools.env()}
    dist.mkdir(exist_ok=True)
    log_path = layout.root / "build" / "logs" / f"build-{profile}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"build: {profile} profile, archs {','.join(archs)}, {env['MAX_JOBS']} jobs, version label {label}")
    start, ninja_before = time.monotonic(), ninja_log_lengths(stage)
    returncode = run_with_progress(pip_wheel_command(dist), stage, env, log_path)
    elapsed = time.monotonic() - start
    if returncode:
        raise ToolError(f"the build failed after {elapsed:.0f} s (exit {returncode}); see {log_path}")
    wheels = sorted(dist.glob(f"flash_attn-*+{label}-*.whl"))
    if not wheels:
        raise ToolError(f"the build finished but no wheel with version label {label} is in {dist}")
    size_mb = wheels[-1].stat().st_size / 1e6
    print(f"build: {wheels[-1].relative_to(layout.root)} ({size_mb:.1f} MB) in {elapsed:.0f} s")
    report_unit_times(stage, ninja_before, log_path.parent / f"units-{UPSTREAM}.txt")
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


def install_wheels(wheels: list[Path]) -> None:
    """Install the wheels in one pip call (without dependencies, replacing what is there)."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", *map(str, wheels)]
    if subprocess.call(command):
        raise ToolError(f"could not install {', '.join(wheel.name for wheel in wheels)}")
    print(f"build: installed {', '.join(wheel.name for wheel in wheels)} into {sys.prefix}")


def install_wheel(wheel: Path) -> None:
    install_wheels([wheel])
