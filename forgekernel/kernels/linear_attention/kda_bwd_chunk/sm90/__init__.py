"""Kimi Delta Attention backward, kernel 2: the chunk-parallel output-side gradients (reference
`reference/kda_bwd.py` `_output_grads`: dq, dk, dw and the per-channel dG finished), sm_90a.
DSL-free declaration; the kernel is `chunk_grads.py`, the launcher `launch.py`, the CPU model
`forgekernel.reference.kda_bwd_chunk`. Wired into KDA's backward, its kernel path (the
default since 2026-12-06; `FORGEKERNEL_KDA_BWD_KERNEL=0`: the interim torch path) with
`ops.kda_bwd.CHUNK_IN_KERNEL` (`_backward_kernel`, after kernel 1's two launches); the WY half
(`_wy_grads`) stays in torch."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.compile import (
        compile_kda_bwd_chunk,
    )

    return compile_kda_bwd_chunk(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # fp32 dw (kernel 2 alone, the torch WY fallback) and 16-bit dw (the device pass's); with
    # it dq16 (the device pass without l2norm at HV = H: the op's dq, no epilogue); dw16 with
    # `token_rows` (the varlen slot layout's dq, dk, dG at their token rows: ops/_linattn_varlen.py
    # NATIVE_STORES)
    flags = ({"dw16": False}, {"dw16": True}, {"dw16": True, "dq16": True},
             {"dw16": True, "token_rows": True})  # fmt: skip
    return [params_for(dtype, **f) for f in flags for dtype in DTYPES]


SPEC = KernelSpec(
    name="kda_bwd_chunk_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
