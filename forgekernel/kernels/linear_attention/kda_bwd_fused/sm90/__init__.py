"""Kimi Delta Attention backward, kernel 2 and the WY kernel fused: one CTA per chunk-head runs
kernel 2's products, then the WY products, with dw, k and G on chip (sm_90a). DSL-free
declaration; the kernel is `fused_grads.py`, the launcher `launch.py`, the CPU model
`forgekernel.reference.kda_bwd_fused`. Behind ops/kda_bwd.py FUSED (off until a GPU A/B): it
replaces the kda_bwd_chunk and kda_bwd_wy launches on the device pass."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.compile import (
        compile_kda_bwd_fused,
    )

    return compile_kda_bwd_fused(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # the device pass's forms (built by `build --only kda_bwd_fused_sm90` for the switch's A/B;
    # no run takes them with FUSED off): 16-bit dv (a 16-bit v), with it dk16 (no l2norm at
    # HV = H: the bench's)
    flags = ({"dv16": True}, {"dv16": True, "dk16": True})
    return [params_for(dtype, **f) for f in flags for dtype in DTYPES]


def _candidate_params() -> list[Params]:
    # the varlen slot layout's gradients at their token rows (both kernels' `token_rows`,
    # ops/_linattn_varlen.py NATIVE_STORES); the op's other forms, which the GPU tests load too
    # (tests/gpu/test_kda_bwd_fused_gpu.py FLAGS): fp32 dv (an fp32 v) and FINAL_QK's dq16
    # (`build --candidates`: no first call of the tests compiles, ~15 s a key on a CPU core)
    rows = ({"dv16": True}, {"dv16": True, "dk16": True})
    other = ({}, {"dq16": True, "dv16": True, "dk16": True})
    return [params_for(dtype, **f, token_rows=True) for f in rows for dtype in DTYPES] + [
        params_for(dtype, **f) for f in other for dtype in DTYPES
    ]


SPEC = KernelSpec(
    name="kda_bwd_fused_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "params_for"]
