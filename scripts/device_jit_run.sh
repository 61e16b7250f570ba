#!/usr/bin/env bash
# Second of the two JIT-path device calls (the DSL and the comparators installed there, so FA4
# runs beside our prebuilt kernels):
#   here:  ../shared/gpu-host/dsl-payload.sh .payload
#          forgekernel build --arch sm_90a --out .bundle/kernels [--only KERNEL ...]
#   GPU 1: bash .payload/p1/dsl-install.sh stash .payload/p1            (carry .payload/p1)
#   GPU 2: bash scripts/device_jit_run.sh OP...   within 30 s  (carry .payload/p2, .bundle/kernels)
# Each OP is checked, then benchmarked, under its own time limits; VARIANTS=1 then times
# attention-forward configurations (scripts/attn_variants.py), BWD_SCRIPT=1 runs
# scripts/bwd_gpu_check.py, BWD_VARIANTS=1 scripts/bwd_variants.py.
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
# At most 8 files come back: the ledgers, one tar of the reports, variants.json.
LOGS=/tmp/forgekernel-logs REPORTS=/tmp/forgekernel-reports
mkdir -p "$OUT/results" "$LOGS" "$REPORTS"
source .payload/p2/dsl-install.sh install .payload/p2 || exit 1
export FORGEKERNEL_KERNEL_DIR="$PWD/.bundle/kernels" FORGEKERNEL_RESULTS_DIR="$OUT/results"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
timeout 120 python3 -m forgekernel selftest 2>&1 | tail -3
for op in "$@"; do
  timeout "${CHECK_TIMEOUT:-200}" python3 -m forgekernel check "$op" 2>&1 | tee "$LOGS/check-$op.log" \
    | grep -v " PASS$"
  check_rc=${PIPESTATUS[0]}
  [ "${SKIP_BENCH:-}" = "$op" ] && continue
  timeout "${BENCH_TIMEOUT:-300}" python3 -m forgekernel bench --report-dir "$REPORTS" "$op" \
    2>&1 | tee "$LOGS/bench-$op.log" | grep -v "^\[" | tail -25
  echo "$op: check rc=$check_rc bench rc=${PIPESTATUS[0]}"
done
tar -cf "$OUT/reports.tar" -C "$REPORTS" . 2>/dev/null
if [ -n "${VARIANTS:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${VARIANTS_TIMEOUT:-200}" python3 scripts/attn_variants.py \
    "$OUT/variants.json" 2>&1 | tail -40
fi
if [ -n "${BWD_SCRIPT:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${BWD_TIMEOUT:-200}" python3 scripts/bwd_gpu_check.py ${BWD_ARGS:-} \
    2>&1 | tail -60
fi
if [ -n "${BWD_VARIANTS:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout "${BWD_VARIANTS_TIMEOUT:-200}" \
    python3 scripts/bwd_variants.py "$OUT/bwd_variants.json" 2>&1 | tee "$LOGS/bwd_variants.log" \
    | tail -40
  cp "$LOGS/bwd_variants.log" "$OUT/" 2>/dev/null
fi
