"""Gated delta rule (Gated DeltaNet / Kimi Delta Attention) decode and MTP step, sm_90a.
DSL-free declaration; the kernels are `step_rows.py` (k-last state) and `step.py` (k-first);
the op is `forgekernel.gated_delta_rule_step`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    MAX_TOKENS,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params

TOKENS = tuple(range(1, MAX_TOKENS + 1))


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_decode.sm90.compile import compile_gdn_step

    return compile_gdn_step(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # fla's form: k-first on the staged kernel (T dynamic, a pool); k-last on the row-streaming
    # kernel for every T, with and without a pool (state_indices given or not; the
    # intermediate states of MTP rollback with one).
    k_first = [
        params_for(dtype, dims, per_channel=pc, k_last=False, l2norm=l2, intermediate=inter)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for pc in (False, True)
        for l2 in (False, True)
        for inter in (False, True)
    ]
    k_last = [
        params_for(dtype, dims, per_channel=pc, l2norm=l2, intermediate=inter, tokens=t, pool=pool)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for t in TOKENS
        for pc in (False, True)
        for l2 in (False, True)
        for inter, pool in ((False, True), (False, False), (True, True))
    ]
    # FlashInfer-Bench's gdn_decode (T = 1, no pool; the suite passes its rows) and gdn_mtp
    # (a pool, with or without the intermediate states and the final state): k-last, gating in
    # the kernel, l2norm on or off.
    gated = [
        params_for(
            dtype,
            dims,
            l2norm=l2,
            intermediate=inter,
            gating=True,
            update_state=upd,
            tokens=t,
            pool=pool,
        )
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for l2 in (False, True)
        for t in TOKENS
        for inter, upd, pool in (
            ((False, True, False), (False, True, True))
            if t == 1
            else ((False, True, True), (True, True, True), (True, False, True))
        )
    ]
    return k_first + k_last + gated


SPEC = KernelSpec(
    name="gdn_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    mma=False,
)

__all__ = ["SPEC", "params_for"]
