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
from forgekernel.kernels.attention.paged.sm90.rows import heads_for, row_cap
from forgekernel.runtime import pdl
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
    return partial + merge_rows_params() + combine + warps_params() + schedule_params()


def warps_params() -> list[Params]:
    """The combine's warp form (combine_form.py: rows x heads >= 1024) at the head dims it
    takes (multiples of 128), plain and ranges."""
    return [
        params_for("combine", dtype, d, ranges=ranges, warps=True)
        for dtype in DTYPES
        for d in HEAD_DIMS
        if d % 128 == 0
        for ranges in (False, True)
    ]


def schedule_params() -> list[Params]:
    """A decode step's schedule (`forgekernel.attention_paged_schedule`, launch.make_schedule):
    the ranges pass of every 16-bit one-token leaf and the ranges combine at every head dim
    (prebuilt: a schedule's first call compiles nothing; its scheduling kernel is MLA's)."""
    partial = [
        params_for("partial", dtype, d, h, ranges=True)
        for dtype in DTYPES
        for d in HEAD_DIMS
        for h in HEADS
        if h <= row_cap(d)
    ]
    combine = [params_for("combine", dtype, d, ranges=True) for dtype in DTYPES for d in HEAD_DIMS]
    return partial + combine


def _candidate_params() -> list[Params]:
    """The 18:47 partial pass (page ids read beside the copies: compile.py's page_ids
    "inline", `PagedDecodeSm90(page_ahead=False)`) for the bf16 D 128 leaves the decode, spec
    and mixed bench cases run, which scripts/paged_spec_probe.py times against the standard
    ones (`forgekernel build --candidates --only attention_paged_decode_sm90`); the builds
    without PDL of the bench's variant `no_pdl` (`no_pdl_params`); the serial ramp of the
    variant `serial_ramp` (`serial_ramp_params`)."""
    inline = [
        tuple(sorted((*params_for("partial", "bfloat16", 128, h, "", qt), ("page_ids", "inline"))))
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= row_cap(128)
    ]
    return inline + no_pdl_params() + serial_ramp_params()


def serial_ramp_params() -> list[Params]:
    """The kernels of the bench's variant `serial_ramp` (Llama-3 8B's GQA 4 at bf16, D 128, one
    query token: the pass and the CTA combine, plain and ranges) built as before the early page
    ids and the held partial rows (compile key ramp "serial", compile.py; PAGED_NOTES.md
    "Small-batch decode")."""
    heads = heads_for(4, 1, 128)
    kernels = [
        params_for(kind, "bfloat16", 128, heads, ranges=ranges)
        for kind in ("partial", "combine")
        for ranges in (False, True)  # the width plan's, the step schedule's
    ]
    return [serial_ramp_key(p) for p in kernels]


def serial_ramp_key(params: Params) -> Params:
    """A pass's or CTA combine's compile key built as before the early page ids and the held
    partial rows."""
    return tuple(sorted((*params, ("ramp", "serial"))))


def no_pdl_params() -> list[Params]:
    """The kernels of the bench's variant `no_pdl` (Llama-3 8B's GQA 4 at bf16, D 128, one query
    token: the pass and the combine, the width plan's and the step schedule's ranges forms, the
    ranges combine in both forms: CTA at one sequence, warps at 64) built without PDL (compile
    key pdl "off", runtime/pdl.py). The ranges forms were missing until 2026-12-06: the H100
    bench of 01:31 compiled two of them at its first no_pdl case."""
    heads = heads_for(4, 1, 128)
    kernels = [
        params_for("partial", "bfloat16", 128, heads),
        params_for("combine", "bfloat16", 128),
        params_for("partial", "bfloat16", 128, heads, ranges=True),
        params_for("combine", "bfloat16", 128, ranges=True),
        params_for("combine", "bfloat16", 128, ranges=True, warps=True),
    ]
    return [pdl.key(p, False) for p in kernels]


def merge_rows(dtype: str, head_dim: int, kv: str, qtokens: int) -> bool:
    """Whether the launcher's default for this partial pass is merge "rows" (the warps' merge
    weights computed once a row, `PagedDecodeSm90.merge_rows`): the speculative leaves (bf16,
    D 128, a 16-bit cache, 2 / 4 query tokens), measured 2026-12-04 04:39 at 0.969-0.991 of the
    per-element merge's time (graph; eager 0.973-0.993) on the bench's seven spec cases
    (docs/attention/PAGED_NOTES.md "Measured 2026-12-04 04:39"). Single-token decode, fp16, FP8
    and D 64 / 256 keep the per-element merge (`combine.write_split`): not timed."""
    return dtype == "bfloat16" and head_dim == 128 and not kv and qtokens > 1


def merge_rows_params() -> list[Params]:
    """The standard builds of the `merge_rows` leaves (compile key merge "rows"); the same
    leaves without it stay standard (the bench's variant `merge_elems`, the chunked-prefill
    decode rows)."""
    return [
        tuple(sorted((*params_for("partial", "bfloat16", 128, h, "", qt), ("merge", "rows"))))
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= row_cap(128) and merge_rows("bfloat16", 128, "", qt)
    ]


SPEC = KernelSpec(
    name="attention_paged_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
    mma=False,
    representative=lambda: params_for("partial", "bfloat16", 128, 4),
)

__all__ = ["SPEC", "params_for", "serial_ramp_key"]
