#!/usr/bin/env bash
# ncu over one profile target, in a device call whose environment scripts/device_setup.sh made
# (the DSL and comparator wheels on PYTHONPATH, the prebuilt kernels in FORGEKERNEL_KERNEL_DIR):
#   source scripts/device_setup.sh || exit 1; bash scripts/device_profile.sh [target args]
# It installs nothing: without the DSL importable it stops and says so.
# Default target: scripts/profile_attention.py, the second round of ours and FA4's forward /
# backward kernels. SCRIPT= another target, e.g. scripts/profile_gdn_prefill.py with KERNELS=GdnChunked SKIP=2 COUNT=1 SOURCE=1
# SUMMARY=1; the gap targets (profile_gemm_fp8.py, profile_mla.py, profile_gemm.py,
# profile_conv.py) through scripts/device_profile_gaps.sh.
# Knobs: KERNELS (ncu -k regex; an absolute path there, as device_setup.sh exports KERNELS,
# means unset: Bwd|Backward), SKIP / COUNT (-s / -c), SOURCE=1 (source counters, and the per-SASS
# page gzipped; SUMMARY=1 summarises it, TOP lines), PROFILE_NAME (files $OUT/NAME*),
# NCU_EXTRA (more ncu options, word-split), PROFILE_TIMEOUT (s, default 400), KEEP_REP=1 (keep
# the .ncu-rep and the raw page), KEEP_RAW=1 (keep the raw page), DRY_RUN=1 (print the ncu
# command and stop), SECTIONS (ncu section names, space-separated, in place of the list below:
# fewer replay passes), SITE (a sidecar comparator's site directory, e.g.
# $FK_SIDE_SITE_FLASHQLA: the target runs with the sidecar child's PYTHONPATH, the site first
# and the main wheel set left out (forgekernel/bench/sidecar.py child_env), and no DSL check;
# with the target's --sidecar-here).
# Outputs in $OUT: NAME.txt (details page), NAME-source.txt / NAME-source.csv.gz (SOURCE=1),
# NAME-raw.csv and NAME.ncu-rep on request (at most 8 files come back from a call).
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export FORGEKERNEL_KERNEL_DIR=${FORGEKERNEL_KERNEL_DIR:-$PWD/.bundle/kernels}
case ":${PYTHONPATH:-}:" in
  *":$PWD:"*) ;;
  *) export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} ;;
esac
regex=${KERNELS:-}
case $regex in  # device_setup.sh exports KERNELS=/root/fk-kernels: an absolute path, no regex
  "" | /*) regex='Bwd|Backward' ;;
esac
NCU=$(command -v ncu)
if [ -z "$NCU" ]; then  # the image's Nsight Compute, not on PATH: the last version there
  for f in /opt/nvidia/nsight-compute/*/ncu; do [ -x "$f" ] && NCU=$f; done
fi
P=$OUT/${PROFILE_NAME:-profile}
names=(SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis WarpStateStats SchedulerStats
  LaunchStats Occupancy InstructionStats)
# shellcheck disable=SC2206  # SECTIONS is a list of names, split on purpose
[ -n "${SECTIONS:-}" ] && names=(${SECTIONS})
sections=()
for n in "${names[@]}"; do sections+=(--section "$n"); done
[ -n "${SOURCE:-}" ] && sections+=(--section SourceCounters --import-source no)
# shellcheck disable=SC2206  # NCU_EXTRA is a list of options, split on purpose
cmd=("${NCU:-ncu}" --clock-control none ${NCU_EXTRA:-} -k "regex:$regex" -s "${SKIP:-6}"
  -c "${COUNT:-6}" "${sections[@]}" -o "$P" -f python3 "${SCRIPT:-scripts/profile_attention.py}"
  "$@")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' timeout -k 15 "${PROFILE_TIMEOUT:-400}" "${cmd[@]}"
  echo
  exit 0
fi
if [ -n "${SITE:-}" ]; then  # the sidecar child's environment (the site's own tvm-ffi: no DSL)
  [ -d "$SITE" ] || { echo "device_profile: SITE=$SITE is not a directory" >&2; exit 1; }
  PYTHONPATH=$(SITE_DIR=$SITE python3 -c "from forgekernel.bench.sidecar import MAIN_SITE, Sidecar, child_env
print(child_env(Sidecar('site', '', 'SITE_DIR', (), drop=(MAIN_SITE,)))['PYTHONPATH'])") || exit 1
  export PYTHONPATH
  echo "device_profile: PYTHONPATH=$PYTHONPATH"
elif ! python3 -c "import cutlass" 2>/dev/null; then
  echo "device_profile: python3 cannot import cutlass (the DSL): begin the call with" \
    "'source scripts/device_setup.sh || exit 1;' (PYTHONPATH=${PYTHONPATH:-})" >&2
  exit 1
fi
[ -n "$NCU" ] || { echo "device_profile: no ncu on PATH or in /opt/nvidia/nsight-compute" >&2; exit 1; }
echo "ncu: $NCU"
timeout -k 15 "${PROFILE_TIMEOUT:-400}" "${cmd[@]}" 2>&1 | tail -"${TAIL:-20}"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || echo "device_profile: ncu exited $rc (124: cut by PROFILE_TIMEOUT)"
if [ ! -f "$P.ncu-rep" ]; then
  echo "device_profile: no report $P.ncu-rep"
  exit 1
fi
"$NCU" --import "$P.ncu-rep" --page details --print-units base > "$P.txt" 2>&1
"$NCU" --import "$P.ncu-rep" --page raw --csv --print-units base > "$P-raw.csv" 2>&1
if [ -n "${SOURCE:-}" ]; then
  "$NCU" --import "$P.ncu-rep" --page source --csv --print-source sass > /tmp/source.csv 2>&1
  [ -n "${SUMMARY:-}" ] && python3 scripts/ncu_source_summary.py /tmp/source.csv "${TOP:-70}" \
    > "$P-source.txt" 2>&1
  gzip -c /tmp/source.csv > "$P-source.csv.gz"
fi
# (at most 8 files come back from a call) the report and raw page only on request
[ -n "${KEEP_REP:-}" ] || rm -f "$P.ncu-rep"
[ -n "${KEEP_REP:-}${KEEP_RAW:-}" ] || rm -f "$P-raw.csv"
ls -la "$OUT"
echo "kernels profiled (count, name):"
grep -E '^  [^ ].*\([0-9]+, [0-9]+, [0-9]+\)x\(' "$P.txt" | sed -E 's/ \([0-9]+, [0-9]+, [0-9]+\)x.*//' \
  | cut -c1-150 | sort | uniq -c
grep -E "^  [a-z_]|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Stall|One or More|No Eligible|Tensor" "$P.txt" | head -80
exit "$rc"
