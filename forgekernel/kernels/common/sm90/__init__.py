"""The Hopper (sm_90a) toolkit under every kernel leaf.

- `constants`: chip limits and numeric constants (DSL-free, so configs can use them).
- `layout`: views of tensors and WGMMA register fragments (no data moves).
- `ptx`: instructions the DSL does not wrap (packed converts, 1-D bulk copies, acquire /
  release on a global counter, proxy fences).
- `pipeline`: the TMA producer / consumer pipelines and shared-memory views.
- `barriers`: named-barrier ids (each kernel an `IntEnum` over `FIRST_FREE`).
- `registers`: setmaxnreg with its direction (.inc / .dec) from the launch's register count.
- `mma`: one warpgroup GEMM over all k-blocks, as one commit group.
- `scheduler/`: tile schedulers (static persistent, longest-first, atomic dynamic).
- `softmax`: masking and online-softmax helpers on WGMMA accumulators.
- `warp_mma`: pieces of the mma.sync kernels that gather rows (paged / sparse caches):
  cp.async row copies into swizzled tiles, accumulators in WGMMA shape, query-row key limits.
- `fake`: fake tensors and options for ahead-of-time compiles.
- `pdl`: programmatic dependent launch, the device side (`griddepcontrol` wait / launch
  dependents behind a build flag) and the contract of every kernel launched with `use_pdl`.

Only `constants` is importable without the DSL; the rest import it at module load.
"""
