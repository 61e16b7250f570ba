"""Kimi Delta Attention backward, the WY kernel: the chunk-parallel WY half (reference
`reference/kda_bwd.py` `_wy_grads`: dk's WY part, dv, dbeta and its per-channel dG finished
within the chunk), sm_90a. DSL-free declaration; the kernel is `wy_grads.py`, the launcher
`launch.py`, the CPU model `forgekernel.reference.kda_bwd_wy`. Wired into KDA's backward,
its kernel path, with `ops.kda_bwd.WY_IN_KERNEL` (on by default since 2026-12-06), after kernel
2 (kda_bwd_chunk: its dw)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.compile import compile_kda_bwd_wy

    return compile_kda_bwd_wy(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # fp32 dv (an fp32 v) and 16-bit dv (the device pass with a 16-bit v); with it dk16 (the
    # device pass without l2norm at HV = H: the op's dk, no epilogue); the 16-bit-dv forms with
    # `token_rows` (the varlen slot layout's gradients at their token rows:
    # ops/_linattn_varlen.py NATIVE_STORES)
    flags = ({"dv16": False}, {"dv16": True}, {"dv16": True, "dk16": True},
             {"dv16": True, "token_rows": True},
             {"dv16": True, "dk16": True, "token_rows": True})  # fmt: skip
    return [params_for(dtype, **f) for f in flags for dtype in DTYPES]


SPEC = KernelSpec(
    name="kda_bwd_wy_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
