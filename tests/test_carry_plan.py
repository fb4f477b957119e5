"""forktools carry-plan on the CPU: each device call's carry list stays within the per-call limit
and path count, the runtime parts keep their calls, and the upstream cache goes file by file only
when it does not fit whole (session 35: a 7.8 MB tree pushed part 1 with a wheel over 64 MiB)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "python"))
from forktools import ToolError, carry  # noqa: E402

KIB = 1 << 10


def put(root: Path, path: str, size: int) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    with open(root / path, "wb") as file:
        file.truncate(size)


def checkout(tmp_path: Path, tree_kib: int) -> Path:
    """A git checkout with `tree_kib` of tracked files and the ignored things a GPU session carries."""
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    (root / ".gitignore").write_text(".carry/\n.cache/\n.commit\n")
    put(root, "benchmarks/results/plot.png", tree_kib * KIB)
    put(root, ".carry/cutedsl/part1/runtime.tar", 500 * KIB)
    put(root, ".carry/cutedsl/part2/runtime.tar", 240 * KIB)
    put(root, ".carry/wheel/dist-wheel.tar", 100 * KIB)
    put(root, ".carry/wheel/dist-fa3-wheel.tar", 140 * KIB)
    put(root, ".carry/fa4pristine/flash_attn_4.whl", 5 * KIB)
    for name, size in {"flash_attn.tar.gz": 85, "cutlass.whl": 64, "fa4.tar.gz": 5, "hopper.tar.gz": 2}.items():
        put(root, f".cache/upstream/{name}", size * KIB)
    (root / ".commit").write_text("abc1234\n")
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def check(calls: list[carry.Call], root: Path, limit: int) -> set[str]:
    assert calls[0].paths[0] == ".carry/cutedsl/part1" and calls[1].paths[:2] == [".carry/cutedsl/part2", ".commit"]
    for call in calls:
        assert call.bytes <= limit and len(call.paths) <= carry.MAX_PATHS
        assert call.bytes == carry.tree_bytes(root) + sum(carry.size_of(root / p) for p in call.paths)
    return {p for call in calls for p in call.paths}


def test_the_cache_goes_whole_while_it_fits(tmp_path: Path):
    root = checkout(tmp_path, tree_kib=20)
    calls = carry.plan(root, limit=640 * KIB)
    carried = check(calls, root, 640 * KIB)
    assert ".cache/upstream" in carried and not any(p.startswith(".cache/upstream/") for p in carried)
    assert {*carry.WHEELS, carry.PRISTINE_FA4} <= carried


def test_a_larger_tree_sends_the_cache_file_by_file_across_both_calls(tmp_path: Path):
    root = checkout(tmp_path, tree_kib=50)
    calls = carry.plan(root, limit=640 * KIB)
    carried = check(calls, root, 640 * KIB)
    cache_files = {f".cache/upstream/{name}" for name in ("flash_attn.tar.gz", "cutlass.whl", "fa4.tar.gz", "hopper.tar.gz")}
    assert cache_files <= carried and ".cache/upstream" not in carried
    assert all(any(p.startswith(".cache/upstream/") for p in call.paths) for call in calls)


def test_what_fits_no_call_is_named(tmp_path: Path):
    root = checkout(tmp_path, tree_kib=100)
    with pytest.raises(ToolError, match=r"fits no call beside a"):
        carry.plan(root, limit=640 * KIB)


def test_without_fa4_one_call_carries_the_wheels_cache_and_commit(tmp_path: Path):
    root = checkout(tmp_path, tree_kib=20)
    (calls,) = carry.plan(root, with_fa4=False, limit=640 * KIB)
    assert calls.paths[0] == ".commit" and set(calls.paths[1:]) == {".cache/upstream", *carry.WHEELS}
