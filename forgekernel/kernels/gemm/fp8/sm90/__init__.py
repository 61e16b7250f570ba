"""Block-scaled FP8 GEMM, sm_90a: the dense GEMM's kernel (`kernels/gemm/dense/sm90/kernel.py`)
with float8_e4m3fn operands and fp32 block scales. DSL-free declaration."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    OUT_DTYPES,
    STANDARD_CONFIGS,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8

    return compile_gemm_fp8(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    dense = [params_for(out, cfg) for out in OUT_DTYPES for cfg in STANDARD_CONFIGS]
    grouped = [params_for(out, GROUPED, True) for out in OUT_DTYPES]
    return dense + grouped


SPEC = KernelSpec(
    name="gemm_fp8_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
