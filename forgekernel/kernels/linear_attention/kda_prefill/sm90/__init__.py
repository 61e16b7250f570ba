"""Kimi Delta Attention forward (prefill), sm_90a. DSL-free declaration; the kernel is
`recurrence.py` (the state pass: TMA + WGMMA, the state on chip, Gated DeltaNet's state
warpgroups with the per-channel decays in the operands) and `intra.py` (the first,
token-parallel pass: every chunk's operands; its torch model is `operands.py`); the op is
`forgekernel.ops.kda_chunked`."""

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


def _compile_intra(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import compile_kda_intra

    return compile_kda_intra(dict(params), "sm_90a", extra_options)


def intra_params_for(dtype: str, k: int = 128, *, bwd: bool = False) -> Params:
    """The first pass's compile key: the q / k dtype and K; bwd (opt-in, named in the key only
    when on): also write the KDA backward's tt and big_g (`intra.py`)."""
    key = {"dtype": dtype, "k": k}
    if bwd:
        key["bwd"] = True
    return tuple(sorted(key.items()))


def _standard_params() -> list[Params]:
    return [
        params_for(dtype, dims, initial_state=init, value_split=split)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for init in (False, True)
        for split in (False, True)
    ]


def _intra_standard_params() -> list[Params]:
    """The forward's keys, then the KDA backward's (`bwd`: bf16 only, the backward's first-pass
    dtype, ops/kda_bwd.py FIRST_PASS_DTYPES: fp16 tiles keep the torch factors; one more
    compile, ~4 s on one CPU core, 2026-12-06)."""
    return [intra_params_for(dtype) for dtype in DTYPES] + [intra_params_for("bfloat16", bwd=True)]


SPEC = KernelSpec(
    name="kda_prefill_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

# The first (token-parallel) pass, `intra.py`: the "rows8" layout since 2026-12-03 (the
# one-channel-a-thread WGMMA kernel it replaced is in docs/linear_attention/NOTES.md). L and P
# by mma.sync m16n8k16 (HMMA), the inverse's merges by mma.sync tf32, no WGMMA: mma=False.
INTRA_SPEC = KernelSpec(
    name="kda_intra_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_intra,
    standard_params=_intra_standard_params,
    mma=False,
)
SPECS = (SPEC, INTRA_SPEC)

__all__ = ["INTRA_SPEC", "SPEC", "SPECS", "intra_params_for", "params_for"]
