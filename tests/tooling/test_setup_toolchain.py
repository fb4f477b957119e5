"""The build's checks before it compiles (forktools.toolchain), one per message, on faked
toolchains: a CUDA toolkit of a fake nvcc and cuda.h in a temporary folder, a torch described by
its version and headers, nvidia-smi as a script on PATH. Each refusal names the fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from forktools import ToolError, build, toolchain
from forktools.layout import Layout

pytestmark = pytest.mark.tooling
REPO = Path(__file__).resolve().parents[2]
ATEN_2_14 = "#pragma once\n#if !defined(__cplusplus) || __cplusplus < 202002L\n" \
            "#error C++20 or later compatible compiler is required to use ATen.\n#endif\n"


def executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def toolkit(folder: Path, release: str = "13.0", headers: bool = True, math_headers: bool = True) -> Path:
    """A CUDA toolkit folder whose bin/nvcc reports `release`, with include/cuda.h if headers (and
    the math library headers torch includes if math_headers)."""
    executable(folder / "bin" / "nvcc", f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.88'\n")
    if headers:
        (folder / "include").mkdir(parents=True)
        (folder / "include" / "cuda.h").write_text("#define CUDA_VERSION 13000\n")
        for name in toolchain.MATH_HEADERS if math_headers else ():
            (folder / "include" / name).write_text("#pragma once\n")
    return folder


def torch(folder: Path, version: str = "2.14.1+cu130", cuda: str | None = "13.0", aten: str = ATEN_2_14) -> toolchain.Torch:
    (folder / "include" / "ATen").mkdir(parents=True, exist_ok=True)
    (folder / "include" / "ATen" / "ATen.h").write_text(aten)
    return toolchain.Torch(version, cuda, folder / "include")


@pytest.fixture
def nowhere(tmp_path, monkeypatch) -> dict:
    """An environment with no CUDA anywhere: an empty PATH, no CUDA_HOME, no default toolkit."""
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_HOME", tmp_path / "no-default-cuda")
    monkeypatch.setattr(toolchain, "TOOLKIT_HEADERS", str(tmp_path / "toolkits" / "cuda*" / "include" / "cuda.h"))
    (tmp_path / "empty-bin").mkdir()
    return {"PATH": str(tmp_path / "empty-bin")}


def test_no_nvcc_says_to_install_the_toolkit_and_set_cuda_home(nowhere, tmp_path):
    with pytest.raises(ToolError, match=r"^no nvcc: none on PATH and CUDA_HOME is not set; install the CUDA toolkit "
                                        r"\(12\.3 to 13\.x\) and set CUDA_HOME to it"):
        toolchain.check(nowhere, torch(tmp_path / "torch"))


def test_cuda_home_without_nvcc_names_the_path_tried(nowhere, tmp_path):
    (tmp_path / "not-cuda").mkdir()
    with pytest.raises(ToolError, match=f"^no nvcc at {tmp_path}/not-cuda/bin/nvcc \\(CUDA_HOME={tmp_path}/not-cuda, "
                                        r"from \$CUDA_HOME\); set CUDA_HOME to the CUDA toolkit"):
        toolchain.check({**nowhere, "CUDA_HOME": str(tmp_path / "not-cuda")}, torch(tmp_path / "torch"))


def test_an_nvcc_wrapper_on_path_makes_torch_guess_a_home_without_headers(nowhere, tmp_path):
    """nvcc reachable only as a wrapper in <prefix>/bin: torch takes <prefix> as CUDA_HOME (here
    the machine's /usr/local), where there is no include/cuda.h; the real toolkit is suggested."""
    real = toolkit(tmp_path / "toolkits" / "cuda-13.0")
    executable(tmp_path / "usr-local" / "bin" / "nvcc", f"#!/bin/sh\nexec {real}/bin/nvcc \"$@\"\n")
    environ = {"PATH": f"{tmp_path}/usr-local/bin:{nowhere['PATH']}"}
    assert toolchain.cuda_home(environ)[0] == tmp_path / "usr-local"
    with pytest.raises(ToolError) as refused:
        toolchain.check(environ, torch(tmp_path / "torch"))
    assert str(refused.value) == (
        f"CUDA headers not found: tried {tmp_path}/usr-local/include/cuda.h (CUDA_HOME={tmp_path}/usr-local, "
        f"guessed by torch from the nvcc on PATH, {tmp_path}/usr-local/bin/nvcc); set CUDA_HOME to the CUDA toolkit "
        f"that holds include/cuda.h, e.g. CUDA_HOME={real}")


def test_a_wrong_cuda_home_names_the_header_path_tried(nowhere, tmp_path):
    wrong = toolkit(tmp_path / "wrong", headers=False)
    with pytest.raises(ToolError, match=f"^CUDA headers not found: tried {wrong}/include/cuda.h \\(CUDA_HOME={wrong}, "
                                        r"from \$CUDA_HOME\); set CUDA_HOME to the CUDA toolkit that holds include/cuda.h$"):
        toolchain.check({**nowhere, "CUDA_HOME": str(wrong)}, torch(tmp_path / "torch"))


def test_an_nvcc_only_toolkit_names_the_missing_math_headers(nowhere, tmp_path):
    """A toolkit with nvcc and cuda.h but not cuBLAS/cuSPARSE/cuSOLVER's headers (an nvcc-only
    install): torch's ATen/cuda headers would fail to compile, so the build stops before."""
    home = toolkit(tmp_path / "cuda", math_headers=False)
    (home / "include" / "cublas_v2.h").write_text("#pragma once\n")
    with pytest.raises(ToolError) as refused:
        toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch"))
    assert str(refused.value) == (
        f"CUDA math library headers not found: cublasLt.h, cusparse.h, cusolverDn.h not in {home}/include "
        f"(CUDA_HOME={home}, from $CUDA_HOME); torch's CUDA headers include them: install the toolkit's cuBLAS, "
        f"cuSPARSE and cuSOLVER development headers, or set CUDA_HOME to a full CUDA toolkit")


@pytest.mark.parametrize("release", ["11.8", "12.2", "14.0"])
def test_a_cuda_outside_the_supported_range_is_refused(nowhere, tmp_path, release):
    home = toolkit(tmp_path / "cuda", release=release)
    with pytest.raises(ToolError, match=f"^CUDA {release} \\({home}/bin/nvcc\\) is outside what this build supports "
                                        r"\(12\.3 to 13\.x\); install such a toolkit and set CUDA_HOME to it$"):
        toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch"))


@pytest.mark.parametrize("version", ["2.8.0+cu128", "2.15.0+cu130", "3.0.0"])
def test_a_torch_outside_the_supported_range_is_refused(nowhere, tmp_path, version):
    home = toolkit(tmp_path / "cuda")
    with pytest.raises(ToolError, match=f"^torch {re.escape(version)} is outside what this build supports; "
                                        r"install torch 2\.9 to 2\.14 built for CUDA 13$"):
        toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch", version=version))


def test_a_cpu_only_torch_is_refused(nowhere, tmp_path):
    home = toolkit(tmp_path / "cuda")
    with pytest.raises(ToolError, match=r"^torch 2\.13\.0\+cpu is a CPU-only build; install torch 2\.9 to 2\.14 built "
                                        r"for CUDA 13 \(a version ending in \+cu130 or similar\)$"):
        toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch", version="2.13.0+cpu", cuda=None))


def test_a_torch_for_another_cuda_major_is_refused(nowhere, tmp_path):
    home = toolkit(tmp_path / "cuda")
    with pytest.raises(ToolError, match=r"^torch 2\.11\.0\+cu128 is built for CUDA 12\.8 but nvcc .* is CUDA 13\.0; "
                                        r"install torch built for CUDA 13, or set CUDA_HOME to a CUDA 12 toolkit$"):
        toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch", version="2.11.0+cu128", cuda="12.8"))


def test_no_gpu_and_no_arch_says_to_set_the_arch(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with pytest.raises(ToolError, match=r"^no GPU visible \(nvidia-smi lists none\) and no arch given: set "
                                        r"FLASH_ATTN_SPARSE_ARCH to the compute capability to build for, e\.g\. "
                                        r"FLASH_ATTN_SPARSE_ARCH=90 for H100/H200"):
        toolchain.build_archs(None, None)
    assert toolchain.build_archs(["90"], None) == ["90"]  # no GPU needed when the arch is given
    assert toolchain.build_archs(None, ["80", "90"]) == ["80", "90"]  # the full profile names its own


def test_the_visible_gpus_arch_is_the_default(tmp_path, monkeypatch):
    executable(tmp_path / "nvidia-smi", "#!/bin/sh\nprintf '9.0\\n9.0\\n'\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert toolchain.build_archs(None, None) == ["90"]


def test_the_cxx_standard_is_the_one_torch_s_headers_require(nowhere, tmp_path):
    home = toolkit(tmp_path / "cuda")
    newest = toolchain.check({**nowhere, "CUDA_HOME": str(home)}, torch(tmp_path / "torch-2.14"))
    assert newest == toolchain.Toolchain(home, (13, 0), "2.14.1+cu130", "c++20")
    assert newest.env() == {"CUDA_HOME": str(home), "FLASH_ATTENTION_CXX_STD": "c++20"}
    older = torch(tmp_path / "torch-2.11", version="2.11.0+cu130", aten="#pragma once\n#include <c10/core/Device.h>\n")
    assert toolchain.check({**nowhere, "CUDA_HOME": str(home)}, older).cxx_standard == "c++17"
    assert toolchain.cxx_standard(tmp_path / "no-headers") == "c++17"


def test_the_installed_torch_is_read_from_its_files(tmp_path):
    package = tmp_path / "torch"
    package.mkdir()
    (package / "version.py").write_text("from typing import Optional\n__version__ = '2.14.1+cu130'\ndebug = False\n"
                                        "cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n")
    assert toolchain.read_torch(package) == toolchain.Torch("2.14.1+cu130", "13.0", package / "include")
    (package / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    assert toolchain.read_torch(package).cuda is None


def test_both_setup_py_patches_take_the_standard_from_the_variable_the_build_sets():
    for patch in ("flash-attn/0001-*.patch", "flash-attn-3/0001-*.patch"):
        text = next((REPO / "patches").glob(patch)).read_text()
        assert f'+CXX_STANDARD = os.getenv("{toolchain.CXX_STD_ENV}", "c++17")' in text, patch
        assert '+    f"-std={CXX_STANDARD}",' in text or '+        f"-std={CXX_STANDARD}",' in text, patch


def test_a_failing_check_stops_the_build_before_anything_is_compiled_or_written(nowhere, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "not-cuda"))
    monkeypatch.setattr(build, "run_with_progress", lambda *args, **kwargs: pytest.fail("compiled"))
    monkeypatch.setattr(build, "install_wheels", lambda wheels: pytest.fail("installed"))
    monkeypatch.setattr(build.wheel_fa4, "build", lambda layout: pytest.fail("wrote the flash-attn-4 wheel"))
    with pytest.raises(ToolError, match="^no nvcc at "):
        build.build(Layout.at(REPO), archs=["90"], install=True)
