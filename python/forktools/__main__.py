"""Command line: `python -m forktools <command> [args]` (PYTHONPATH=python); nox wraps each."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from forktools import ToolError, build, build_fa3, gpu, series, stages, upstream, variant, wheel_fa4
from forktools.layout import Layout, checkout_root

REPO_ROOT = checkout_root()


def _upstream(layout: Layout, args: argparse.Namespace) -> int:
    for name, tree in args.trees:
        upstream.record_tree(layout, name, tree)
    upstream.fetch(layout, offline=args.offline, mirror=args.mirror)
    return 0


def _apply(layout: Layout, args: argparse.Namespace) -> int:
    series.apply(layout, force=args.force, use_git=False if args.no_git else None)
    return 0


def _export(layout: Layout, args: argparse.Namespace) -> int:
    series.export(layout)
    return 0


def _check_patches(layout: Layout, args: argparse.Namespace) -> int:
    series.check(layout)
    return 0


def _variant(layout: Layout, args: argparse.Namespace) -> int:
    text = variant.diff(layout, args.branch, base=args.base, name=args.upstream)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_bytes(text)
        print(f"variant: {args.output} ({args.branch} over {args.base}, {text.count(b'diff --git')} files)")
    else:
        sys.stdout.buffer.write(text)
    return 0


def _build(layout: Layout, args: argparse.Namespace) -> int:
    upstream.fetch(layout)  # whatever the cache lacks, so that one command sets everything up
    if args.fa4_only:
        wheel_fa4.build(layout)
        return 0
    if args.fa3_only:
        foreign = [m for m in args.mutations if not build_fa3.is_mutation_of_fa3(m)]
        if foreign:
            raise ToolError(f"--fa3-only takes mutations of hopper/ only, not {', '.join(map(str, foreign))}")
        build_fa3.build(layout, profile=args.profile, jobs=args.jobs, reuse=args.reuse, mutations=args.mutations)
        return 0
    archs = args.archs or [a for a in os.environ.get("FLASH_ATTN_SPARSE_ARCH", "").split(",") if a] or None
    build.build(layout, profile=args.profile, archs=archs, jobs=args.jobs, reuse=args.reuse,
                mutations=args.mutations, install=args.install, fa3=not args.no_fa3)
    return 0


def _review(layout: Layout, args: argparse.Namespace) -> int:
    return stages.review(layout, args.stage)


BUILD_OPTIONS = ("--profile", "--arch", "--jobs", "--reuse", "--mutation", "--fa4-only", "--fa3-only", "--install")


def _test(layout: Layout, args: argparse.Namespace) -> int:
    # `nox -s build test -- --arch 80` hands --arch to this session too: say how to spell it.
    misplaced = [a for a in args.pytest_args if a.split("=")[0] in BUILD_OPTIONS]
    if misplaced:
        raise ToolError(f"{' '.join(misplaced)} is a build option, not pytest's: use FLASH_ATTN_SPARSE_PROFILE, "
                        "FLASH_ATTN_SPARSE_ARCH (e.g. 80,90) or FLASH_ATTN_SPARSE_JOBS, as in "
                        "`FLASH_ATTN_SPARSE_ARCH=80 nox -s build test`")
    return stages.run_pytest(layout, args.pytest_args)


def _name_and_path(text: str) -> tuple[str, str]:
    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m forktools", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    command = commands.add_parser("upstream", help="fetch and verify the pinned upstream sdists, trees and wheels "
                                                   "(GitHub trees from $FORKTOOLS_GITHUB_URL, default https://github.com)")
    command.add_argument("--offline", action="store_true", help="never download; only verify the cache")
    command.add_argument("--tree", dest="trees", action="append", default=[], type=_name_and_path,
                         metavar="NAME=PATH", help="use this source tree of the pinned release instead")
    command.add_argument("--mirror", type=Path, metavar="DIR",
                         help="offline mirror folder holding the pinned GitHub tree archives "
                              "(default $FORKTOOLS_UPSTREAM_MIRROR; else they are downloaded)")
    command.set_defaults(run=_upstream)

    command = commands.add_parser("apply", help="build build/trees/<name> from the upstreams and patches/")
    command.add_argument("--force", action="store_true", help="discard existing trees, whatever they hold")
    command.add_argument("--no-git", action="store_true", help="plain patched copies, no git repos")
    command.set_defaults(run=_apply)

    command = commands.add_parser("export", help="write patches/ from the commits in build/trees")
    command.set_defaults(run=_export)

    command = commands.add_parser("check-patches", help="check patches/ against the lock and the trees")
    command.set_defaults(run=_check_patches)

    # Defaults from the environment, so that `FLASH_ATTN_SPARSE_ARCH=80 nox -s build test` works:
    # nox gives posargs to every session, and pytest would reject --arch.
    command = commands.add_parser("build", help="build wheels into dist/")
    command.add_argument("--profile", choices=["dev", "full"], default=os.environ.get("FLASH_ATTN_SPARSE_PROFILE", "dev"),
                         help="default $FLASH_ATTN_SPARSE_PROFILE, else dev")
    command.add_argument("--arch", dest="archs", action="append", metavar="SM",
                         help="CUDA compute capability, e.g. 90; repeatable (default $FLASH_ATTN_SPARSE_ARCH, "
                              "comma-separated, else the profile's)")
    command.add_argument("--jobs", type=int, metavar="N", default=os.environ.get("FLASH_ATTN_SPARSE_JOBS"),
                         help="parallel compile jobs (default $FLASH_ATTN_SPARSE_JOBS, else one per CPU)")
    command.add_argument("--reuse", action="store_true", help="return the wheel in dist/ if this exact source was built")
    command.add_argument("--mutation", dest="mutations", action="append", default=[], type=Path, metavar="PATCH",
                         help="apply a defect on top, to check that the tests catch it (tests/mutations/)")
    command.add_argument("--install", action="store_true", help="pip-install the wheel into this Python afterwards")
    command.add_argument("--no-fa3", action="store_true", help="skip the FA-3 (flash_attn_3) wheel")
    command.add_argument("--fa4-only", action="store_true",
                         help="only the patched flash-attn-4 wheel (pure Python, seconds), e.g. beside a carried flash-attn one")
    command.add_argument("--fa3-only", action="store_true",
                         help="only the FA-3 (flash_attn_3) wheel, e.g. beside a carried flash-attn one (with --mutation: hopper/ diffs)")
    command.set_defaults(run=_build)

    command = commands.add_parser("variant", help="a branch as a diff over the base's patched tree (for build --mutation)")
    command.add_argument("branch", help="the experiment's branch or commit")
    command.add_argument("--base", default="HEAD", help="what it is measured against (default HEAD)")
    command.add_argument("--upstream", default="flash-attn", metavar="NAME",
                         help="whose patched tree, a name of upstream/lock.toml (flash-attn-3: a hopper/ diff for "
                              "the fa3-variants step and build --fa3-only)")
    command.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the diff here, not to stdout")
    command.set_defaults(run=_variant)

    command = commands.add_parser("review", help="show a stage's notes and patches, run its tests")
    command.add_argument("stage", type=int, metavar="N")
    command.set_defaults(run=_review)

    gpu.add_parser(commands)

    # No options of its own, not even -h: everything after `test` goes to pytest.
    command = commands.add_parser("test", help="run pytest from the repo root", add_help=False)
    command.set_defaults(run=_test)
    return parser


def main(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    try:
        return run(argv, root)
    except ToolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def run(argv: list[str] | None = None, root: Path = REPO_ROOT) -> int:
    """main() without its error handling: a refusal raises ToolError (nox reports it itself)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "test":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    return args.run(Layout.at(root), args)


if __name__ == "__main__":
    sys.exit(main())
