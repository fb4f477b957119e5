"""Tests of `python -m forktools gpu` on this CPU: the step list, refusals, the order steps run
in, the command lines a dry run shows, prebuilt wheels reused by label, the time budget, the
pristine flash-attn-4 laid from its sdist, and that a variant's tests get their own folder."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "python"))  # appended: an installed flash_attn_sparse keeps precedence

from forktools import gpu, gpu_steps  # noqa: E402
from forktools.__main__ import main  # noqa: E402

pytestmark = pytest.mark.tooling
SHELL_STEPS = ["tests", "mutation", "sanitize", "reliability", "fa4", "fa3", "fa3-mutation", "bench", "fullbench", "crossover", "profile",
               "profile-fa4", "sweep", "variants", "ncu-dense", "ncu-source", "ncu-spec", "fa4-prefill-check"]


def dry_run(capsys, *args: str) -> list[str]:
    """The `+ command` lines of a dry run, in order."""
    assert main(["gpu", "--dry-run", *args]) == 0
    return [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]


def test_list_names_every_step_with_one_line_of_help(capsys):
    assert main(["gpu", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(gpu_steps.STEPS)
    new_steps = ["fuzz", "upstream-fa2", "example", "upstream-fa3", "distributed", "client-bench", "bench-pristine-fa4", "host-time",
                 "sanitize-fuzz", "fa3-variants", "host-profile", "ncu-fa3-prefill", "ncu-fa3-decode", "gqa-sweep", "gqa-mutation",
                 "fa3-paged-mutation", "engine-bench", "fp8-bench"]
    assert set(SHELL_STEPS + new_steps) == set(gpu_steps.STEPS)
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)


def test_an_unknown_step_exits_non_zero_before_anything_runs(capsys, tmp_path):
    code = main(["gpu", "--out", str(tmp_path / "out"), "tests", "benhc"])
    captured = capsys.readouterr()
    assert code != 0
    assert "unknown step 'benhc'" in captured.err
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_the_command_line_refuses_an_unknown_step():
    run = subprocess.run([sys.executable, "-m", "forktools", "gpu", "nonsense"], cwd=REPO, capture_output=True,
                         text=True, env={"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "unknown step 'nonsense'" in run.stderr


def test_steps_run_in_the_order_given_after_the_one_build(capsys, tmp_path):
    commands = dry_run(capsys, "--out", str(tmp_path), "sweep", "tests", "sanitize")
    joined = [" ".join(command.split()[:3]) for command in commands]
    build = next(i for i, c in enumerate(commands) if "forktools build --profile dev" in c)
    sweep = next(i for i, c in enumerate(commands) if "--split-sweep" in c)
    pytest_ = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    sanitize = next(i for i, c in enumerate(commands) if "tests/sanitize.py" in c)
    assert build < sweep < pytest_ < sanitize, joined
    assert sum("forktools build" in c for c in commands) == 1


def test_dry_run_command_lines_put_everything_under_the_output_folder(capsys, tmp_path):
    out = tmp_path / "results"
    commands = dry_run(capsys, "--out", str(out), "--pytest-args", "tests/api/test_stage5_api.py -k paged",
                       "--bench-shapes", "decode", "tests", "bench")
    pytest_line = next(c for c in commands if "-m pytest" in c)
    assert "-m gpu tests/api/test_stage5_api.py -k paged" in pytest_line
    assert f"> {out}/logs/pytest-gpu.log" in pytest_line
    bench_line = next(c for c in commands if "bench_sparse.py" in c)
    assert "--shapes decode" in bench_line and f"--json {out}/bench.json" in bench_line
    assert not out.exists(), "a dry run writes nothing"


def test_a_given_wheel_is_installed_without_a_build(capsys, tmp_path):
    commands = dry_run(capsys, "--out", str(tmp_path), "--wheel", "variant-x-wheel.tar", "tests")
    assert not any("forktools build" in c or "forktools upstream" in c for c in commands)
    assert any(c.startswith("extract variant-x-wheel.tar") for c in commands)


def tar_wheels(folder: Path, *names: str) -> Path:
    """A --wheels folder as an earlier run leaves it: each wheel in a tar of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, name in enumerate(names):
        wheel = folder / name
        wheel.write_bytes(b"wheel " + name.encode())
        with tarfile.open(folder / f"wheel-{number}.tar", "w") as tar:
            tar.add(wheel, arcname=name)
        wheel.unlink()
    return folder


def test_the_default_output_folder_is_local_and_the_budget_off():
    from forktools.__main__ import _parser
    args = _parser().parse_args(["gpu", "tests"])
    assert args.out == Path("gpu-out") and args.budget_s == 0 and args.wheels is None
    args = _parser().parse_args(["gpu", "--out", "o", "--cutedsl-site", "s", "tests", "bench", "--wheels", "w", "--budget-s", "9"])
    assert (args.out, args.cutedsl_site, args.wheels, args.budget_s) == (Path("o"), Path("s"), Path("w"), 9)
    assert args.steps == ["tests", "bench"]


def test_wheels_are_found_loose_and_in_tars(tmp_path):
    folder = tar_wheels(tmp_path / "wheels", "flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl")
    (folder / "flash_attn_3-3.0.0b1+sparse.b.dev-cp312-linux_x86_64.whl").write_bytes(b"loose")
    found = gpu.wheels_in(folder)
    assert set(found) == {"flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl",
                          "flash_attn_3-3.0.0b1+sparse.b.dev-cp312-linux_x86_64.whl"}
    gpu.lay_wheels(folder, sorted(found), tmp_path / "dist")
    assert (tmp_path / "dist/flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl").read_bytes().startswith(b"wheel")
    assert (tmp_path / "dist/flash_attn_3-3.0.0b1+sparse.b.dev-cp312-linux_x86_64.whl").read_bytes() == b"loose"
    assert gpu.wheels_in(tmp_path / "missing") == {} and gpu.wheels_in(None) == {}


def test_prebuilt_wheels_go_to_dist_before_the_build_that_reuses_them(capsys, tmp_path):
    """--wheels: every wheel but a mutant is laid into dist/, then `build --reuse` takes those whose
    label is this checkout's; only wheels not taken from the folder are written to --out."""
    folder = tar_wheels(tmp_path / "wheels", "flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl",
                        "flash_attn-2.8.3+sparse.b.dev.mutant-cp312-linux_x86_64.whl")
    commands = dry_run(capsys, "--out", str(tmp_path / "out"), "--wheels", str(folder), "tests")
    lay = next(i for i, c in enumerate(commands) if c.startswith("copy ") and "into dist/" in c)
    build = next(i for i, c in enumerate(commands) if "forktools build --profile dev" in c)
    assert lay < build and "--reuse" in commands[build]
    assert "sparse.a.dev" in commands[lay] and "mutant" not in commands[lay]
    assert any(c.startswith("tar ") and c.endswith("flash-attn-wheel.tar") for c in commands)


def test_reusing_the_fa2_wheel_builds_only_flash_attn_4(capsys, tmp_path):
    folder = tar_wheels(tmp_path / "wheels", "flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl")
    commands = dry_run(capsys, "--out", str(tmp_path), "--wheels", str(folder), "--reuse-fa2-wheel", "fa4")
    builds = [c for c in commands if "forktools build" in c and "--fa3-only" not in c]
    assert len(builds) == 1 and "--fa4-only" in builds[0]
    assert any("flash_attn-2.8.3+sparse.a.dev" in c and "given-wheel" in c for c in commands)
    assert not any(c.endswith("flash-attn-wheel.tar") for c in commands), "a wheel from --wheels is not written back"


def test_reusing_the_fa2_wheel_needs_a_wheels_folder(capsys):
    assert main(["gpu", "--dry-run", "--reuse-fa2-wheel", "fa4"]) == 2
    assert "--wheels" in capsys.readouterr().err


def test_hooks_call_the_fuzzer_upstream_tests_and_examples(capsys, tmp_path):
    commands = dry_run(capsys, "--out", str(tmp_path), "--fuzz-seed", "7", "--fuzz-budget-s", "60",
                       "fuzz", "upstream-fa2", "example")
    assert any("tests/fuzz/run.py --seed 7 --budget-s 60" in c for c in commands)
    assert any("tests/upstream/run_upstream.py" in c for c in commands)
    examples = sorted((REPO / "examples").glob("*.py"))
    assert examples, "examples/ holds at least the quickstart"
    for example in examples:
        assert any(f"examples/{example.name}" in c for c in commands)


def test_an_fa3_variant_is_built_tested_and_benched_beside_this_build(capsys, tmp_path):
    """fa3-variants: the diff rebuilds the FA-3 wheel as a mutant, the FA-3 tests run on it, and
    the bench runs fa3 with its dense peers on this build first, then on the variant."""
    diff = REPO / "benchmarks/experiments/fa3-static-scheduler.diff"
    commands = dry_run(capsys, "--out", str(tmp_path), "--bench-shapes", "prefill", "--fa3-variant", str(diff), "fa3-variants")
    build = next(i for i, c in enumerate(commands) if f"--mutation {diff}" in c)
    benches = [i for i, c in enumerate(commands) if "bench_sparse.py" in c]
    tests = next(i for i, c in enumerate(commands) if "-m pytest" in c and "fa3-variant-fa3-static-scheduler" in c)
    assert len(benches) == 2 and benches[0] < build < tests < benches[1]
    assert all(f"--methods {gpu_steps.FA3_VARIANT_METHODS}" in commands[i] and "--shapes prefill" in commands[i] for i in benches)
    assert "fa3-baseline.json" in commands[benches[0]] and "fa3-variant-fa3-static-scheduler.json" in commands[benches[1]]
    # FA-3 alone: a build of both would rebuild FA-2 whenever the installed wheel's label is not this checkout's
    assert "build --fa3-only" in commands[build]


def test_the_fa3_mutant_builds_fa3_alone(capsys, tmp_path):
    (build,) = [c for c in dry_run(capsys, "--out", str(tmp_path), "fa3-mutation") if "--mutation" in c]
    assert "build --fa3-only" in build and str(gpu_steps.FA3_MUTATION) in build


def test_upstream_fa3_tests_run_in_a_freshly_laid_patched_tree(capsys, tmp_path):
    """With a reused wheel nothing lays out build/wheel/flash-attn-3, and after fa3-mutation that
    folder holds the mutant's tree: the step lays its own."""
    folder = tar_wheels(tmp_path / "wheels", "flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl")
    commands = dry_run(capsys, "--out", str(tmp_path), "--wheels", str(folder), "--reuse-fa2-wheel", "fa3-mutation",
                       "upstream-fa3")
    lay = max(i for i, c in enumerate(commands) if c.startswith("lay the patched flash-attn-3 tree"))
    pytest_run = next(i for i, c in enumerate(commands) if "test_flash_attn.py" in c)
    mutant = next(i for i, c in enumerate(commands) if "--mutation" in c)
    assert mutant < lay < pytest_run


def test_fa3_variant_diffs_joined_by_plus_build_as_one_variant(capsys, tmp_path):
    """--fa3-variant a.diff+b.diff: one FA-3 build with both diffs applied, tested and benched once."""
    first, second = (REPO / "benchmarks/experiments" / name for name in ("fa3-static-scheduler.diff", "fa3-combine-pdl.diff"))
    commands = dry_run(capsys, "--out", str(tmp_path), "--fa3-variant", f"{first}+{second}", "fa3-variants")
    (build,) = [c for c in commands if "--mutation" in c]
    assert f"--mutation {first} --mutation {second}" in build
    assert sum("fa3-variant-fa3-static-scheduler-and-fa3-combine-pdl.json" in c for c in commands) == 1


def test_without_an_fa3_variant_the_step_says_so(capsys, tmp_path):
    commands = dry_run(capsys, "--out", str(tmp_path), "fa3-variants")
    assert not any("bench_sparse.py" in c or "--mutation" in c for c in commands)


def test_a_variant_s_tests_run_from_their_own_folder(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_a.py").write_text("main's a\n")
    (repo / "tests" / "test_b.py").write_text("main's b\n")
    (repo / "python").mkdir()
    (repo / "pytest.ini").write_text("[pytest]\n")
    changed = tmp_path / "x.tests"
    changed.mkdir()
    (changed / "test_b.py").write_text("the variant's b\n")
    options = argparse.Namespace(cutedsl_site=None)
    session = gpu.Session(root=repo, out=tmp_path / "out", scratch=tmp_path / "scratch", options=options)
    root = gpu_steps.variant_test_root(session, "x", changed)
    assert (root / "tests" / "test_a.py").read_text() == "main's a\n"
    assert (root / "tests" / "test_b.py").read_text() == "the variant's b\n"
    assert (repo / "tests" / "test_b.py").read_text() == "main's b\n", "the repo's tests/ is untouched"
    assert (root / "python").resolve() == (repo / "python").resolve()
    assert (root / "pytest.ini").is_symlink()


def test_a_failing_step_makes_the_exit_non_zero_and_the_summary_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "describe_machine", lambda session: None)
    monkeypatch.setattr(gpu, "prepare_wheel", lambda session: tmp_path / "flash_attn-1.whl")
    monkeypatch.setattr(gpu, "install", lambda session, wheel: True)

    def failing(session):
        session.run([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], output=session.logs / "x.log")
        return "it failed"

    monkeypatch.setitem(gpu_steps.STEPS, "tests", ("a failing stand-in", failing))
    out = tmp_path / "out"
    code = main(["gpu", "--out", str(out), "--scratch", str(tmp_path / "scratch"), "tests"])
    assert code == 1
    summary = (out / "summary.txt").read_text()
    assert "| tests | 3 |" in summary and "it failed" in summary
    assert (out / "logs.tar.gz").exists() and not (out / "logs").exists()


def test_the_budget_cuts_a_command_with_its_children_and_skips_later_steps(tmp_path, monkeypatch):
    """--budget-s stops the run before a CI job's own timeout would: the running command and the
    processes below it are killed, later steps are not started, and the summary and the logs
    tarball are written."""
    monkeypatch.setattr(gpu, "describe_machine", lambda session: None)
    monkeypatch.setattr(gpu, "prepare_wheel", lambda session: tmp_path / "flash_attn-1.whl")
    monkeypatch.setattr(gpu, "install", lambda session, wheel: True)
    late = tmp_path / "written-by-a-grandchild"
    grandchild = f"import time, pathlib; time.sleep(3); pathlib.Path({str(late)!r}).write_text('late')"
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"

    def slow(session):
        session.run([sys.executable, "-c", child], output=session.logs / "slow.log")
        return "slow step"

    monkeypatch.setitem(gpu_steps.STEPS, "tests", ("a slow stand-in", slow))
    monkeypatch.setitem(gpu_steps.STEPS, "bench", ("never reached", lambda session: pytest.fail("started past the budget")))
    out = tmp_path / "out"
    started = time.monotonic()
    code = main(["gpu", "--out", str(out), "--scratch", str(tmp_path / "scratch"), "--budget-s", "1", "tests", "bench"])
    assert time.monotonic() - started < 20
    assert code == 1
    summary = (out / "summary.txt").read_text()
    assert "| tests | 124 |" in summary and "budget: cut after 1 s" in summary
    assert "| bench | 124 | 0 | not started: past --budget-s |" in summary
    assert (out / "logs.tar.gz").exists()
    time.sleep(4)
    assert not late.exists(), "the command's own child outlived the cut"


def test_the_mutation_step_succeeds_when_its_tests_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "describe_machine", lambda session: None)
    monkeypatch.setattr(gpu, "prepare_wheel", lambda session: tmp_path / "flash_attn-1.whl")
    monkeypatch.setattr(gpu, "install", lambda session, wheel: True)
    monkeypatch.setattr(gpu_steps, "build_mutant", lambda session, name, diff: tmp_path / "site")
    outcomes = {}

    def pytest_exits(code):
        def fake(session, name, *args, env=None, cwd_root=None):
            session.run([sys.executable, "-c", f"raise SystemExit({code})"])
            return f"pytest {name}: exit {code}"
        return fake

    for code in (1, 0):
        monkeypatch.setattr(gpu_steps, "run_pytest", pytest_exits(code))
        out = tmp_path / f"out-{code}"
        outcomes[code] = main(["gpu", "--out", str(out), "--scratch", str(tmp_path / "scratch"), "mutation"])
        assert ("NOT caught" in (out / "summary.txt").read_text()) == (code == 0)
    assert outcomes == {1: 0, 0: 1}


def test_reusing_the_fa2_wheel_takes_the_given_fa3_wheel_or_builds_fa3_alone(monkeypatch, tmp_path):
    """--reuse-fa2-wheel keeps the fa3 backend: the flash_attn_3 wheel of --wheels goes into dist/
    when its label is this tree's, else FA-3 is built here alone (`forktools build --fa3-only`)."""
    from forktools import build_fa3
    monkeypatch.setattr(build_fa3, "version_label", lambda layout, profile="dev", mutations=(): "sparse.1234567890.dev")
    root = tmp_path / "root"
    root.mkdir()
    builds = []

    def fake_forktools(self, *args, output):
        builds.append(args)
        output.write_text("build fa3: dist/flash_attn_3-X.whl (14.0 MB) in 280 s\n")
        return 0
    monkeypatch.setattr(gpu.Session, "forktools", fake_forktools)

    def session(folder):
        made = gpu.Session(root=root, out=tmp_path / "out", scratch=tmp_path / "scratch",
                           options=argparse.Namespace(wheels=folder))
        made.logs.mkdir(parents=True, exist_ok=True)
        return made
    this_trees = "flash_attn_3-3.0.0b1+sparse.1234567890.dev-cp312-cp312-linux_x86_64.whl"
    current_folder = tar_wheels(tmp_path / "current", this_trees)
    current = session(current_folder)
    gpu.given_or_built_fa3_wheel(current, gpu.wheels_in(current_folder))
    assert (root / "dist" / this_trees).exists() and not builds

    (root / "dist" / this_trees).unlink()
    stale_folder = tar_wheels(tmp_path / "stale", "flash_attn_3-3.0.0b1+sparse.aaaaaaaaaa.dev-cp312-cp312-linux_x86_64.whl")
    stale = session(stale_folder)
    gpu.given_or_built_fa3_wheel(stale, gpu.wheels_in(stale_folder))
    assert not list((root / "dist").glob("*.whl"))  # the stale wheel is not laid in
    assert len(builds) == 1 and builds[0][:2] == ("build", "--fa3-only") and "--reuse" in builds[0]
    assert any("built here" in note and "in 280 s" in note for note in stale.notes)


def test_the_wheel_a_build_printed_is_the_one_installed():
    """dist/ may hold wheels of other labels (from --wheels): the runner installs the one the build
    named, reused or built."""
    reused = "build: reusing dist/flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl\n"
    built = ("build: dev profile, archs 90, 16 jobs, version label x\n"
             "build: dist/flash_attn-2.8.3+sparse.b.dev-cp312.whl (40.1 MB) in 300 s\n")
    assert gpu.BUILT_WHEEL.findall(reused) == ["dist/flash_attn-2.8.3+sparse.a.dev-cp312-linux_x86_64.whl"]
    assert gpu.BUILT_WHEEL.findall(built) == ["dist/flash_attn-2.8.3+sparse.b.dev-cp312.whl"]


def test_the_pristine_flash_attn_4_peer_comes_from_the_pinned_sdist(capsys, tmp_path):
    commands = dry_run(capsys, "--out", str(tmp_path), "--cutedsl-site", str(tmp_path / "site"), "--wheel", "x.tar",
                       "bench-pristine-fa4")
    lay = next(i for i, c in enumerate(commands) if c.startswith("lay pristine flash-attn-4 from the pinned sdist"))
    bench = next(i for i, c in enumerate(commands) if "bench_sparse.py --pristine-fa4" in c)
    assert lay < bench


@pytest.mark.skipif(not (REPO / ".cache/upstream/flash_attn_4-4.0.0b36.tar.gz").exists(),
                    reason="the upstream cache lacks the flash-attn-4 sdist (`nox -s upstream` fetches it)")
def test_the_pristine_flash_attn_4_is_laid_as_released(tmp_path):
    folder = tmp_path / "fa4-pristine"
    gpu_steps.lay_pristine_fa4(REPO, folder)
    package = folder / "flash_attn" / "cute"
    assert (package / "__init__.py").exists() and (package / "interface.py").exists()
    assert not (package / "sparse_series.py").exists(), "the patched series' marker is not in the release"
    assert not (folder / "flash_attn" / "__init__.py").exists(), "flash_attn stays the FA-2 wheel's package"
    (info,) = folder.glob("flash_attn_4-*.dist-info")
    assert info.name == "flash_attn_4-4.0.0b36.dist-info" and "Version: 4.0.0b36" in (info / "METADATA").read_text()


def test_fa4_variants_and_the_pristine_release_each_run_first_on_the_path(capsys, tmp_path):
    site = tmp_path / "site"
    commands = dry_run(capsys, "--out", str(tmp_path), "--cutedsl-site", str(site), "--wheel", "x.tar",
                       "--fa4-variant", f"early={tmp_path / 'fa4.whl'}", "fa4-prefill-check")
    checks = [c for c in commands if "fa4_prefill_check.py" in c]
    assert len(checks) == 3 and "--label early" in checks[1] and "--pristine" in checks[2]
    assert any("pip install" in c and "fa4-variant-early" in c for c in commands)


@pytest.mark.parametrize("step, shape", [("ncu-fa3-prefill", "'prefill B1 S16k H32 full' --density 0.0625"),
                                         ("ncu-fa3-decode", "'decode B8 Sq16' --density 1.0")])
def test_ncu_fa3_steps_profile_fa3_kernels_by_their_demangled_names(capsys, step, shape):
    """FA-3's kernels are all cutlass::device_kernel<...>: only the demangled name tells the forward."""
    ncu = next(line for line in dry_run(capsys, "--wheel", "x.tar", step) if line.startswith("ncu --set"))
    assert "--kernel-name-base demangled -k regex:FlashAttnFwdSm90" in ncu and "benchmarks/profile_fa3.py" in ncu
    assert "--launch-skip 2 --launch-count 4" in ncu and f"--shape {shape}" in ncu
