"""What this flash_attn build compiled, and refusals of what it compiled out.

setup.py (patches/flash-attn/0006) writes flash_attn/_build_profile.py as it builds: the profile
name, the head dims whose kernels it compiled and the features it compiled out
(FLASH_ATTENTION_DISABLE_*). A narrowed build's kernels cannot run the rest: its C++ raises a
bare error for a missing head dim or the backward, and for alibi, softcap, local windows, dropout
or an uneven head dim it has no check at all (the switches are compiled to constants), so the
call would run the wrong kernel. flash_attn_interface calls check_forward / check_backward before
reaching C++, which name the profile and how to build the full one. Importing a narrowed build
warns once (DeveloperBuildWarning). A tree without the generated file (not built by setup.py)
counts as the full build.
"""

import warnings

try:
    from flash_attn._build_profile import DISABLED, HEAD_DIMS, PROFILE
except ImportError:
    PROFILE, HEAD_DIMS, DISABLED = "full", (32, 64, 96, 128, 192, 256), ()

NARROWED = bool(DISABLED) or len(HEAD_DIMS) < 6  # else the full build: nothing to check per call
FULL_BUILD = "FLASH_ATTN_SPARSE_PROFILE=full nox -s build"
_DESCRIPTION = (f"profile {PROFILE!r}: {'forward only, ' if 'BACKWARD' in DISABLED else ''}"
                f"head dims {'/'.join(map(str, HEAD_DIMS))}"
                + "".join(f", no {feature.lower()}" for feature in DISABLED if feature != "BACKWARD"))


class DeveloperBuildWarning(UserWarning):
    """This flash_attn wheel is a narrowed (developer) build."""


class CompiledOutError(NotImplementedError):
    """The call needs kernels or a feature this build compiled out."""


def _refuse(what: str):
    raise CompiledOutError(f"{what} is compiled out of this flash_attn build ({_DESCRIPTION}); "
                           f"build the full one with `{FULL_BUILD}`")


def _kernel_head_dim(head_dim: int) -> int:
    """The kernel head dim flash_api.cpp dispatches a head dim to."""
    step = 32 if head_dim <= 128 else 64
    return -(-head_dim // step) * step


# head dim -> None when the build runs it, else what to refuse: one dict lookup per call once seen
_HEAD_DIM_VERDICTS = {}


def _head_dim_verdict(head_dim: int):
    kernel = _kernel_head_dim(head_dim)
    if kernel not in HEAD_DIMS:
        return f"head dim {head_dim} (kernel head dim {kernel})"
    if "UNEVEN_K" in DISABLED and head_dim != kernel:
        return f"head dim {head_dim}, below its kernel's {kernel} (uneven head dims)"
    return None


def check_forward(head_dim: int, *, seqlen_k: int, causal: bool, window_size_left: int = -1,
                  window_size_right: int = -1, softcap: float = 0.0, alibi_slopes=None,
                  dropout_p: float = 0.0) -> None:
    """Raise CompiledOutError when this forward needs what the build lacks."""
    if not NARROWED:
        return
    if head_dim not in _HEAD_DIM_VERDICTS:
        _HEAD_DIM_VERDICTS[head_dim] = _head_dim_verdict(head_dim)
    if _HEAD_DIM_VERDICTS[head_dim]:
        _refuse(_HEAD_DIM_VERDICTS[head_dim])
    if alibi_slopes is not None and "ALIBI" in DISABLED:
        _refuse("alibi_slopes")
    if softcap and "SOFTCAP" in DISABLED:
        _refuse("softcap")
    if dropout_p and "DROPOUT" in DISABLED:
        _refuse("dropout")
    # flash_api.cpp: a window reaching past the keys is no window; causal is right = 0.
    left = -1 if window_size_left >= seqlen_k else window_size_left
    right = -1 if window_size_right >= seqlen_k else window_size_right
    if (left >= 0 or (right > 0 and not causal)) and "LOCAL" in DISABLED:
        _refuse(f"window_size ({window_size_left}, {window_size_right}) (local attention)")


def check_backward() -> None:
    if "BACKWARD" in DISABLED:
        _refuse("the backward (autograd through flash_attn)")


if NARROWED:
    warnings.warn(f"flash_attn is a developer build ({_DESCRIPTION}); the full build: `{FULL_BUILD}`",
                  DeveloperBuildWarning, stacklevel=2)
