"""Attention backward (FlashAttention layout), sm_90a: three kernels. DSL-free declaration; the
kernels are `preprocess.py`, `kernel.py` (main) and `postprocess.py`; the host launcher is
`launch.attention_bwd`.

Compiled functions (the stream is the TVM-FFI environment stream):
- pre:  fn(o, do, lse, lse2, dsum, cu_seqlens_q, max_seqlen_q): o, do (B, Sq, Hq, Dv); lse
  (B, Hq, Sq) fp32 contiguous; lse2, dsum (B, Hq, Sq_pad) fp32 workspaces, Sq_pad = Sq rounded
  up to 128.
- main: fn(q, k, v, do, lse2, dsum, dq_accum, dk, dv, sem, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_k, softmax_scale, softmax_scale_log2): dq_accum (B, Hq, Sq_pad * D) fp32 zeroed;
  sem (B, Hq, Sq_pad / tile_m) int32 zeroed (read only when deterministic).
- post: fn(dq_accum, dq, cu_seqlens_q, max_seqlen_q, softmax_scale).
Fixed length passes None for the cu_seqlens and 0 for the max lengths. Varlen variants
(`varlen=True` in the params): packed (T, H, D) tensors, lse (Hq, Tq), workspaces (Hq, rows)
with rows = `config.varlen_ws_rows(Tq, B)` (dq_accum (Hq, rows * D), sem (Hq, rows)), int32
(B + 1,) offsets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from forgekernel.kernels.attention.bwd.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    LONG_GQA_SWIZZLE,
    LONG_GQA_WALK,
    BwdConfig,
    default_config,
    main_params,
    post_params,
    pre_params,
)
from forgekernel.runtime.spec import KernelSpec, Params

_DIR = Path(__file__).parent
# The launcher takes cu_seqlens (packed sequences); turns on the bench suite's varlen check cases.
VARLEN = True


def _compile_pre(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.compile import compile_pre

    return compile_pre(dict(params), "sm_90a", extra_options)


def _compile_main(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.compile import compile_main

    return compile_main(dict(params), "sm_90a", extra_options)


def _compile_post(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.compile import compile_post

    return compile_post(dict(params), "sm_90a", extra_options)


def _pre_standard() -> list[Params]:
    dvs = sorted({dv for _, dv in HEAD_DIMS})
    return [
        pre_params(dtype, dv, varlen) for varlen in (False, True) for dtype in DTYPES for dv in dvs
    ]


def _main_standard() -> list[Params]:
    # + the kernels config.choose_config picks by shape for GQA at D = 128 (fixed length):
    # head_split, and (causal, long keys) the walk in walk_order LONG_GQA_WALK with
    # l2_swizzle LONG_GQA_SWIZZLE
    split = replace(default_config(128, 128), head_split=2)
    long_gqa = replace(
        default_config(128, 128), walk_order=LONG_GQA_WALK, l2_swizzle=LONG_GQA_SWIZZLE
    )
    return (
        [
            main_params(dtype, d, dv, causal, det, varlen=varlen)
            for varlen in (False, True)
            for dtype in DTYPES
            for d, dv in HEAD_DIMS
            for causal in (False, True)
            for det in (False, True)
        ]
        + [
            main_params(dtype, 128, 128, causal, False, split)
            for dtype in DTYPES
            for causal in (False, True)
        ]
        + [main_params(dtype, 128, 128, True, False, long_gqa) for dtype in DTYPES]
    )


def _main_candidates() -> list[Params]:
    """The L2 model's chunked GQA candidates (bench attention_bwd CHUNKED_CANDIDATES: sections
    of two (kv head, batch) pairs, with the long-key walk or the default one; BWD_NOTES.md "The
    launch order against the forward's L2 finding"), bf16 causal, so that `build --candidates`
    compiles them before the bench times them."""
    base = default_config(128, 128)
    cfgs = (replace(base, l2_swizzle=2, walk_order=LONG_GQA_WALK), replace(base, l2_swizzle=2))
    return [main_params("bfloat16", 128, 128, True, False, cfg) for cfg in cfgs]


def _post_standard() -> list[Params]:
    # one per workspace order the standard main kernels write (dq_split or not)
    out = []
    for varlen in (False, True):
        for dtype in DTYPES:
            for d, dv in HEAD_DIMS:
                for det in (False, True):
                    cfg = default_config(d, dv, det, varlen)
                    p = post_params(dtype, d, cfg.tile_m, varlen, cfg.dq_split)
                    if p not in out:
                        out.append(p)
    return out


SPEC_PRE = KernelSpec(
    name="attention_bwd_pre_sm90",
    arch="sm_90a",
    directory=_DIR,
    compile=_compile_pre,
    standard_params=_pre_standard,
    mma=False,
)
SPEC_MAIN = KernelSpec(
    name="attention_bwd_sm90",
    arch="sm_90a",
    directory=_DIR,
    compile=_compile_main,
    standard_params=_main_standard,
    candidate_params=_main_candidates,
)
SPEC_POST = KernelSpec(
    name="attention_bwd_post_sm90",
    arch="sm_90a",
    directory=_DIR,
    compile=_compile_post,
    standard_params=_post_standard,
    mma=False,
)
SPECS = [SPEC_PRE, SPEC_MAIN, SPEC_POST]


def attention_bwd(*args, **kwargs):
    """See `launch.attention_bwd` (imported lazily: torch only)."""
    from forgekernel.kernels.attention.bwd.sm90.launch import attention_bwd as _impl

    return _impl(*args, **kwargs)


__all__ = [
    "SPECS",
    "VARLEN",
    "SPEC_PRE",
    "SPEC_MAIN",
    "SPEC_POST",
    "HEAD_DIMS",
    "DTYPES",
    "BwdConfig",
    "default_config",
    "attention_bwd",
]
