#!/usr/bin/env bash
# Copy what scripts/device_run.sh wrote under $OUT (fetched to DIR) into the repository.
#   bash scripts/take_results.sh DIR
set -euo pipefail
src=${1:?usage: take_results.sh DIR (where the device run OUT was fetched)}
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -f "$src/results.tar" ] && [ ! -d "$src/results" ]; then  # scripts/device_streams.sh
  mkdir -p "$src/results" 2>/dev/null || { tmp=$(mktemp -d); cp -r "$src"/. "$tmp"; src=$tmp; mkdir -p "$src/results"; }
  tar -xf "$src/results.tar" -C "$src/results"
fi
for f in "$src"/results/*/*.json; do
  [ -e "$f" ] || continue
  arch=$(basename "$(dirname "$f")")
  # the ledger's sections this call lacks but an earlier call wrote on the same sources stay
  # (a partial bench too, until a call brings that suite's complete bench section)
  python3 -c "import sys; from forgekernel.bench.ledger import take; take(*sys.argv[1:])" \
    "$f" "$root/benchmarks/results/$arch/$(basename "$f")"
done
if [ -f "$src/reports.tar" ]; then  # scripts/device_jit_run.sh packs its reports
  mkdir -p "$src/reports" 2>/dev/null || { tmp=$(mktemp -d); cp -r "$src"/. "$tmp"; src=$tmp; }
  mkdir -p "$src/reports" && tar -xf "$src/reports.tar" -C "$src/reports"
fi
if ls "$src"/reports/* >/dev/null 2>&1; then
  arch=$(ls "$src"/results 2>/dev/null | head -1); arch=${arch:-sm_90a}
  mkdir -p "$root/benchmarks/reports/$arch" && cp "$src"/reports/* "$root/benchmarks/reports/$arch/"
fi
# the kernels the call loaded (scripts/device_setup.sh's FORGEKERNEL_KEYLOG), kept as the union
# of every call's: `forgekernel build --keys benchmarks/keys/sm_90a.jsonl` builds only those
if [ -f "$src/logs.tar" ] && tar -tf "$src/logs.tar" ./keys.jsonl > /dev/null 2>&1; then
  keys=$root/benchmarks/keys/sm_90a.jsonl
  call=$(mktemp)
  tar -xOf "$src/logs.tar" ./keys.jsonl > "$call"
  mkdir -p "$(dirname "$keys")"
  { [ -f "$keys" ] && cat "$keys"; cat "$call"; } | sort -u > "$keys.new"
  mv "$keys.new" "$keys"
  # loaded but not built by `forgekernel build --candidates`: compiled at their first call there
  python3 -c "
import sys
from forgekernel.runtime.build import build_tasks
from forgekernel.runtime.cache import read_keylog
built = set(build_tasks('sm_90a', candidates=True))
for name, params in read_keylog(sys.argv[1]):
    if (name, params) not in built:
        print(f'take_results: loaded, not prebuilt: {name} {dict(params)}')
" "$call"
  rm -f "$call"
fi
# the comparators' autotuning results, TileLang's compiled kernels and FlashInfer's JIT modules
# (scripts/comparator_caches.sh): .device-cache, git-ignored (a GPU model at most 18 MiB of
# kernels, FK_COMPARATOR_CACHE_MB, and 8 of modules, FK_FLASHINFER_CACHE_MB), carried by the next
# session's calls
bash "$root/scripts/comparator_caches.sh" take "$src" || true
git -C "$root" status --short benchmarks
