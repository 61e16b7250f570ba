"""Compile the sm90 attention forward against fake tensors: batch, lengths, heads and every stride
but the innermost are dynamic; dtype, head dims, causal, varlen and the tile config are baked in.

Fixed length: fn(q, k, v, o, lse, None, None, scale_log2, 0, qgroup, num_ctas) with q
(B, Sq, Hq, D), lse (B, Hq, Sq). Varlen: fn(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
scale_log2, max_seqlen_q, 1, num_ctas) with q (Tq, Hq, D), lse (Hq, Tq), offsets int32
(B + 1,)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from forgekernel.kernels.attention.fwd.sm90.config import AttnConfig
from forgekernel.kernels.attention.fwd.sm90.kernel import AttentionFwdSm90

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def _tokens(dtype, shape, d: int):
    # (..., H, D), D contiguous; other strides any multiple of 8 elements (16 B, TMA).
    strides = tuple(cute.sym_int64(divisibility=8) for _ in shape)
    return make_fake_tensor(dtype, (*shape, d), stride=(*strides, 1), assumed_align=16)


def compile_attention_fwd(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = _DTYPES[params["dtype"]]
    d, dv = params["head_dim"], params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    if varlen:
        tq, tk, nb = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q, o = _tokens(dtype, (tq, hq), d), _tokens(dtype, (tq, hq), dv)
        k, v = _tokens(dtype, (tk, hkv), d), _tokens(dtype, (tk, hkv), dv)
        # (Hq, Tq) fp32, unit stride along the tokens.
        lse = make_fake_tensor(cutlass.Float32, (hq, tq), stride=(cute.sym_int64(), 1))
        cu_q = make_fake_tensor(cutlass.Int32, (nb,), stride=(1,))
        cu_k = make_fake_tensor(cutlass.Int32, (nb,), stride=(1,))
    else:
        b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q, o = _tokens(dtype, (b, sq, hq), d), _tokens(dtype, (b, sq, hq), dv)
        k, v = _tokens(dtype, (b, sk, hkv), d), _tokens(dtype, (b, sk, hkv), dv)
        # (B, Hq, Sq) fp32: unit stride along Sq.
        lse = make_fake_tensor(
            cutlass.Float32, (b, hq, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1)
        )
        cu_q = cu_k = None
    kernel = AttentionFwdSm90(
        d, dv, causal=params["causal"], config=AttnConfig.from_params(params), varlen=varlen
    )
    return cute.compile(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip(),
    )
