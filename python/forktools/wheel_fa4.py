"""Build the patched flash-attn-4 wheel (pure Python) into dist/.

flash-attn-4's own build takes its version from git tags through setuptools-scm, which neither a
source tree of the sdist nor a machine without a package index provides. Its wheel is only the
package's Python files under flash_attn/cute/ plus metadata, so it is written directly: the
sdist's PKG-INFO (version given a local label naming the stage-4 patches), a WHEEL file and a
RECORD. Entries are sorted and dated 1980-01-01, so the same series gives the same bytes.
"""

from __future__ import annotations

import base64
import hashlib
import re
import tempfile
import zipfile
from pathlib import Path

from forktools import series
from forktools.layout import Layout

UPSTREAM = "flash-attn-4"
PACKAGE_DIR = "flash_attn/cute"
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def label(layout: Layout) -> str:
    """`sparse.<hash>` of the lock, the series and the flash-attn-4 patches."""
    digest = hashlib.sha256()
    for path in [layout.lock, layout.series, *sorted((layout.patches / UPSTREAM).glob("*.patch"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"sparse.{digest.hexdigest()[:10]}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build(layout: Layout) -> Path:
    """Write dist/flash_attn_4-<version>+<label>-py3-none-any.whl and return its path."""
    with tempfile.TemporaryDirectory(prefix="forktools-fa4-") as scratch:
        tree = Path(scratch) / UPSTREAM
        series.materialize(layout, UPSTREAM, tree)
        pkg_info = (tree / "PKG-INFO").read_text()
        version = re.search(r"^Version: (\S+)$", pkg_info, re.M)[1] + "+" + label(layout)
        metadata = re.sub(r"^Version: \S+$", f"Version: {version}", pkg_info, count=1, flags=re.M)
        dist_info = f"flash_attn_4-{version}.dist-info"
        files = {f"{PACKAGE_DIR}/{p.name}": p.read_bytes() for p in sorted(tree.glob("*.py"))}
        files[f"{dist_info}/METADATA"] = metadata.encode()
        files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: forktools\nRoot-Is-Purelib: true\n"
                                      b"Tag: py3-none-any\n")
        record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
        files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    dist = layout.root / "dist"
    dist.mkdir(exist_ok=True)
    wheel = dist / f"flash_attn_4-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, ZIP_DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    print(f"build: {wheel.relative_to(layout.root)} (flash-attn-4 with the stage-4 patches)")
    return wheel
