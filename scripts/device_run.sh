#!/usr/bin/env bash
# The one device command: check and bench from a bundle on the lent GPU, full results to $OUT.
#   here:  forgekernel bundle .bundle
#   GPU:   bash scripts/device_run.sh [op ...]      (carry .bundle)
# Then copy $OUT/results/<arch>/<op>.json into benchmarks/results/ and the reports into
# benchmarks/reports/ (scripts/take_results.sh does it) and commit them with the kernel.
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
mkdir -p "$OUT/results" "$OUT/reports"
export FORGEKERNEL_RESULTS_DIR="$OUT/results"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
export FORGEKERNEL_SITE=/tmp/forgekernel-site
timeout 120 bash .bundle/run.sh selftest 2>&1 | tee "$OUT/selftest.log"
timeout "${CHECK_TIMEOUT:-240}" bash .bundle/run.sh check "$@" 2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" bash .bundle/run.sh bench --report-dir "$OUT/reports" "$@" \
  2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "check rc=$check_rc bench rc=$bench_rc"
