"""DSA lightning indexer backward (issue 22), sm_90a (kernel.py): dq, dw and the fp32 dK
accumulator of `forgekernel::dsa_indexer_backward`, one CTA per query row, 64 heads x 128.
DSL-free declaration; the launcher is launch.py (the dK cast in torch), the op
ops/dsa_indexer_bwd.py takes it where `launch.unsupported` is None and
FORGEKERNEL_DSA_INDEXER_BWD_KERNEL is not 0 (the interim path)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.config import DTYPES, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.compile import compile_indexer_bwd

    return compile_indexer_bwd(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Both 16-bit dtypes at 64 heads."""
    return [params_for(d) for d in DTYPES]


def _candidate_params() -> list[Params]:
    """bf16, both plans (standard, pair) x both reduction forms (the lane-pair swap, staged),
    each with and without its dK reductions (the timing probe's builds: `params_for` reduce
    False), less the standard build itself."""
    builds = [
        params_for("bfloat16", reduce=r, staged=st, pair=pr)
        for pr in (False, True)
        for st in (False, True)
        for r in (True, False)
    ]
    return [b for b in builds if b != params_for("bfloat16")]


SPEC = KernelSpec(
    name="dsa_indexer_bwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
    representative=lambda: params_for("bfloat16"),
)

__all__ = ["SPEC", "params_for"]
