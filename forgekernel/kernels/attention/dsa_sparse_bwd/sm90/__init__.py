"""DeepSeek sparse attention backward (DSA, issue 22), sm_90a, v1 (kernel.py): dq and the fp32
dkv accumulator of `forgekernel::dsa_sparse_attention_bwd`, one CTA per (query token, head
block). DSL-free declaration; the launcher is launch.py (preprocess and cast in torch), the op
ops/dsa_bwd.py takes it unless FORGEKERNEL_DSA_BWD_KERNEL=0 (the interim path)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import (
    BLOCKS,
    DTYPES,
    H64_PARTS,
    params_for,
    params_h64,
    standard_red4s,
    standard_xchg,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.compile import (
        compile_h64,
        compile_sparse_bwd,
    )

    if "h64" in dict(params):  # the bench variant h64 (kernel_h64.py)
        return compile_h64(dict(params), "sm_90a", extra_options)
    return compile_sparse_bwd(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every dtype x head block (16: H = 16; 32: H = 32, 64, 128): xchg4s (red4s under xchg,
    measured 2026-12-04 04:23)."""
    return [
        params_for(d, b, xchg=standard_xchg(b), red4s=standard_red4s(b))
        for d in DTYPES
        for b in BLOCKS
    ]


def _candidate_params() -> list[Params]:
    """The timing probe's and the bench variant's builds (scripts/time_dsa_bwd_kernel.py,
    bench/suites/dsa_sparse_bwd.py `red4s`) at both blocks: red4s without xchg (the standard
    form before 2026-12-04 04:23) with and without reductions, the fragments' red.global.add.v2
    (both blocks' form before red4s) with and without reductions, xchg4s (the standard form)
    and xchg without reductions. xchg with v2 reductions (9.20 ms at H 16, 00:37) is gone:
    xchg4s replaces it."""
    return [
        params_for("bfloat16", b, reduce=r, xchg=x, red4s=s)
        for b in BLOCKS
        for r, x, s in (
            (True, False, True),
            (False, False, True),
            (True, False, False),
            (False, False, False),
            (False, True, True),
            (False, True, False),
        )
    ]


def _h64_params() -> list[Params]:
    """The bench variant h64's builds (kernel_h64.py), both dtypes (the GPU tests take fp16
    too), and for the probe its kv part without reductions and with the v2 reductions."""
    return [
        *(params_h64(d, part) for d in DTYPES for part in H64_PARTS),
        *(params_h64(d, "dq", dq_heads=128) for d in DTYPES),
        params_h64("bfloat16", "kv", reduce=False),
        params_h64("bfloat16", "kv", shfl4=False),
    ]


SPEC = KernelSpec(
    name="dsa_sparse_bwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=lambda: [*_candidate_params(), *_h64_params()],
    representative=lambda: params_for("bfloat16", 16, xchg=True, red4s=True),
)

__all__ = ["SPEC", "params_for"]
