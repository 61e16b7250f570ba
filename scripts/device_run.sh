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
export FORGEKERNEL_SITE=/tmp/forgekernel-site
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv; timeout 120 bash .bundle/run.sh selftest; } 2>&1 | tee "$OUT/selftest.log"
timeout "${CHECK_TIMEOUT:-240}" bash .bundle/run.sh check "$@" 2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" bash .bundle/run.sh bench --report-dir "$OUT/reports" "$@" \
  2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "check rc=$check_rc bench rc=$bench_rc"
if [ -n "${SWEEP:-}" ]; then
  timeout "${SWEEP_TIMEOUT:-200}" bash .bundle/run.sh python scripts/gemm_sweep.py \
    "$OUT/sweep.json" 2>&1 | tail -80
fi
if [ -n "${TUNE:-}" ]; then
  # the opt-in autotune, end to end: times every prebuilt config and records the winner
  FORGEKERNEL_TUNING_DIR=/tmp/forgekernel-tuning timeout 120 bash .bundle/run.sh python -c "
import forgekernel, json, pathlib
for shape in ((1000, 3000, 4104), (128, 8192, 8192)):
    print('tune_gemm', shape, '->', forgekernel.tune_gemm(*shape).tag())
print(pathlib.Path('/tmp/forgekernel-tuning/gemm_dense_sm90.json').read_text())"
fi
