"""DeepSeek sparse attention backward (DSA, issue 22), sm_90a, v1 (kernel.py): dq and the fp32
dkv accumulator of `forgekernel::dsa_sparse_attention_bwd`, one CTA per (query token, head
block). DSL-free declaration; the launcher is launch.py (preprocess and cast in torch), the op
ops/dsa_bwd.py takes it unless FORGEKERNEL_DSA_BWD_KERNEL=0 (the interim path)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import (
    BLOCKS,
    DTYPES,
    params_for,
    standard_red4s,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.compile import compile_sparse_bwd

    return compile_sparse_bwd(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every dtype x head block (16: H = 16; 32: H = 32, 64, 128), dkv by red4s."""
    return [params_for(d, b, red4s=standard_red4s(b)) for d in DTYPES for b in BLOCKS]


def _candidate_params() -> list[Params]:
    """The timing probe's builds (scripts/time_dsa_bwd_kernel.py) at both blocks: the
    fragments' red.global.add.v2 (both blocks' form before red4s, xchg's measured form) with
    and without reductions, the xchg candidate with and without reductions, red4s (the
    standard form) without reductions, and xchg4s (red4s under xchg) with and without
    reductions."""
    return [
        params_for("bfloat16", b, reduce=r, xchg=x, red4s=s)
        for b in BLOCKS
        for r, x, s in (
            (False, False, False),
            (True, True, False),
            (False, True, False),
            (True, False, False),
            (False, False, True),
            (True, True, True),
            (False, True, True),
        )
    ]


SPEC = KernelSpec(
    name="dsa_sparse_bwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
    representative=lambda: params_for("bfloat16", 16, red4s=True),
)

__all__ = ["SPEC", "params_for"]
