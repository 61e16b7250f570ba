"""Chunked Gated DeltaNet forward (prefill), sm_90a. DSL-free declaration; the kernel is
`chunked_fwd.py` (TMA + WGMMA, 64-token chunks, the state on chip; its warpgroups in
`aux_wy.py`, `inverse.py`, `inverse_mma.py`, `state_wg.py`; its `t_pre` form's aux in
`aux_p.py`); `t_pre.py` precomputes T diag(beta) of every chunk for that form; the op is
`forgekernel.ops.gated_delta_rule_chunked.gated_delta_rule`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    V_SPLITS,
    params_for,
    t_pre_params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.compile import compile_gdn_prefill

    return compile_gdn_prefill(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every configuration in each form the launcher runs: the t_pre form (T precomputed)
    except on direct unsplit launches over ungrouped heads (`launch.t_pre_for`), where the
    standard form runs with its O warp (`o_warp`); the segmented path's pass B on the t_pre
    form's `no_o` key (from its c I start: always an initial state). The standard form
    without the O warp stays built: the bench's A/B `no_o_warp` and the GPU tests'
    bit-for-bit reference (and the t_pre form where the launcher takes the other: the
    bench's `t_pre`)."""
    configs = [
        (dtype, dims, kl, l2)
        for dtype in DTYPES
        for dims in HEAD_DIMS
        for kl in (False, True)
        for l2 in (False, True)
    ]

    def form(initial_states, **key):
        return [
            params_for(dtype, dims, k_last=kl, l2norm=l2, initial_state=init, v_split=split, **key)
            for dtype, dims, kl, l2 in configs
            for init in initial_states
            for split in V_SPLITS
        ]

    both = (False, True)
    return (form(both) + form(both, t_pre=True) + form(both, o_warp=True)
            + form((True,), t_pre=True, no_o=True))  # fmt: skip


def _compile_t_pre(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.compile import compile_gdn_t_pre

    return compile_gdn_t_pre(dict(params), "sm_90a", extra_options)


def _candidates() -> list[Params]:
    """The t_pre form with next/gdn-tpre's state chain (`state_lds`, the bench's A/B variant
    `t_pre_state_lds`) in the suite's configurations (bf16, fla's state layout, no l2norm),
    state or not, unsplit and split."""
    suite = dict(k_last=False, l2norm=False, t_pre=True, state_lds=True)
    return [
        params_for("bfloat16", initial_state=init, v_split=split, **suite)
        for init in (False, True)
        for split in V_SPLITS
    ]


SPEC = KernelSpec(
    name="gdn_prefill_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidates,
)

# T diag(beta) of every (chunk, value head) at once (`t_pre.py`), read by the t_pre form above.
T_PRE_SPEC = KernelSpec(
    name="gdn_t_pre_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_t_pre,
    standard_params=lambda: [
        t_pre_params_for(dtype, l2norm=l2) for dtype in DTYPES for l2 in (False, True)
    ],
)
SPECS = (SPEC, T_PRE_SPEC)

__all__ = ["SPEC", "SPECS", "T_PRE_SPEC", "params_for", "t_pre_params_for"]
