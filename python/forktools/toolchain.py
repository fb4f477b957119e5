"""What a build needs before it compiles, checked up front: a toolchain problem stops the build in
a second with the fix in its message, not minutes into the compile (or after a half-installed
environment).

- nvcc and the CUDA headers of the CUDA_HOME that torch's extension build will use (found the way
  torch finds it: $CUDA_HOME, $CUDA_PATH, else two folders above the nvcc on PATH);
- a CUDA and a torch version the build supports, torch built for CUDA of nvcc's major version;
- the GPU arch: given (FLASH_ATTN_SPARSE_ARCH or --arch), else that of the visible GPUs;
- the C++ standard torch's headers require (C++20 from torch 2.14 on), which the patched setup.py
  files read from $FLASH_ATTENTION_CXX_STD.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from forktools import ToolError

SUPPORTED_CUDA = ((12, 3), (14, 0))  # from FA-3's minimum up to, not including, the first untried major
SUPPORTED_TORCH = ((2, 9), (2, 15))  # the first CUDA 13 torch up to, not including, the first untried minor
DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # torch's last guess
TOOLKIT_HEADERS = "/usr/local/cuda*/include/cuda.h"  # where a hint for CUDA_HOME is looked for
# The CUDA math library headers torch's ATen/cuda headers include; an nvcc-only toolkit lacks them.
MATH_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")
ARCH_ENV = "FLASH_ATTN_SPARSE_ARCH"
CXX_STD_ENV = "FLASH_ATTENTION_CXX_STD"
DEFAULT_CXX_STD = "c++17"
_CXX_REQUIRED = re.compile(r"#\s*error\s+C\+\+(\d+) or later")


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cuda_home: Path
    cuda_version: tuple[int, int]
    torch_version: str
    cxx_standard: str

    def env(self) -> dict[str, str]:
        """What the build's environment gets, so setup.py uses exactly what was checked."""
        return {"CUDA_HOME": str(self.cuda_home), CXX_STD_ENV: self.cxx_standard}


@dataclasses.dataclass(frozen=True)
class Torch:
    version: str
    cuda: str | None  # None: a CPU-only build
    include: Path


def _span(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (low_major, low_minor), (high_major, high_minor) = bounds
    last = f"{high_major - 1}.x" if high_minor == 0 else f"{high_major}.{high_minor - 1}"
    return f"{low_major}.{low_minor} to {last}"


def _within(version: tuple[int, int], bounds: tuple[tuple[int, int], tuple[int, int]]) -> bool:
    return bounds[0] <= version < bounds[1]


def cuda_home(environ: dict | None = None) -> tuple[Path | None, str]:
    """(CUDA_HOME as torch's extension build will take it, where that came from)."""
    environ = os.environ if environ is None else environ
    for name in ("CUDA_HOME", "CUDA_PATH"):
        if environ.get(name):
            return Path(environ[name]), f"from ${name}"
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        return Path(nvcc).parent.parent, f"guessed by torch from the nvcc on PATH, {nvcc}"
    return (DEFAULT_CUDA_HOME, "torch's default") if DEFAULT_CUDA_HOME.exists() else (None, "")


def _toolkits_with_headers() -> list[str]:
    return sorted(str(Path(header).parents[1]) for header in glob.glob(TOOLKIT_HEADERS))


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    try:
        output = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError as err:
        raise ToolError(f"could not run {nvcc} --version: {err}; set CUDA_HOME to a working CUDA toolkit") from None
    match = re.search(r"release (\d+)\.(\d+)", output)
    if not match:
        raise ToolError(f"{nvcc} --version names no CUDA release; set CUDA_HOME to a working CUDA toolkit")
    return int(match[1]), int(match[2])


def installed_torch() -> Torch | None:
    """The torch this Python would import (read from its files, without importing it)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    return read_torch(Path(list(spec.submodule_search_locations)[0]))


def read_torch(package: Path) -> Torch:
    text = (package / "version.py").read_text()
    version = re.search(r"^__version__ = '([^']+)'", text, re.M)
    cuda = re.search(r"^cuda(?:: [^=]+)? = '([^']+)'", text, re.M)
    return Torch(version[1] if version else "unknown", cuda[1] if cuda else None, package / "include")


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def cxx_standard(torch_include: Path) -> str:
    """The standard torch's headers require: their `#error C++NN or later ...` guard, else C++17."""
    for header in ("ATen/ATen.h", "torch/csrc/api/include/torch/all.h"):
        path = torch_include / header
        match = path.is_file() and _CXX_REQUIRED.search(path.read_text(errors="replace"))
        if match:
            return f"c++{match[1]}"
    return DEFAULT_CXX_STD


def check(environ: dict | None = None, torch: Torch | None = None) -> Toolchain:
    """The toolchain the build will use, or a ToolError naming what is wrong and how to fix it."""
    home, origin = cuda_home(environ)
    if home is None:
        raise ToolError(f"no nvcc: none on PATH and CUDA_HOME is not set; install the CUDA toolkit "
                        f"({_span(SUPPORTED_CUDA)}) and set CUDA_HOME to it (the folder holding bin/nvcc)")
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise ToolError(f"no nvcc at {nvcc} (CUDA_HOME={home}, {origin}); set CUDA_HOME to the CUDA toolkit "
                        f"(the folder holding bin/nvcc and include/cuda.h)")
    header = home / "include" / "cuda.h"
    if not header.is_file():
        found = [path for path in _toolkits_with_headers() if Path(path) != home]
        hint = f", e.g. CUDA_HOME={found[-1]}" if found else ""
        raise ToolError(f"CUDA headers not found: tried {header} (CUDA_HOME={home}, {origin}); set CUDA_HOME to "
                        f"the CUDA toolkit that holds include/cuda.h{hint}")
    missing = [name for name in MATH_HEADERS if not (home / "include" / name).is_file()]
    if missing:
        raise ToolError(f"CUDA math library headers not found: {', '.join(missing)} not in {home / 'include'} "
                        f"(CUDA_HOME={home}, {origin}); torch's CUDA headers include them: install the toolkit's "
                        f"cuBLAS, cuSPARSE and cuSOLVER development headers, or set CUDA_HOME to a full CUDA toolkit")
    cuda = nvcc_version(nvcc)
    if not _within(cuda, SUPPORTED_CUDA):
        raise ToolError(f"CUDA {cuda[0]}.{cuda[1]} ({nvcc}) is outside what this build supports "
                        f"({_span(SUPPORTED_CUDA)}); install such a toolkit and set CUDA_HOME to it")
    torch = torch or installed_torch()
    wanted = f"torch {_span(SUPPORTED_TORCH)} built for CUDA {cuda[0]}"
    if torch is None:
        raise ToolError(f"torch is not installed in this Python; install {wanted}")
    if not _within(_release(torch.version), SUPPORTED_TORCH):
        raise ToolError(f"torch {torch.version} is outside what this build supports; install {wanted}")
    if torch.cuda is None:
        raise ToolError(f"torch {torch.version} is a CPU-only build; install {wanted} (a version ending in "
                        f"+cu{cuda[0]}{cuda[1]} or similar)")
    if _release(torch.cuda)[0] != cuda[0]:
        raise ToolError(f"torch {torch.version} is built for CUDA {torch.cuda} but nvcc ({nvcc}) is CUDA "
                        f"{cuda[0]}.{cuda[1]}; install torch built for CUDA {cuda[0]}, or set CUDA_HOME to a "
                        f"CUDA {_release(torch.cuda)[0]} toolkit")
    return Toolchain(home, cuda, torch.version, cxx_standard(torch.include))


def visible_gpu_archs() -> list[str]:
    """Compute capabilities of the GPUs nvidia-smi lists ("90" for an H100), none without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        result = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode:
        return []
    return sorted({line.strip().replace(".", "") for line in result.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())})


def build_archs(given: list[str] | None, profile_archs: list[str] | None) -> list[str]:
    """The archs to compile for: those given, else the profile's own list, else the visible GPUs'."""
    if given:
        return given
    if profile_archs:
        return profile_archs
    found = visible_gpu_archs()
    if not found:
        raise ToolError(f"no GPU visible (nvidia-smi lists none) and no arch given: set {ARCH_ENV} to the compute "
                        f"capability to build for, e.g. {ARCH_ENV}=90 for H100/H200 or {ARCH_ENV}=80 for A100")
    return found
