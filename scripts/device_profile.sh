#!/usr/bin/env bash
# One JIT-path device call (after `dsl-install.sh stash`, see device_jit_run.sh): ncu over
# scripts/profile_attention.py, the second round of ours and FA4's forward / backward kernels
# (SCRIPT= another target, e.g. scripts/profile_mla.py with KERNELS=MlaSeesaw SKIP=2 COUNT=1, or
# scripts/profile_gdn_prefill.py with KERNELS=GdnChunked SKIP=2 COUNT=1 SOURCE=1 SUMMARY=1).
#   bash scripts/device_profile.sh [b hq hkv s d]
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
mkdir -p "$OUT"
source .payload/p2/dsl-install.sh install .payload/p2 || exit 1
export FORGEKERNEL_KERNEL_DIR="$PWD/.bundle/kernels" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
P=$OUT/${PROFILE_NAME:-profile}
# Kernels of the second round only (-s skips the first round's), main kernels of interest.
timeout "${PROFILE_TIMEOUT:-400}" "$NCU" --clock-control none ${NCU_EXTRA:-} -k "regex:${KERNELS:-Bwd|Backward}" \
  -s "${SKIP:-6}" -c "${COUNT:-6}" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
  --section InstructionStats ${SOURCE:+--section SourceCounters --import-source no} \
  -o "$P" -f python3 "${SCRIPT:-scripts/profile_attention.py}" "$@" 2>&1 | tail -20
"$NCU" --import "$P.ncu-rep" --page details --print-units base > "$P.txt" 2>&1
"$NCU" --import "$P.ncu-rep" --page raw --csv > "$P-raw.csv" 2>&1
if [ -n "${SOURCE:-}" ]; then
  "$NCU" --import "$P.ncu-rep" --page source --csv --print-source sass > /tmp/source.csv 2>&1
  [ -n "${SUMMARY:-}" ] && python3 scripts/ncu_source_summary.py /tmp/source.csv "${TOP:-70}" \
    > "$P-source.txt" 2>&1
  gzip -c /tmp/source.csv > "$P-source.csv.gz"
fi
# (at most 8 files come back from a call) the report and raw page only on request
[ -n "${KEEP_REP:-}" ] || rm -f "$P.ncu-rep" "$P-raw.csv"
ls -la "$OUT"
grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Stall|One or More|No Eligible|Tensor" "$P.txt" | head -80
