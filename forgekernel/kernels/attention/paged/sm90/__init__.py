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


def _candidate_params() -> list[Params]:
    """The 18:47 partial pass (page ids read beside the copies: compile.py's page_ids
    "inline", `PagedDecodeSm90(page_ahead=False)`) for the bf16 D 128 leaves the decode, spec
    and mixed bench cases run, which scripts/paged_spec_probe.py times against the standard
    ones, and the merge candidates (`merge_candidates`; `forgekernel build --candidates --only
    attention_paged_decode_sm90`)."""
    inline = [
        tuple(sorted((*params_for("partial", "bfloat16", 128, h, "", qt), ("page_ids", "inline"))))
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= row_cap(128)
    ]
    return inline + merge_candidates()


def merge_candidates() -> list[Params]:
    """The speculative leaves (bf16, D 128, 2 / 4 query tokens) with the warps' merge weights
    computed once a row (`PagedDecodeSm90.merge_rows`, compile key merge "rows"), which the
    bench times beside the standard ones on its spec cases (variant `merge_rows`;
    docs/attention/PAGED_NOTES.md "Speculative decoding: the same kernel")."""
    return [
        tuple(sorted((*params_for("partial", "bfloat16", 128, h, "", qt), ("merge", "rows"))))
        for qt in QTOKENS[1:]
        for h in HEADS
        if h * qt <= row_cap(128)
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

__all__ = ["SPEC", "params_for"]
