"""Gated DeltaNet backward, kernel 2: the chunk-parallel output-side gradients (reference
`_output_grads`: dq, dk, dw, dG's rows), sm_90a. DSL-free declaration; the kernel is
`chunk_grads.py`, the launcher `launch.py`, the CPU model `forgekernel.reference.gdn_bwd_chunk`.
Wired into the op's backward, its kernel path (the default since 2026-12-06;
`FORGEKERNEL_GDN_BWD_KERNEL=0`: the interim torch path), after kernel 1's two launches
(`forgekernel.ops.gated_delta_rule_bwd._backward_kernel`); its WY variant (the op's default,
`WY_IN_KERNEL`) does the WY half (`_wy_grads`) too."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.compile import (
        compile_gdn_bwd_chunk,
    )

    return compile_gdn_bwd_chunk(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    standard = [params_for(dtype, wy=wy) for dtype in DTYPES for wy in (False, True)]
    # the op's path: the WY variant with dv in 16 bits, reading q / k at their own H heads when
    # value heads are grouped (H < HV); with dq, dk in 16 bits too (`dqk16`, the op's default:
    # ops/gated_delta_rule_bwd.py QK16) and without (the QK16 = False A/B); on the dqk16 keys
    # also `fsplit` (two math warpgroups split by function: the op's default,
    # ops/gated_delta_rule_bwd.py FSPLIT; the 256-thread dqk16 keys its FSPLIT = False A/B)
    standard += [
        params_for(dtype, wy=True, grouped=g, dv16=True, dqk16=q16, fsplit=fs)
        for dtype in DTYPES
        for g in (False, True)
        for q16, fs in ((False, False), (True, False), (True, True))
    ]
    # the varlen slot layout's outputs at their token rows (`token_rows`: ops/_linattn_varlen.py
    # NATIVE_STORES): the op's default form (dv16, dqk16, fsplit)
    return standard + [
        params_for(dtype, wy=True, grouped=g, dv16=True, dqk16=True, fsplit=True, token_rows=True)
        for dtype in DTYPES
        for g in (False, True)
    ]


SPEC = KernelSpec(
    name="gdn_bwd_chunk_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "params_for"]
