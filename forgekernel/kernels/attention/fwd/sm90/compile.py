"""Compile the sm90 attention forward against fake tensors: B, Sq, Sk, Hq, Hkv and every stride
but the innermost are dynamic; dtype, head dims, causal and the tile config are baked in."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from forgekernel.kernels.attention.fwd.sm90.config import AttnConfig
from forgekernel.kernels.attention.fwd.sm90.kernel import AttentionFwdSm90

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def _bshd(dtype, b, s, h, d: int):
    # (B, S, H, D), D contiguous; other strides any multiple of 8 elements (16 B, TMA).
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8))
    return make_fake_tensor(
        dtype,
        (b, s, h, d),
        stride=(*stride, cute.sym_int64(divisibility=8), 1),
        assumed_align=16,
    )


def compile_attention_fwd(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = _DTYPES[params["dtype"]]
    d, dv = params["head_dim"], params["head_dim_v"]
    b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    q = _bshd(dtype, b, sq, hq, d)
    k = _bshd(dtype, b, sk, hkv, d)
    v = _bshd(dtype, b, sk, hkv, dv)
    o = _bshd(dtype, b, sq, hq, dv)
    # (B, Hq, Sq) fp32, contiguous: unit stride along Sq, the others Sq and Hq * Sq.
    lse = make_fake_tensor(
        cutlass.Float32, (b, hq, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1)
    )
    kernel = AttentionFwdSm90(d, dv, causal=params["causal"], config=AttnConfig.from_params(params))
    return cute.compile(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cutlass.Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip(),
    )
