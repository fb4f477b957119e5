#!/usr/bin/env bash
# One call on the GPU machine (no package index there): build the dev wheel from the carried
# upstream cache, install it, run the GPU tests, then the optional steps named in $STEPS.
# Everything is logged under $OUT; the last lines printed are a short summary.
#
#   STEPS="tests mutation bench" bash benchmarks/gpu_session.sh
#
# Steps: tests (all GPU tests, or the files / -k in $PYTEST_ARGS), mutation (V steps densely: the permuted-list tests must fail),
# bench (benchmarks/bench_sparse.py on $BENCH_SHAPES), fullbench (the whole matrix), fa4 (the
# stage-4 tests), crossover (FA-2 vs FA-4 as query rows grow), sanitize, reliability, profile
# (benchmarks/profile_decode.py, then ncu on the decode kernels unless PROFILE_NCU=0), variants
# (each diff in $VARIANTS, an experiment over this commit's patched tree, built as a mutant
# wheel, then its GPU tests and profile_decode: a same-run comparison with the profile step;
# make one with `PYTHONPATH=python python -m forktools variant BRANCH -o .carry/variants/BRANCH.diff`;
# the branch's changed test files, copied into .carry/variants/BRANCH.tests/, replace main's for its tests;
# VARIANT_TESTS="NAME ..." runs the tests of those variants only ("none": timing only; default all)),
# sweep (profile_decode.py --split-sweep $SWEEP_ARGS: every split count at 1/4 and 1/16 beside the heuristic's pick),
# profile-fa4 (the profile step's per-kernel times and split table on FA-4's SM90 kernel, then
# ncu on that kernel at B8 Sq16 1/16; needs the CuTe-DSL runtime),
# ncu-dense (counters of the sparse kernel with every block listed beside upstream's dense kernel),
# ncu-source (that kernel's per-SASS-instruction counters and stall samples, for the hot spots),
# ncu-spec (the same for the union pass and the one-launch speculative call at B8 Sq16 1/16, the
# kernels side by side: their difference is the one tile per list that crosses the diagonal).
# fa4-prefill-check (benchmarks/fa4_prefill_check.py: FA-4 prefill with every block listed, dense,
# upstream-form lists and this API, on this flash-attn-4, on variant wheels in .carry/fa4variants/NAME/
# and on the pristine release if carried in .carry/fa4pristine).
#
# The summary names the commit from .commit (git-ignored): `git rev-parse --short HEAD > .commit`
# and carry it with the upstream cache, e.g. carry [".cache/upstream", ".commit"].
#
# The CuTe-DSL runtime (flash-attn-4's, for the Hopper backend) comes in two parts made by
# ../shared/gpu/cutedsl-runtime/make-parts.sh into .carry/cutedsl: carry part1 in one call and
# part2 in the next (within 30 s, while /tmp survives); this script unpacks whichever it finds
# and lays the patched flash-attn-4 wheel over the unpacked one.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session-out}
STEPS=${STEPS:-tests}
BENCH_SHAPES=${BENCH_SHAPES:-B8 Sq16}
mkdir -p "$OUT"
# What comes back is a few files: summary.txt, logs.tar.gz, the wheel, bench.md / bench.json.
LOGS="$OUT/logs"
mkdir -p "$LOGS"
trap 'tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$LOGS"' EXIT
trap 'exit 124' TERM
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() { echo "== $(date +%T) $*"; }

step machine
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$LOGS/gpu.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOGS/gpu.txt"
note "commit $(cat .commit 2>/dev/null || echo unknown), $(date -u +%F), $(head -2 "$LOGS/gpu.txt" | tail -1)"

if [ -f .carry/cutedsl/part1/unpack.sh ]; then
    step "cutedsl part 1"
    bash .carry/cutedsl/part1/unpack.sh > "$LOGS/cutedsl1.log" 2>&1 && note "cutedsl part 1: unpacked" || note "cutedsl part 1: FAILED"
fi
CUTEDSL_PATH=""
if [ -f .carry/cutedsl/part2/unpack.sh ]; then
    step "cutedsl part 2"
    if bash .carry/cutedsl/part2/unpack.sh > "$LOGS/cutedsl2.log" 2>&1; then
        CUTEDSL_PATH=/tmp/cutedsl/site:/tmp/cutedsl/site/nvidia_cutlass_dsl/dsl_packages
        note "cutedsl part 2: unpacked"
    else
        note "cutedsl part 2: FAILED ($(tail -1 "$LOGS/cutedsl2.log"))"
    fi
fi
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/cutedsl-cache

step build
start=$(date +%s)
# INSTALL_WHEEL=TAR skips the build and installs the wheel in TAR (a variant's, as the variants
# step returns it), for benchmarks of a build whose tests already ran. Otherwise a wheel carried
# back from an earlier call (.carry/wheel/dist-wheel.tar, as $OUT returns it) is reused when its
# label (the hash of the patched tree and build profile) is this commit's.
# REUSE_FA2_WHEEL=1 installs the carried flash-attn wheel (.carry/wheel/dist-wheel.tar) without
# a build, builds only flash-attn-4's wheel (seconds) and puts this checkout's python/ first on
# the path: for a commit whose flash-attn patches and overlay C++ are the wheel's (check
# `git diff --stat WHEEL_COMMIT -- patches/flash-attn patches/overlay` first; run 58 did this by
# hand). Saves the ~190 s build of an FA-4-only change. Carry the upstream cache, the wheel and
# runtime part 2 in the second call (part 1 alone in the first: together they pass 64 MiB).
SOURCE_PYTHON=""
check_upstream_cache() {
    PYTHONPATH=python python3 -m forktools upstream --offline > "$LOGS/upstream.log" 2>&1 || { note "upstream cache: FAILED"; cat "$LOGS/upstream.log"; exit 1; }
}
if [ -n "${INSTALL_WHEEL:-}" ]; then
    mkdir -p /tmp/given-wheel && tar xf "$INSTALL_WHEEL" -C /tmp/given-wheel
    wheel=$(ls /tmp/given-wheel/flash_attn-*.whl | head -1)
    note "wheel given: $(basename "$wheel") (no build)"
elif [ -n "${REUSE_FA2_WHEEL:-}" ]; then
    mkdir -p /tmp/given-wheel && tar xf .carry/wheel/dist-wheel.tar -C /tmp/given-wheel
    wheel=$(ls /tmp/given-wheel/flash_attn-*.whl | head -1)
    check_upstream_cache
    PYTHONPATH=python python3 -m forktools build --fa4-only > "$LOGS/build.log" 2>&1 || { note "flash-attn-4 wheel: FAILED"; cat "$LOGS/build.log"; exit 1; }
    SOURCE_PYTHON=$PWD/python
    note "wheel reused: $(basename "$wheel") (no build); flash-attn-4 wheel built here; python/ first on the path"
else
    if [ -f .carry/wheel/dist-wheel.tar ]; then mkdir -p dist && tar xf .carry/wheel/dist-wheel.tar -C dist; fi
    check_upstream_cache
    PYTHONPATH=python python3 -m forktools build --profile dev --jobs "$(nproc)" --reuse 2>&1 | tee "$LOGS/build.log" | grep -v '^  \[' || true
    cp build/logs/build-dev.log "$LOGS/build-full.log" 2>/dev/null
    wheel=$(ls -t dist/flash_attn-*.whl 2>/dev/null | grep -v mutant | head -1)
    [ -n "$wheel" ] || { note "build: FAILED (see build-full.log)"; tail -50 build/logs/build-dev.log; exit 1; }
    note "build: $(grep -o 'in [0-9]* s' "$LOGS/build.log" | tail -1) (wall $(( $(date +%s) - start )) s incl. re-lay), $(basename "$wheel"), $(du -m "$wheel" | cut -f1) MB"
fi
rm -rf /tmp/site && python3 -m pip install -q --no-deps --no-index --target /tmp/site "$wheel" || { note "install: FAILED"; exit 1; }
export PYTHONPATH=${SOURCE_PYTHON:+$SOURCE_PYTHON:}${CUTEDSL_PATH:+$CUTEDSL_PATH:}/tmp/site
# A flash-attn-4 wheel laid over the runtime's (this build's, or a variant's in fa4-prefill-check).
lay_fa4_wheel() { python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/cutedsl/site "$1"; }
fa4_wheel=$(ls -t dist/flash_attn_4-*.whl 2>/dev/null | head -1)
if [ -n "$CUTEDSL_PATH" ]; then  # flash-attn-4 with the stage-4 patches over upstream's
    lay_fa4_wheel "$fa4_wheel" && note "flash-attn-4: $(basename "$fa4_wheel")" || note "flash-attn-4 install: FAILED"
fi
python3 -c "import flash_attn_sparse.fa4 as f; print('FA-4 backend:', f.missing_runtime() or 'available')" 2>&1 | tail -1 | tee -a "$SUMMARY"
if [ -n "$CUTEDSL_PATH" ]; then  # where the CuTe-DSL pieces come from, and any import error in full
    python3 -m pip list 2>/dev/null | grep -iE "cutlass|quack|flash|tvm|dlpack" > "$LOGS/cutedsl-packages.txt"
    python3 -c "import flash_attn_sparse.fa4 as f, quack, cutlass; print('quack', quack.__file__, 'cutlass', cutlass.__file__); f.import_cute('interface')" > "$LOGS/cutedsl-import.log" 2>&1
fi
tar cf "$OUT/dist-wheel.tar" -C "$(dirname "$wheel")" "$(basename "$wheel")"  # "+" in the name does not come back; reuse: untar into dist/

run_tests() {  # name, pytest args...
    local name=$1; shift
    step "pytest $name"
    timeout "${PYTEST_TIMEOUT:-900}" python3 -m pytest -p no:cacheprovider -q -rfE --junitxml="$LOGS/junit-$name.xml" "$@" > "$LOGS/pytest-$name.log" 2>&1
    note "pytest $name: $(tail -1 "$LOGS/pytest-$name.log")"
}

ncu_sections() {  # log name, title, summary file, kernel regex, launches to skip, profile_decode.py args...:
    # two launches' speed-of-light, occupancy, stall and memory sections, their key lines summarised
    local name=$1 title=$2 summary=$3 kernels=$4 skip=$5; shift 5
    timeout 200 ncu --clock-control none -k regex:"$kernels" --launch-skip "$skip" --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/profile_decode.py "$@" > "$LOGS/$name.txt" 2>&1
    { echo "### ncu $title"; grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Block Limit|Waves Per SM|Grid Size|Dynamic Shared|Stall|Issue Slots|SM Busy|Executed Ipc|L2 Hit|Eligible Warps" "$LOGS/$name.txt"; } >> "$summary"
}

ncu_sass() {  # name, kernels to profile, profile_decode.py args...: ncu --set full, the report and its per-SASS CSV
    local name=$1 count=$2; shift 2
    step "ncu $name"
    timeout 300 ncu --set full --clock-control none -k regex:flash_fwd_sparse_kernel --launch-skip 2 --launch-count "$count" \
        -o "$OUT/$name" python3 benchmarks/profile_decode.py "$@" > "$LOGS/ncu-$name.log" 2>&1
    ncu --import "$OUT/$name.ncu-rep" --page source --print-source sass --csv > "$LOGS/$name-sass.csv" 2>&1 \
        && gzip -c "$LOGS/$name-sass.csv" > "$OUT/$name-sass.csv.gz"
    ncu --import "$OUT/$name.ncu-rep" --page details --csv > "$OUT/$name-details.csv" 2>&1  # readable without ncu
    note "ncu $name: $(ls -s "$OUT/$name.ncu-rep" 2>/dev/null | cut -d' ' -f1) KB report, $(wc -l < "$LOGS/$name-sass.csv") SASS lines"
}

for s in $STEPS; do
    case $s in
    tests)  # every GPU test, or those $PYTEST_ARGS names (files, -k), within $PYTEST_TIMEOUT s (default 900)
        run_tests gpu -m "gpu" ${PYTEST_ARGS:-tests} ;;
    mutation)
        step mutation
        PYTHONPATH=python python3 -m forktools build --profile dev --jobs "$(nproc)" \
            --mutation tests/mutations/v-steps-densely.patch > "$LOGS/mutation-build.log" 2>&1
        mutant=$(ls -t dist/flash_attn-*mutant*.whl 2>/dev/null | head -1)
        [ -n "$mutant" ] || { note "mutation build: FAILED"; continue; }
        note "mutation build: $(grep -o 'in [0-9]* s' "$LOGS/mutation-build.log" | tail -1)"
        rm -rf /tmp/site-mutant && python3 -m pip install -q --no-deps --no-index --target /tmp/site-mutant "$mutant"
        PYTHONPATH=/tmp/site-mutant run_tests mutant tests/test_stage3_sparse_fa2.py -k "permuted or tail_block_in_the_middle" ;;
    sanitize)
        step sanitize
        timeout 300 python3 tests/sanitize.py > "$LOGS/sanitize.log" 2>&1
        note "sanitize: $(tr '\n' ';' < "$LOGS/sanitize.log")" ;;
    reliability)
        run_tests reliability tests/test_reliability_gpu.py ;;
    fa4)
        run_tests fa4 tests/test_stage4_fa4.py ;;
    bench)
        step bench
        timeout 600 python3 benchmarks/bench_sparse.py --shapes "$BENCH_SHAPES" ${BENCH_METHODS:+--methods "$BENCH_METHODS"} --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$LOGS/bench.log" 2>&1
        note "bench: $(wc -l < "$OUT/bench.md" 2>/dev/null) lines in bench.md" ;;
    crossover)
        step crossover
        timeout 600 python3 benchmarks/bench_sparse.py --shapes crossover --methods fa2_sparse,fa4_sparse,auto \
            --json "$OUT/crossover.json" --markdown "$OUT/crossover.md" > "$LOGS/crossover.log" 2>&1
        note "crossover: $(wc -l < "$OUT/crossover.md" 2>/dev/null) lines in crossover.md" ;;
    profile)
        step profile
        timeout 300 python3 benchmarks/profile_decode.py > "$OUT/profile.txt" 2>&1
        [ "${PROFILE_NCU:-1}" = 0 ] && { note "profile: $(wc -l < "$OUT/profile.txt") lines in profile.txt"; continue; }
        for target in "B8 Sq16" "B8 Sq1 " "B1 Sq1"; do  # "B8 Sq1 ": not a prefix of "B8 Sq16"
            ncu_sections "ncu-${target// /_}" "$target" "$OUT/profile.txt" "flash_fwd_sparse|combine" 6 --ncu-target "$target"
        done
        note "profile: $(wc -l < "$OUT/profile.txt") lines in profile.txt" ;;
    profile-fa4)
        step profile-fa4
        timeout 300 python3 benchmarks/profile_decode.py --backend fa4 > "$OUT/profile-fa4.txt" 2>&1
        ncu_sections ncu-fa4-B8_Sq16 "fa4 B8 Sq16" "$OUT/profile-fa4.txt" "FlashAttentionForwardSm90|FlashAttentionForwardCombine" 4 \
            --backend fa4 --ncu-target "B8 Sq16"
        note "profile-fa4: $(wc -l < "$OUT/profile-fa4.txt") lines in profile-fa4.txt" ;;
    sweep)
        step sweep
        timeout 300 python3 benchmarks/profile_decode.py --split-sweep ${SWEEP_ARGS:-} > "$OUT/sweep.txt" 2>&1
        note "sweep: $(grep -c '^##' "$OUT/sweep.txt") shapes" ;;
    variants)
        for diff in $VARIANTS; do
            name=$(basename "$diff" .diff)
            step "variant $name"
            start=$(date +%s)
            PYTHONPATH=python python3 -m forktools build --profile dev --jobs "$(nproc)" --mutation "$diff" > "$LOGS/variant-$name-build.log" 2>&1
            mutant=$(ls -t dist/flash_attn-*mutant*.whl 2>/dev/null | head -1)
            [ -n "$mutant" ] || { note "variant $name build: FAILED"; tail -30 build/logs/build-dev.log; continue; }
            note "variant $name build: $(( $(date +%s) - start )) s"
            tar cf "$OUT/variant-$name-wheel.tar" -C "$(dirname "$mutant")" "$(basename "$mutant")"  # for INSTALL_WHEEL
            rm -rf "/tmp/site-$name" && python3 -m pip install -q --no-deps --no-index --target "/tmp/site-$name" "$mutant"
            PYTHONPATH=/tmp/site-$name timeout 300 python3 benchmarks/profile_decode.py > "$OUT/profile-$name.txt" 2>&1
            note "variant $name profile: $(wc -l < "$OUT/profile-$name.txt") lines"
            case " ${VARIANT_TESTS:-all} " in *" all "*|*" $name "*) ;; *) note "variant $name tests: not run (not in VARIANT_TESTS)"; continue ;; esac
            # The branch's own test files, if carried beside the diff (NAME.tests/), replace main's for this run.
            if [ -d "${diff%.diff}.tests" ]; then
                rm -rf /tmp/tests-main && cp -r tests /tmp/tests-main && cp "${diff%.diff}.tests"/* tests/
            fi
            PYTHONPATH=/tmp/site-$name run_tests "variant-$name" tests -m gpu
            [ -d /tmp/tests-main ] && rm -rf tests && mv /tmp/tests-main tests
        done ;;
    ncu-dense)  # the sparse kernel with every block listed vs upstream's dense one, same shape: counters side by side
        step ncu-dense
        for target_ in ${NCU_TARGETS:-B8_Sq1 B1_Sq1}; do
            target=${target_//_/ }
            timeout 200 ncu --clock-control none -k regex:"flash_fwd_sparse_kernel|flash_fwd_splitkv_kernel|flash_fwd_kernel" --launch-skip 2 --launch-count 2 \
                --csv --metrics "$(tr -s ' \n' ',' < benchmarks/ncu_metrics.txt | sed 's/,$//')" \
                python3 benchmarks/profile_decode.py --ncu-target "$target" --ncu-dense > "$LOGS/ncu-dense-${target// /_}.csv" 2>&1
            { echo "### ncu dense $target"; python3 benchmarks/ncu_table.py "$LOGS/ncu-dense-${target// /_}.csv"; } >> "$OUT/ncu-dense.txt" 2>&1
        done
        note "ncu-dense: $(wc -l < "$OUT/ncu-dense.txt") lines" ;;
    ncu-source)  # per-instruction (SASS) counters and stall samples of the sparse kernel, every block listed, B1 Sq1 Sk128k
        ncu_sass sparse-dense 1 --ncu-target "B1 Sq1" --ncu-dense ;;
    ncu-spec)  # the same for the union pass (launch 2) and the speculative call (launch 3), B8 Sq16 1/16
        ncu_sass spec 2 --ncu-target "B8 Sq16" --ncu-speculative ;;
    fa4-prefill-check)  # benchmarks/fa4_prefill_check.py on this flash-attn-4, then on each wheel in
        # .carry/fa4variants/NAME/ (label NAME) and on the pristine release if carried in
        # .carry/fa4pristine (`pip wheel --no-deps` of the upstream sdist); each with its own kernel cache
        step fa4-prefill-check
        check="$OUT/fa4-prefill-check.txt"
        timeout 150 python3 benchmarks/fa4_prefill_check.py > "$check" 2>"$LOGS/fa4-prefill-check.log"
        for other_fa4 in .carry/fa4variants/*/flash_attn_4-*.whl .carry/fa4pristine/flash_attn_4-*.whl; do
            [ -f "$other_fa4" ] || continue
            name=$(basename "$(dirname "$other_fa4")"); flags="--label $name"
            [ "$name" = fa4pristine ] && flags="--pristine"
            lay_fa4_wheel "$other_fa4" \
                && FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/cutedsl-cache-$name timeout 150 python3 benchmarks/fa4_prefill_check.py $flags \
                    >> "$check" 2>>"$LOGS/fa4-prefill-check.log"
        done
        lay_fa4_wheel "$fa4_wheel"
        note "fa4-prefill-check: $(grep -c ' ms ' "$check") rows" ;;
    fullbench)
        step fullbench
        timeout 900 python3 benchmarks/bench_sparse.py ${BENCH_METHODS:+--methods "$BENCH_METHODS"} --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$LOGS/bench.log" 2>&1
        note "fullbench: done" ;;
    esac
done
echo "== summary"
cat "$SUMMARY"
