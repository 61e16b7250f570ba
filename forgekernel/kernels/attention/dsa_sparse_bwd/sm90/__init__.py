"""DeepSeek sparse attention backward (DSA, issue 22), sm_90a: dq and the fp32 dkv accumulator
of `forgekernel::dsa_sparse_attention_bwd`. v1 (kernel.py): one CTA per (query token, head block
of 16 / 32); h64f (kernel_h64f.py, the default where H is a multiple of 64): one CTA per (token,
64 heads) computing dkv and dq; h64 (kernel_h64.py, the two-kernel form before it): a kv part
writing dkv and a dS workspace, then a dq part. DSL-free declaration; the launcher is
launch.py (preprocess and cast in torch), the op ops/dsa_bwd.py takes it unless
FORGEKERNEL_DSA_BWD_KERNEL=0 (the interim path)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import (
    BLOCKS,
    DTYPES,
    H64_BLOCK,
    H64_DQ_HEADS,
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

    if "h64" in dict(params):  # kernel_h64.py's two parts
        return compile_h64(dict(params), "sm_90a", extra_options)
    return compile_sparse_bwd(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """What the launcher's default reaches, every dtype: the head blocks (16: H = 16; 32: H a
    multiple of 32 but not of 64, and the launcher's h64=False) as xchg4s (red4s under xchg,
    measured 2026-12-04 04:23); at H a multiple of 64 the fused h64 kernel (kernel_h64f.py)."""
    return [
        *(
            params_for(d, b, xchg=standard_xchg(b), red4s=standard_red4s(b))
            for d in DTYPES
            for b in BLOCKS
        ),
        *_h64_standard_params(),
    ]


def _h64_standard_params() -> list[Params]:
    return [params_h64(d, "fused") for d in DTYPES]


def _h64_split_params() -> list[Params]:
    """The two-kernel h64 form (kernel_h64.py, the default from 2026-12-06 01:37 until the fused
    kernel): the kv part (shfl4 reductions) and the dq part at 64 and 128 heads a CTA, every
    dtype (the bench variant `split`, the probe, the GPU tests' h64_ws / h64_v2 launches)."""
    return [
        params_h64(d, part, dq_heads=dq_heads)
        for d in DTYPES
        for part, dq_heads in (("kv", H64_BLOCK), *(("dq", h) for h in H64_DQ_HEADS))
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


def _h64_candidate_params() -> list[Params]:
    """The two-kernel h64 form (`_h64_split_params`) and the probe's h64 builds: the fused
    kernel and the kv part without reductions, the kv part with the fragments' v2 reductions
    (scripts/time_dsa_bwd_kernel.py)."""
    return [
        *_h64_split_params(),
        params_h64("bfloat16", "fused", reduce=False),
        params_h64("bfloat16", "kv", reduce=False),
        params_h64("bfloat16", "kv", shfl4=False),
    ]


SPEC = KernelSpec(
    name="dsa_sparse_bwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=lambda: [*_candidate_params(), *_h64_candidate_params()],
    representative=lambda: params_for("bfloat16", 16, xchg=True, red4s=True),
)

__all__ = ["SPEC", "params_for"]
