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
#   - flashinfer/: FlashInfer's JIT modules (flashinfer-python 0.7.2.post1: attention_paged's
#     batch prefill / decode, mla_decode's MLA, gdn_decode's CuTe DSL kernels), the modules of its
#     cache ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/<version>/<arch>/cached_ops/,
#     kept with the nvcc release that built them (flashinfer/cuda.txt; their .so links the
#     toolkit's libcudart) and restored only under the same nvcc and FlashInfer version:
#       - an nvcc module <m>/ carries its <m>.so alone, restored as FlashInfer's own prebuilt
#         module, <package>/data/aot/<m>/<m>.so, which it loads before building anything
#         (jit/env.py get_aot_artifacts, jit/core.py JitSpecNvcc.try_load; one that fails to load
#         is built as before). Back in cached_ops/ it would be built again: FlashInfer always
#         runs ninja on a JIT module, and ninja rebuilds an output its .ninja_log lacks, or one
#         older than its inputs, which pip's install on the new host has just written.
#       - a CuTe DSL module <m>_<arch>_cute_dsl/ carries its kernels' .o and meta.json, restored
#         where it was: FlashInfer loads a kernel's .o where meta.json names this host's DSL
#         version, arch and sources' hash (jit/cute_dsl_core.py), and compiles it otherwise.
#     Not FlashInfer's sm90 GDN prefill (gdn_prefill's comparator): its kernels are compiled by
#     `cute.compile` into a dict of the process (gdn_kernels/delta_rule_dsl/
#     custom_compile_cache.py; `cute.compile` sets no_cache, so the DSL's own file cache is not
#     used either): nothing on disk to carry, each process compiles them at its first call.
#     Each kind newest first up to its cap a GPU model, in the tar and in the store:
#     FK_COMPARATOR_CACHE_MB MiB of TileLang's kernels (default 18; 12 until 2026-12-07, when the
#     gdn_prefill and kda_bwd benches' packs each dropped 8-9 of FlashQLA's kernels: ~40 in all,
#     ~17 MB) and FK_FLASHINFER_CACHE_MB of FlashInfer's modules (default 8; apart, since a few MB
#     of FlashInfer .so, ~30 s of nvcc each, would otherwise push out several of FlashQLA's
#     ~0.4 MB kernels, whose compiles cost a fresh host's gdn_bwd 293 s with fla's tuning); what
#     does not fit is named. The tar comes back gzipped, one file of at most 16 MiB (12.3 MB of
#     TileLang entries: ~2.2 MB); the store travels with every call that carries it.
#
#   bash scripts/comparator_caches.sh pack OUT      # device: the host's caches -> OUT/comparator-caches.tar.gz
#   bash scripts/comparator_caches.sh restore       # device: .device-cache/GPU/ -> the Triton, TileLang, FlashInfer caches
#   bash scripts/comparator_caches.sh take DIR      # here: DIR/comparator-caches.tar.gz -> .device-cache/GPU/ (union)
#
# .device-cache/ is git-ignored: carry it with the call (`carry: [".device-cache"]`, <= 28 MB: the
# tree is ~35 MB of the call's 64 MiB; with stores of two GPU models past that, carry the one
# of the GPU the call gets, `.device-cache/NVIDIA_H100_80GB_HBM3`).
set -uo pipefail
cmd=${1:?pack OUT | restore | take DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
tl_cache=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
fi_cache=${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer
store=${FK_DEVICE_CACHE:-$root/.device-cache}
mib=$((1024 * 1024))
declare -A cap=([tilelang]=$((${FK_COMPARATOR_CACHE_MB:-18} * mib))
                [flashinfer]=$((${FK_FLASHINFER_CACHE_MB:-8} * mib)))

gpu_slug() {  # "NVIDIA H100 80GB HBM3" -> NVIDIA_H100_80GB_HBM3
  tr -c 'A-Za-z0-9\n' '_' <<< "$1" | head -1
}

gpu_name() {
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
}

cuda_release() {  # the nvcc tilelang and FlashInfer compile with (tilelang's _find_cuda_home,
  # FlashInfer's get_cuda_path: CUDA_HOME, CUDA_PATH, nvcc on PATH): "release 12.8" or "unknown"
  local home=${CUDA_HOME:-${CUDA_PATH:-}} nvcc
  if [ -n "$home" ]; then nvcc=$home/bin/nvcc
  else nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  fi
  "$nvcc" --version 2>/dev/null | grep -o 'release [0-9.]*' | head -1 | grep . || echo unknown
}

fi_files() {  # DIR REL -> the files of FlashInfer's module DIR/REL that load on another host
  local dir=$1 rel=$2
  if [ -f "$dir/$rel/${rel##*/}.so" ]; then
    echo "$rel/${rel##*/}.so"  # nvcc: the linked module (its objects and ninja files stay)
  elif [ -f "$dir/$rel/meta.json" ]; then  # CuTe DSL: the kernels and their meta.json
    (cd "$dir" && find "$rel" -maxdepth 1 -type f \( -name '*.o' -o -name meta.json \))
  fi
}

entries() {  # KIND DIR -> "mtime bytes path" per entry of KIND (tilelang, flashinfer), newest first
  local kind=$1 dir=$2 t rel
  [ -d "$dir" ] || return 0
  if [ "$kind" = tilelang ]; then  # a kernel's folder and its mtime
    (cd "$dir" && find . -mindepth 4 -maxdepth 4 -type d -path './*/*/kernels/*' -printf '%T@ %P\n') \
      | while read -r t rel; do
        find "$dir/$rel" -type f -printf '%s\n' \
          | awk -v e="$t" -v r="$rel" '{s += $1} END {print e, s + 0, r}'
      done | sort -rn
  else  # a module's folder, the newest mtime of the files it carries (the tar keeps no folder)
    (cd "$dir" && find . -mindepth 4 -maxdepth 4 -type d -path './*/*/cached_ops/*' -printf '%P\n') \
      | while read -r rel; do
        fi_files "$dir" "$rel" | (cd "$dir" && xargs -r stat -c '%Y %s') | awk -v r="$rel" \
          '$1 > t {t = $1} {s += $2} END {if (NR) print t, s, r}'
      done | sort -rn
  fi
}

fit() {  # KIND DIR -> the entries (paths) under KIND's cap, newest first; the others named on stderr
  local total=0 t n rel
  entries "$1" "$2" | while read -r t n rel; do
    if [ $((total + n)) -le "${cap[$1]}" ]; then
      total=$((total + n)); echo "$rel"
    else
      echo "comparator_caches: dropped $1 ${rel##*/} ($((n / 1024)) KB, over ${cap[$1]} bytes)" >&2
    fi
  done
}

count() {  # KIND DIR -> "N compiled TileLang kernels (M KB)" / "N FlashInfer modules (M KB)"
  local what="compiled TileLang kernels"
  [ "$1" = flashinfer ] && what="FlashInfer modules"
  entries "$1" "$2" | awk -v w="$what" '{s += $2} END {print NR, w, "(" int(s / 1024), "KB)"}'
}

fi_package() {  # the folder of the flashinfer package python3 would import (found, not imported)
  python3 -c 'import importlib.util as u; s = u.find_spec("flashinfer")
print(s.submodule_search_locations[0] if s and s.submodule_search_locations else "")' 2>/dev/null
}

restore_flashinfer() {  # SRC GPU NVCC: SRC/<version>/<arch>/cached_ops/* -> this host's FlashInfer
  local src=$1 gpu=$2 nvcc=$3 pkg version n=0 rel m
  pkg=$(fi_package)
  version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$pkg/_build_meta.py" 2>/dev/null)
  if [ -z "$version" ]; then
    echo "comparator_caches: no FlashInfer wheel installed here: its modules not restored"
    return 0
  fi
  while read -r _ _ rel; do
    [ "${rel%%/*}" = "$version" ] || continue  # another FlashInfer's modules: not this one's
    m=${rel##*/}
    if [ -f "$src/$rel/$m.so" ]; then  # as its prebuilt module: loaded without ninja
      mkdir -p "$pkg/data/aot/$m" && cp -np "$src/$rel/$m.so" "$pkg/data/aot/$m/"
    else  # a CuTe DSL module: where FlashInfer looks, its meta.json decides
      mkdir -p "$fi_cache/${rel%/*}" && cp -rnp "$src/$rel" "$fi_cache/${rel%/*}/"
    fi
    n=$((n + 1))
  done < <(entries flashinfer "$src")
  echo "comparator_caches: restored $n FlashInfer $version modules ($gpu, nvcc $nvcc)"
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
    fit tilelang "$tl_cache" > "$tmp/tilelang.list"
    fit flashinfer "$fi_cache" > "$tmp/flashinfer.list"
    while read -r rel; do fi_files "$fi_cache" "$rel"; done < "$tmp/flashinfer.list" > "$tmp/fi-files"
    if [ -s "$tmp/list" ] || [ -s "$tmp/tilelang.list" ] || [ -s "$tmp/flashinfer.list" ]; then
      tarball=$tmp/comparator-caches.tar
      tar -cf "$tarball" -C "$tmp" gpu.txt || { rm -rf "$tmp"; exit 1; }
      if [ -s "$tmp/list" ]; then
        tar -rf "$tarball" -C "$triton_cache" --transform 's|^\./|triton/|' -T "$tmp/list"
      fi
      for kind in tilelang flashinfer; do  # each with the nvcc release that built it
        [ -s "$tmp/$kind.list" ] || continue
        mkdir -p "$tmp/$kind" && cuda_release > "$tmp/$kind/cuda.txt"
        tar -rf "$tarball" -C "$tmp" "$kind/cuda.txt"
      done
      if [ -s "$tmp/tilelang.list" ]; then
        tar -rf "$tarball" -C "$tl_cache" --transform 's|^|tilelang/|' -T "$tmp/tilelang.list"
      fi
      if [ -s "$tmp/fi-files" ]; then
        tar -rf "$tarball" -C "$fi_cache" --transform 's|^|flashinfer/|' -T "$tmp/fi-files"
      fi
      gzip -c "$tarball" > "$out/comparator-caches.tar.gz" || { rm -rf "$tmp"; exit 1; }
      kb=$(( $(stat -c %s "$out/comparator-caches.tar.gz") / 1024 ))
      echo "comparator_caches: packed $(wc -l < "$tmp/list") autotuning results," \
        "$(wc -l < "$tmp/tilelang.list") compiled TileLang kernels," \
        "$(wc -l < "$tmp/flashinfer.list") FlashInfer modules ($gpu, $kb KB gzipped)"
      if [ "$kb" -gt $((16 * 1024)) ]; then
        echo "comparator_caches: $kb KB, over the 16 MiB a file that comes back: lower the caps" >&2
      fi
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
    here=$(cuda_release)
    if [ -d "$src/tilelang" ]; then
      built=$(cat "$src/tilelang/cuda.txt" 2>/dev/null)
      if [ "$built" != "$here" ]; then
        echo "comparator_caches: TileLang kernels built with nvcc ${built:-?}, this host has $here: not restored"
      else
        mkdir -p "$tl_cache"
        for d in "$src/tilelang"/*/; do cp -rnp "$d" "$tl_cache"/; done  # mtimes kept: newest first
        echo "comparator_caches: restored $(count tilelang "$src/tilelang") ($gpu, nvcc $here)"
      fi
    fi
    if [ -d "$src/flashinfer" ]; then
      built=$(cat "$src/flashinfer/cuda.txt" 2>/dev/null)
      if [ "$built" != "$here" ]; then
        echo "comparator_caches: FlashInfer modules built with nvcc ${built:-?}, this host has $here: not restored"
      else
        restore_flashinfer "$src/flashinfer" "$gpu" "$here"
      fi
    fi
    ;;
  take)
    dir=${2:?take DIR}
    # .tar: a call packed by the scripts before 2026-12-07 (tar reads either form)
    tarball=$(ls "$dir"/comparator-caches.tar.gz "$dir"/comparator-caches.tar 2>/dev/null | head -1)
    [ -n "$tarball" ] || exit 0
    gpu=$(tar -xOf "$tarball" gpu.txt) || exit 1
    dest=$store/$(gpu_slug "$gpu")
    mkdir -p "$dest"
    for kind in tilelang flashinfer; do
      came=$(tar -xOf "$tarball" "$kind/cuda.txt" 2>/dev/null)
      if [ -n "$came" ] && [ "$came" != "$(cat "$dest/$kind/cuda.txt" 2>/dev/null)" ]; then
        rm -rf "${dest:?}/$kind"  # built by another nvcc: the newer host's replace them
      fi
    done
    tar -xf "$tarball" -C "$dest" --exclude gpu.txt || exit 1
    for kind in tilelang flashinfer; do  # the union, cut back to the cap (oldest out)
      fit "$kind" "$dest/$kind" > "$dest/.keep"
      entries "$kind" "$dest/$kind" | while read -r _ _ rel; do
        grep -qxF "$rel" "$dest/.keep" || rm -rf "${dest:?}/$kind/$rel"
      done
    done
    rm -f "$dest/.keep"
    echo "comparator_caches: $(find "$dest/triton" -name '*.autotune.json' 2>/dev/null | wc -l) autotuning results," \
      "$(count tilelang "$dest/tilelang"), $(count flashinfer "$dest/flashinfer") kept for $gpu" \
      "in ${dest#"$root"/}"
    ;;
  *)
    echo "comparator_caches.sh: unknown command $cmd (pack, restore, take)" >&2
    exit 2
    ;;
esac
