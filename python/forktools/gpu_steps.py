"""The steps of `python -m forktools gpu`: each takes the Session (forktools.gpu) and returns the
one line the summary table shows. STEPS maps a step's name to its help line and its function."""

from __future__ import annotations

import gzip
import os
import re
import shlex
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

PY = sys.executable
NCU_SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
                "MemoryWorkloadAnalysis", "SchedulerStats"]
NCU_KEY_LINES = re.compile(
    r"^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|"
    r"Registers Per Thread|Block Limit|Waves Per SM|Grid Size|Dynamic Shared|Stall|Issue Slots|SM Busy|"
    r"Executed Ipc|L2 Hit|Eligible Warps")


def _last_line(session, path: Path) -> str:
    lines = session.read(path).strip().splitlines()
    return lines[-1] if lines else "(no output)"


def _line_count(session, path: Path) -> int:
    return len(session.read(path).splitlines())


def run_pytest(session, name: str, *args, env: dict | None = None, cwd_root: Path | None = None) -> str:
    log = session.logs / f"pytest-{name}.log"
    command = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE",
               f"--junitxml={session.logs / f'junit-{name}.xml'}", *args]
    if cwd_root:  # a variant's own test folder: pytest runs there, its conftest finds that root
        command[3:3] = ["--rootdir", str(cwd_root), "-c", str(cwd_root / "pytest.ini")]
    session.run(command, output=log, timeout=session.options.pytest_timeout, env=env)
    return f"pytest {name}: {_last_line(session, log)}"


def tests(session) -> str:
    return run_pytest(session, "gpu", "-m", "gpu", *shlex.split(session.options.test_selection))


def reliability(session) -> str:
    return run_pytest(session, "reliability", "tests/contract/test_reliability_gpu.py")


def fa4(session) -> str:
    return run_pytest(session, "fa4", "tests/backends/test_stage4_fa4.py")


def build_mutant(session, name: str, diff: Path) -> Path | None:
    """A dev wheel with `diff` applied on top, installed into its own folder (returned)."""
    if session.forktools("build", "--profile", "dev", "--mutation", str(diff), output=session.logs / f"{name}-build.log"):
        return None
    wheel = session.newest("flash_attn-*mutant*.whl")
    site = session.scratch / f"site-{name}"
    session.act(f"empty {site}", recreate, site)
    if wheel is None or session.pip_install(wheel, site):
        return None
    session.mutant_wheel = wheel
    return site


def mutant_must_fail(session, name: str, diff: str, *pytest_args: str) -> str:
    """A dev wheel with `diff` planted, and the tests that must catch it run on it: the step passes
    when they fail (pytest's "some tests failed", not a crash or a timeout)."""
    site = build_mutant(session, name, Path(diff))
    if site is None:
        return f"{name} build: FAILED"
    return caught(session, run_pytest(session, name, *pytest_args, env={"PYTHONPATH": str(site)}))


def caught(session, result: str) -> str:
    """The last pytest run on a mutant, reported: the step passes when its tests failed (pytest's
    "some tests failed", not a crash or a timeout)."""
    was_caught = session.last_rc == 1
    session.worst_rc = 0 if was_caught else 1
    return f"{result} ({'caught' if was_caught else 'NOT caught'}: these tests must fail)"


def gqa_mutation(session) -> str:
    return mutant_must_fail(session, "gqa-mutant", "tests/mutations/packed-row-head-ignores-tile-start.patch",
                            "tests/contract/test_contract_gqa_gpu.py", "-k", "fa2")


def gqa_sweep(session) -> str:
    session.run([PY, "benchmarks/bench_gqa.py", "--out", session.out, *shlex.split(session.options.gqa_args)],
                output=session.logs / "gqa.log", timeout=600)
    return f"gqa sweep: {'gqa.md' if (session.out / 'gqa.md').exists() else 'FAILED (see logs/gqa.log)'}"


def engine_bench(session) -> str:
    session.run([PY, "benchmarks/bench_engine.py", "--out", session.out], output=session.logs / "engine.log", timeout=600)
    return f"engine bench: {'engine.md' if (session.out / 'engine.md').exists() else 'FAILED (see logs/engine.log)'}"


def fp8_bench(session) -> str:
    session.run([PY, "benchmarks/bench_fp8.py", "--out", session.out], output=session.logs / "fp8.log", timeout=600)
    return f"fp8 bench: {'fp8.md' if (session.out / 'fp8.md').exists() else 'FAILED (see logs/fp8.log)'}"


def mutation(session) -> str:
    return mutant_must_fail(session, "mutant", "tests/mutations/v-steps-densely.patch",
                            "tests/backends/test_stage3_sparse_fa2.py", "-k", "permuted or tail_block_in_the_middle")


FA3_TESTS = "tests/backends/test_stage4_fa3_sparse.py"
FA3_MUTATION = Path("tests/mutations/fa3-v-steps-densely.patch")


def fa3_site(session, name: str, wheel: Path | None) -> dict | None:
    """The flash_attn_3 wheel installed into its own folder, as a PYTHONPATH placing it first."""
    site = session.scratch / f"site-{name}"
    session.act(f"empty {site}", recreate, site)
    if wheel is None or session.pip_install(wheel, site):
        return None
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), session.env.get("PYTHONPATH")) if p)}


def fa3(session) -> str:
    env = fa3_site(session, "fa3", session.fa3_wheel)
    if env is None:
        return "fa3 install: FAILED (no flash_attn_3 wheel in dist/?)"
    return run_pytest(session, "fa3", FA3_TESTS, env=env)


def fa3_mutant_must_fail(session, name: str, diff: Path, *pytest_args: str) -> str:
    """build --mutation with a hopper/ diff rebuilds only the FA-3 wheel (label .mutant); the tests
    that must catch it run on it, and the step passes when they fail."""
    if session.forktools("build", "--fa3-only", "--profile", "dev", "--reuse", "--mutation", str(diff),
                         output=session.logs / f"{name}-build.log"):
        return f"{name} build: FAILED"
    env = fa3_site(session, name, session.newest("flash_attn_3-*mutant*.whl"))
    if env is None:
        return f"{name} install: FAILED"
    return caught(session, run_pytest(session, name, *pytest_args, env=env))


def fa3_mutation(session) -> str:
    return fa3_mutant_must_fail(session, "fa3-mutant", FA3_MUTATION, FA3_TESTS, "-k", "permuted or forced_splits or wrapper")


def fa3_paged_mutation(session) -> str:
    return fa3_mutant_must_fail(session, "fa3-paged-mutant", Path("tests/mutations/fa3-paged-loads-ignore-page-table.patch"),
                                "tests/api/test_stage5_paged.py", "-k", "fa3 and page128")


FA3_VARIANT_METHODS = "fa3_sparse,fa3_dense_listed,fa3_dense_listed_128"


def fa3_variants(session) -> str:
    """Each --fa3-variant diff (hopper/, on the patched tree) built as an FA-3 mutant wheel: the FA-3
    tests on it (they must pass), then the bench step's shapes with fa3 and its dense FA-3 peers on
    this build and on the variant, one process after the other (the peers' times say whether the
    machine moved between the two): an experiment's same-run A/B."""
    diffs = session.options.fa3_variants or []
    if not diffs:
        return "no --fa3-variant given"
    baseline = fa3_site(session, "fa3", session.fa3_wheel)
    if baseline is None:
        return "fa3 install: FAILED (no flash_attn_3 wheel in dist/?)"
    results = [_fa3_bench(session, "fa3-baseline", baseline)]
    for diff in diffs:
        # "a.diff+b.diff": the diffs applied together, one build measuring both
        parts = str(diff).split("+")
        name = "-and-".join(Path(part).stem for part in parts)  # a plain file name in --out
        # --fa3-only: the FA-2 wheel in use stays (a build of both would also rebuild FA-2 whenever
        # the installed one's label is not this checkout's, minutes for no use here).
        if session.forktools("build", "--fa3-only", "--profile", "dev", "--reuse",
                             *(arg for part in parts for arg in ("--mutation", part)),
                             output=session.logs / f"fa3-variant-{name}-build.log"):
            results.append(f"{name}: build FAILED")
            continue
        env = fa3_site(session, f"fa3-variant-{name}", session.newest("flash_attn_3-*mutant*.whl"))
        if env is None:
            results.append(f"{name}: install FAILED")
            continue
        results.append(f"{name}: " + run_pytest(session, f"fa3-variant-{name}", FA3_TESTS, env=env))
        results.append(_fa3_bench(session, f"fa3-variant-{name}", env))
    return "; ".join(results)


def _fa3_bench(session, name: str, env: dict) -> str:
    return _bench(session, name, "--shapes", session.options.bench_shapes, methods=FA3_VARIANT_METHODS, env=env)


def sanitize(session) -> str:
    log = session.logs / "sanitize.log"
    session.run([PY, "tests/sanitize.py", "--raw", session.logs, *session.options.sanitize_args.split()], output=log, timeout=600)
    return "sanitize: " + ";".join(session.read(log).splitlines())


def sanitize_fuzz(session) -> str:
    log = session.logs / "sanitize-fuzz.log"
    raw = session.logs / "sanitize-fuzz"
    session.act(f"make {raw}", raw.mkdir, 0o755, True, True)
    # synccheck is left to the sanitize step's barrier-heavy cases: the subset is about bad inputs.
    session.run([PY, "tests/sanitize.py", "--fuzz-subset", str(session.options.sanitize_fuzz_count), "--raw", raw,
                 "--tools", "memcheck,racecheck,initcheck"], output=log, timeout=420)
    return "sanitize fuzz subset: " + ";".join(line for line in session.read(log).splitlines() if "fuzz cases" in line or "clean" in line
                                               or "ERRORS" in line)


def _bench(session, name: str, *shapes: str, methods: str | None = None, env: dict | None = None) -> str:
    methods = methods or session.options.bench_methods
    session.run([PY, "benchmarks/bench_sparse.py", *shapes, *(["--methods", methods] if methods else []),
                 "--json", session.out / f"{name}.json", "--markdown", session.out / f"{name}.md"],
                output=session.logs / f"{name}.log", timeout=600, env=env)
    return f"{_line_count(session, session.out / f'{name}.md')} lines in {name}.md"


def bench(session) -> str:
    return _bench(session, "bench", "--shapes", session.options.bench_shapes)


PRISTINE_FA4 = "flash-attn-4"  # its name in upstream/lock.toml


def lay_pristine_fa4(root: Path, folder: Path) -> None:
    """flash-attn-4 as released, from the pinned sdist in the upstream cache (sha256-checked by
    forktools.upstream.unpack): its package files under flash_attn/cute/ and a dist-info naming its
    version. Laid, not pip-installed: the package is pure Python and its own build needs the git
    tags the sdist lacks (forktools.wheel_fa4 says the same of the patched wheel)."""
    from forktools import upstream
    from forktools.layout import Layout
    recreate(folder)
    with tempfile.TemporaryDirectory(prefix="forktools-fa4-pristine-") as scratch:
        source = Path(scratch) / "source"
        upstream.unpack(Layout.at(root), PRISTINE_FA4, source)
        package = folder / "flash_attn" / "cute"
        package.mkdir(parents=True)
        for file in sorted(source.glob("*.py")):
            shutil.copyfile(file, package / file.name)
        pkg_info = (source / "PKG-INFO").read_text()
    version = re.search(r"^Version: (\S+)$", pkg_info, re.M)[1]
    info = folder / f"flash_attn_4-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(pkg_info)


def fa4_site_first(session, folder: Path, cache_name: str) -> dict:
    """An environment placing a flash-attn-4 folder before this build's (the CuTe-DSL runtime stays
    on the path), with its own kernel cache: the same kernel names compile from other sources."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), session.env.get("PYTHONPATH")) if p),
            "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": f"{session.kernel_cache}-{cache_name}"}


def pristine_fa4_env(session) -> dict:
    folder = session.scratch / "fa4-pristine"
    session.act(f"lay pristine flash-attn-4 from the pinned sdist into {folder}", lay_pristine_fa4, session.root, folder)
    return fa4_site_first(session, folder, "pristine")


def bench_pristine_fa4(session) -> str:
    """The bench step's shapes with flash-attn-4's own block-sparse call on the pristine release."""
    if not session.cutedsl_site:
        session.worst_rc = 1
        return "bench-pristine-fa4: needs --cutedsl-site (flash-attn-4's runtime)"
    env = pristine_fa4_env(session)
    session.run([PY, "benchmarks/bench_sparse.py", "--pristine-fa4", "--shapes", session.options.bench_shapes,
                 "--json", session.out / "bench-pristine-fa4.json", "--markdown", session.out / "bench-pristine-fa4.md"],
                output=session.logs / "bench-pristine-fa4.log", timeout=600, env=env)
    return f"{_line_count(session, session.out / 'bench-pristine-fa4.md')} lines in bench-pristine-fa4.md"


def fullbench(session) -> str:
    return _bench(session, "bench")


def crossover(session) -> str:
    log = session.logs / "crossover.log"
    session.run([PY, "benchmarks/bench_sparse.py", "--shapes", "crossover", "--methods", "fa2_sparse,fa3_sparse,fa4_sparse,auto",
                 "--json", session.out / "crossover.json", "--markdown", session.out / "crossover.md"],
                output=log, timeout=600)
    return f"{_line_count(session, session.out / 'crossover.md')} lines in crossover.md"


def ncu_sections(session, name: str, title: str, summary: Path, kernels: str, skip: int, *profile_args: str) -> None:
    """Two launches' speed-of-light, occupancy, stall and memory sections; their key lines go to `summary`."""
    log = session.logs / f"{name}.txt"
    sections = [word for section in NCU_SECTIONS for word in ("--section", section)]
    session.run(["ncu", "--clock-control", "none", "-k", f"regex:{kernels}", "--launch-skip", str(skip),
                 "--launch-count", "2", *sections, PY, "benchmarks/profile_decode.py", *profile_args],
                output=log, timeout=200)
    key_lines = [line for line in session.read(log).splitlines() if NCU_KEY_LINES.search(line)]
    session.act(f"append ncu {title}'s key lines to {summary.name}", _append, summary,
                "\n".join([f"### ncu {title}", *key_lines]) + "\n")


def profile(session) -> str:
    report = session.out / "profile.txt"
    session.run([PY, "benchmarks/profile_decode.py"], output=report, timeout=300)
    if not session.options.no_profile_ncu:
        for target in ["B8 Sq16", "B8 Sq1 ", "B1 Sq1"]:  # "B8 Sq1 ": not a prefix of "B8 Sq16"
            ncu_sections(session, f"ncu-{target.strip().replace(' ', '_')}", target, report, "flash_fwd_sparse|combine", 6,
                         "--ncu-target", target)
    return f"{_line_count(session, report)} lines in profile.txt"


def profile_fa4(session) -> str:
    report = session.out / "profile-fa4.txt"
    session.run([PY, "benchmarks/profile_decode.py", "--backend", "fa4"], output=report, timeout=300)
    ncu_sections(session, "ncu-fa4-B8_Sq16", "fa4 B8 Sq16", report,
                 "FlashAttentionForwardSm90|FlashAttentionForwardCombine", 4, "--backend", "fa4", "--ncu-target", "B8 Sq16")
    return f"{_line_count(session, report)} lines in profile-fa4.txt"


def sweep(session) -> str:
    report = session.out / "sweep.txt"
    session.run([PY, "benchmarks/profile_decode.py", "--split-sweep", *shlex.split(session.options.sweep_args)],
                output=report, timeout=300)
    return f"{sum(line.startswith('##') for line in session.read(report).splitlines())} shapes in sweep.txt"


def variant_test_root(session, name: str, tests_dir: Path) -> Path:
    """A folder standing in for the repo root: the repo's entries linked, tests/ a copy with the
    variant's changed test files laid over it (the repo's tests/ is never touched)."""
    root = session.scratch / f"variant-{name}"
    session.act(f"make {root}: the repo linked, tests/ copied with {tests_dir}/* over it",
                _lay_variant_root, session.root, root, tests_dir)
    return root


def _lay_variant_root(repo: Path, root: Path, tests_dir: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for entry in repo.iterdir():
        if entry.name != "tests":
            (root / entry.name).symlink_to(entry)
    shutil.copytree(repo / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for file in tests_dir.iterdir():
        shutil.copy(file, root / "tests" / file.name)


def variants(session) -> str:
    diffs = session.options.variants or []
    chosen = session.options.variant_tests.split()
    results = []
    for diff in diffs:
        diff = session.root / diff
        name = diff.stem
        site = build_mutant(session, f"variant-{name}", diff)
        if site is None:
            results.append(f"{name}: build FAILED")
            continue
        session.act(f"tar the {name} wheel into variant-{name}-wheel.tar", _tar_wheel, session, name)
        env = {"PYTHONPATH": str(site)}
        session.run([PY, "benchmarks/profile_decode.py"], output=session.out / f"profile-{name}.txt", timeout=300, env=env)
        if not ("all" in chosen or name in chosen):
            results.append(f"{name}: profiled, tests not run")
            continue
        own_tests = diff.with_suffix(".tests")
        if own_tests.is_dir():
            root = variant_test_root(session, name, own_tests)
            outcome = run_pytest(session, f"variant-{name}", str(root / "tests"), "-m", "gpu", env=env, cwd_root=root)
        else:
            outcome = run_pytest(session, f"variant-{name}", "tests", "-m", "gpu", env=env)
        results.append(f"{name}: {outcome}")
    return "; ".join(results) or "no variants given"


def _tar_wheel(session, name: str) -> None:
    tar_one(session.mutant_wheel, session.out / f"variant-{name}-wheel.tar")


def tar_one(path: Path, tar_path: Path) -> None:
    # A tar keeps a wheel's name whole ("+" and its local label) wherever the file is copied.
    with tarfile.open(tar_path, "w") as tar:
        tar.add(path, arcname=path.name)


def ncu_dense(session) -> str:
    report = session.out / "ncu-dense.txt"
    metrics = ",".join((session.root / "benchmarks/ncu_metrics.txt").read_text().split())
    for target_ in session.options.ncu_targets.split():
        target = target_.replace("_", " ")
        csv = session.logs / f"ncu-dense-{target_}.csv"
        session.run(["ncu", "--clock-control", "none", "-k", "regex:flash_fwd_sparse_kernel|flash_fwd_splitkv_kernel|flash_fwd_kernel",
                     "--launch-skip", "2", "--launch-count", "2", "--csv", "--metrics", metrics,
                     PY, "benchmarks/profile_decode.py", "--ncu-target", target, "--ncu-dense"], output=csv, timeout=200)
        session.act(f"append ### ncu dense {target} to {report.name}", _append, report, f"### ncu dense {target}\n")
        session.run([PY, "benchmarks/ncu_table.py", csv], output=report, append=True)
    return f"{_line_count(session, report)} lines in ncu-dense.txt"


def ncu_sass(session, name: str, count: int, *profile_args: str, kernels: str = "flash_fwd_sparse_kernel",
             name_base: str = "function", script: str = "benchmarks/profile_decode.py") -> str:
    """ncu --set full over `count` launches of the kernels whose names (`name_base`: ncu's
    --kernel-name-base) match `kernels`, after the first two: the report, its per-SASS-instruction
    CSV, its details."""
    report = session.out / f"{name}.ncu-rep"
    session.run(["ncu", "--set", "full", "--clock-control", "none", "--kernel-name-base", name_base,
                 "-k", f"regex:{kernels}", "--launch-skip", "2", "--launch-count", str(count), "-o", session.out / name,
                 PY, script, *profile_args], output=session.logs / f"ncu-{name}.log", timeout=300)
    sass = session.logs / f"{name}-sass.csv"
    if session.run(["ncu", "--import", report, "--page", "source", "--print-source", "sass", "--csv"], output=sass) == 0:
        session.act(f"gzip {sass.name} into {name}-sass.csv.gz", _gzip, sass, session.out / f"{name}-sass.csv.gz")
    session.run(["ncu", "--import", report, "--page", "details", "--csv"], output=session.out / f"{name}-details.csv")
    size = 0 if session.dry_run or not report.exists() else report.stat().st_size >> 10
    return f"ncu {name}: {size} KB report, {_line_count(session, sass)} SASS lines"


def ncu_source(session) -> str:
    return ncu_sass(session, "sparse-dense", 1, "--ncu-target", "B1 Sq1", "--ncu-dense")


def ncu_spec(session) -> str:
    return ncu_sass(session, "spec", 2, "--ncu-target", "B8 Sq16", "--ncu-speculative")


def ncu_fa3_prefill(session) -> str:
    """The third FA-3 sparse launch at prefill 1/16 and three of dense FA-3 over the listed keys in
    the same 128-key tiles (benchmarks/profile_fa3.py), side by side."""
    return _ncu_fa3(session, "fa3-prefill", "prefill B1 S16k H32 full", 1 / 16)


def ncu_fa3_decode(session) -> str:
    """The same at decode B8 Sq16 with every block listed (dense FA-3 with its own splits)."""
    return _ncu_fa3(session, "fa3-decode", "decode B8 Sq16", 1.0)


def _ncu_fa3(session, name: str, shape: str, density: float) -> str:
    # FA-3's kernels are all cutlass::device_kernel<...>: the template argument names the forward.
    return ncu_sass(session, name, 4, "--shape", shape, "--density", str(density), kernels="FlashAttnFwdSm90",
                    name_base="demangled", script="benchmarks/profile_fa3.py")


def fa4_prefill_check(session) -> str:
    """This build's flash-attn-4, then each --fa4-variant wheel and the pristine release, each first
    on the path in its own run with its own kernel cache."""
    report, errors = session.out / "fa4-prefill-check.txt", session.logs / "fa4-prefill-check.log"
    session.run([PY, "benchmarks/fa4_prefill_check.py"], output=report, stderr=errors, timeout=150)
    if not session.cutedsl_site:
        return f"{_rows(session, report)} rows in fa4-prefill-check.txt (no --cutedsl-site: variants and pristine skipped)"
    for name, wheel in session.options.fa4_variants:
        folder = session.scratch / f"fa4-variant-{name}"
        session.act(f"empty {folder}", recreate, folder)
        if session.pip_install(wheel, folder) == 0:
            session.run([PY, "benchmarks/fa4_prefill_check.py", "--label", name], output=report, append=True, stderr=errors,
                        timeout=150, env=fa4_site_first(session, folder, name))
    session.run([PY, "benchmarks/fa4_prefill_check.py", "--pristine"], output=report, append=True, stderr=errors,
                timeout=150, env=pristine_fa4_env(session))
    return f"{_rows(session, report)} rows in fa4-prefill-check.txt"


def _rows(session, report: Path) -> int:
    return sum(" ms " in line for line in session.read(report).splitlines())


def fuzz(session) -> str:
    log = session.logs / "fuzz.log"
    budget = session.options.fuzz_budget_s
    session.run([PY, "tests/fuzz/run.py", "--seed", str(session.options.fuzz_seed), "--budget-s", str(budget)],
                output=log, timeout=budget + 120)
    return f"fuzz: {_last_line(session, log)}"


def upstream_fa2(session) -> str:
    log = session.logs / "upstream-fa2.log"
    # Thousands of small cases: eight pytest workers (pytest-xdist) share the GPU.
    session.run([PY, "tests/upstream/run_upstream.py", "-n", "8"], output=log, timeout=session.options.pytest_timeout)
    return f"upstream FA-2 tests: {_last_line(session, log)}"


def upstream_fa3(session) -> str:
    """Upstream FA-3's hopper/test_flash_attn.py (of the patched tree) on the installed flash_attn_3,
    narrowed by -k and by forktools.fa3_tests' deselection of what the dev profile leaves out.
    The tree is laid out afresh: a reused wheel leaves none, and a mutant build leaves its own."""
    from forktools import build_fa3, wheelbuild
    from forktools.layout import Layout
    log = session.logs / "upstream-fa3.log"
    tree = session.root / "build" / "wheel" / build_fa3.UPSTREAM
    session.act(f"lay the patched {build_fa3.UPSTREAM} tree in {tree}", wheelbuild.relay_tree, Layout.at(session.root), tree,
                build_fa3.UPSTREAM)
    hopper = tree / "hopper"
    python_path = os.pathsep.join([str(session.root / "python"), session.env.get("PYTHONPATH", "")])
    # Thousands of small cases: eight pytest workers share the GPU, as for upstream FA-2.
    session.run([PY, "-m", "pytest", "-p", "forktools.fa3_tests", "-q", "-rfE", "--maxfail", "20", "-n", "8",
                 "test_flash_attn.py",
                 "-k", session.options.upstream_fa3_k], output=log, timeout=session.options.pytest_timeout,
                env={**build_fa3.PROFILES["dev"], "PYTHONPATH": python_path}, cwd=hopper)
    return f"upstream FA-3 tests: {_last_line(session, log)}"


def distributed(session) -> str:
    return run_pytest(session, "distributed", "tests/api/test_distributed_gpu.py")


def client_bench(session) -> str:
    log = session.logs / "client-bench.log"
    session.run([PY, "examples/transformers_quest.py", "--bench", "--context", "32768", "--density", "0.125"],
                output=log, timeout=400)
    table = session.out / "client-bench.md"
    session.act("copy the markdown table", shutil.copyfile, log, table)
    return f"client bench: {_last_line(session, log)}"


def host_time(session) -> str:
    log = session.logs / "host-time.log"
    session.run([PY, "benchmarks/host_time.py", "--out", session.out], output=log, timeout=300)
    return f"host time: {'host-time.md' if (session.out / 'host-time.md').exists() else 'FAILED (see host-time.log)'}"


def host_profile(session) -> str:
    """cProfile of the one-shot call per backend (benchmarks/one_shot_profile.py), into logs/: a
    diagnostic, kept in logs.tar.gz with the other logs rather than as a result file."""
    log = session.logs / "one-shot-profile.log"
    session.run([PY, "benchmarks/one_shot_profile.py", "--out", session.logs], output=log, timeout=120)
    found = (session.logs / "one-shot-profile.txt").exists()
    return f"one-shot profile: {'logs/one-shot-profile.txt' if found else 'FAILED (see one-shot-profile.log)'}"


def examples(session) -> str:
    results = []
    for example in sorted((session.root / "examples").glob("*.py")):
        log = session.logs / f"example-{example.stem}.log"
        rc = session.run([PY, example.relative_to(session.root)], output=log, timeout=300)
        results.append(f"{example.name} {'ok' if rc == 0 else f'FAILED (exit {rc})'}")
    return "; ".join(results) or "no examples"


def _append(path: Path, text: str) -> None:
    with open(path, "a") as file:
        file.write(text)


def _gzip(source: Path, target: Path) -> None:
    with open(source, "rb") as raw, gzip.open(target, "wb") as packed:
        shutil.copyfileobj(raw, packed)


def recreate(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


STEPS = {
    "tests": ("every GPU test, or those --pytest-args names (files, -k), within --pytest-timeout s", tests),
    "mutation": ("build with V stepping densely: the permuted-list tests must fail", mutation),
    "sanitize": ("compute-sanitizer memcheck, racecheck, initcheck, synccheck over the sparse kernels (tests/sanitize.py)", sanitize),
    "sanitize-fuzz": ("memcheck, racecheck, initcheck over the fuzzer's adversarial subset (bad ids, counts, pages, varlen edges)",
                      sanitize_fuzz),
    "reliability": ("tests/contract/test_reliability_gpu.py", reliability),
    "fa4": ("the stage-4 (FA-4 backend) tests", fa4),
    "fa3": ("the FA-3 sparse SM90 forward's tests (tests/backends/test_stage4_fa3_sparse.py) on the dev flash_attn_3 wheel", fa3),
    "fa3-mutation": ("the FA-3 wheel rebuilt with V stepping densely: its permuted-list tests must fail", fa3_mutation),
    "fa3-paged-mutation": ("the FA-3 wheel rebuilt with paged loads ignoring the page table: its paged tests must fail",
                           fa3_paged_mutation),
    "fa3-variants": ("each --fa3-variant diff built as an FA-3 wheel: the FA-3 tests, then fa3 and dense FA-3 on the bench "
                     "shapes, this build beside the variant", fa3_variants),
    "bench": ("benchmarks/bench_sparse.py on --bench-shapes: bench.md, bench.json", bench),
    "fullbench": ("benchmarks/bench_sparse.py's whole matrix: bench.md, bench.json", fullbench),
    "crossover": ("fa2 vs fa3 vs fa4 vs auto as query rows grow: crossover.md, crossover.json", crossover),
    "profile": ("benchmarks/profile_decode.py, then ncu on the decode kernels (not with --no-profile-ncu)", profile),
    "profile-fa4": ("the profile step on FA-4's SM90 kernel, then ncu on it at B8 Sq16 1/16", profile_fa4),
    "sweep": ("profile_decode.py --split-sweep (--sweep-args): every split count beside the heuristic's", sweep),
    "variants": ("each --variant diff built as a mutant wheel: its profile, then its GPU tests (--variant-tests)", variants),
    "ncu-dense": ("ncu counters of the sparse kernel, every block listed, beside upstream's dense one (--ncu-targets)", ncu_dense),
    "ncu-fa3-prefill": ("per-SASS-instruction stalls of the FA-3 sparse kernel at prefill 1/16 beside dense FA-3 in its tile steps",
                        ncu_fa3_prefill),
    "ncu-fa3-decode": ("the same at decode B8 Sq16 with every block listed, beside dense FA-3 with its own splits",
                       ncu_fa3_decode),
    "ncu-source": ("per-SASS-instruction counters and stalls of the sparse kernel, every block listed, B1 Sq1", ncu_source),
    "ncu-spec": ("the same for the union pass and the one-launch speculative call, B8 Sq16 1/16", ncu_spec),
    "bench-pristine-fa4": ("the bench step's shapes: flash-attn-4's own block-sparse call, the pristine release laid from "
                           "the pinned sdist", bench_pristine_fa4),
    "fa4-prefill-check": ("benchmarks/fa4_prefill_check.py on this, each --fa4-variant and pristine flash-attn-4",
                          fa4_prefill_check),
    "fuzz": ("tests/fuzz/run.py --seed --fuzz-seed --budget-s --fuzz-budget-s", fuzz),
    "upstream-fa2": ("upstream FA-2's tests on this wheel (tests/upstream/run_upstream.py)", upstream_fa2),
    "example": ("every examples/*.py, each must exit 0", examples),
    "upstream-fa3": ("upstream FA-3 hopper/test_flash_attn.py forward tests on flash_attn_3 (--upstream-fa3-k)", upstream_fa3),
    "distributed": ("the context-parallel tests on one GPU (tests/api/test_distributed_gpu.py)", distributed),
    "host-time": ("benchmarks/host_time.py: where plan.run's and the one-shot call's host time goes, per backend", host_time),
    "gqa-sweep": ("benchmarks/bench_gqa.py: every GQA group at decode against dense FA-3 over the listed keys: gqa.md, "
                  "gqa.json (--gqa-args)", gqa_sweep),
    "fp8-bench": ("benchmarks/bench_fp8.py: FP8 sparse on fa3 against bf16 sparse and dense FA-3 FP8 over the listed "
                  "keys, with accuracy: fp8.md, fp8.json (needs a FLASH_ATTN_SPARSE_FP8=1 build)", fp8_bench),
    "engine-bench": ("benchmarks/bench_engine.py: the engine-shaped paged varlen call on fa3, fa2 and auto, and fa3 over "
                     "contiguous K/V, per page size: engine.md, engine.json", engine_bench),
    "gqa-mutation": ("build with packed rows mapped to the wrong head: the GQA contract tests on fa2 must fail",
                     gqa_mutation),
    "host-profile": ("benchmarks/one_shot_profile.py: cProfile of the one-shot call per backend, into logs/", host_profile),
    "client-bench": ("examples/transformers_quest.py --bench at 32k, 1/8: tokens/s eager and graphed vs dense SDPA", client_bench),
}
