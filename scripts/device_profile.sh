#!/usr/bin/env bash
# One JIT-path device call (after `dsl-install.sh stash`, see device_jit_run.sh): ncu over
# scripts/profile_attention.py, the second round of ours and FA4's forward / backward kernels.
#   bash scripts/device_profile.sh [b hq hkv s d]
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
mkdir -p "$OUT"
source .payload/p2/dsl-install.sh install .payload/p2 || exit 1
export FORGEKERNEL_KERNEL_DIR="$PWD/.bundle/kernels" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
# Kernels of the second round only (-s skips the first round's), main kernels of interest.
timeout "${PROFILE_TIMEOUT:-400}" "$NCU" --clock-control none -k "regex:${KERNELS:-Bwd|Backward}" \
  -s "${SKIP:-6}" -c "${COUNT:-6}" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
  --section InstructionStats \
  -o "$OUT/profile" -f python3 scripts/profile_attention.py "$@" 2>&1 | tail -20
"$NCU" --import "$OUT/profile.ncu-rep" --page details --print-units base > "$OUT/profile.txt" 2>&1
"$NCU" --import "$OUT/profile.ncu-rep" --page raw --csv > "$OUT/profile_raw.csv" 2>&1
ls -la "$OUT"
grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Stall|One or More|No Eligible|Tensor" "$OUT/profile.txt" | head -80
