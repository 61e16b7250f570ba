"""Paged GQA attention decode, sm_90a (split-KV partial pass + combine). DSL-free declaration;
the kernels are `decode_mma.py` (16-bit caches, tensor cores), `decode.py` (FP8 caches, CUDA
cores; the combine pass); the op is `forgekernel.attention_paged`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.paged.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    HEADS,
    MMA_ROWS,
    QTOKENS,
    max_heads,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.paged.sm90.compile import compile_paged

    return compile_paged(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    mma = [
        params_for("mma", dtype, d, h, qtokens=qt)
        for dtype in DTYPES
        for d in HEAD_DIMS
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= MMA_ROWS
    ]
    fp8 = [
        params_for("partial", dtype, d, h, "float8_e4m3fn", qtokens=qt)
        for dtype in DTYPES
        for d in HEAD_DIMS
        for qt in QTOKENS
        for h in HEADS
        if h <= max_heads(d, qt)
    ]
    combine = [params_for("combine", dtype, d) for dtype in DTYPES for d in HEAD_DIMS]
    return mma + fp8 + combine


SPEC = KernelSpec(
    name="attention_paged_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    mma=False,
    representative=lambda: params_for("mma", "bfloat16", 128, 4),
)

__all__ = ["SPEC", "params_for"]
