"""Attention forward (FlashAttention layout), sm_90a. DSL-free declaration; the kernel itself is
`kernel.py`.

Compiled function, fixed length: fn(q, k, v, o, lse, None, None, softmax_scale_log2, 0,
qgroup, num_ctas) with q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
o (B, Sq, Hq, Dv) in bf16/fp16 (last dim contiguous), lse (B, Hq, Sq) fp32 contiguous,
softmax_scale_log2 = softmax_scale * log2(e), qgroup the query rows per position (pack-GQA:
G query heads of a kv head packed as rows s * G + g of one head; else 1), num_ctas the
persistent grid (the SM count). Varlen (params varlen=True): fn(q, k, v, o, lse,
cu_seqlens_q, cu_seqlens_k, softmax_scale_log2, max_seqlen_q, 1, num_ctas) with q (Tq, Hq, D),
k (Tk, Hkv, D), v (Tk, Hkv, Dv), o (Tq, Hq, Dv), lse (Hq, Tq), int32 offsets (B + 1,). The
stream is the TVM-FFI environment stream.
"""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.fwd.sm90.config import (
    DTYPES,
    HEAD_DIMS,
    AttnConfig,
    default_config,
    params_for,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.fwd.sm90.compile import compile_attention_fwd

    return compile_attention_fwd(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    return [
        params_for(dtype, d, dv, causal, varlen=varlen)
        for dtype in DTYPES
        for d, dv in HEAD_DIMS
        for causal in (False, True)
        for varlen in (False, True)
    ]


SPEC = KernelSpec(
    name="attention_fwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
)

__all__ = ["SPEC", "AttnConfig", "default_config", "params_for"]
