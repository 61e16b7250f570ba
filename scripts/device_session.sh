#!/usr/bin/env bash
# One device session's calls, each within the device's per-call limit (CALL_LIMIT, default 570 s),
# back to back on a warm host (a host idle 30 s is given back: the next call starts a bare one).
# Before: wheels packed (../shared/gpu-host/wheels.sh pack .wheels --room 24 --dsl ...), c1-c3
# stashed from an orphan checkout (`bash .wheels/cK/wheels.sh stash .wheels/cK`, carry .wheels/cK),
# the last chunk carried by the first call below (with `carry: [".wheels/c4"]`).
#   bash scripts/device_session.sh checks "OPS_1" "OPS_2" ...   checks + sanitizers, one stream an
#        argument, GPU_TEST_FILES (space-separated tests/gpu files) in one more stream; the host
#        builds the kernels FK_BUILD_ARGS names (default: every kernel, ~3.5 min for ~700)
#   bash scripts/device_session.sh probes "NAME=python3 SCRIPT ARGS" ...   each under PROBE_T s
#        (default 100; NAME:T=... its own T), run by bash -c (quotes and pipes work), logs (and
#        JSON written to /tmp/probes) packed into $OUT/probes.tar, each log's last PROBE_TAIL
#        lines (default 30) printed; `@FILE` reads such specs from FILE, one a line (blank and
#        # lines skipped: a session's list longer than a call's 2,000-character command); no
#        build unless FK_BUILD=1 (2026-12-03: the default built all 1044 kernels, 133 s, for a
#        probe that compiles its own)
#   bash scripts/device_session.sh benches OP ...   one stream of benches (BENCH_TIMEOUT each; a
#        bench cut there is resumed by the next call that benches it: `bench --resume`)
# Then here: scripts/take_results.sh on each call's files IN CALL ORDER (it keeps an earlier
# call's sections on the same sources where a later call on a fresh host lacks them).
set -uo pipefail
mode=${1:?checks, probes or benches}
shift
if [ "$mode" = probes ]; then export FK_BUILD=${FK_BUILD:-0}; else export FK_BUILD=${FK_BUILD:-1}; fi
# shellcheck disable=SC1091  # the setup's exports (KERNELS, PYTHONPATH, the DSL) must stay
source scripts/device_setup.sh || exit 1
left=$((${CALL_LIMIT:-570} - SECONDS))
case $mode in
  checks)
    n=$(($# + 1))
    if [ -n "${GPU_TEST_FILES:-}" ]; then
      export "STREAM_ENV_$n=GPU_TESTS=1 CHECK=0 SANITIZE=0 GPU_TESTS_TIMEOUT=$((left - 30)) GPU_TESTS_PATHS='$GPU_TEST_FILES'"
      set -- "$@" ""
    fi
    STREAM_TIMEOUT=$left BENCH=0 SANITIZE=${SANITIZE:-1} bash scripts/device_streams.sh "$@"
    ;;
  probes)
    mkdir -p /tmp/probes
    specs=()
    for spec in "$@"; do
      if [ "${spec:0:1}" = @ ]; then
        while IFS= read -r line; do
          [[ -z "${line//[[:space:]]/}" || "$line" =~ ^[[:space:]]*# ]] || specs+=("$line")
        done < "${spec:1}"
      else
        specs+=("$spec")
      fi
    done
    for spec in "${specs[@]}"; do
      name=${spec%%=*}
      t=${PROBE_T:-100}
      if [[ "$name" == *:* ]]; then t=${name#*:}; name=${name%%:*}; fi
      room=$((${CALL_LIMIT:-570} - SECONDS - 15))
      if (( room < 20 )); then echo "== $name skipped: ${room} s left of CALL_LIMIT"; continue; fi
      (( t > room )) && t=$room
      echo "== $name $(date +%T)"
      start=$SECONDS
      timeout -k 10 "$t" bash -c "${spec#*=}" > "/tmp/probes/$name.log" 2>&1
      echo "rc=$? in $((SECONDS - start)) s (limit $t)"
      grep -v "UserWarning\|exe_args\|^forgekernel: compiling" "/tmp/probes/$name.log" \
        | tail -"${PROBE_TAIL:-30}"
      tar -cf "${OUT:-/tmp/forgekernel-out}/probes.tar" -C /tmp/probes .
    done
    bash scripts/comparator_caches.sh pack "${OUT:-/tmp/forgekernel-out}" || true
    ;;
  benches)
    CHECK=0 BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} STREAM_TIMEOUT=$left bash scripts/device_streams.sh "$*"
    ;;
  *)
    echo "device_session.sh: unknown mode $mode" >&2
    exit 2
    ;;
esac
