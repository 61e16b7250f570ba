#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over the FP4-weight GEMM's opt-in forms
# (`staged_sa`, `converter` with one and two converter warpgroups, the converter's 96-token
# tile): the GPU tests that run them on small problems. The suite's `check --sanitize` covers the
# standard kernels only (docs/gemm/NOTES.md "FP4 at 16-96 tokens"). Run on the device host after
# `source scripts/device_setup.sh` (a probe: bash scripts/device_session.sh probes
# "forms=bash scripts/fp4_forms_sanitize.sh"); prints each tool's summary, exits non-zero on a
# finding.
set -uo pipefail
san=$(python3 -c 'from forgekernel.bench.sanitize import find_sanitizer; print(find_sanitizer() or "")')
if [ -z "$san" ]; then
  echo "fp4_forms_sanitize: no compute-sanitizer" >&2
  exit 2
fi
tests=(tests/gpu/test_gemm_fp4_masked_gpu.py -k "gives_the_standard_bits or converter_96")
rc=0
for tool in memcheck racecheck synccheck; do
  extra=()
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  echo "== $tool $(date +%T)"
  "$san" --tool "$tool" "${extra[@]}" --error-exitcode 3 python3 -m pytest -q -x "${tests[@]}" \
    2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed|error" | tail -8
  status=${PIPESTATUS[0]}
  echo "rc=$status"
  [ "$status" -ne 0 ] && rc=1
done
exit $rc
