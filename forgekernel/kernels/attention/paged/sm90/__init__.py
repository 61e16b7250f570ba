"""Paged GQA attention decode, sm_90a (split-KV partial pass + combine). DSL-free declaration;
the kernels are `decode.py` (the partial pass, tensor cores) and `combine.py`; the op is
`forgekernel.attention_paged`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.paged.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    HEADS,
    KV_DTYPES,
    QTOKENS,
    params_for,
)
from forgekernel.kernels.attention.paged.sm90.rows import row_cap
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.paged.sm90.compile import compile_paged

    return compile_paged(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    partial = [
        params_for("partial", dtype, d, h, kv, qt)
        for dtype in DTYPES
        for d in HEAD_DIMS
        for qt in QTOKENS
        for h in HEADS
        for kv in KV_DTYPES
        if h * qt <= row_cap(d, kv)
    ]
    combine = [params_for("combine", dtype, d) for dtype in DTYPES for d in HEAD_DIMS]
    return partial + combine


SPEC = KernelSpec(
    name="attention_paged_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    mma=False,
    representative=lambda: params_for("partial", "bfloat16", 128, 4),
)

__all__ = ["SPEC", "params_for"]
