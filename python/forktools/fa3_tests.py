"""Upstream FA-3's own forward tests on the patched FA-3 build, on a GPU host:

    PYTHONPATH=python python -m forktools.fa3_tests [pytest args]

(`nox -s upstream` fetches the pinned sources first). It builds (or reuses) and installs the
dev flash_attn_3 wheel (forktools.build_fa3), then runs hopper/test_flash_attn.py of the patched
tree from build/wheel/flash-attn-3/hopper with the dev profile's FLASH_ATTENTION_DISABLE_*
variables, which upstream's test file reads to narrow its own parameters. It is also the pytest
plugin (`-p forktools.fa3_tests`) that deselects, by name and parameter, what the dev profile
does not compile (DESELECT); pytest's summary line gives the pass / skip / fail / deselected counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

from forktools import build, build_fa3
from forktools.layout import Layout

# Test → why it is left out, for a parameter predicate (None: all of it).
DESELECT = {
    # They loop over dv in (256, 512, 64) at d = 64: the dv != d kernels are not in the dev set.
    "test_flash_attn_output": ("d = 64 loops over dv 256/512", lambda params: params.get("d") == 64),
    "test_flash_attn_varlen_output": ("d = 64 loops over dv 256/512", lambda params: params.get("d") == 64),
    # Forward and backward under memory load, and head dims up to 256.
    "test_flash_attn_race_condition": ("needs the backward", None),
}


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        rule = DESELECT.get(item.originalname or item.name)
        params = getattr(getattr(item, "callspec", None), "params", {})
        (dropped if rule and (rule[1] is None or rule[1](params)) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        reasons = "; ".join(f"{name}: {why}" for name, (why, _) in DESELECT.items())
        print(f"\nfa3_tests: deselected {len(dropped)} cases the dev profile does not compile ({reasons})")


def main(argv: list[str]) -> int:
    layout = Layout.at(os.path.join(os.path.dirname(__file__), "..", ".."))
    wheel = build_fa3.build(layout, profile="dev", reuse=True)
    build.install_wheel(wheel)
    hopper = layout.root / "build" / "wheel" / build_fa3.UPSTREAM / "hopper"
    env = {**os.environ, **build_fa3.PROFILES["dev"],
           "PYTHONPATH": os.pathsep.join([str(layout.root / "python"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", "-p", "forktools.fa3_tests", "-q", "-rfE",
               "test_flash_attn.py", *argv]
    print("+", " ".join(command), flush=True)
    return subprocess.call(command, cwd=hopper, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
