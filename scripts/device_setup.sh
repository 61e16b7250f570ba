# The first lines of every device call, sourced (not run) so that its exports stay:
#   source scripts/device_setup.sh || exit 1; bash scripts/device_streams.sh ...
# A separate file because the setup written inline as `a && b && c && { x; } & y` backgrounds
# the whole AND-list (2026-12-02 04:10: the streams ran before the DSL was installed, every check
# failed on `import tvm_ffi`). Idempotent: a warm host keeps what an earlier call installed.
#   - the prebuilt kernels: .bundle/kernels*.tgz (those carried; `forgekernel bundle`'s
#     kernels.tgz, or tarballs built on the CPU machine: docs/PENDING.md) unpacked into
#     /root/fk-kernels, each once a host;
#   - the wheels: the last chunk .wheels/cN carried (after `stash` of the others), installed by
#     its wheels.sh (the DSL, its tvm-ffi, the comparators) into /root/wheels-site;
#   - FK_BUILD=1: `forgekernel build` of every kernel missing from /root/fk-kernels (the ones
#     whose sources changed since the tarball), all cores, log in /tmp/forgekernel-logs/build.log;
#     FK_BUILD_ARGS="--only KERNEL ..." restricts it to the kernels the call needs, and
#     "--keys benchmarks/keys/sm_90a.jsonl" to the configurations earlier calls loaded
#     (FORGEKERNEL_KEYLOG, below; a configuration missing there compiles at its first call);
#   - exports KERNELS / FORGEKERNEL_KERNEL_DIR, FORGEKERNEL_PENDING_SUITES=1, PYTHONPATH (this
#     tree first) for scripts/device_streams.sh, device_jit_run.sh and the diag scripts.
fk_setup() {
  local chunk tgz mark
  mkdir -p /root/fk-kernels /tmp/forgekernel-logs
  for tgz in .bundle/kernels*.tgz; do  # each carried tarball once a host (its own marker)
    [ -f "$tgz" ] || continue
    mark=/root/fk-kernels/.unpacked-$(basename "$tgz" .tgz)
    if [ ! -f "$mark" ]; then
      tar -xzf "$tgz" -C /root/fk-kernels && touch "$mark" || return 1
    fi
  done
  chunk=$(ls -d .wheels/c* 2>/dev/null | sort -V | tail -1)
  if [ -n "$chunk" ]; then
    # shellcheck disable=SC1090  # the carried chunk's installer
    source "$chunk/wheels.sh" install "$chunk" > /tmp/forgekernel-logs/wheels.log 2>&1 || {
      tail -5 /tmp/forgekernel-logs/wheels.log; return 1; }
  else  # installed by an earlier call of this host
    export PYTHONPATH=/root/wheels-site:/root/wheels-site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  fi
  # the comparators' autotuning results, TileLang's compiled kernels (FlashQLA's) and FlashInfer's
  # JIT modules of earlier hosts (.device-cache, carried; packed back by device_streams.sh): no
  # re-tuning and no nvcc inside a bench's first calls (scripts/comparator_caches.sh). After the
  # wheels: FlashInfer's nvcc modules go into its installed package, as its prebuilt ones.
  # Exported, so that the sidecar children (forgekernel/bench/sidecar.py, which pass the
  # environment on) read the same caches.
  export TRITON_CACHE_AUTOTUNING=1
  export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
  bash scripts/comparator_caches.sh restore || true
  export KERNELS=/root/fk-kernels FORGEKERNEL_KERNEL_DIR=/root/fk-kernels
  export FORGEKERNEL_PENDING_SUITES=1 PYTHONPATH=$PWD:$PYTHONPATH
  # every kernel the call's processes load, one JSON line each (runtime/cache.py): it comes back
  # in logs.tar and take_results.sh keeps the union in benchmarks/keys/, for `build --keys`
  export FORGEKERNEL_KEYLOG=/tmp/forgekernel-logs/keys.jsonl
  python3 -c "import tvm_ffi, cutlass, torch; assert torch.cuda.is_available()" || return 1
  if [ "${FK_BUILD:-0}" = 1 ]; then
    # shellcheck disable=SC2086  # FK_BUILD_ARGS: e.g. "--only gemm_dense_sm90 --only ..."
    python3 -m forgekernel build --arch sm_90a -j "$(nproc)" --out /root/fk-kernels ${FK_BUILD_ARGS:-} \
      > /tmp/forgekernel-logs/build.log 2>&1 || { tail -20 /tmp/forgekernel-logs/build.log; return 1; }
    tail -2 /tmp/forgekernel-logs/build.log
  fi
  echo "device_setup: kernels $(ls /root/fk-kernels | grep -c '\.so$'), DSL ok"
}
fk_setup
