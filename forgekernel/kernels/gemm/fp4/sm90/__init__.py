"""FP4-weight (e2m1, UE8M0 per 1x32) grouped GEMM for MoE decode, sm_90a, masked and contiguous
layouts: the weights widened to e4m3 in WGMMA's A register fragments (`kernel.py`). DSL-free
declaration."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.gemm.fp4.sm90.config import (
    CONTIGUOUS_STANDARD_TOKENS,
    OUT_DTYPES,
    STANDARD_TOKENS,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.fp4.sm90.compile import compile_gemm_fp4_grouped

    return compile_gemm_fp4_grouped(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    masked = [params_for(out, h) for out in OUT_DTYPES for h in STANDARD_TOKENS]
    contiguous = [
        params_for(out, h, contiguous=True)
        for out in OUT_DTYPES
        for h in CONTIGUOUS_STANDARD_TOKENS
    ]
    return masked + contiguous


SPEC = KernelSpec(
    name="gemm_fp4_grouped_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
