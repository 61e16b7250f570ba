#!/usr/bin/env bash
# Nsight Compute on the largest gaps to the comparators, in one device call (~4-6 min):
#   source scripts/device_setup.sh || exit 1; bash scripts/device_profile_gaps.sh [--dry-run] [TARGET...]
# TARGETs, in this order by default (each one ncu process, scripts/device_profile.sh):
#   gemm_fp8    scripts/profile_gemm_fp8.py: ours vs DeepGEMM, 16384x7168x18432, 4096x7168x2048
#   mla         scripts/profile_mla.py: ours vs FlashMLA, b1-h16-p64-L65536, b48-h16-p64-mixed,
#               b16-h128-p64-L4096
#   gemm        scripts/profile_gemm.py: ours vs cuBLAS, 129x10240x8192, 4096x576x7168,
#               512x10240x5120
#   conv_wgrad  scripts/profile_conv.py --suite conv_wgrad: ours vs cuDNN, worst / median cases
#   conv_fwd    scripts/profile_conv.py --suite conv_fwd: the same for the forward
#   dsa         scripts/profile_dsa.py: ours vs FlashMLA's FP8 sparse decode, t1 / t128 h16, t64 h128
#   paged_prefill  scripts/profile_paged_prefill.py: ours vs FA4, chunked prefill at page 16 / 64
# and, named only (not in the default list):
#   gdn_bwd     scripts/profile_linattn_bwd.py: our GDN backward, one call at 4x8192-h16-hv32
#   gdn_bwd_qla the same case's FlashQLA backward, its sidecar's runner in the ncu process with
#               the sidecar's site (SITE=$FK_SIDE_SITE_FLASHQLA, default /root/side-sites/qla;
#               scripts/device_profile.sh); its first call compiles TileLang kernels not cached
# Each target profiles, after unprofiled warm-ups, one call of ours and one of the comparator per
# case (ncu --profile-from-start off: only what lies between cudaProfilerStart / Stop, every
# kernel of it whatever its name; scripts/profile_suite.py), then scripts/ncu_gap_summary.py
# puts them side by side. Knobs: GAPS_BUDGET (s for all targets, default 450: a target starts
# only with 45 s left, its limit the lesser of its own and what is left), PROFILE_TIMEOUT (one
# limit for every target instead of each one's own), GAPS_KERNELS (ncu -k regex inside the
# profiled range, default every kernel), GAPS_COUNT (-c, default 40 a target), GAPS_ARGS (more
# target arguments, e.g. "--calls 2"), NCU_EXTRA, KEEP_REP=1 (the .ncu-rep files in
# $OUT/gaps-reps.tar), GAPS_WORK (scratch directory).
# $OUT gets at most 3 files: gaps-summary.txt (every target's summary, the file to read first),
# gaps.tar.gz (per target: NAME.txt details page, NAME-raw.csv, NAME-plan.json, NAME.log,
# NAME-summary.txt) and gaps-reps.tar (KEEP_REP=1).
set -uo pipefail
FINAL=${OUT:-/tmp/forgekernel-out}
WORK=${GAPS_WORK:-/tmp/forgekernel-gaps}
BUDGET=${GAPS_BUDGET:-450}
ALL=(gemm_fp8 mla gemm conv_wgrad conv_fwd dsa paged_prefill)
dry=
targets=()
for a in "$@"; do
  case $a in
    --dry-run) dry=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) targets+=("$a") ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${ALL[@]}")

# target -> "script|its arguments|its own time limit (s)|the sidecar site it runs in (or none)"
QLA_SITE=${FK_SIDE_SITE_FLASHQLA:-/root/side-sites/qla}
GDN_CASE="--case gdn_bwd:4x8192-h16-hv32"
spec() {
  case $1 in
    gemm_fp8) echo "scripts/profile_gemm_fp8.py||170" ;;  # DeepGEMM's JIT on a fresh host
    mla) echo "scripts/profile_mla.py||110" ;;
    gemm) echo "scripts/profile_gemm.py||100" ;;
    conv_wgrad) echo "scripts/profile_conv.py|--suite conv_wgrad|110" ;;
    conv_fwd) echo "scripts/profile_conv.py|--suite conv_fwd|110" ;;
    dsa) echo "scripts/profile_dsa.py||100" ;;
    paged_prefill) echo "scripts/profile_paged_prefill.py||150" ;;  # FA4's first compiles
    gdn_bwd) echo "scripts/profile_linattn_bwd.py|$GDN_CASE --which ours|150" ;;
    gdn_bwd_qla)  # the suite finds FlashQLA's sidecar by FK_SIDE_SITE_FLASHQLA: set to the site
      echo "scripts/profile_linattn_bwd.py|$GDN_CASE --which comparator --comparator flashqla \
--sidecar-here|240|$QLA_SITE" ;;
    *) return 1 ;;
  esac
}
for t in "${targets[@]}"; do
  spec "$t" > /dev/null || { echo "unknown target $t (one of ${ALL[*]})" >&2; exit 2; }
done

mkdir -p "$FINAL" "$WORK"
start=$SECONDS
[ -n "$dry" ] || nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
for t in "${targets[@]}"; do
  IFS='|' read -r script args limit site <<< "$(spec "$t")"
  left=$((BUDGET - (SECONDS - start)))
  limit=${PROFILE_TIMEOUT:-$limit}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ -z "$dry" ] && [ "$left" -lt 45 ]; then
    echo "=== $t: skipped, ${left} s of GAPS_BUDGET left" | tee "$WORK/$t-summary.txt"
    continue
  fi
  (cd "$WORK" && rm -f "$t.txt" "$t-raw.csv" "$t-plan.json" "$t.ncu-rep" "$t.log" "$t-summary.txt")
  echo "=== $t: $script $args (limit ${limit} s, ${left} s of the budget left)"
  # shellcheck disable=SC2086  # args and GAPS_ARGS are argument lists
  OUT=$WORK PROFILE_NAME=$t SCRIPT=$script KERNELS=${GAPS_KERNELS:-.} SKIP=0 SITE=$site \
    FK_SIDE_SITE_FLASHQLA=${site:-${FK_SIDE_SITE_FLASHQLA:-}} \
    COUNT=${GAPS_COUNT:-40} KEEP_RAW=1 PROFILE_TIMEOUT=$limit DRY_RUN=$dry TAIL=40 \
    NCU_EXTRA="--profile-from-start off --nvtx ${NCU_EXTRA:-}" \
    bash scripts/device_profile.sh $args --plan "$WORK/$t-plan.json" ${GAPS_ARGS:-} \
    > "$WORK/$t.log" 2>&1
  rc=$?
  if [ -n "$dry" ]; then
    cat "$WORK/$t.log"
    # shellcheck disable=SC2086  # the cases the ncu command above profiles (GAPS_ARGS' too)
    python3 "$script" $args --list ${GAPS_ARGS:-}
    continue
  fi
  tail -15 "$WORK/$t.log"
  python3 scripts/ncu_gap_summary.py --raw "$WORK/$t-raw.csv" --details "$WORK/$t.txt" \
    --plan "$WORK/$t-plan.json" --title "$t (rc $rc, $((SECONDS - start)) s)" \
    > "$WORK/$t-summary.txt" 2>&1
  head -30 "$WORK/$t-summary.txt"
done
[ -n "$dry" ] && exit 0

for t in "${targets[@]}"; do cat "$WORK/$t-summary.txt" 2>/dev/null; echo; done \
  > "$FINAL/gaps-summary.txt"
if [ -n "${KEEP_REP:-}" ]; then
  (cd "$WORK" && tar -cf "$FINAL/gaps-reps.tar" ./*.ncu-rep 2>/dev/null)
fi
tar -czf "$FINAL/gaps.tar.gz" -C "$WORK" --exclude='*.ncu-rep' .
echo "gaps: $((SECONDS - start)) s"
ls -la "$FINAL"
