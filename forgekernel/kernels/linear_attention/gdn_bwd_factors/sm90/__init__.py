"""Gated DeltaNet backward, kernel 0: the chunk factors (A, T = (I + A)^-1, W, u, P, Ke, Qe,
the decays) of every (chunk, value head) at once from q, k, v, g, beta, in the 16-bit layouts
kernel 1's two launches and kernel 2 read, sm_90a. DSL-free declaration; the kernel is
`factors.py`, the launcher `launch.py`, the CPU model `forgekernel.reference.gdn_bwd_factors`.
Wired into the op's backward, its kernel path (the default since 2026-12-06;
`FORGEKERNEL_GDN_BWD_KERNEL=0`: the interim torch path)
(`forgekernel.ops.gated_delta_rule_bwd._backward_kernel`, before kernel 1's launches;
`FACTORS_IN_KERNEL = False` there: the torch factors)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.compile import (
        compile_gdn_bwd_factors,
    )

    return compile_gdn_bwd_factors(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # today's path and the fused route's (`fused`: no Ke, Qe; ops.gated_delta_rule_bwd
    # `_fused_pass`)
    return [params_for(dtype, fused=f) for f in (False, True) for dtype in DTYPES]


def _candidate_params() -> list[Params]:
    # the T-only form (`w_from_t`, next/gdn-w-from-t2: no W, u, v not read; ops.
    # gated_delta_rule_bwd FUSED_WFROMT, off until its device A/B)
    return [params_for(dtype, fused=True, w_from_t=True) for dtype in DTYPES]


SPEC = KernelSpec(
    name="gdn_bwd_factors_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "params_for"]
