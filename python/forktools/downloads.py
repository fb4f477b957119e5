"""Getting files: pip downloads of pinned packages, HTTP downloads with a time limit, and sha256
checks. The lowest layer of the fetching modules (upstream, sources, github), importing none."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from forktools import ToolError

# Seconds a download may wait for the server at any one step (connecting, each read).
HTTP_TIMEOUT_S = 60


def sha256_of(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def verify_sha256(path: Path, expected: str, label: str | None = None) -> None:
    """Refuse a file whose sha256 is not the pinned one, naming it and both hashes."""
    actual = sha256_of(path)
    if actual != expected:
        raise ToolError(
            f"sha256 mismatch for {label or path}:\n  expected {expected}\n  actual   {actual}\n"
            "Refusing to use it; delete it and run `nox -s upstream` to fetch it again.")


def pip_download(name: str, version: str, file_name: str, sha256: str, cache: Path, options: list[str],
                 env: dict | None = None) -> None:
    """`pip download --no-deps OPTIONS name==version` into cache/file_name, verified by sha256.
    Downloaded next to the cache so the verified file can be renamed into place atomically."""
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *options, f"{name}=={version}", "-d", scratch]
        print("+", " ".join(command), flush=True)
        result = subprocess.run(command, env={**os.environ, **(env or {})})
        if result.returncode:
            raise ToolError(f"{name}: pip download failed (exit {result.returncode})")
        fetched = Path(scratch) / file_name
        if not fetched.exists():
            raise ToolError(f"{name}: pip produced {sorted(os.listdir(scratch))}, not {file_name}")
        verify_sha256(fetched, sha256, label=f"the downloaded {file_name}")
        os.replace(fetched, cache / file_name)


def http_download(url: str, dest: Path) -> None:
    """Save `url` at dest (following redirects), or raise a ToolError naming the URL and why."""
    print(f"downloading {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response, open(dest, "wb") as file:
            shutil.copyfileobj(response, file, length=1 << 20)
    except urllib.error.HTTPError as err:
        raise ToolError(f"could not download {url}: HTTP {err.code} {str(err.reason).splitlines()[0]}") from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise ToolError(f"could not download {url}: {reason}") from None
