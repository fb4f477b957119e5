#!/usr/bin/env bash
# One call on the GPU machine (no package index there): build the dev wheel from the carried
# upstream cache, install it, run the GPU tests, then the optional steps named in $STEPS.
# Everything is logged under $OUT; the last lines printed are a short summary.
#
#   STEPS="tests mutation bench" bash benchmarks/gpu_session.sh
#
# Steps: tests (all GPU tests), mutation (V steps densely: the permuted-list tests must fail),
# bench (benchmarks/bench_sparse.py --quick), fullbench (the whole matrix).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session-out}
STEPS=${STEPS:-tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
step() { echo "== $(date +%T) $*"; }

step machine
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
note "commit $(cat .commit 2>/dev/null || echo unknown), $(date -u +%F), $(head -2 "$OUT/gpu.txt" | tail -1)"

step build
start=$(date +%s)
PYTHONPATH=python python3 -m forktools upstream --offline > "$OUT/upstream.log" 2>&1 || { note "upstream cache: FAILED"; cat "$OUT/upstream.log"; exit 1; }
PYTHONPATH=python python3 -m forktools build --profile dev --jobs "$(nproc)" --reuse 2>&1 | tee "$OUT/build.log" | grep -v '^  \[' || true
cp build/logs/build-dev.log "$OUT/build-full.log" 2>/dev/null
wheel=$(ls -t dist/flash_attn-*.whl 2>/dev/null | grep -v mutant | head -1)
[ -n "$wheel" ] || { note "build: FAILED (see build-full.log)"; tail -50 build/logs/build-dev.log; exit 1; }
note "build: $(grep -o 'in [0-9]* s' "$OUT/build.log" | tail -1) (wall $(( $(date +%s) - start )) s incl. re-lay), $(basename "$wheel"), $(du -m "$wheel" | cut -f1) MB"
rm -rf /tmp/site && python3 -m pip install -q --no-deps --no-index --target /tmp/site "$wheel" || { note "install: FAILED"; exit 1; }
export PYTHONPATH=/tmp/site
split -b 15M -d "$wheel" "$OUT/wheel.part"

run_tests() {  # name, pytest args...
    local name=$1; shift
    step "pytest $name"
    timeout 900 python3 -m pytest -p no:cacheprovider -q -rfE --junitxml="$OUT/junit-$name.xml" "$@" > "$OUT/pytest-$name.log" 2>&1
    note "pytest $name: $(tail -1 "$OUT/pytest-$name.log")"
}

for s in $STEPS; do
    case $s in
    tests)
        run_tests gpu tests -m "gpu" ;;
    mutation)
        step mutation
        PYTHONPATH=python python3 -m forktools build --profile dev --jobs "$(nproc)" \
            --mutation tests/mutations/v-steps-densely.patch > "$OUT/mutation-build.log" 2>&1
        mutant=$(ls -t dist/flash_attn-*mutant*.whl 2>/dev/null | head -1)
        [ -n "$mutant" ] || { note "mutation build: FAILED"; continue; }
        note "mutation build: $(grep -o 'in [0-9]* s' "$OUT/mutation-build.log" | tail -1)"
        rm -rf /tmp/site-mutant && python3 -m pip install -q --no-deps --no-index --target /tmp/site-mutant "$mutant"
        PYTHONPATH=/tmp/site-mutant run_tests mutant tests/test_stage3_sparse_fa2.py -k "permuted or tail_block_in_the_middle" ;;
    bench)
        step bench
        timeout 600 python3 benchmarks/bench_sparse.py --quick --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
        note "bench: $(tail -n +3 "$OUT/bench.md" 2>/dev/null | tr '\n' ';')" ;;
    fullbench)
        step fullbench
        timeout 900 python3 benchmarks/bench_sparse.py --json "$OUT/bench.json" --markdown "$OUT/bench.md" > "$OUT/bench.log" 2>&1
        note "fullbench: done" ;;
    esac
done
echo "== summary"
cat "$SUMMARY"
