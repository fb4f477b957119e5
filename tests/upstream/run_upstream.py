"""Upstream flash-attn's own forward-only tests as a gate, on the installed (patched) wheel.

    python tests/upstream/run_upstream.py [--collect-only] [--stub] [pytest args...]

Unpacks flash-attention-v2.8.3-tests.tar.gz (its git tree id checked against upstream/lock.toml's
pin) from the upstream cache .cache/upstream (where `nox -s upstream` puts it), or the folder
$FORKTOOLS_UPSTREAM_MIRROR names, into a temporary folder and runs
pytest over its tests/test_flash_attn.py with the selection plugin fa2_forward_selection.py
(which tests, and why). Prints the pass / skip / fail / deselected counts; exits with pytest's
status.
--stub (with --collect-only) collects without a GPU or flash_attn (collect_stubs.py).
"""

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "python"))
from forktools import github  # noqa: E402

LOCK = REPO / "upstream" / "lock.toml"
CACHE = REPO / ".cache" / "upstream"
ARCHIVE = "flash-attention-v2.8.3-tests.tar.gz"
COUNTS = ("passed", "skipped", "failed", "error", "deselected")


def find_archive() -> Path:
    mirror = os.environ.get("FORKTOOLS_UPSTREAM_MIRROR")
    folders = [CACHE] + ([Path(mirror)] if mirror else [])
    for folder in folders:
        if (folder / ARCHIVE).is_file():
            return folder / ARCHIVE
    raise SystemExit(f"{ARCHIVE} is in none of {', '.join(map(str, folders))} (nox -s upstream puts it in {CACHE})")


def unpack(archive: Path, into: Path) -> Path:
    pin = next(p for p in github.load(LOCK) if p.archive == ARCHIVE)
    github.check(archive, pin)  # refuses, naming both tree ids, an archive that is not the pinned tree
    with tarfile.open(archive) as tar:
        try:
            tar.extractall(into, filter="data")
        except TypeError:  # Python before 3.11.4 has no filters; the archive's content is checked above
            tar.extractall(into)
    (into / "pytest.ini").write_text("[pytest]\n")  # keep this repo's pytest.ini out
    return into / "tests" / "test_flash_attn.py"


def summary(output: str) -> dict:
    last = [line for line in output.splitlines() if re.search(r"\d+ (passed|deselected|failed|skipped|error)", line)]
    return {key: int(m.group(1)) for key in COUNTS if (m := re.search(rf"(\d+) {key}", last[-1] if last else ""))}


def main(argv) -> int:
    stub = "--stub" in argv
    args = [a for a in argv if a != "--stub"]
    with tempfile.TemporaryDirectory(prefix="fa2-upstream-") as tmp:
        test_file = unpack(find_archive(), Path(tmp))
        plugins = ["-p", "collect_stubs"] if stub else []
        command = [sys.executable, "-m", "pytest", *plugins, "-p", "fa2_forward_selection", "-p", "no:cacheprovider",
                   "--rootdir", tmp, "-q", "-rfE", str(test_file), *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        run = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True)
    print(run.stdout[-6000:], run.stderr[-2000:], sep="\n")
    counts = summary(run.stdout)
    collected = sum(1 for line in run.stdout.splitlines() if "::" in line) if "--collect-only" in args else None
    print("upstream test_flash_attn.py (forward-only selection): "
          + ", ".join(f"{k} {counts.get(k, 0)}" for k in COUNTS) + (f", collected {collected}" if collected is not None else ""))
    return run.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
