#!/usr/bin/env bash
# Wheel sets of the sidecar comparators (forgekernel/bench/sidecar.py): each installed on the GPU
# host into a site directory of its own, /root/side-sites/NAME, that only the sidecar's child
# process puts on its PYTHONPATH (the bench's own processes keep /root/wheels-site and the host's
# triton 3.6, which torch 2.11 pins).
#
#   here:  bash scripts/side_wheels.sh pack NAME        -> .wheels-NAME/c1 ... cN (wheels.sh pack)
#   GPU:   bash .wheels-NAME/cK/wheels.sh stash .wheels-NAME/cK    each chunk K < N (carry it)
#          bash scripts/side_wheels.sh install NAME .wheels-NAME/cN   the last chunk (carry it):
#            reassembles /root/wheels/<sha>/piece.*, checks the manifest's sha256, installs into
#            /root/side-sites/NAME (pip --target, no index, no dependencies), prints the export
#            of the sidecar's variable; a host where the same set is installed only prints it.
# Sets (each wheel's Requires-Dist checked against the host image's packages, 2026-12-04):
#   qla  FlashQLA: flash-qla 0.1.3, tilelang 0.1.15 (pins apache-tvm-ffi < 0.1.13 and z3-solver
#        < 4.15.5; needs torch-c-dlpack-ext below Python 3.14), apache-tvm-ffi 0.1.12, z3-solver
#        4.15.4.0, torch-c-dlpack-ext 0.1.5 (the host has cloudpickle, ml-dtypes, numpy, psutil,
#        torch, tqdm, typing-extensions). The child drops /root/wheels-site, whose tvm-ffi
#        0.1.15 would win. Variable FK_SIDE_SITE_FLASHQLA.
#   tri  triton 3.7.1 (fla 0.6.0's gated backward refuses triton >= 3.4.0, < 3.7.1 on Hopper; no
#        runtime Requires-Dist on Python 3.12; ~198 MB, 4 chunks),
#        shadowing the host's 3.6 in the child only; fla itself stays in /root/wheels-site.
#        Variable FK_SIDE_SITE_TRITON.
set -euo pipefail
cmd=${1:?pack|install}
name=${2:?qla|tri}
case $name in
  qla) specs=(flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 z3-solver==4.15.4.0
              torch-c-dlpack-ext==0.1.5)
       var=FK_SIDE_SITE_FLASHQLA ;;
  tri) specs=(triton==3.7.1); var=FK_SIDE_SITE_TRITON ;;
  *) echo "side_wheels.sh: unknown set $name (qla, tri)" >&2; exit 2 ;;
esac
here=$(cd "$(dirname "$0")/.." && pwd)
root=${SIDE_ROOT:-/root}  # where wheels.sh stashes (/root/wheels) and the sites go
case $cmd in
  pack)
    cd "$here"
    # worktrees share the main checkout's info/exclude (wheels.sh writes the worktree's own)
    exclude="$(git rev-parse --git-common-dir)/info/exclude"
    grep -qx "/.wheels-$name/" "$exclude" 2>/dev/null || echo "/.wheels-$name/" >> "$exclude"
    # from outside the checkout: wheels.sh would write the worktree's own info/exclude
    (cd /tmp && bash "$here/../shared/gpu-host/wheels.sh" pack "$here/.wheels-$name" "${specs[@]}")
    ;;
  install)
    dir=$(cd "${3:?the last chunk, .wheels-$name/cN}" && pwd)
    site=$root/side-sites/$name
    read -r n sha < "$dir/manifest"
    if [ "$(cat "$site/.sha" 2>/dev/null)" != "$sha" ]; then
      w=$root/wheels/$sha
      mkdir -p "$w" && cp "$dir"/piece.* "$w/"
      have=$(ls "$w"/piece.* | wc -l)
      [ "$have" = "$n" ] || { echo "have $have of $n pieces: stash every chunk first" >&2; exit 1; }
      cat "$w"/piece.* > "$w/all.tar"
      [ "$(sha256sum "$w/all.tar" | cut -d' ' -f1)" = "$sha" ] \
        || { echo "reassembled archive is corrupt (sha256 differs from the manifest)" >&2; exit 1; }
      rm -rf "$w/whl" "$site" && mkdir -p "$w/whl" && tar -xf "$w/all.tar" -C "$w/whl"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$site" "$w"/whl/*.whl
      echo "$sha" > "$site/.sha"
      rm -f "$w/all.tar"
    fi
    echo "installed $(ls "$root/wheels/$sha/whl" | tr '\n' ' ')into $site"
    echo "export $var=$site"
    ;;
  *) echo "side_wheels.sh: unknown command $cmd (pack, install)" >&2; exit 2 ;;
esac
