#!/usr/bin/env bash
# The one device command: check and bench from a bundle on the lent GPU, full results to $OUT.
#   here:  forgekernel bundle .bundle
#   GPU:   bash scripts/device_run.sh [op ...]      (carry .bundle)
# SANITIZE=1 then runs `check --sanitize` (compute-sanitizer memcheck and racecheck on each
# suite's sanitize cases; ledger section "sanitize") under SANITIZE_TIMEOUT; SANITIZE=only runs
# that step alone (check + bench + sanitizers of all three operators can outlast a 10-minute call).
# Then scripts/take_results.sh DIR copies $OUT/results/<arch>/<op>.json into benchmarks/results/
# and the reports (reports.tar) into benchmarks/reports/; commit them with the kernel.
# At most 8 files come back: the ledgers, reports.tar, logs.tar (every log, the sanitizers' full
# output under sanitize/), sweep.json.
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
LOGS=/tmp/forgekernel-logs REPORTS=/tmp/forgekernel-reports
mkdir -p "$OUT/results" "$LOGS" "$REPORTS"
export FORGEKERNEL_RESULTS_DIR="$OUT/results"
export FORGEKERNEL_SITE=/tmp/forgekernel-site
pack() {
  tar -cf "$OUT/reports.tar" -C "$REPORTS" . 2>/dev/null
  tar -cf "$OUT/logs.tar" -C "$LOGS" . 2>/dev/null
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv; timeout 120 bash .bundle/run.sh selftest; } 2>&1 | tee "$LOGS/selftest.log"
check_rc=skipped bench_rc=skipped sanitize_rc=skipped
if [ "${SANITIZE:-0}" != only ]; then
  timeout -k 15 "${CHECK_TIMEOUT:-240}" bash .bundle/run.sh check "$@" 2>&1 | tee "$LOGS/check.log"
  check_rc=${PIPESTATUS[0]}
  timeout -k 15 "${BENCH_TIMEOUT:-300}" bash .bundle/run.sh bench --report-dir "$REPORTS" "$@" \
    2>&1 | tee "$LOGS/bench.log"
  bench_rc=${PIPESTATUS[0]}
  pack
fi
if [ "${SANITIZE:-0}" != 0 ]; then
  timeout -k 15 "${SANITIZE_TIMEOUT:-420}" bash .bundle/run.sh check --sanitize \
    --sanitize-log-dir "$LOGS/sanitize" --sanitize-timeout "${SANITIZE_RUN_TIMEOUT:-200}" "$@" \
    2>&1 | tee "$LOGS/sanitize.log"
  sanitize_rc=${PIPESTATUS[0]}
  pack
fi
echo "check rc=$check_rc bench rc=$bench_rc sanitize rc=$sanitize_rc"
if [ -n "${SWEEP:-}" ]; then
  timeout -k 15 "${SWEEP_TIMEOUT:-200}" bash .bundle/run.sh python scripts/gemm_sweep.py \
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
pack
