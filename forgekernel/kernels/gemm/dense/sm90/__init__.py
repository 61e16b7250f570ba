"""Dense 16-bit GEMM, sm_90a. DSL-free declaration; the kernel itself is `kernel.py`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.gemm.dense.sm90.config import (
    CANDIDATES,
    DTYPES,
    STANDARD_CONFIGS,
    GemmConfig,
    choose_config,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.dense.sm90.compile import compile_gemm

    return compile_gemm(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    return [
        params_for(dtype, b_kn, cfg)
        for dtype in DTYPES
        for b_kn in (False, True)
        for cfg in STANDARD_CONFIGS
    ]


def _candidate_params() -> list[Params]:
    return [params_for("bfloat16", False, cfg) for cfg in CANDIDATES]


SPEC = KernelSpec(
    name="gemm_dense_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "GemmConfig", "choose_config", "params_for"]
