"""Gated DeltaNet backward, fused: kernel 1's reverse state recurrence and kernel 2's chunk
gradients (WY form) in one kernel, one CTA per (sequence, value head), sm_90a. DSL-free
declaration; the kernel is `fused_bwd.py`, the launcher `launch.py`. Behind
ops/gated_delta_rule_bwd.py FUSED: it replaces kernel 1's reverse launch and kernel 2 on the
device pass where B x HV fills about a wave (`config.fused_fits`); its `varlen` keys behind
FUSED_SLOTS in the varlen slot layout (`config.slots_fit`); its `group_sum` keys behind
FUSED_GROUPSUM at HV = 2 H (both on since the H100 A/Bs of 2026-12-07); the two together
(`varlen, group_sum`) candidates behind FUSED_SLOTS_GROUPSUM (off until measured)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.compile import (
        compile_gdn_bwd_fused,
    )

    return compile_gdn_bwd_fused(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # the op's keys: with / without a final-state gradient, q / k at their own H heads or not;
    # U read (kernel 1's forward launch's) or formed in the kernel (`u_from_h`,
    # ops.gated_delta_rule_bwd.FUSED_DIET; U read: the diet's A/B baseline), B equal sequences
    # and the varlen slot layout (`varlen`, FUSED_SLOTS)
    keys = [
        params_for(dtype, d_final_state=ds, grouped=g, u_from_h=u, varlen=vl)
        for vl in (False, True)
        for dtype in DTYPES
        for ds in (False, True)
        for g in (False, True)
        for u in (False, True)
    ]
    # the grouped ones with `group_sum` (FUSED_GROUPSUM: dq, dk summed over a cluster's two
    # value heads; with varlen: `_candidate_params`)
    pairs = [
        params_for(dtype, d_final_state=ds, grouped=True, u_from_h=u, group_sum=True)
        for dtype in DTYPES
        for ds in (False, True)
        for u in (False, True)
    ]
    return keys + pairs


def _candidate_params() -> list[Params]:
    # `group_sum` in the varlen slot layout (next/gdn-bwd-slots-groupsum; ops.gated_delta_rule_bwd
    # FUSED_SLOTS_GROUPSUM, off until its device A/B): the grouped varlen keys with the pair;
    # `wg_split` (next/gdn-bwd-wgsplit: G's chain on two math warpgroups) on every key of the
    # op's (with `group_sum`: next/wgsplit-groupsum), until a GPU A/B adopts or drops it; with
    # `w_from_t` (ops.gated_delta_rule_bwd FUSED_WFROMT, off) likewise
    slots_pairs = [
        params_for(dtype, d_final_state=ds, grouped=True, u_from_h=u, varlen=True, group_sum=True)
        for dtype in DTYPES
        for ds in (False, True)
        for u in (False, True)
    ]
    split = [
        params_for(dtype, d_final_state=ds, grouped=g, u_from_h=u, varlen=vl, wg_split=True)
        for vl in (False, True)
        for dtype in DTYPES
        for ds in (False, True)
        for g in (False, True)
        for u in (False, True)
    ]
    both = {"group_sum": True, "wg_split": True}
    split_pairs = [
        params_for(dtype, d_final_state=ds, grouped=True, u_from_h=u, varlen=vl, **both)
        for vl in (False, True)
        for dtype in DTYPES
        for ds in (False, True)
        for u in (False, True)
    ]
    # `w_from_t` (next/gdn-w-from-t: W, u formed by G2 from T^T, k, v) on the split's
    # `u_from_h` keys, with and without `group_sum`
    split_w = {"u_from_h": True, "wg_split": True, "w_from_t": True}
    w_from_t = [
        params_for(dtype, d_final_state=ds, grouped=g, varlen=vl, group_sum=gs, **split_w)
        for vl in (False, True)
        for dtype in DTYPES
        for ds in (False, True)
        for g, gs in ((False, False), (True, False), (True, True))
    ]
    return slots_pairs + split + split_pairs + w_from_t


SPEC = KernelSpec(
    name="gdn_bwd_fused_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "params_for"]
