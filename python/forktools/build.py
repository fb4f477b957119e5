"""Build wheels of the patched upstreams from the applied trees (build/trees/<name>) into dist/.

Not written yet: only the entry point the CLI and nox call is fixed here.
"""

from __future__ import annotations

from forktools.layout import Layout


def build(layout: Layout, profile: str = "dev", archs: list[str] | None = None,
          jobs: int | None = None, reuse: bool = False) -> None:
    """Build the wheels of the patched upstreams into layout.root / "dist".

    profile: "dev" (a narrow build: few head dims and features, fast to compile) or "full".
    archs: CUDA compute capabilities to compile for, e.g. ["90"]; None for the profile's default.
    jobs: parallel compile jobs; None for one per CPU.
    reuse: build in the existing trees and keep earlier compile outputs instead of re-applying
        the series and starting clean.
    """
    raise NotImplementedError("forktools build is not written yet")
