"""forktools' FA-3 parts: the GitHub tree pins are checked by content (git tree id) and a mismatch
is refused; the dev profile's kernel list is what the patched setup.py compiles."""

import dataclasses
import gzip
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from forktools import ToolError, build_fa3, github, lockfile, series, treeid
from forktools.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
MIRROR = github.mirror_dir(None) or ROOT.parent / "shared" / "upstream"  # CI's offline mirror


def _tar(members: dict[str, tuple[bytes, int]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, (data, mode) in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buffer.getvalue())


@pytest.mark.skipif(shutil.which("git") is None, reason="git computes the reference tree id")
def test_archive_tree_id_is_gits(tmp_path):
    members = {"top/a.txt": (b"alpha\n", 0o644), "top/run.sh": (b"#!/bin/sh\n", 0o755),
               "top/sub/b.txt": (b"beta\n", 0o644), "top/sub-x": (b"dash sorts before slash\n", 0o644)}
    archive = tmp_path / "t.tar.gz"
    archive.write_bytes(_tar(members))
    unpacked = tmp_path / "u"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(unpacked / "top")]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    expected = subprocess.run([*git, "write-tree"], check=True, capture_output=True, text=True).stdout.strip()
    assert treeid.tar_folder_id(archive, "top") == expected


def _layout_with_pin(tmp_path, pin: github.GithubTree) -> Layout:
    layout = Layout.at(tmp_path)
    layout.lock.parent.mkdir(parents=True)
    layout.lock.write_text("[[github]]\n" + "".join(f'{key} = "{value}"\n' for key, value in vars(pin).items()))
    return layout


@pytest.mark.skipif(not (MIRROR / "flash-attention-v2.8.3-hopper.tar.gz").exists(), reason="no upstream mirror")
def test_mirror_archive_verified_by_tree_id_and_mismatches_refused(tmp_path):
    hopper = lockfile.named(github.load(ROOT / "upstream" / "lock.toml"), "flash-attention-hopper", "github")
    layout = _layout_with_pin(tmp_path / "ok", hopper)
    github.fetch(layout, [hopper], offline=True, mirror=MIRROR)
    assert (layout.cache / hopper.archive).exists()
    wrong = dataclasses.replace(hopper, tree="1" * 40)
    with pytest.raises(ToolError, match=f"refusing hopper/ from {MIRROR / hopper.archive}: its git tree id is "
                                        f"{hopper.tree}, but upstream/lock.toml pins {'1' * 40}"):
        github.fetch(_layout_with_pin(tmp_path / "tree", wrong), [wrong], offline=True, mirror=MIRROR)
    assert not (tmp_path / "tree" / ".cache" / "upstream" / hopper.archive).exists()
    absent = dataclasses.replace(hopper, archive="absent.tar.gz")
    with pytest.raises(ToolError, match="absent.tar.gz missing from .* and --offline was given"):
        github.fetch(_layout_with_pin(tmp_path / "none", absent), [absent], offline=True, mirror=tmp_path)


@pytest.fixture(scope="module")
def patched_hopper(tmp_path_factory) -> Path:
    """hopper/ of FA-3 as the committed series lays it, from the cached sources (CI's
    check-patches fetched them; here `nox -s upstream`)."""
    layout = Layout.at(ROOT)
    if not any(layout.cache.glob("*hopper*.tar.gz")):
        pytest.skip(f"FA-3's hopper/ archive is not in {layout.cache} (run `nox -s upstream`)")
    scratch = tmp_path_factory.mktemp("fa3")
    series.materialize(layout.with_trees(scratch / "trees"), build_fa3.UPSTREAM, scratch / "flash-attn-3")
    return scratch / "flash-attn-3" / "hopper"


@pytest.mark.parametrize("fp8, paged", [(False, False), (True, False), (False, True), (True, True)])
def test_dev_kernels_are_what_the_patched_setup_compiles(patched_hopper: Path, tmp_path, monkeypatch, fp8: bool, paged: bool):
    """The source list of hopper/setup.py (patches flash-attn-3/0001, 0003, 0008, 0011) under the
    dev variables, by running its list-building lines: 12 dense kernel units, the 20 sparse units it
    writes from generate_kernels_sparse.py (here into tmp_path), flash_api and flash_api_sparse,
    combine and scheduler, and the driver entry points CUTLASS's TMA descriptors call (0011); with
    FLASH_ATTN_SPARSE_FP8=1 also the 6 dense and 10 sparse e4m3 units (0008); with
    FLASH_ATTN_SPARSE_PAGED=1 the 8 dense and 12 sparse cp.async paged units (with FP8: 10 more)."""
    hopper = patched_hopper
    text = (hopper / "setup.py").read_text()
    flags = "".join(line + "\n" for line in text.splitlines() if re.match(r"(DISABLE_\w+|USE_SYSTEM_NVCC) = ", line))
    body = text[text.index("    DTYPE_FWD_SM80"):text.index("    nvcc_flags = [")]
    for option, on in ((build_fa3.FP8_OPTION, fp8), (build_fa3.PAGED_OPTION, paged)):
        if on:
            monkeypatch.setenv(option, "1")
        else:
            monkeypatch.delenv(option, raising=False)
    environ = build_fa3.profile_env("dev")
    shutil.copy(hopper / "generate_kernels_sparse.py", tmp_path)
    (tmp_path / "instantiations").mkdir()
    monkeypatch.setattr("sys.path", list(sys.path))
    monkeypatch.delitem(sys.modules, "generate_kernels_sparse", raising=False)
    scope = {"os": type("os", (), {"getenv": staticmethod(lambda k, d=None: environ.get(k, d))}),
             "sys": sys, "Path": Path, "this_dir": str(tmp_path)}
    exec("import itertools\n" + flags, scope)  # noqa: S102 -- runs setup.py's own list-building lines
    exec("import itertools\n" + "\n".join(line[4:] for line in body.splitlines()), scope)  # noqa: S102 -- runs setup.py's own list-building lines
    kernels = sorted(Path(s).name for s in scope["sources"] if s.startswith("instantiations/"))
    fp8_kernels = build_fa3.DEV_FP8_KERNELS if fp8 else []
    paged_kernels = build_fa3.DEV_PAGED_KERNELS if paged else []
    both = [name.replace("_bf16", "_e4m3") for name in paged_kernels if "_bf16" in name] if fp8 else []
    assert kernels == sorted(build_fa3.DEV_KERNELS + build_fa3.DEV_SPARSE_KERNELS + fp8_kernels + paged_kernels + both)
    assert len(kernels) == 32 + 16 * fp8 + 20 * paged + 10 * (fp8 and paged)
    written = sorted(p.name for p in (tmp_path / "instantiations").iterdir())
    extra = fp8_kernels + paged_kernels + both
    assert written == sorted(build_fa3.DEV_SPARSE_KERNELS + [k for k in extra if k.endswith("_sparse_sm90.cu")])
    assert set(scope["sources"]) - {f"instantiations/{k}" for k in kernels} == {
        "flash_api.cpp", "flash_api_sparse.cpp", "flash_fwd_combine.cu", "flash_prepare_scheduler.cu",
        "cuda_driver_entry_points.cpp"}


def test_the_fp8_option_keeps_dev_s_fp8_kernels_under_a_label_of_their_own(monkeypatch):
    """FLASH_ATTN_SPARSE_FP8=1 lifts only dev's FP8 flag and names the profile dev.fp8, so an FP8
    wheel is never taken for a plain dev one (or the reverse); the full profile already has FP8."""
    monkeypatch.delenv(build_fa3.FP8_OPTION, raising=False)
    monkeypatch.delenv(build_fa3.PAGED_OPTION, raising=False)
    plain = build_fa3.profile_env("dev")
    assert plain["FLASH_ATTENTION_DISABLE_FP8"] == "TRUE" and build_fa3.profile_name("dev") == "dev"
    monkeypatch.setenv(build_fa3.FP8_OPTION, "1")
    with_fp8 = build_fa3.profile_env("dev")
    assert set(plain) - set(with_fp8) == {"FLASH_ATTENTION_DISABLE_FP8"} and set(with_fp8) < set(plain)
    assert build_fa3.profile_name("dev") == "dev.fp8"
    assert build_fa3.profile_name("full") == "full" and build_fa3.profile_env("full") == {}
    assert build_fa3.PROFILES["dev"]["FLASH_ATTENTION_DISABLE_FP8"] == "TRUE"  # profile_env copies, never edits


@pytest.mark.parametrize("sm80_off", [True, False])
def test_combine_and_scheduler_units_compile_for_sm80_only_when_sm8x_is_built(patched_hopper: Path, sm80_off: bool):
    """setup.py's rule for the two units both archs share (flash_fwd_combine.cu,
    flash_prepare_scheduler.cu; patch flash-attn-3/0001): the dev profile (DISABLE_SM80) compiles
    them for sm90a alone, upstream's build for sm90a and sm80."""
    text = (patched_hopper / "setup.py").read_text()
    (line,) = [line.strip() for line in text.splitlines() if line.strip().startswith("cuda_post_cflags_sm80_sm90 = ")]
    scope = {"cuda_post_cflags": ["-O3", "-gencode", "arch=compute_90a,code=sm_90a"], "DISABLE_SM8x": sm80_off}
    exec(line, scope)  # noqa: S102 -- runs setup.py's own rule line
    archs = [flag for flag in scope["cuda_post_cflags_sm80_sm90"] if flag.startswith("arch=")]
    assert archs == (["arch=compute_90a,code=sm_90a"] if sm80_off else ["arch=compute_90a,code=sm_90a", "arch=compute_80,code=sm_80"])
    assert "SM80" in build_fa3.DEV_OFF  # the dev profile is the sm80_off case


def test_fa3_mutation_goes_to_the_fa3_build_only():
    """build --mutation sends a hopper/ diff to build_fa3 and a csrc/ one to the FA-2 build."""
    assert build_fa3.is_mutation_of_fa3(ROOT / "tests" / "mutations" / "fa3-v-steps-densely.patch")
    assert not build_fa3.is_mutation_of_fa3(ROOT / "tests" / "mutations" / "v-steps-densely.patch")


def test_the_paged_option_lifts_dev_s_pagedkv_flag_and_names_it_after_fp8(monkeypatch):
    """FLASH_ATTN_SPARSE_PAGED=1 lifts only PAGEDKV; with FP8 both, labelled dev.fp8.paged."""
    monkeypatch.delenv(build_fa3.FP8_OPTION, raising=False)
    monkeypatch.setenv(build_fa3.PAGED_OPTION, "1")
    assert set(build_fa3.PROFILES["dev"]) - set(build_fa3.profile_env("dev")) == {"FLASH_ATTENTION_DISABLE_PAGEDKV"}
    assert build_fa3.profile_name("dev") == "dev.paged"
    monkeypatch.setenv(build_fa3.FP8_OPTION, "1")
    assert set(build_fa3.PROFILES["dev"]) - set(build_fa3.profile_env("dev")) == {
        "FLASH_ATTENTION_DISABLE_PAGEDKV", "FLASH_ATTENTION_DISABLE_FP8"}
    assert build_fa3.profile_name("dev") == "dev.fp8.paged" and build_fa3.profile_name("full") == "full"


@pytest.mark.parametrize("cpus,memory_gib,alone,beside", [
    (16, 124, 16, 15),  # a "128 GB" host: FA-2's build is left 32 GB
    (2, 24, 2, 2),      # FA-2's two jobs are left 12 GB, not 32 (which left FA-3 one job)
    (8, 16, 2, 1),
])
def test_fa3_jobs_fit_the_memory_left_beside_fa2(monkeypatch, cpus, memory_gib, alone, beside):
    monkeypatch.setattr(build_fa3.os, "cpu_count", lambda: cpus)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": memory_gib * 2**30 // 4096}
    monkeypatch.setattr(build_fa3.os, "sysconf", lambda name: pages[name])
    assert build_fa3.default_jobs(None) == alone
    assert build_fa3.default_jobs(None, beside_fa2=True) == beside
