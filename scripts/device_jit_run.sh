#!/usr/bin/env bash
# Second of the two JIT-path device calls (the DSL and the comparators installed there, so FA4
# runs beside our prebuilt kernels):
#   here:  ../shared/gpu-host/dsl-payload.sh .payload
#          forgekernel build --arch sm_90a --out .bundle/kernels [--only KERNEL ...]
#   GPU 1: bash .payload/p1/dsl-install.sh stash .payload/p1            (carry .payload/p1)
#   GPU 2: bash scripts/device_jit_run.sh OP...   within 30 s  (carry .payload/p2, .bundle/kernels)
# Or with ../shared/gpu-host/wheels.sh chunks (the DSL, FA4): WHEELS=.wheels/cN names the last
# chunk (the earlier ones stashed); BUILD=1 then builds every kernel on the host (`forgekernel
# build -j <all cores>`, the DSL is there; BUILD_ARGS="--only KERNEL ..." fewer) instead of
# carrying .bundle/kernels. A later call on
# the still-warm host needs neither (the wheels stay installed, the kernels built, the ledger
# files kept in $RESULTS and copied to $OUT at the end of every call).
# Each OP is checked, then benchmarked (the backward's deterministic mode with it: `bench
# attention_bwd`; `--resume`: a bench cut by BENCH_TIMEOUT keeps the cases it finished in its
# ledger's partial section, packed with the ledger, and the next call on this host, or on a fresh
# one with the taken ledger carried, times only the rest; BENCH_FRESH=1 starts from the first case,
# for a partial section whose cases are not to be kept), under its own time limits; SANITIZE=1 then runs `check --sanitize OP`
# (compute-sanitizer memcheck and racecheck, under SANITIZE_TIMEOUT; SANITIZE=only skips check
# and bench); CHECK=0 / BENCH=0 skip check / bench; BENCH_ARGS (e.g. --timing graph) go to bench;
# GPU_TESTS=1 runs `pytest -m gpu` over GPU_TESTS_PATHS (default tests/gpu: folders, files, node
# ids) one test file per pytest process, in order, GPU_TESTS_TIMEOUT (default 200 s) the limit of
# them all: each file gets an equal share of the time left (what one leaves unused goes to the
# rest), so a slow file cannot starve the others; each file's failures are printed as they happen
# (tests/gpu/conftest.py), then its summary line and rc (124: cut by its share); the whole output
# in logs.tar as pytest-gpu.log, packed after every file;
# WARM="SUITE ..." warms those benches' comparators in the background (below);
# DIAGS="mla_seesaw dsa_indexer" first runs those scripts/diag_NAME.py ladders (each case in its own
# process under a timeout: a hang costs seconds), logs in logs.tar as diag-NAME.log;
# VARIANTS=1 then times attention-forward configurations (scripts/attn_variants.py),
# BWD_VARIANTS=1 scripts/bwd_variants.py.
set -uo pipefail
OUT=${OUT:-/tmp/forgekernel-out}
# At most 8 files come back: the ledgers, reports.tar, logs.tar (every log, the sanitizers' full
# output under sanitize/), variants.json, bwd_variants.json.
LOGS=${LOGS:-/tmp/forgekernel-logs} REPORTS=${REPORTS:-/tmp/forgekernel-reports}
RESULTS=${RESULTS:-/tmp/forgekernel-results} KERNELS=${KERNELS:-$PWD/.bundle/kernels}
mkdir -p "$OUT/results" "$LOGS" "$REPORTS" "$RESULTS"
# Start from the committed ledgers: a section this run does not write (say the sanitizers') stays
# as long as its kernel sources are unchanged (the ledger drops it otherwise).
[ -n "$(ls -A "$RESULTS")" ] || cp -r benchmarks/results/. "$RESULTS/" 2>/dev/null
if [ -n "${WHEELS:-}" ]; then
  source "$WHEELS/wheels.sh" install "$WHEELS" >/dev/null || exit 1
elif [ -d .payload/p2 ]; then
  source .payload/p2/dsl-install.sh install .payload/p2 || exit 1
else  # installed by an earlier call: the same path as wheels.sh install (the DSL's packages
  # too, or every kernel missing from $KERNELS fails on `import cutlass`, as on 2026-12-02)
  extra=/root/wheels-site
  [ -d $extra/nvidia_cutlass_dsl/dsl_packages ] && extra=$extra:$extra/nvidia_cutlass_dsl/dsl_packages
  export PYTHONPATH=$extra${PYTHONPATH:+:$PYTHONPATH}
fi
export FORGEKERNEL_KERNEL_DIR="$KERNELS" FORGEKERNEL_RESULTS_DIR="$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ "${BUILD:-0}" = 1 ]; then
  python3 -m forgekernel build -j "$(nproc)" --out "$KERNELS" ${BUILD_ARGS:-} 2>&1 | tee "$LOGS/build.log" | tail -2
fi
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
timeout 120 python3 -m forgekernel selftest 2>&1 | tail -3
# WARM="gdn_prefill kda_prefill": those benches' comparator first calls (fla's Triton autotuning:
# 28 (GDN) / 82 (KDA) configs compiled and timed per head count) made in the background by
# scripts/warm_comparators.py while the checks run, into the on-disk caches the bench then loads;
# the first bench waits for it (log: warm.log).
warm_pid=
if [ -n "${WARM:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout -k 15 "${WARM_TIMEOUT:-400}" \
    python3 scripts/warm_comparators.py $WARM > "$LOGS/warm.log" 2>&1 &
  warm_pid=$!
fi
for d in ${DIAGS:-}; do
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FORGEKERNEL_PENDING_SUITES=1 timeout -k 15 \
    "${DIAG_TIMEOUT:-300}" python3 "scripts/diag_$d.py" 2>&1 | tee "$LOGS/diag-$d.log" | tail -30
done
pack() {
  cp -r "$RESULTS"/. "$OUT/results/" 2>/dev/null
  tar -cf "$OUT/reports.tar" -C "$REPORTS" . 2>/dev/null
  tar -cf "$OUT/logs.tar" -C "$LOGS" . 2>/dev/null
}
# A step cut by its timeout must leave the GPU: `timeout -k 15` KILLs what ignores the TERM, and
# before each bench a forgekernel process still holding a context (a hung kernel: mla_decode on
# 2026-12-01 23:00 left every later bench of that call timed at half speed, graph ~2x eager) is
# named and killed; bench's own device check then says whether the device is ours.
free_gpu() {
  local pid
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    [ "$pid" = "$$" ] || ! grep -qa forgekernel "/proc/$pid/cmdline" 2>/dev/null && continue
    echo "left on the GPU: pid $pid ($(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-80)): killed"
    kill -9 "$pid" 2>/dev/null
  done
  sleep 1
}
for op in "$@"; do
  check_rc=skipped bench_rc=skipped sanitize_rc=skipped
  if [ "${SANITIZE:-0}" != only ] && [ "${CHECK:-1}" != 0 ]; then
    timeout -k 15 "${CHECK_TIMEOUT:-200}" python3 -m forgekernel check "$op" 2>&1 \
      | tee "$LOGS/check-$op.log" | grep -v " PASS$"
    check_rc=${PIPESTATUS[0]}
  fi
  if [ "${SANITIZE:-0}" != only ] && [ "${BENCH:-1}" != 0 ] && [ "${SKIP_BENCH:-}" != "$op" ]; then
    if [ -n "$warm_pid" ]; then  # no timing while the warm-up tunes on the same GPU
      wait "$warm_pid"; echo "warm-up rc=$?"; tail -20 "$LOGS/warm.log"; warm_pid=
    fi
    free_gpu
    timeout -k 15 "${BENCH_TIMEOUT:-300}" python3 -m forgekernel bench $([ "${BENCH_FRESH:-0}" = 1 ] || echo --resume) --report-dir "$REPORTS" ${BENCH_ARGS:-} "$op" \
      2>&1 | tee "$LOGS/bench-$op.log" | grep -v "^\[" | tail -40
    bench_rc=${PIPESTATUS[0]}
  fi
  if [ "${SANITIZE:-0}" != 0 ]; then
    timeout -k 15 "${SANITIZE_TIMEOUT:-300}" python3 -m forgekernel check --sanitize "$op" \
      --sanitize-log-dir "$LOGS/sanitize" --sanitize-timeout "${SANITIZE_RUN_TIMEOUT:-200}" \
      2>&1 | tee "$LOGS/sanitize-$op.log"
    sanitize_rc=${PIPESTATUS[0]}
  fi
  echo "$op: check rc=$check_rc bench rc=$bench_rc sanitize rc=$sanitize_rc"
  pack
done
# One pytest process per test file (node ids of one file together), in the order given, a folder
# as its test_*.py files sorted. 2026-12-02 10:20: one process over tests/gpu was killed by its
# limit after 239 of 633 tests, the files after the slow ones never run and no summary printed.
gpu_tests() {
  local arg f key files=() keys=() i=0 n share left rc start
  declare -A args=()
  for arg in ${GPU_TESTS_PATHS:-tests/gpu}; do
    if [ -d "$arg" ]; then
      mapfile -t files < <(find "$arg" -name 'test_*.py' | sort)
    else
      files=("$arg")
    fi
    for f in "${files[@]}"; do
      key=${f%%::*}
      [ -n "${args[$key]+x}" ] || keys+=("$key")
      args[$key]="${args[$key]:-} $f"
    done
  done
  n=${#keys[@]}
  local end=$((SECONDS + ${GPU_TESTS_TIMEOUT:-200}))
  : > "$LOGS/pytest-gpu.log"
  for key in "${keys[@]}"; do
    left=$((end - SECONDS))
    share=$((left / (n - i))) i=$((i + 1))
    if [ "$share" -lt 1 ]; then
      echo "$key: not run (GPU_TESTS_TIMEOUT spent)" | tee -a "$LOGS/pytest-gpu.log"
      continue
    fi
    echo "=== $key: limit $share s of the $left s left" >> "$LOGS/pytest-gpu.log"
    start=$SECONDS
    # unbuffered (-u): a run killed by its limit still leaves every test it finished in the log
    # (2026-12-02 06:40: the stream's limit killed pytest with its whole output still buffered);
    # shown here: the failures as they happen (conftest's `FAILED <nodeid>: <reason>`, not the
    # summary's repeat of them), collection errors, the summary line
    # shellcheck disable=SC2086  # the node ids of one file, split
    timeout -k 15 "$share" python3 -u -m pytest -q -rfE -m gpu ${args[$key]} 2>&1 \
      | tee -a "$LOGS/pytest-gpu.log" \
      | grep --line-buffered -E '^FAILED [^ ]+: |^ERROR |^[0-9]+ [a-z]+.* in [0-9.]+s|^no tests ran'
    rc=${PIPESTATUS[0]}
    case $rc in
      124 | 137) echo "$key: cut by its limit ($share s), rc=$rc" ;;
      *) echo "$key: pytest rc=$rc in $((SECONDS - start)) s (limit $share s)" ;;
    esac | tee -a "$LOGS/pytest-gpu.log"
    pack
  done
}
if [ "${GPU_TESTS:-0}" = 1 ]; then
  gpu_tests
fi
if [ -n "${VARIANTS:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout -k 15 "${VARIANTS_TIMEOUT:-200}" python3 scripts/attn_variants.py \
    "$OUT/variants.json" 2>&1 | tail -40
fi
if [ -n "${BWD_VARIANTS:-}" ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout -k 15 "${BWD_VARIANTS_TIMEOUT:-200}" \
    python3 scripts/bwd_variants.py "$OUT/bwd_variants.json" 2>&1 | tee "$LOGS/bwd_variants.log" \
    | tail -40
fi
pack
