"""Tests of the patch-set tooling, offline, on tiny synthetic upstream releases."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
# Appended, not prepended: an installed flash_attn_sparse wheel must keep shadowing
# python/flash_attn_sparse for the other test modules (see conftest.py).
sys.path.append(str(REPO / "python"))

from forktools import ToolError, build_fa3, lockfile, patchfile, series, stages, upstream, variant  # noqa: E402
from forktools.__main__ import main  # noqa: E402
from forktools.layout import Layout  # noqa: E402
from forktools.patchfile import PatchError  # noqa: E402

pytestmark = pytest.mark.tooling
CORE = "".join(f"def function_{n}():\n    return {n}\n\n" for n in range(20))
FLASH_FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: flash_attn\nVersion: 1.0\n",
    "flash_attn/__init__.py": '__version__ = "1.0"\n',
    "csrc/kernel.cu": "".join(f"// kernel line {n}\n" for n in range(12)),
}
DEMO_FILES = {
    "README.md": "# demo\n\nA tiny upstream.\n",
    "src/core.py": CORE,
    "src/obsolete.py": "print('going away')\n",
    "tail.txt": "first\nlast without newline",
}
# Commits in the demo tree look like a developer's: own identity, own config shut out.
DEV_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "Dev", "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "Dev", "GIT_COMMITTER_EMAIL": "dev@example.com",
}


def git(tree: Path, *args: str, **env: str) -> str:
    result = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                            env={**os.environ, **DEV_ENV, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


def make_sdist(directory: Path, top: str, files: dict[str, str]) -> Path:
    path = directory / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return path


def write_lock(layout: Layout, pins: list[upstream.Pin]) -> None:
    layout.lock.parent.mkdir(parents=True, exist_ok=True)
    layout.lock.write_text("\n".join(map(lock_table, pins)))


def lock_table(pin: upstream.Pin) -> str:
    env = ", ".join(f"{key} = {json.dumps(value)}" for key, value in pin.download_env.items())
    return (f'[[upstream]]\nname = "{pin.name}"\nversion = "{pin.version}"\nsdist = "{pin.sdist}"\n'
            f'sha256 = "{pin.sha256}"\ndownload_args = {json.dumps(list(pin.download_args))}\n'
            f"download_env = {{ {env} }}\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def project(tmp_path: Path) -> Layout:
    """A repo with two pinned synthetic upstreams in its cache, an overlay and the sparse package."""
    layout = Layout.at(tmp_path / "repo")
    layout.cache.mkdir(parents=True)
    pins = []
    for name, version, top, files in (("flash-attn", "1.0", "flash_attn-1.0", FLASH_FILES),
                                      ("demo", "2.0", "demo-2.0", DEMO_FILES)):
        sdist = make_sdist(layout.cache, top, files)
        pins.append(upstream.Pin(name, version, sdist.name, sha256(sdist)))
    write_lock(layout, pins)
    (layout.overlay / "demo" / "src").mkdir(parents=True)
    (layout.overlay / "demo" / "src" / "extra.py").write_text("EXTRA = 1\n")
    (layout.root / "python" / "flash_attn_sparse").mkdir(parents=True)
    (layout.root / "python" / "flash_attn_sparse" / "__init__.py").write_text("SPARSE = True\n")
    return layout


def commit(tree: Path, title: str, stage: int, edits: dict[str, str | None],
           body: str = "Why: the test needs a patch here.") -> str:
    for path, text in edits.items():
        if text is None:
            (tree / path).unlink()
        else:
            (tree / path).parent.mkdir(parents=True, exist_ok=True)
            (tree / path).write_text(text)
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", f"[stage {stage}] {title}\n\n{body}\n\nStage: {stage}")
    return git(tree, "rev-parse", "HEAD").strip()


def patch_files(layout: Layout) -> dict[str, bytes]:
    """Everything export writes: the series and the patch files."""
    return {path.relative_to(layout.patches).as_posix(): path.read_bytes()
            for path in sorted(layout.patches.rglob("*"))
            if path.is_file() and layout.overlay not in path.parents}


@pytest.fixture
def exported(project: Layout) -> Layout:
    """The project after apply, three demo commits and one flash-attn commit, and export."""
    series.apply(project)
    demo = project.trees / "demo"
    commit(demo, "Core: make function_1 return eleven", 1,
           {"src/core.py": CORE.replace("return 1\n", "return 11\n")})
    commit(demo, "Modules: add new_module, drop obsolete", 2,
           {"src/new_module.py": "NEW = True\n", "src/obsolete.py": None})
    commit(demo, "Tail: end the file with a newline", 2, {"tail.txt": "first\nlast with newline\n"})
    commit(project.trees / "flash-attn", "Kernel: tune line 5", 3,
           {"csrc/kernel.cu": FLASH_FILES["csrc/kernel.cu"].replace("line 5", "line five")})
    series.export(project)
    return project


# --- upstream artefacts ----------------------------------------------------------------------

def test_corrupted_sdist_is_refused_naming_file_and_both_hashes(project: Layout):
    sdist = project.cache / "demo-2.0.tar.gz"
    expected = sha256(sdist)
    sdist.write_bytes(sdist.read_bytes() + b"tampered")
    actual = sha256(sdist)
    for attempt in (lambda: upstream.fetch(project, offline=True), lambda: series.apply(project),
                    lambda: upstream.unpack(project, "demo", project.root / "unpacked")):
        with pytest.raises(ToolError) as refused:
            attempt()
        assert str(sdist) in str(refused.value)
        assert expected in str(refused.value) and actual in str(refused.value)
    assert not (project.trees / "demo").exists()
    assert not (project.root / "unpacked").exists()
    assert sorted(os.listdir(project.trees)) == ["flash-attn"]  # no half-unpacked leftovers


def test_offline_fetch_of_a_missing_sdist_says_what_to_copy_where(project: Layout):
    (project.cache / "demo-2.0.tar.gz").unlink()
    with pytest.raises(ToolError, match=r"copy demo-2\.0\.tar\.gz .* into .*\.cache/upstream"):
        upstream.fetch(project, offline=True)


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                    reason="pip needs setuptools to read the synthetic sdist's metadata")
def test_fetch_downloads_with_pip_verifies_and_caches(project: Layout, tmp_path: Path):
    index = tmp_path / "index"
    index.mkdir()
    setup = ('import os\nassert os.environ["DEMO_FETCH"] == "yes"  # download_env reaches pip\n'
             'from setuptools import setup\nsetup(name="demo", version="2.0")\n')
    sdist = make_sdist(index, "demo-2.0", {"setup.py": setup})
    (project.cache / "demo-2.0.tar.gz").unlink()
    flash, _ = upstream.load_pins(project.lock)
    demo = upstream.Pin("demo", "2.0", "demo-2.0.tar.gz", sha256(sdist),
                        download_args=("--no-index", "--find-links", str(index), "--no-build-isolation"),
                        download_env={"DEMO_FETCH": "yes"})
    write_lock(project, [flash, demo])
    upstream.fetch(project)
    assert (project.cache / "demo-2.0.tar.gz").read_bytes() == sdist.read_bytes()

    (project.cache / "demo-2.0.tar.gz").unlink()
    write_lock(project, [flash, dataclasses.replace(demo, sha256="0" * 64)])
    with pytest.raises(ToolError, match="sha256 mismatch for the downloaded demo-2.0.tar.gz"):
        upstream.fetch(project)
    assert sorted(os.listdir(project.cache)) == ["flash_attn-1.0.tar.gz"]


def test_a_recorded_tree_replaces_the_sdist_after_its_version_is_checked(project: Layout, tmp_path: Path):
    checkout = tmp_path / "checkout"
    with tarfile.open(project.cache / "flash_attn-1.0.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    (tmp_path / "flash_attn-1.0").rename(checkout)
    (checkout / "PKG-INFO").unlink()  # a git checkout has no PKG-INFO: __version__ decides
    git(checkout, "init", "-q")

    (checkout / "flash_attn" / "__init__.py").write_text('__version__ = "0.9"\n')
    assert main(["upstream", "--offline", "--tree", f"flash-attn={checkout}"], root=project.root) == 1
    (checkout / "flash_attn" / "__init__.py").write_text('__version__ = "1.0"\n')
    assert main(["upstream", "--offline", "--tree", f"flash-attn={checkout}"], root=project.root) == 0
    assert upstream.recorded_trees(project) == {"flash-attn": checkout.resolve()}

    (checkout / "marker.txt").write_text("from the checkout\n")
    upstream.unpack(project, "flash-attn", tmp_path / "unpacked")
    assert (tmp_path / "unpacked" / "marker.txt").exists()
    assert not (tmp_path / "unpacked" / ".git").exists()


REAL_SDIST = REPO / ".cache" / "upstream" / "flash_attn-2.8.3.post2.tar.gz"


@pytest.mark.skipif(not REAL_SDIST.exists(), reason=f"{REAL_SDIST} absent (run `nox -s upstream`)")
def test_real_flash_attn_sdist_unpacks_and_its_version_is_checked(tmp_path: Path):
    real = Layout.at(REPO)
    layout = Layout(root=real.root, lock=real.lock, cache=tmp_path / "cache", trees=tmp_path / "trees",
                    patches=real.patches)
    layout.cache.mkdir()
    (layout.cache / REAL_SDIST.name).symlink_to(REAL_SDIST)
    tree = tmp_path / "flash-attn"
    upstream.unpack(layout, "flash-attn", tree)
    assert (tree / "setup.py").exists() and (tree / "csrc").is_dir()
    pin = lockfile.named(upstream.load_pins(layout.lock), "flash-attn", "upstream")
    assert upstream.tree_version(pin, tree) == "2.8.3.post2"

    (tree / "PKG-INFO").unlink()  # as in a git checkout: flash_attn/__init__.py decides
    upstream.record_tree(layout, "flash-attn", tree)
    init = tree / "flash_attn" / "__init__.py"
    init.write_text(init.read_text().replace('"2.8.3.post2"', '"2.8.2"'))
    with pytest.raises(ToolError, match=r"flash-attn 2\.8\.2, but the lock pins 2\.8\.3\.post2"):
        upstream.record_tree(layout, "flash-attn", tree)


@pytest.mark.skipif(not REAL_SDIST.exists(), reason=f"{REAL_SDIST} absent (run `nox -s upstream`)")
@pytest.mark.parametrize("mutation", sorted((REPO / "tests" / "mutations").glob("*.patch"))
                         + sorted((REPO / "benchmarks" / "experiments").glob("*.diff")), ids=lambda p: p.name)
def test_mutations_apply_to_the_patched_tree(mutation: Path, tmp_path: Path):
    """A mutation (or an experiment of benchmarks/experiments/, built the same way by the runner's
    fa3-variants step) whose context drifted from the kernel would fail the GPU session's build;
    here it fails on CPU first. A hopper/ one goes to the FA-3 tree, as build --mutation lays it."""
    layout = Layout.at(REPO).with_trees(tmp_path / "trees")  # its cache holds REAL_SDIST
    name = build_fa3.UPSTREAM if build_fa3.is_mutation_of_fa3(mutation) else "flash-attn"
    tree = tmp_path / name
    series.materialize(layout, name, tree)
    patchfile.apply_diff(patchfile.split_description(mutation.read_bytes()), tree, str(mutation))


# --- apply, export, check --------------------------------------------------------------------

def test_series_and_patch_files_have_the_agreed_format(exported: Layout):
    pins = upstream.load_pins(exported.lock)
    assert exported.series.read_text() == (
        "# Patch series over pinned upstream releases, applied in this order. Written by `nox -s export`.\n"
        f"# base flash-attn 1.0 sha256:{pins[0].sha256}\n"
        f"# base demo 2.0 sha256:{pins[1].sha256}\n"
        "flash-attn/0001-kernel-tune-line-5.patch stage=3\n"
        "demo/0001-core-make-function-1-return-eleven.patch stage=1\n"
        "demo/0002-modules-add-new-module-drop-obsolete.patch stage=2\n"
        "demo/0003-tail-end-the-file-with-a-newline.patch stage=2\n")
    text = (exported.patches / "demo" / "0001-core-make-function-1-return-eleven.patch").read_text()
    header, _, diff = text.partition("\ndiff --git ")
    assert header == ("Subject: [stage 1] Core: make function_1 return eleven\n\n"
                      "Why: the test needs a patch here.\n\nStage: 1\n---\n"
                      " src/core.py | 2 +-\n 1 file changed, 1 insertion(+), 1 deletion(-)\n")
    assert diff.startswith("a/src/core.py b/src/core.py\nindex ")
    index_line = diff.splitlines()[1]
    assert len(index_line.split()[1]) == 2 * 40 + 2  # full blob ids, no dates or commit ids


def test_apply_then_export_is_byte_identical_and_export_is_byte_stable(exported: Layout, tmp_path: Path):
    before = patch_files(exported)
    series.export(exported)
    assert patch_files(exported) == before

    series.apply(exported)  # the trees hold only committed patches, so no --force is needed
    series.export(exported)
    assert patch_files(exported) == before

    elsewhere = exported.with_trees(tmp_path / "elsewhere")
    series.apply(elsewhere)
    for name in ("demo", "flash-attn"):  # fixed identity and dates: reproducible commit ids
        assert git(elsewhere.trees / name, "rev-parse", "HEAD") == git(exported.trees / name, "rev-parse", "HEAD")
        assert git(exported.trees / name, "log", "-1", "--format=%an %ad", "upstream") == \
            "forktools Sat Jan 1 00:00:00 2000 +0000\n"


def test_new_and_deleted_file_patches_apply(exported: Layout):
    series.apply(exported, force=True)
    demo = exported.trees / "demo"
    assert (demo / "src" / "new_module.py").read_text() == "NEW = True\n"
    assert not (demo / "src" / "obsolete.py").exists()
    assert (demo / "tail.txt").read_text() == "first\nlast with newline\n"
    patch = (exported.patches / "demo" / "0002-modules-add-new-module-drop-obsolete.patch").read_text()
    assert "new file mode 100644" in patch and "deleted file mode 100644" in patch


def test_check_passes_then_fails_on_an_unexported_commit_naming_the_patch(exported: Layout, capsys):
    series.check(exported)
    assert "check-patches: OK (4 patches over 2 upstreams)" in capsys.readouterr().out
    commit(exported.trees / "demo", "Readme: say more", 4, {"README.md": "# demo\n\nMore.\n"})
    with pytest.raises(ToolError) as failed:
        series.check(exported)
    assert "exporting would add patches/demo/0004-readme-say-more.patch" in str(failed.value)


def test_uncommitted_changes_block_export_and_fail_check(exported: Layout):
    demo = exported.trees / "demo"
    (demo / "README.md").write_text("edited, not committed\n")
    (demo / "scratch.txt").write_text("untracked\n")
    before = patch_files(exported)
    for attempt in (series.export, series.check):
        with pytest.raises(ToolError) as refused:
            attempt(exported)
        assert "uncommitted changes" in str(refused.value)
        assert " M README.md" in str(refused.value) and "?? scratch.txt" in str(refused.value)
    assert patch_files(exported) == before


def test_fixing_up_an_earlier_patch_changes_exactly_that_patch_file(exported: Layout):
    demo = exported.trees / "demo"
    first = git(demo, "rev-list", "--reverse", "upstream..HEAD").split()[0]
    (demo / "src" / "core.py").write_text(CORE.replace("return 1\n", "return 11\n")
                                          .replace("return 15\n", "return 150\n"))
    git(demo, "commit", "-q", "-a", f"--fixup={first}")
    with pytest.raises(ToolError, match=r"\(fixup! \[stage 1\] Core: .*\): it has no `Stage: N` trailer"):
        series.check(exported)  # until it is squashed into the patch it fixes
    git(demo, "rebase", "-q", "-i", "--autosquash", "upstream", GIT_SEQUENCE_EDITOR="true")

    before = patch_files(exported)
    series.export(exported)
    after = patch_files(exported)
    assert [path for path in after if after[path] != before.get(path)] == \
        ["demo/0001-core-make-function-1-return-eleven.patch"]
    assert after.keys() == before.keys()
    series.check(exported)


def test_export_removes_stale_patch_files(exported: Layout):
    stray = exported.patches / "demo" / "0009-leftover.patch"
    stray.write_bytes((exported.patches / "demo" / "0002-modules-add-new-module-drop-obsolete.patch").read_bytes())
    with pytest.raises(ToolError, match="patches/demo/0009-leftover.patch is stale"):
        series.check(exported)
    git(exported.trees / "demo", "reset", "-q", "--hard", "HEAD~1")
    series.export(exported)
    assert sorted(path.name for path in (exported.patches / "demo").iterdir()) == [
        "0001-core-make-function-1-return-eleven.patch", "0002-modules-add-new-module-drop-obsolete.patch"]
    assert "0003" not in exported.series.read_text()
    series.check(exported)


def test_a_patch_that_does_not_apply_names_patch_file_and_hunk(exported: Layout):
    path = exported.patches / "demo" / "0001-core-make-function-1-return-eleven.patch"
    path.write_text(path.read_text().replace(" def function_1():", " def function_one():"))
    with pytest.raises(PatchError) as failed:
        series.apply(exported, force=True)
    message = str(failed.value)
    assert "demo/0001-core-make-function-1-return-eleven.patch: src/core.py: hunk #1 (@@ -2,7 +2,7 @@" in message
    assert "does not apply" in message


def test_export_refuses_a_commit_without_a_stage_trailer_naming_it(exported: Layout):
    demo = exported.trees / "demo"
    (demo / "README.md").write_text("quick\n")
    git(demo, "commit", "-q", "-a", "-m", "Quick hack")
    sha = git(demo, "rev-parse", "HEAD")[:12]
    with pytest.raises(ToolError, match=f"commit {sha} \\(Quick hack\\): it has no `Stage: N` trailer"):
        series.export(exported)


def test_apply_refuses_to_discard_unexported_work_unless_forced(exported: Layout):
    commit(exported.trees / "demo", "Readme: say more", 4, {"README.md": "# demo\n\nMore.\n"})
    with pytest.raises(ToolError, match="holds work that is not in patches/"):
        series.apply(exported)
    assert "say more" in git(exported.trees / "demo", "log", "-1")
    series.apply(exported, force=True)
    assert "say more" not in git(exported.trees / "demo", "log", "-1")


def test_apply_refuses_before_touching_any_tree(exported: Layout):
    commit(exported.trees / "demo", "Readme: say more", 4, {"README.md": "# demo\n\nMore.\n"})
    # An excluded build output is no work to keep, but a rebuild of the tree would delete it.
    output = exported.trees / "flash-attn" / "build" / "kernel.o"
    output.parent.mkdir()
    output.write_text("compiled\n")
    with pytest.raises(ToolError, match="demo holds work"):
        series.apply(exported)
    assert output.exists()


def test_export_keeps_the_committed_patches_of_an_upstream_without_a_tree(exported: Layout):
    before = patch_files(exported)
    shutil.rmtree(exported.trees / "flash-attn")
    commit(exported.trees / "demo", "Readme: say more", 4, {"README.md": "# demo\n\nMore.\n"})
    series.export(exported)
    after = patch_files(exported)
    assert after["flash-attn/0001-kernel-tune-line-5.patch"] == before["flash-attn/0001-kernel-tune-line-5.patch"]
    assert after.keys() - before.keys() == {"demo/0004-readme-say-more.patch"}
    assert "flash-attn/0001-kernel-tune-line-5.patch stage=3\n" in after["series"].decode()
    series.check(exported)


def test_overlay_is_laid_in_as_excluded_symlinks(exported: Layout):
    demo, flash = exported.trees / "demo", exported.trees / "flash-attn"
    extra = demo / "src" / "extra.py"
    assert extra.is_symlink() and extra.resolve() == (exported.overlay / "demo" / "src" / "extra.py").resolve()
    package = flash / "flash_attn_sparse"
    assert package.is_symlink() and (package / "__init__.py").read_text() == "SPARSE = True\n"
    assert "/src/extra.py" in (demo / ".git" / "info" / "exclude").read_text().splitlines()
    assert "/flash_attn_sparse" in (flash / ".git" / "info" / "exclude").read_text().splitlines()
    extra.write_text("EXTRA = 2\n")  # editing in the tree edits the repo file
    assert (exported.overlay / "demo" / "src" / "extra.py").read_text() == "EXTRA = 2\n"
    assert git(demo, "status", "--porcelain") == ""
    series.check(exported)  # laid-in files never become patches


def test_an_overlay_file_may_not_replace_an_upstream_file(project: Layout):
    (project.overlay / "demo" / "README.md").write_text("mine\n")
    with pytest.raises(ToolError, match="would replace README.md"):
        series.apply(project)


def test_without_git_apply_makes_a_plain_patched_copy(exported: Layout, tmp_path: Path):
    plain = exported.with_trees(tmp_path / "plain")
    series.apply(plain, use_git=False)
    for name in ("demo", "flash-attn"):
        assert not (plain.trees / name / ".git").exists()
        assert tree_files(plain.trees / name) == tree_files(exported.trees / name)
    assert not (plain.trees / "demo" / "src" / "extra.py").is_symlink()


def tree_files(tree: Path) -> dict[str, tuple[bytes, bool]]:
    """Path → (content, executable) of every file outside .git, through symlinks."""
    files = {}
    for directory, subdirectories, names in os.walk(tree, followlinks=True):
        subdirectories[:] = sorted(set(subdirectories) - {".git"})
        for path in (Path(directory, name) for name in names):
            files[path.relative_to(tree).as_posix()] = (path.read_bytes(), bool(path.stat().st_mode & stat.S_IXUSR))
    return files


def test_a_composed_release_is_named_by_its_tree_id_in_the_series_header(tmp_path: Path):
    """FA-3 has no sdist: its header line names the git tree id that checks its main part."""
    pins = [upstream.Pin("flash-attn", "1.0", "f.tar.gz", "a" * 64), upstream.Pin("fa3", "2.0", composed=True, tree="b" * 40)]
    path = tmp_path / "series"
    path.write_bytes(series.render_series(pins, []))
    assert path.read_text().splitlines()[1:] == [f"# base flash-attn 1.0 sha256:{'a' * 64}", f"# base fa3 2.0 tree:{'b' * 40}"]
    assert series.read_series(path).bases == [("flash-attn", "1.0", f"sha256:{'a' * 64}"), ("fa3", "2.0", f"tree:{'b' * 40}")]


def test_check_fails_when_the_series_base_disagrees_with_the_lock(exported: Layout):
    exported.series.write_text(exported.series.read_text().replace("# base demo 2.0", "# base demo 1.9"))
    with pytest.raises(ToolError, match="the series is made against .*demo 1.9"):
        series.check(exported)


def test_check_passes_with_no_series_and_export_writes_the_header(project: Layout, capsys):
    assert main(["check-patches"], root=project.root) == 0
    assert "check-patches: OK (0 patches over 2 upstreams)" in capsys.readouterr().out
    series.apply(project)
    series.export(project)
    assert project.series.read_text().count("\n") == 3 and "# base demo 2.0" in project.series.read_text()


def test_review_shows_notes_and_diffstat_then_runs_the_stage_tests(exported: Layout, capfd):
    (exported.root / "stages").mkdir()
    (exported.root / "stages" / "stage2.md").write_text("# Stage 2\n\nModules.\n")
    assert stages.review(exported, 2) == 5  # pytest: no tests collected
    out = capfd.readouterr().out
    assert "# Stage 2" in out
    assert "demo/0002-modules-add-new-module-drop-obsolete.patch" in out
    assert " src/obsolete.py   | 1 -\n" in out and "core.py" not in out


# --- the applier against git apply -----------------------------------------------------------

def diff_and_trees(tmp: Path, old: dict[str, bytes], new: dict[str, bytes],
                   executable: set[str] = frozenset()) -> tuple[bytes, Path, Path]:
    """A git diff turning `old` into `new` (files absent from one side are created or deleted),
    and two copies of the old tree to apply it to."""
    repo = tmp / "repo"
    repo.mkdir()
    write_files(repo, old)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", "old")
    for path in old.keys() - new.keys():
        (repo / path).unlink()
    write_files(repo, new)
    for path in executable:
        (repo / path).chmod(0o755)
    git(repo, "add", "-A")
    diff = subprocess.run(["git", "-C", str(repo), "diff", "--cached", "--no-color", "--no-renames",
                           "--full-index"], capture_output=True, env={**os.environ, **DEV_ENV}).stdout
    copies = []
    for name in ("by-git", "by-forktools"):
        copies.append(tmp / name)
        copies[-1].mkdir()
        write_files(copies[-1], old)
    return diff, copies[0], copies[1]


def write_files(tree: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(data)


def apply_both(diff: bytes, by_git: Path, by_forktools: Path) -> None:
    subprocess.run(["git", "apply", "-"], input=diff, cwd=by_git, check=True, env={**os.environ, **DEV_ENV})
    patchfile.apply_diff(diff, by_forktools, "test.patch")
    assert tree_files(by_forktools) == tree_files(by_git)


LONG = b"".join(b"line %d\n" % n for n in range(60))
CASES = {
    "hunks far apart": ({"a.txt": LONG}, {"a.txt": LONG.replace(b"line 2\n", b"two\n").replace(b"line 50\n", b"")}),
    "first and last line": ({"a.txt": LONG}, {"a.txt": b"start\n" + LONG[7:-8] + b"end\n"}),
    "newline added at end": ({"a.txt": b"x\ny"}, {"a.txt": b"x\ny\n"}),
    "newline dropped at end": ({"a.txt": b"x\ny\n"}, {"a.txt": b"x\nz"}),
    "no newline either side": ({"a.txt": b"a\nb\nc"}, {"a.txt": b"a\nB\nc"}),
    "crlf lines": ({"w.txt": b"one\r\ntwo\r\nthree\r\n"}, {"w.txt": b"one\r\n2\r\nthree\r\n"}),
    "new, empty and deleted files": ({"gone/deep/old.txt": b"bye\n", "keep.txt": b"k\n"},
                                     {"keep.txt": b"k\n", "new/file.txt": b"hi\n", "empty.txt": b""}),
    "name with a space": ({"my file.txt": b"a\n"}, {"my file.txt": b"b\n"}),
}


@pytest.mark.parametrize("case", CASES)
def test_applier_matches_git_apply(case: str, tmp_path: Path):
    old, new = CASES[case]
    apply_both(*diff_and_trees(tmp_path, old, new))


def test_applier_matches_git_apply_on_mode_changes(tmp_path: Path):
    files = {"run.sh": b"echo hi\n", "tool.sh": b"echo a\n"}
    diff, by_git, by_forktools = diff_and_trees(tmp_path, files, {**files, "tool.sh": b"echo b\n"},
                                                executable={"run.sh", "tool.sh"})
    assert b"new mode 100755" in diff
    apply_both(diff, by_git, by_forktools)
    assert os.access(by_forktools / "run.sh", os.X_OK)


def test_applier_finds_hunks_that_moved_like_git_apply(tmp_path: Path):
    diff, by_git, by_forktools = diff_and_trees(tmp_path, {"a.txt": LONG}, {"a.txt": LONG.replace(b"line 30\n", b"thirty\n")})
    for tree in (by_git, by_forktools):
        (tree / "a.txt").write_bytes(b"inserted above\n" * 5 + LONG)
    apply_both(diff, by_git, by_forktools)


def test_applier_refuses_a_file_it_would_create_that_exists(tmp_path: Path):
    diff, _, by_forktools = diff_and_trees(tmp_path, {}, {"a.txt": b"a\n"})
    (by_forktools / "a.txt").write_bytes(b"already here\n")
    with pytest.raises(PatchError, match="test.patch: a.txt: the patch creates it but it already exists"):
        patchfile.apply_diff(diff, by_forktools, "test.patch")


lines = st.lists(st.sampled_from([b"a\n", b"b\n", b"c\n", b"\n", b"d"]), max_size=25).map(b"".join)


@settings(max_examples=30, deadline=None)
@given(old=lines, new=lines)
def test_applier_matches_git_apply_on_random_edits(old: bytes, new: bytes):
    assume(old != new)  # git apply refuses an empty diff
    with tempfile.TemporaryDirectory() as tmp:
        apply_both(*diff_and_trees(Path(tmp), {"f.txt": old}, {"f.txt": new}))


# --- variants: an experiment branch as a diff over the base's laid tree ----------------------

def commit_base_on_main(exported: Layout) -> Path:
    """The exported project as a git repository whose branch main holds it: an experiment's base."""
    root = exported.root
    (root / ".gitignore").write_text("/.cache/\n/build/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


def test_variant_diff_turns_the_base_tree_into_the_branch_tree(exported: Layout, tmp_path: Path):
    root = commit_base_on_main(exported)
    git(root, "checkout", "-q", "-b", "experiment")
    (root / "python" / "flash_attn_sparse" / "__init__.py").write_text("SPARSE = 2\n")
    (exported.overlay / "flash-attn" / "csrc").mkdir(parents=True)
    (exported.overlay / "flash-attn" / "csrc" / "new_kernel.cu").write_text("// new kernel\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "experiment")
    text = variant.diff(exported, "experiment", base="main")
    assert b"diff --git a/flash_attn_sparse/__init__.py b/flash_attn_sparse/__init__.py" in text
    assert b"+++ b/csrc/new_kernel.cu" in text and b"base/" not in text and b"branch/" not in text
    laid = {}
    for rev in ("main", "experiment"):
        git(root, "checkout", "-q", rev)
        series.materialize(exported, "flash-attn", tmp_path / rev)
        laid[rev] = tree_files(tmp_path / rev)
    patchfile.apply_diff(text, tmp_path / "main", "experiment")  # what build --mutation does
    assert tree_files(tmp_path / "main") == laid["experiment"] != laid["main"]


def test_variant_command_diffs_the_named_upstreams_tree(exported: Layout, tmp_path: Path):
    """`forktools variant BRANCH --upstream NAME`: FA-3 experiments are diffs of the flash-attn-3
    tree (hopper/ paths); a branch that leaves the named tree as it is has nothing to build."""
    root = commit_base_on_main(exported)
    git(root, "checkout", "-q", "-b", "experiment")
    (exported.overlay / "demo").mkdir(parents=True, exist_ok=True)
    (exported.overlay / "demo" / "new_module.py").write_text("VALUE = 1\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "experiment")
    out = tmp_path / "experiment.diff"
    assert main(["variant", "experiment", "--base", "main", "--upstream", "demo", "-o", str(out)], root=root) == 0
    assert b"+++ b/new_module.py" in out.read_bytes()
    assert main(["variant", "experiment", "--base", "main"], root=root) == 1  # flash-attn's tree is unchanged
    assert main(["variant", "experiment", "--base", "main", "--upstream", "nope"], root=root) == 1


def test_variant_refuses_a_branch_that_does_not_contain_the_base(exported: Layout):
    root = commit_base_on_main(exported)
    git(root, "branch", "experiment")
    (root / "python" / "flash_attn_sparse" / "__init__.py").write_text("SPARSE = 3\n")
    git(root, "commit", "-q", "-am", "main moves on")
    with pytest.raises(ToolError, match="rebase it onto main"):
        variant.diff(exported, "experiment", base="main")


def test_build_options_come_from_the_environment_so_posargs_stay_pytest_s(monkeypatch, tmp_path):
    """`FLASH_ATTN_SPARSE_ARCH=80 nox -s build test`: nox hands posargs to every session, so the
    build's options have their own spelling; command-line flags still win."""
    from forktools import build
    calls = []
    monkeypatch.setattr(build, "build", lambda layout, **options: calls.append(options))
    monkeypatch.setattr(upstream, "fetch", lambda layout: None)
    monkeypatch.setenv("FLASH_ATTN_SPARSE_ARCH", "80,90")
    monkeypatch.setenv("FLASH_ATTN_SPARSE_PROFILE", "full")
    monkeypatch.setenv("FLASH_ATTN_SPARSE_JOBS", "3")
    assert main(["build"], root=tmp_path) == 0
    assert (calls[-1]["archs"], calls[-1]["profile"], calls[-1]["jobs"]) == (["80", "90"], "full", 3)
    assert main(["build", "--arch", "120", "--profile", "dev"], root=tmp_path) == 0
    assert (calls[-1]["archs"], calls[-1]["profile"]) == (["120"], "dev")


def test_fa3_only_builds_its_mutations_and_refuses_flash_attn_ones(monkeypatch, capsys, tmp_path):
    """build --fa3-only --mutation: an FA-3 (hopper/) diff goes to the FA-3 build; a flash-attn one
    would be dropped silently there, so it is refused."""
    from forktools import build_fa3
    calls = []
    monkeypatch.setattr(build_fa3, "build", lambda layout, **options: calls.append(options))
    monkeypatch.setattr(upstream, "fetch", lambda layout: None)
    fa3_diff, fa2_diff = REPO / "tests/mutations/fa3-v-steps-densely.patch", REPO / "tests/mutations/v-steps-densely.patch"
    assert main(["build", "--fa3-only", "--mutation", str(fa3_diff)], root=tmp_path) == 0
    assert calls[-1]["mutations"] == [fa3_diff]
    assert main(["build", "--fa3-only", "--mutation", str(fa2_diff)], root=tmp_path) == 1
    assert len(calls) == 1 and "hopper/ only" in capsys.readouterr().err


def test_a_build_option_given_to_the_test_command_is_refused_with_its_spelling(capsys, tmp_path):
    assert main(["test", "-q", "--arch", "80"], root=tmp_path) == 1
    assert "FLASH_ATTN_SPARSE_ARCH=80 nox -s build test" in capsys.readouterr().err


def test_unit_times_are_the_units_this_build_compiled_slowest_first(tmp_path):
    from forktools import wheelbuild as build
    log = tmp_path / "build" / "temp" / ".ninja_log"
    log.parent.mkdir(parents=True)
    log.write_text("# ninja log v5\n0\t90000\t1\t/x/old_unit.o\th\n")  # an earlier build's line
    before = build.ninja_log_lengths(tmp_path)
    with log.open("a") as appended:
        appended.write("# ninja log v5\n5\t120005\t1\t/x/flash_fwd_hdim128_bf16_sparse_sm90.o\th\n"
                       "0\t80000\t1\t/x/flash_api.o\th\n")
    assert build.unit_times(tmp_path, before) == [(120.0, "flash_fwd_hdim128_bf16_sparse_sm90.o", 0.005, 120.005),
                                                  (80.0, "flash_api.o", 0.0, 80.0)]
    out = tmp_path / "units.txt"
    build.report_unit_times(tmp_path, before, out)
    assert out.read_text().splitlines()[0].split() == ["120.0", "s", "flash_fwd_hdim128_bf16_sparse_sm90.o", "(0-120", "s)"]


def test_the_build_log_times_each_line_and_the_console_gets_ninjas_progress(tmp_path, capsys):
    """The log says when each line came (where a build's time outside its units goes)."""
    from forktools import wheelbuild
    script = "print('setup'); print('[1/2] nvcc -c unit_a.cu'); print('error: unit_b.cu failed')"
    log = tmp_path / "build.log"
    assert wheelbuild.run_with_progress([sys.executable, "-c", script], tmp_path, dict(os.environ), log, prefix="fa3 ") == 0
    lines = log.read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["setup", "[1/2] nvcc -c unit_a.cu", "error: unit_b.cu failed"]
    assert all(float(line[1:line.index("]")]) >= 0 for line in lines)
    assert capsys.readouterr().out.splitlines() == ["  fa3 [1/2] unit_a.cu", "  fa3 error: unit_b.cu failed"]


def test_a_wheel_label_hashes_its_own_upstreams_patches_not_the_others(tmp_path):
    """An FA-3 patch rebuilds the FA-3 wheel only (the FA-2 wheel's label hashes the FA-2 and
    FA-4 patches, its [hopper] extra naming FA-4's); the two builds took ~490 s together."""
    from forktools import build
    project = tmp_path / "project"
    shutil.copytree(REPO / "patches", project / "patches")
    (project / "upstream").mkdir()
    shutil.copy(REPO / "upstream" / "lock.toml", project / "upstream" / "lock.toml")
    layout = Layout.at(project)

    def labels():
        return {name: build.source_hash(layout, "dev", ["90"], name=name) for name in ("flash-attn", "flash-attn-3")}
    before = labels()
    new_patch = layout.patches / "flash-attn-3" / "0099-a-new-fa3-patch.patch"
    new_patch.write_text("Subject: [stage 4] a new FA-3 patch\n")
    with layout.series.open("a") as series_file:
        series_file.write("flash-attn-3/0099-a-new-fa3-patch.patch stage=4\n")
    after = labels()
    assert after["flash-attn"] == before["flash-attn"]
    assert after["flash-attn-3"] != before["flash-attn-3"]
    fa3_patch = sorted((layout.patches / "flash-attn-3").glob("0001-*.patch"))[0]
    fa3_patch.write_bytes(fa3_patch.read_bytes().replace(b"Stage: 0", b"Measured since.\n\nStage: 0", 1))
    assert labels() == after  # a patch's description is not built
    described = fa3_patch.read_bytes()
    fa3_patch.write_bytes(described.replace(b"+                #endif", b"+                #endif  // changed", 1))
    assert labels()["flash-attn-3"] != after["flash-attn-3"]  # its diff is
    fa3_patch.write_bytes(described)
    (layout.patches / "flash-attn-4" / "0001-sm90-forward-varlen-block-sparse-rows-with-tile-n.patch").write_text("changed\n")
    assert labels()["flash-attn"] != after["flash-attn"]  # FA-4's patches name the FA-2 wheel's extra


def test_every_patch_of_the_series_states_its_stage_and_upstream_status():
    """Each header says why the patch exists, its stage, and whether it could go upstream (as
    Electron's patches do): a new patch without an `Upstream:` line fails here."""
    listed = [line.split()[0] for line in (REPO / "patches" / "series").read_text().splitlines()
              if line and not line.startswith("#")]
    assert sorted(listed) == sorted(str(p.relative_to(REPO / "patches")) for p in (REPO / "patches").glob("*/*.patch"))
    for name in listed:
        header = (REPO / "patches" / name).read_text().split("\n---\n", 1)[0]
        assert re.search(r"^Upstream( status)?: \S", header, re.M), f"{name}: no Upstream: line in its header"
        assert re.search(r"^Stage: \d$", header, re.M), f"{name}: no Stage: line in its header"
