#!/usr/bin/env bash
# Several scripts/device_jit_run.sh streams side by side on one warm host: the checks and
# sanitizer runs of independent suites (one such stream leaves the GPU mostly idle; three took a
# third of the wall time on 2026-12-02), then what they wrote packed into few files (at most 8
# come back): results.tar (the ledgers written by this call: newer than its stamp, $OUT/.stamp,
# made by the call's first invocation, so that a second one in the same call keeps the first's
# ledgers: 2026-12-03 14:24 lost conv_wgrad's that way), logs.tar, reports.tar, stream-N.log
# (numbered on from the logs an earlier invocation of the call left).
#   KERNELS=/root/fk-kernels BENCH=0 SANITIZE=1 bash scripts/device_streams.sh \
#       "mla_decode dsa_sparse" "kda_prefill dsa_recompute" "gdn_prefill"
# Each argument is one stream's OP list; the environment applies to every stream, and
# STREAM_ENV_N="VAR=value ..." to stream N alone (e.g. GPU_TESTS=1 in one stream). Benches time
# the device: they are refused with more than one stream (one stream of benches, or a call of
# their own). Each stream runs under STREAM_TIMEOUT (default 540 s), KILLed after. A bench cut by
# BENCH_TIMEOUT or by the stream's limit has written the cases it finished to its ledger's partial
# section after each one (atomically: the kill leaves the last whole file): that ledger is newer
# than the stamp, so results.tar carries it, and `bench --resume` (device_jit_run.sh) goes on.
# scripts/take_results.sh DIR unpacks results.tar and reports.tar.
set -uo pipefail
R=${OUT:-/tmp/forgekernel-out}
export RESULTS=${RESULTS:-/tmp/forgekernel-results}
if [ $# -gt 1 ] && [ "${BENCH:-1}" != 0 ] && [ "${SANITIZE:-0}" != only ]; then
  echo "device_streams.sh: benches in parallel streams would time each other: BENCH=0" >&2
  exit 2
fi
mkdir -p "$R" "$RESULTS" /tmp/forgekernel-logs /tmp/forgekernel-reports
[ -n "$(ls -A "$RESULTS")" ] || cp -r benchmarks/results/. "$RESULTS/"
stamp=$R/.stamp  # the call's: $OUT starts empty on every call
if [ ! -f "$stamp" ]; then
  touch "$stamp"
  sleep 1  # ledgers written from now on are newer than the stamp
fi
logs=$(find "$R" -maxdepth 1 -name 'stream-*.log' | wc -l)
i=0
for ops in "$@"; do
  i=$((i + 1))
  extra=STREAM_ENV_$i
  (
    [ -n "${!extra:-}" ] && eval "export ${!extra}"
    # shellcheck disable=SC2086  # an OP list
    OUT=/tmp/fk-stream-$i timeout -k 15 "${STREAM_TIMEOUT:-540}" bash scripts/device_jit_run.sh $ops
  ) > "$R/stream-$((logs + i)).log" 2>&1 &
done
wait
(cd "$RESULTS" && find . -name '*.json' -newer "$stamp" | tar -cf "$R/results.tar" -T -)
tar -cf "$R/logs.tar" -C /tmp/forgekernel-logs .
tar -cf "$R/reports.tar" -C /tmp/forgekernel-reports .
bash scripts/comparator_caches.sh pack "$R" || true  # autotuning, TileLang, FlashInfer: later hosts
grep -h "rc=\|FAIL\|HANG\|NOT CLEAN\|passed\|failed\|Error" "$R"/stream-*.log | tail -60
