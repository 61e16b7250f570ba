"""Gated DeltaNet backward, kernel 1: the reverse state recurrence over chunks, sm_90a.
DSL-free declaration; the kernel is `reverse_state.py`, the launcher `launch.py`, the CPU
model `forgekernel.reference.gdn_bwd_state`. Wired into the op's backward, its kernel path
(the default since 2026-12-06, after its GPU check; `FORGEKERNEL_GDN_BWD_KERNEL=0`: the
interim torch path) (`forgekernel.ops.gated_delta_rule_bwd._backward_kernel`: two launches,
the forward's chunk states by the same recurrence fed transposed inputs, then the reverse
pass). Variant `channel_decay` (e^(G_C) per key channel): Kimi Delta Attention's backward
(`forgekernel.ops.kda_bwd._backward_kernel`, the default likewise;
`FORGEKERNEL_KDA_BWD_KERNEL=0`: the interim). Variants
`out16` (dU, dS in kernel 2's 16-bit forms) and `forward` (the forward launch: P^T = I, Qe = 0
built in, outputs in chunk order): Gated DeltaNet's path (`STATES16`), and with
`channel_decay` Kimi Delta Attention's device pass (`forgekernel.ops.kda_bwd._device_pass`,
bf16)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.compile import (
        compile_gdn_bwd_state,
    )

    return compile_gdn_bwd_state(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    gdn = [
        params_for(dtype, d_final_state=d, dke=dke)
        for dtype in DTYPES
        for d in (False, True)
        for dke in (False, True)
    ]
    # Kimi Delta Attention's per-key-channel e^(G_C): the dh variant its backward runs
    kda = [
        params_for(dtype, d_final_state=d, channel_decay=True)
        for dtype in DTYPES
        for d in (False, True)
    ]
    # the op's kernel path: both launches write kernel 2's 16-bit h / dh, U / dU (out16); the
    # forward launch with P^T = I, Qe = 0 built in, in chunk order (forward)
    out16 = [
        params_for(dtype, d_final_state=d, out16=True, forward=fw)
        for dtype in DTYPES
        for d in (False, True)
        for fw in (False, True)
    ]
    # Kimi Delta Attention's device pass (ops/kda_bwd.py `_device_pass`: the first pass's
    # factors and the WY kernel, bf16 only, FIRST_PASS_DTYPES): the same two launches with
    # e^(G_C) per key channel (168 registers, no spill, as the scalar keys; cu13, 2026-12-06)
    kda16 = [
        params_for("bfloat16", d_final_state=d, channel_decay=True, out16=True, forward=fw)
        for d in (False, True)
        for fw in (False, True)
    ]
    # varlen (ops/_linattn_varlen.py): both ops' device-pass keys over the forward's chunk slots
    varlen = [
        params_for(dtype, d_final_state=d, channel_decay=cd, out16=True, forward=fw, varlen=True)
        for dtype, cd in (*((dt, False) for dt in DTYPES), ("bfloat16", True))
        for d in (False, True)
        for fw in (False, True)
    ]
    # the fused route's forward launch (ops/gated_delta_rule_bwd.py `_fused_pass`, FUSED_DIET):
    # h only, on k and G in place of Ke
    fused = [
        params_for(dtype, d_final_state=d, out16=True, forward=True, fused=True)
        for dtype in DTYPES
        for d in (False, True)
    ]
    return gdn + kda + out16 + kda16 + varlen + fused


def _candidate_params() -> list[Params]:
    # the fused route's forward launch forming W, u from T^T, v, k, beta, G (`w_from_t`,
    # next/gdn-w-from-t2; ops.gated_delta_rule_bwd FUSED_WFROMT, off until its device A/B)
    return [
        params_for(dtype, d_final_state=d, out16=True, forward=True, fused=True, w_from_t=True)
        for dtype in DTYPES
        for d in (False, True)
    ]


SPEC = KernelSpec(
    name="gdn_bwd_state_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "params_for"]
