"""forktools: the patch-set tooling of this fork.

Upstream FlashAttention releases are pinned in upstream/lock.toml, fetched and verified
(upstream.py), unpacked into build/trees/<name>/ and patched by the series in patches/
(series.py, patchfile.py, overlay.py). Run it as `python -m forktools <command>` from the
repo root with PYTHONPATH=python, or through nox (noxfile.py).
"""


class ToolError(Exception):
    """A refusal or failure reported to the user as a readable message, without a traceback."""
