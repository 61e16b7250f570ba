#!/usr/bin/env bash
# The comparators' tuned configurations, carried from one device host to the next, so that a
# fresh host does not autotune them again inside a bench's first calls (2026-12-06, H100: kda_bwd's
# first case spent 235 s there, gdn_bwd's 104 s on fla's forward before its backward refused
# triton 3.6; scripts/warm_comparators.py moves that cost, this removes it on later hosts).
# What is kept: Triton's autotuning results, `*.autotune.json` under the Triton cache (written
# where an autotuner caches its results, as fla-core's do: one small JSON per kernel and tuning
# key, keyed by the triton version, the target and the kernel's source, so a sidecar's triton
# 3.7.1 keeps its own). Not the compiled kernels: the chosen configuration compiles at its first
# call (seconds). Kept per GPU model (the bench's comparators tune on the card they run on).
#
#   bash scripts/comparator_caches.sh pack OUT      # device: the host's results -> OUT/comparator-caches.tar
#   bash scripts/comparator_caches.sh restore       # device: .device-cache/GPU/ -> the Triton cache
#   bash scripts/comparator_caches.sh take DIR      # here: DIR/comparator-caches.tar -> .device-cache/GPU/ (union)
#
# .device-cache/ is git-ignored: carry it with the call (`carry: [".device-cache"]`, a few KB).
set -uo pipefail
cmd=${1:?pack OUT | restore | take DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
store=${FK_DEVICE_CACHE:-$root/.device-cache}

gpu_slug() {  # "NVIDIA H100 80GB HBM3" -> NVIDIA_H100_80GB_HBM3
  tr -c 'A-Za-z0-9\n' '_' <<< "$1" | head -1
}

case $cmd in
  pack)
    out=${2:?pack OUT}
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    [ -n "$gpu" ] && [ -d "$triton_cache" ] || exit 0
    tmp=$(mktemp -d)
    printf '%s\n' "$gpu" > "$tmp/gpu.txt"
    (cd "$triton_cache" && find . -name '*.autotune.json') > "$tmp/list"
    if [ -s "$tmp/list" ]; then
      tar -cf "$out/comparator-caches.tar" -C "$tmp" gpu.txt \
        && tar -rf "$out/comparator-caches.tar" -C "$triton_cache" --transform 's|^\./|triton/|' \
          -T "$tmp/list" \
        && echo "comparator_caches: packed $(wc -l < "$tmp/list") autotuning results ($gpu)"
    fi
    rm -rf "$tmp"
    ;;
  restore)
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    src=$store/$(gpu_slug "$gpu")/triton
    [ -n "$gpu" ] && [ -d "$src" ] || exit 0
    mkdir -p "$triton_cache" && cp -rn "$src"/. "$triton_cache"/
    echo "comparator_caches: restored $(find "$src" -name '*.autotune.json' | wc -l) autotuning results ($gpu)"
    ;;
  take)
    tarball=${2:?take DIR}/comparator-caches.tar
    [ -f "$tarball" ] || exit 0
    gpu=$(tar -xOf "$tarball" gpu.txt) || exit 1
    dest=$store/$(gpu_slug "$gpu")
    mkdir -p "$dest" && tar -xf "$tarball" -C "$dest" --exclude gpu.txt
    echo "comparator_caches: $(find "$dest/triton" -name '*.autotune.json' | wc -l) autotuning results kept for $gpu in ${dest#"$root"/}"
    ;;
  *)
    echo "comparator_caches.sh: unknown command $cmd (pack, restore, take)" >&2
    exit 2
    ;;
esac
