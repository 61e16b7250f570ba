"""Gated DeltaNet backward's q / k epilogue (the group sum over value heads, l2norm's backward,
the scale, the 16-bit gradient), sm_90a. DSL-free declaration; the kernel is `norm_bwd.py`, the
launcher `launch.py`, the CPU model `forgekernel.reference.gdn_bwd_norm`. Wired into the op's
backward, its kernel path (the default since 2026-12-06; `FORGEKERNEL_GDN_BWD_KERNEL=0`: the
interim torch path) (`forgekernel.ops.gated_delta_rule_bwd`, after kernel 2)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.compile import (
        compile_gdn_bwd_norm,
    )

    return compile_gdn_bwd_norm(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # fp32 value-head gradients (KDA's, the GDN op's QK16 = False) and 16-bit ones (`d16`: the
    # GDN chunk kernel's dqk16, the op's default)
    return [params_for(dtype, l2norm=on, d16=d16) for dtype in DTYPES for on in (False, True)
            for d16 in (False, True)]  # fmt: skip


SPEC = KernelSpec(
    name="gdn_bwd_norm_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    mma=False,  # a per-row norm and its gradient: no HGMMA in its SASS
)

__all__ = ["SPEC", "params_for"]
