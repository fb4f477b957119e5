"""forktools: the patch-set tooling of this fork.

Upstream FlashAttention releases are pinned in upstream/lock.toml, fetched and verified
(upstream.py; the GitHub trees in github.py), unpacked into build/trees/<name>/ and patched by
the series in patches/ (series.py, patchfile.py, overlay.py), then built (build.py, after the
checks of toolchain.py). Run it through nox (noxfile.py), as `python -m forktools <command>` from
the repo root with PYTHONPATH=python, or as `forktools <command>` after `pip install .`.
"""


class ToolError(Exception):
    """A refusal or failure reported to the user as a readable message, without a traceback."""
