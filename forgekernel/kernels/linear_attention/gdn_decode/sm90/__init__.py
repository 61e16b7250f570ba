"""Gated delta rule (Gated DeltaNet / Kimi Delta Attention) decode and MTP step, sm_90a.
DSL-free declaration; the kernel is `step.py`; the op is `forgekernel.gated_delta_rule_step`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_decode.sm90.compile import compile_gdn_step

    return compile_gdn_step(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    plain = [
        params_for(dtype, dims, per_channel=pc, k_last=kl, l2norm=l2, intermediate=inter)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for pc in (False, True)
        for kl in (True, False)
        for l2 in (False, True)
        for inter in (False, True)
    ]
    # FlashInfer-Bench's gdn_decode / gdn_mtp: k-last state, gating in the kernel, l2norm on
    # or off; MTP with or without the final state stored.
    gated = [
        params_for(dtype, dims, l2norm=l2, intermediate=inter, gating=True, update_state=upd)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for l2 in (False, True)
        for inter, upd in ((False, True), (True, True), (True, False))
    ]
    return plain + gated


SPEC = KernelSpec(
    name="gdn_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    mma=False,
)

__all__ = ["SPEC", "params_for"]
