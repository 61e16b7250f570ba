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
    """The timing probe's builds (reductions never run), the xchg candidate with and without
    reductions, the fragments' red.global.add.v2 (both blocks' form before red4s), and at block
    16 the bulk candidate (dkv by cp.reduce.async.bulk) alone, with xchg and without
    reductions, red4 (red4s's reductions from a dedicated staging buffer: block 16's form
    before red4s), and the red4p candidate (the red4 reductions issued by the producer
    warpgroup's reducer warps) alone, with xchg and without reductions, and red4p's two
    diagnostics: red4 and the no-reduction build with red4p's 64-thread gather (gather64),
    red4p's handshake alone; red4s (the standard form) without reductions at both blocks
    (scripts/time_dsa_bwd_kernel.py)."""
    return (
        [
            params_for("bfloat16", b, reduce=r, xchg=x)
            for b in BLOCKS
            for r, x in ((False, False), (True, True), (False, True), (True, False))
        ]
        + [
            params_for("bfloat16", 16, reduce=r, xchg=x, bulk=True)
            for r, x in ((True, False), (True, True), (False, False))
        ]
        + [params_for("bfloat16", 16, red4=True)]
        + [
            params_for("bfloat16", 16, reduce=r, xchg=x, red4p=True)
            for r, x in ((True, False), (True, True), (False, False))
        ]
        + [
            params_for("bfloat16", 16, red4=True, gather64=True),
            params_for("bfloat16", 16, reduce=False, gather64=True),
            params_for("bfloat16", 16, reduce=False, red4p=True, handshake=True),
        ]
        + [params_for("bfloat16", b, reduce=False, red4s=True) for b in BLOCKS]
    )


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
