"""Compile the sm90 attention-backward kernels against fake tensors: B, Sq, Sk, Hq, Hkv and every
stride but the innermost are dynamic; dtype, head dims, flags and tiles are baked in."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from forgekernel.kernels.attention.bwd.sm90.config import BwdConfig

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


def _bhs(dtype, b, h, s):
    # (B, H, S) contiguous fp32 / int32 workspace; S padded to a multiple of 4 (16 B).
    return make_fake_tensor(
        dtype,
        (b, h, s),
        stride=(cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1),
        assumed_align=16,
    )


def _options(arch: str, extra: str) -> str:
    return f"--enable-tvm-ffi --gpu-arch {arch} {extra}".strip()


def compile_main(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.kernel import AttentionBwdSm90

    dtype = _DTYPES[params["dtype"]]
    d, dv = params["head_dim"], params["head_dim_v"]
    b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    sq_pad, sq_pad_d, n_mblk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    kernel = AttentionBwdSm90(
        d,
        dv,
        causal=params["causal"],
        deterministic=params["deterministic"],
        config=BwdConfig.from_params(params),
    )
    return cute.compile(
        kernel,
        _bshd(dtype, b, sq, hq, d),  # q
        _bshd(dtype, b, sk, hkv, d),  # k
        _bshd(dtype, b, sk, hkv, dv),  # v
        _bshd(dtype, b, sq, hq, dv),  # do
        _bhs(cutlass.Float32, b, hq, sq_pad),  # lse (log2 units, padded)
        _bhs(cutlass.Float32, b, hq, sq_pad),  # dsum
        _bhs(cutlass.Float32, b, hq, sq_pad_d),  # dq accumulator
        _bshd(dtype, b, sk, hkv, d),  # dk
        _bshd(dtype, b, sk, hkv, dv),  # dv
        make_fake_tensor(
            cutlass.Int32, (b, hq, n_mblk), stride=(cute.sym_int64(), cute.sym_int64(), 1)
        ),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )


def compile_pre(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.preprocess import AttentionBwdPreSm90

    dtype = _DTYPES[params["dtype"]]
    dv = params["head_dim_v"]
    b, sq, hq, sq_pad = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    lse = make_fake_tensor(
        cutlass.Float32, (b, hq, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1)
    )
    return cute.compile(
        AttentionBwdPreSm90(dv),
        _bshd(dtype, b, sq, hq, dv),  # o
        _bshd(dtype, b, sq, hq, dv),  # do
        lse,
        _bhs(cutlass.Float32, b, hq, sq_pad),  # lse, log2 units, padded
        _bhs(cutlass.Float32, b, hq, sq_pad),  # dsum
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )


def compile_post(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.postprocess import AttentionBwdPostSm90

    dtype = _DTYPES[params["dtype"]]
    d = params["head_dim"]
    b, sq, hq, sq_pad_d = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    return cute.compile(
        AttentionBwdPostSm90(d, params["tile_m"]),
        _bhs(cutlass.Float32, b, hq, sq_pad_d),  # dq accumulator
        _bshd(dtype, b, sq, hq, d),  # dq
        cutlass.Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )
