#!/usr/bin/env bash
# Second of the two JIT-path device calls (the DSL and the comparators installed there, so FA4
# runs beside our prebuilt kernels):
#   here:  ../shared/gpu-host/dsl-payload.sh .payload
#          forgekernel build --arch sm_90a --out .bundle/kernels
#   GPU 1: bash .payload/p1/dsl-install.sh stash .payload/p1            (carry .payload/p1)
#   GPU 2: bash scripts/device_jit_run.sh OP...   within 30 s  (carry .payload/p2, .bundle/kernels)
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
mkdir -p "$OUT/results" "$OUT/reports"
source .payload/p2/dsl-install.sh install .payload/p2 || exit 1
export FORGEKERNEL_KERNEL_DIR="$PWD/.bundle/kernels" FORGEKERNEL_RESULTS_DIR="$OUT/results"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
timeout 120 python3 -m forgekernel selftest
timeout "${CHECK_TIMEOUT:-200}" python3 -m forgekernel check "$@" 2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
timeout "${BENCH_TIMEOUT:-300}" python3 -m forgekernel bench --report-dir "$OUT/reports" "$@" \
  2>&1 | tee "$OUT/bench.log"
echo "check rc=$check_rc bench rc=${PIPESTATUS[0]}"
if [ -n "${VARIANTS:-}" ]; then
  timeout "${VARIANTS_TIMEOUT:-200}" python3 scripts/attn_variants.py "$OUT/variants.json" 2>&1 | tail -40
fi
