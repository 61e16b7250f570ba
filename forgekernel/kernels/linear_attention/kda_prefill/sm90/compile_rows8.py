"""Compile the re-laid-out first pass (`intra_rows8.py`, compile key `layout` "rows8") against
the standard first pass's fake tensors (`compile.compile_kda_intra`: the same arguments). Its
own entry module, so that the standard kernels' import closure (their cache and ledger key)
does not hold the new kernel."""

from __future__ import annotations

from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import compile_kda_intra
from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra_rows8 import KdaIntraRows8Sm90

LAYOUTS = ("rows8",)


def compile_kda_intra_rows8(params: dict, arch: str = "sm_90a", extra_options: str = "",
                            kernel=None):  # fmt: skip
    """kernel: a `KdaIntraRows8Sm90` to compile (the tests read its shared_storage after the
    compile), or None for a fresh one."""
    if params.get("layout") not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {params.get('layout')!r}")
    if kernel is None:
        kernel = KdaIntraRows8Sm90(params["k"])
    return compile_kda_intra(params, arch, extra_options, kernel=kernel)
