"""The set-up's fetch of the GitHub trees, as a user's machine runs it: `forktools upstream` with
an empty cache downloads the repository's archive of the pinned commit from a loopback HTTP
server standing in for GitHub (reached through $FORKTOOLS_GITHUB_URL), checks hopper/ and tests/
by git tree id and caches them; a tampered tree is refused by tree id before anything is cached
or unpacked. The served archive is laid out as GitHub's (one top folder
`flash-attention-<commit>/`), built from the offline mirror's trees."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import io
import os
import shutil
import tarfile
import threading
from pathlib import Path

import pytest

from forktools import ToolError, downloads, github, lockfile, upstream
from forktools.__main__ import main
from forktools.layout import Layout

pytestmark = pytest.mark.tooling
REPO = Path(__file__).resolve().parents[2]
MIRROR = Path(os.environ.get(github.MIRROR_ENV) or REPO.parent / "shared" / "upstream")  # CI's offline mirror
PINS = github.load(REPO / "upstream" / "lock.toml")
needs_mirror = pytest.mark.skipif(not all((MIRROR / pin.archive).is_file() for pin in PINS),
                                  reason=f"the offline mirror of the GitHub trees is not at {MIRROR}")


def github_archive(commit: str, tamper: str | None = None) -> bytes:
    """The repository's archive of `commit` as GitHub serves it (a pax header naming the commit,
    every member under flash-attention-<commit>/), holding the mirror's trees and a README;
    `tamper` names a member whose bytes are changed."""
    top = f"flash-attention-{commit}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": commit}) as out:
        readme = b"# FlashAttention\n"
        info = tarfile.TarInfo(f"{top}/README.md")
        info.size, info.mode, info.mtime = len(readme), 0o664, 1_700_000_000
        out.addfile(info, io.BytesIO(readme))
        for pin in PINS:
            with tarfile.open(MIRROR / pin.archive) as tree:
                for member in tree:
                    data = tree.extractfile(member).read() if member.isfile() else None
                    if member.name == tamper:
                        data += b"\n// tampered\n"
                        member.size = len(data)
                    member.name = f"{top}/{member.name}"
                    member.mtime = 1_700_000_000  # GitHub stamps the commit's time, not the mirror's
                    out.addfile(member, io.BytesIO(data) if data is not None else None)
    return gzip.compress(buffer.getvalue())


@contextlib.contextmanager
def serving(files: dict[str, bytes]):
    """An HTTP server on 127.0.0.1 (a free port) that answers GET of `files`' paths, redirecting
    /<owner>/<repo>/archive/... to /codeload/... as GitHub does; yields (base URL, requested paths)."""
    requested = []

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 10  # seconds a connection may stall

        def do_GET(self):  # noqa: N802 -- http.server's name
            requested.append(self.path)
            if "/archive/" in self.path and not self.path.startswith("/codeload/"):
                self.send_response(302)
                self.send_header("Location", "/codeload" + self.path)
                self.end_headers()
            elif self.path.removeprefix("/codeload") in files:
                body = files[self.path.removeprefix("/codeload")]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requested
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def fresh_clone(tmp_path: Path, monkeypatch) -> Layout:
    """A checkout's upstream/ and patches/ with a cache holding only what pip fetches (the
    sdists and the wheel, copied from this checkout's cache), no mirror, downloads bounded."""
    layout = Layout.at(tmp_path / "clone")
    shutil.copytree(REPO / "upstream", layout.root / "upstream")
    layout.cache.mkdir(parents=True)
    for pin in upstream.load_pins(layout.lock):
        if not pin.composed:
            _copy_from_this_cache(pin.sdist, layout)
    _copy_from_this_cache("nvidia_cutlass-4.2.0.0-py3-none-any.whl", layout)
    monkeypatch.delenv(github.MIRROR_ENV, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(downloads, "HTTP_TIMEOUT_S", 10)
    return layout


def _copy_from_this_cache(name: str, layout: Layout) -> None:
    source = REPO / ".cache" / "upstream" / name
    if not source.is_file():
        pytest.skip(f"{source} is not cached (`nox -s upstream` fetches it)")
    shutil.copyfile(source, layout.cache / name)


def _archive_path(pin: github.GithubTree) -> str:
    return f"/Dao-AILab/flash-attention/archive/{pin.commit}.tar.gz"


@needs_mirror
def test_upstream_downloads_the_commit_archive_and_caches_each_tree_verified(fresh_clone: Layout, monkeypatch, capsys):
    commit = PINS[0].commit
    with serving({_archive_path(PINS[0]): github_archive(commit)}) as (url, requested):
        monkeypatch.setenv(github.URL_ENV, url)
        assert main(["upstream"], root=fresh_clone.root) == 0
    assert requested == [_archive_path(PINS[0]), "/codeload" + _archive_path(PINS[0])]  # one download for both trees
    output = capsys.readouterr().out
    for pin in PINS:
        assert f"{pin.name}: {fresh_clone.cache / pin.archive} verified (tree {pin.tree[:12]} of {pin.path}/), from {url}" in output
        github.check(fresh_clone.cache / pin.archive, pin)
    upstream.unpack(fresh_clone, "flash-attn-3", fresh_clone.root / "fa3")  # the tree the series patches
    assert (fresh_clone.root / "fa3" / "hopper" / "setup.py").is_file()
    assert (fresh_clone.root / "fa3" / "csrc" / "cutlass" / "include" / "cutlass" / "gemm" / "collective" / "builders"
            / "sm90_common.inl").is_file()

    with serving({}) as (url, requested):  # a second run finds everything cached
        monkeypatch.setenv(github.URL_ENV, url)
        assert main(["upstream"], root=fresh_clone.root) == 0
    assert requested == []


@needs_mirror
def test_a_tampered_tree_is_refused_by_tree_id_before_anything_is_cached(fresh_clone: Layout, monkeypatch, capsys):
    hopper = lockfile.named(PINS, "flash-attention-hopper", "github")
    tampered = github_archive(hopper.commit, tamper="hopper/flash_fwd_launch_template.h")
    with serving({_archive_path(hopper): tampered}) as (url, _):
        monkeypatch.setenv(github.URL_ENV, url)
        assert main(["upstream"], root=fresh_clone.root) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"error: flash-attention-hopper: refusing hopper/ from {url}{_archive_path(hopper)}: "
                            "its git tree id is ")
    found = error.split("its git tree id is ")[1].split(",")[0]
    assert len(found) == 40 and found != hopper.tree
    assert error.endswith(f"but upstream/lock.toml pins {hopper.tree} ({hopper.repository} commit {hopper.commit})")
    assert not any((fresh_clone.cache / pin.archive).exists() for pin in PINS)
    assert [p.name for p in fresh_clone.cache.iterdir() if p.name.startswith(".")] == []  # no partial download left


@needs_mirror
def test_a_cached_tree_changed_afterwards_is_refused_before_it_is_unpacked(fresh_clone: Layout):
    hopper = lockfile.named(PINS, "flash-attention-hopper", "github")
    cached = fresh_clone.cache / hopper.archive
    shutil.copyfile(MIRROR / hopper.archive, cached)
    with tarfile.open(cached) as tar:
        members = [(member, tar.extractfile(member).read() if member.isfile() else None) for member in tar]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for member, data in members:
            if member.name == "hopper/setup.py":
                data = data.replace(b"-std=c++17", b"-std=c++14")
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    cached.write_bytes(gzip.compress(buffer.getvalue()))
    with pytest.raises(ToolError, match=f"refusing hopper/ from {cached}: its git tree id is [0-9a-f]{{40}}, "
                                        f"but upstream/lock.toml pins {hopper.tree}"):
        upstream.unpack(fresh_clone, "flash-attn-3", fresh_clone.root / "fa3")
    assert not (fresh_clone.root / "fa3" / "hopper").exists()


def test_the_archive_url_is_the_repository_s_with_its_scheme_and_host_replaceable(monkeypatch):
    pin = PINS[0]
    monkeypatch.delenv(github.URL_ENV, raising=False)
    assert github.archive_url(pin) == f"https://github.com/Dao-AILab/flash-attention/archive/{pin.commit}.tar.gz"
    monkeypatch.setenv(github.URL_ENV, "http://127.0.0.1:8123/")
    assert github.archive_url(pin) == f"http://127.0.0.1:8123/Dao-AILab/flash-attention/archive/{pin.commit}.tar.gz"


def test_an_unreachable_server_fails_with_the_url_and_why(tmp_path, monkeypatch):
    with serving({}) as (url, _):
        pass  # closed: nothing listens on its port any more
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(downloads, "HTTP_TIMEOUT_S", 10)
    with pytest.raises(ToolError, match=f"could not download {url}/x.tar.gz: "):
        downloads.http_download(f"{url}/x.tar.gz", tmp_path / "x.tar.gz")
