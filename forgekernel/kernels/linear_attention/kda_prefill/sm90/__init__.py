"""Kimi Delta Attention forward (prefill), sm_90a. DSL-free declaration; the kernel is
`recurrence.py` (the state pass: TMA + WGMMA, the state on chip, Gated DeltaNet's state
warpgroups with the per-channel decays in the operands) and `intra.py` (the first,
token-parallel pass: every chunk's operands; its torch model is `operands.py`; the opt-in
re-laid-out form `intra_rows8.py`, compile key `layout` "rows8", its own spec and entry); the op
is `forgekernel.ops.kda_chunked`."""

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


LAYOUTS = ("standard", "rows8")  # the first pass's forms (`layout`: named only off standard)


def _compile_intra_rows8(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile_rows8 import (
        compile_kda_intra_rows8,
    )

    return compile_kda_intra_rows8(dict(params), "sm_90a", extra_options)


def intra_params_for(dtype: str, k: int = 128, layout: str = "standard") -> Params:
    """The first pass's compile key: the q / k dtype and K, and the layout where it is not the
    standard one (the standard keys, and the records behind them, stay as they were)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    key = {"dtype": dtype, "k": k}
    if layout != "standard":
        key["layout"] = layout
    return tuple(sorted(key.items()))


def intra_spec_for(params: Params) -> KernelSpec:
    """The spec that compiles a first-pass key (`intra_params_for`)."""
    return ROWS8_SPEC if dict(params).get("layout") == "rows8" else INTRA_SPEC


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

# The first (token-parallel) pass, `intra.py` (checked on the H200 2026-12-02; the launcher's
# only first pass since).
INTRA_SPEC = KernelSpec(
    name="kda_intra_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_intra,
    standard_params=lambda: [intra_params_for(dtype) for dtype in DTYPES],
)
# The first pass re-laid out (opt-in, `layout` "rows8"; docs/linear_attention/NOTES.md, "KDA
# first pass re-laid out"): its own entry module, so that the standard kernels' import closure
# (cache and ledger key) stays. Its two keys are built ahead of time like the others (a spec's
# representative is one of its standard keys); the op takes it only where asked (`layout`).
# mma.sync m16n8k16 (HMMA), no WGMMA: mma=False.
ROWS8_SPEC = KernelSpec(
    name="kda_intra_rows8_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_intra_rows8,
    standard_params=lambda: [intra_params_for(dtype, layout="rows8") for dtype in DTYPES],
    mma=False,
    entry=Path(__file__).parent / "compile_rows8.py",
    representative=lambda: intra_params_for("bfloat16", layout="rows8"),
)
SPECS = (SPEC, INTRA_SPEC, ROWS8_SPEC)

__all__ = [
    "INTRA_SPEC",
    "LAYOUTS",
    "ROWS8_SPEC",
    "SPEC",
    "SPECS",
    "intra_params_for",
    "intra_spec_for",
    "params_for",
]
