#!/usr/bin/env bash
# The comparators' caches, carried from one device host to the next, so that a fresh host neither
# autotunes nor JIT-compiles them again inside a bench's first calls (2026-12-06, H100: kda_bwd's
# first case spent 235 s there, gdn_bwd's 104 s on fla's forward before its backward refused
# triton 3.6; 2026-12-06 08:25, a fresh host: gdn_bwd's first case 293 s in its sidecars, FlashQLA's
# nvcc compiles and fla's tuning, kda_bwd's 200 s; scripts/warm_comparators.py moves that cost,
# this removes it on later hosts). Kept per GPU model (the comparators tune and compile for the
# card they run on). What is kept:
#   - triton/: Triton's autotuning results, `*.autotune.json` under the Triton cache (written where
#     an autotuner caches its results, as fla-core's do with TRITON_CACHE_AUTOTUNING=1: one small
#     JSON per kernel and tuning key, keyed by the triton version, the target and the kernel's
#     source, so a sidecar's triton 3.7.1 keeps its own). Not the compiled kernels: a swept host's
#     cache holds every configuration the sweep compiled (~0.3-1 MB each, cubin + IRs) with nothing
#     saying which one the JSON chose, their group files name absolute paths, and the chosen one
#     compiles at its first call in about a second (a 128x128x64 bf16 dot: 0.7 s, 435 KB entry).
#   - tilelang/: TileLang's compiled kernels (FlashQLA's, tilelang 0.1.15), the entries of its
#     disk cache $TILELANG_CACHE_DIR (default ~/.tilelang/cache), laid out
#     <tilelang version>/<os>-<machine>/kernels/<sha256 key>/{device_kernel.cu, host_kernel.cu,
#     executable.so, params.json, manifest.json}; the key hashes the kernel's TIR, its arguments,
#     the target (the card's arch), pass configs and tilelang's version, so an entry is loaded
#     (no nvcc) only where it fits. The .so holds a cubin from the host's nvcc: entries are kept
#     with the nvcc release that built them (tilelang/cuda.txt) and restored only under the same.
#     Newest entries first up to FK_COMPARATOR_CACHE_MB (default 12) MiB a GPU model, in the tar
#     and in the store (the tar comes back as one file of at most 16 MiB, the store travels with
#     every call that carries it); what does not fit is named.
#
#   bash scripts/comparator_caches.sh pack OUT      # device: the host's caches -> OUT/comparator-caches.tar
#   bash scripts/comparator_caches.sh restore       # device: .device-cache/GPU/ -> the Triton and TileLang caches
#   bash scripts/comparator_caches.sh take DIR      # here: DIR/comparator-caches.tar -> .device-cache/GPU/ (union)
#
# .device-cache/ is git-ignored: carry it with the call (`carry: [".device-cache"]`, a few MB).
set -uo pipefail
cmd=${1:?pack OUT | restore | take DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
tl_cache=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
store=${FK_DEVICE_CACHE:-$root/.device-cache}
cap=$(( ${FK_COMPARATOR_CACHE_MB:-12} * 1024 * 1024 ))

gpu_slug() {  # "NVIDIA H100 80GB HBM3" -> NVIDIA_H100_80GB_HBM3
  tr -c 'A-Za-z0-9\n' '_' <<< "$1" | head -1
}

gpu_name() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
}

cuda_release() {  # the nvcc tilelang compiles with (its _find_cuda_home): "release 12.8" or "unknown"
  local home=${CUDA_HOME:-${CUDA_PATH:-}} nvcc
  if [ -n "$home" ]; then nvcc=$home/bin/nvcc
  else nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  fi
  "$nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' | head -1 | grep . || echo unknown
}

tl_entries() {  # DIR -> "mtime bytes path" per kernel entry under DIR, newest first
  local dir=$1 rel
  [ -d "$dir" ] || return 0
  (cd "$dir" && find . -mindepth 4 -maxdepth 4 -type d -path './*/*/kernels/*' -printf '%T@ %P\n') \
    | sort -rn | while read -r t rel; do
      echo "$t $(find "$dir/$rel" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}') $rel"
    done
}

tl_fit() {  # DIR -> the entries (paths) that fit under the cap, newest first; the others named on stderr
  local total=0 t n rel
  tl_entries "$1" | while read -r t n rel; do
    if [ $((total + n)) -le "$cap" ]; then
      total=$((total + n)); echo "$rel"
    else
      echo "comparator_caches: dropped tilelang ${rel##*/} ($((n / 1024)) KB, over ${cap} bytes)" >&2
    fi
  done
}

count_tl() {  # DIR -> "N kernels, M KB"
  local n kb
  n=$(tl_entries "$1" | wc -l)
  kb=$(tl_entries "$1" | awk '{s += $2} END {print int(s / 1024)}')
  echo "$n compiled TileLang kernels (${kb} KB)"
}

case $cmd in
  pack)
    out=${2:?pack OUT}
    gpu=$(gpu_name)
    [ -n "$gpu" ] || exit 0
    tmp=$(mktemp -d)
    printf '%s\n' "$gpu" > "$tmp/gpu.txt"
    : > "$tmp/list"
    [ -d "$triton_cache" ] && (cd "$triton_cache" && find . -name '*.autotune.json') > "$tmp/list"
    tl_fit "$tl_cache" > "$tmp/tl"
    if [ -s "$tmp/list" ] || [ -s "$tmp/tl" ]; then
      tarball=$out/comparator-caches.tar
      tar -cf "$tarball" -C "$tmp" gpu.txt || { rm -rf "$tmp"; exit 1; }
      if [ -s "$tmp/list" ]; then
        tar -rf "$tarball" -C "$triton_cache" --transform 's|^\./|triton/|' -T "$tmp/list"
      fi
      if [ -s "$tmp/tl" ]; then
        mkdir -p "$tmp/tilelang" && cuda_release > "$tmp/tilelang/cuda.txt"
        tar -rf "$tarball" -C "$tmp" tilelang/cuda.txt \
          && tar -rf "$tarball" -C "$tl_cache" --transform 's|^|tilelang/|' -T "$tmp/tl"
      fi
      echo "comparator_caches: packed $(wc -l < "$tmp/list") autotuning results," \
        "$(wc -l < "$tmp/tl") compiled TileLang kernels ($gpu, $(( $(stat -c %s "$tarball") / 1024 )) KB)"
    fi
    rm -rf "$tmp"
    ;;
  restore)
    gpu=$(gpu_name)
    [ -n "$gpu" ] || exit 0
    src=$store/$(gpu_slug "$gpu")
    if [ -d "$src/triton" ]; then
      mkdir -p "$triton_cache" && cp -rn "$src/triton"/. "$triton_cache"/
      echo "comparator_caches: restored $(find "$src/triton" -name '*.autotune.json' | wc -l) autotuning results ($gpu)"
    fi
    if [ -d "$src/tilelang" ]; then
      built=$(cat "$src/tilelang/cuda.txt" 2>/dev/null) here=$(cuda_release)
      if [ "$built" != "$here" ]; then
        echo "comparator_caches: TileLang kernels built with nvcc ${built:-?}, this host has $here: not restored"
      else
        mkdir -p "$tl_cache"
        for d in "$src/tilelang"/*/; do cp -rnp "$d" "$tl_cache"/; done  # mtimes kept: newest first
        echo "comparator_caches: restored $(count_tl "$src/tilelang") ($gpu, nvcc $here)"
      fi
    fi
    ;;
  take)
    tarball=${2:?take DIR}/comparator-caches.tar
    [ -f "$tarball" ] || exit 0
    gpu=$(tar -xOf "$tarball" gpu.txt) || exit 1
    dest=$store/$(gpu_slug "$gpu")
    mkdir -p "$dest"
    came=$(tar -xOf "$tarball" tilelang/cuda.txt 2>/dev/null)
    if [ -n "$came" ] && [ "$came" != "$(cat "$dest/tilelang/cuda.txt" 2>/dev/null)" ]; then
      rm -rf "$dest/tilelang"  # built by another nvcc: the newer host's replace them
    fi
    tar -xf "$tarball" -C "$dest" --exclude gpu.txt || exit 1
    if [ -d "$dest/tilelang" ]; then  # the union, cut back to the cap (oldest out)
      tl_fit "$dest/tilelang" > "$dest/.keep"
      tl_entries "$dest/tilelang" | while read -r _ _ rel; do
        grep -qxF "$rel" "$dest/.keep" || rm -rf "${dest:?}/tilelang/$rel"
      done
      rm -f "$dest/.keep"
    fi
    echo "comparator_caches: $(find "$dest/triton" -name '*.autotune.json' 2>/dev/null | wc -l) autotuning results," \
      "$(count_tl "$dest/tilelang") kept for $gpu in ${dest#"$root"/}"
    ;;
  *)
    echo "comparator_caches.sh: unknown command $cmd (pack, restore, take)" >&2
    exit 2
    ;;
esac
