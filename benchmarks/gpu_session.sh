#!/usr/bin/env bash
# On the GPU machine: unpack the CuTe-DSL runtime (FA-4's) carried in .carry/cutedsl, then run
# `python -m forktools gpu` with the arguments given (`--list` shows the steps), e.g.
#
#   bash benchmarks/gpu_session.sh tests mutation bench --bench-shapes decode
#
# The runtime comes in two parts made by ../shared/gpu/cutedsl-runtime/make-parts.sh: carry part1
# in one call and part2 in the next (within 30 s, while /tmp survives); their unpack.sh scripts
# are shell, so this wrapper stays. The summary names the commit in .commit (git-ignored):
# `git rev-parse --short HEAD > .commit`, carried with the upstream cache.
#
# A call carries at most 64 MiB, the working tree (about 8 MB) included. Built wheels come back in
# $OUT (dist-wheel.tar, dist-fa3-wheel.tar); laid in .carry/wheel/ they skip the build while the
# labels match. The runtime parts, both wheels, .carry/fa4pristine, .cache/upstream and .commit do
# not fit two calls whole; a warm machine keeps ignored files between calls, so the cache may go
# file by file (runs 172-178). `PYTHONPATH=python python -m forktools carry-plan [--no-fa4]` prints
# each call's carry list from the sizes at hand. The flash-attn wheel's label also hashes python/
# (the wheel ships flash_attn_sparse), so after a Python-only change pass --reuse-fa2-wheel:
# the carried wheels are installed unbuilt (FA-3's when its label is this commit's) and python/
# goes first on the path; without it such a change rebuilds FA-2 (184 s, run 115).
# The runner stops its own work 560 s after it starts (--deadline-s), so that its summary and
# logs.tar.gz come back before the device tool's 600 s limit; pass a smaller --deadline-s with a
# smaller timeout_s.
set -uo pipefail
out=${OUT:-/tmp/gpu-session-out}
mkdir -p "$out/logs"
runtime=()
site=/tmp/cutedsl/site
if [ -f "$site/nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so" ]; then
    # A warm machine keeps /tmp: an earlier call's runtime is whole (part 2 moves part 1's file in).
    echo "cutedsl: unpacked by an earlier call in $site"
    runtime=(--cutedsl-site "$site")
else
    for part in 1 2; do
        [ -f ".carry/cutedsl/part$part/unpack.sh" ] || continue
        if bash ".carry/cutedsl/part$part/unpack.sh" > "$out/logs/cutedsl$part.log" 2>&1; then
            echo "cutedsl part $part: unpacked"
            [ "$part" = 2 ] && runtime=(--cutedsl-site "$site")
        else
            echo "cutedsl part $part: FAILED ($(tail -1 "$out/logs/cutedsl$part.log"))"
        fi
    done
fi
PYTHONPATH=python exec python3 -m forktools gpu --out "$out" "${runtime[@]}" "$@"
