"""DSA sparse backward preprocess (issue 22), sm_90a: lse2, Delta' and the per-(token, head)
d_sink terms of `forgekernel::dsa_sparse_attention_bwd` in one pass over out and dO (kernel.py),
what the sparse backward kernel (kernels/attention/dsa_sparse_bwd/sm90) reads. DSL-free
declaration; the launcher is launch.py, the op ops/dsa_bwd.py runs it before the backward
kernel (its own leaf: its sources and builds apart from the backward kernel's)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.compile import compile_pre

    return compile_pre(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every dtype x sink given or not x dLSE given or not."""
    return [params_for(d, s, g) for d in DTYPES for s in (False, True) for g in (False, True)]


SPEC = KernelSpec(
    name="dsa_sparse_bwd_pre_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    representative=lambda: params_for("bfloat16", True, True),
    mma=False,  # a row reduction: no HGMMA in its SASS
)

__all__ = ["SPEC", "params_for"]
