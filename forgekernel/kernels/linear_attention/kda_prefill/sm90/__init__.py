"""Kimi Delta Attention forward (prefill), sm_90a. DSL-free declaration; the kernel is
`recurrence.py` (the state pass: TMA + WGMMA, the state on chip, Gated DeltaNet's state
warpgroups with the per-channel decays in the operands); the first, token-parallel pass
(`operands.py`) runs in torch for now; the op is `forgekernel.ops.kda_chunked`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import (
        compile_kda_recurrence,
    )

    return compile_kda_recurrence(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    return [
        params_for(dtype, dims, initial_state=init, value_split=split)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for init in (False, True)
        for split in (False, True)
    ]


SPEC = KernelSpec(
    name="kda_prefill_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
