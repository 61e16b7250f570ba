"""Compile the sm90 attention-backward kernels against fake tensors: B, Sq, Sk, Hq, Hkv and every
stride but the innermost are dynamic; dtype, head dims, flags (varlen included) and tiles are
baked in.

Fixed length passes None for the cu_seqlens tensors and 0 for the max lengths; varlen passes
packed (T, H, D) tensors, (Hq, T) lse, (Hq, rows) workspaces and int32 (B + 1,) offsets."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

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


def _tokens(dtype, t, h, d: int):
    # packed varlen (T, H, D), D contiguous; other strides multiples of 8 elements (16 B, TMA).
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
    return make_fake_tensor(dtype, (t, h, d), stride=stride, assumed_align=16)


def _hs(dtype, h, s):
    # (H, rows) contiguous fp32 / int32 varlen workspace; rows a multiple of 4 (16 B).
    return make_fake_tensor(
        dtype, (h, s), stride=(cute.sym_int64(divisibility=4), 1), assumed_align=16
    )


def _cu():
    return make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), stride=(1,))


def _options(arch: str, extra: str) -> str:
    return f"--enable-tvm-ffi --gpu-arch {arch} {extra}".strip()


def compile_main(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.kernel import AttentionBwdSm90

    dtype = _DTYPES[params["dtype"]]
    d, dv = params["head_dim"], params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    sq_pad, sq_pad_d, n_mblk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    # dk, dv; head_split: compact fp32 accumulators (strides from the shape: fewer runtime
    # scalars live through the step loop for the epilogue's additions)
    dkv = (_bshd(dtype, b, sk, hkv, d), _bshd(dtype, b, sk, hkv, dv))
    if params.get("head_split", False):
        dkv = tuple(
            make_fake_compact_tensor(
                cutlass.Float32, (b, sk, hkv, w), stride_order=(3, 2, 1, 0), assumed_align=16
            )
            for w in (d, dv)
        )
    kernel = AttentionBwdSm90(
        d,
        dv,
        causal=params["causal"],
        deterministic=params["deterministic"],
        config=BwdConfig.from_params(params),
        varlen=varlen,
    )
    if varlen:
        f32 = cutlass.Float32
        tensors = (
            _tokens(dtype, sq, hq, d),  # q (Tq, Hq, D)
            _tokens(dtype, sk, hkv, d),  # k
            _tokens(dtype, sk, hkv, dv),  # v
            _tokens(dtype, sq, hq, dv),  # do
            _hs(f32, hq, sq_pad),  # lse (log2 units, padded per sequence)
            _hs(f32, hq, sq_pad),  # dsum
            _hs(f32, hq, sq_pad_d),  # dq accumulator
            _tokens(dtype, sk, hkv, d),  # dk
            _tokens(dtype, sk, hkv, dv),  # dv
            _hs(cutlass.Int32, hq, sq_pad),  # semaphores, one per workspace row
            _cu(),
            _cu(),
        )
    else:
        tensors = (
            _bshd(dtype, b, sq, hq, d),  # q
            _bshd(dtype, b, sk, hkv, d),  # k
            _bshd(dtype, b, sk, hkv, dv),  # v
            _bshd(dtype, b, sq, hq, dv),  # do
            _bhs(cutlass.Float32, b, hq, sq_pad),  # lse (log2 units, padded)
            _bhs(cutlass.Float32, b, hq, sq_pad),  # dsum
            _bhs(cutlass.Float32, b, hq, sq_pad_d),  # dq accumulator
            *dkv,
            make_fake_tensor(
                cutlass.Int32, (b, hq, n_mblk), stride=(cute.sym_int64(), cute.sym_int64(), 1)
            ),
            None,
            None,
        )
    return cute.compile(
        kernel,
        *tensors,
        cutlass.Int32(0),  # max_seqlen_k (varlen grid)
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )


def compile_pre(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.preprocess import AttentionBwdPreSm90

    dtype = _DTYPES[params["dtype"]]
    dv = params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    b, sq, hq, sq_pad = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    f32 = cutlass.Float32
    if varlen:
        tensors = (
            _tokens(dtype, sq, hq, dv),  # o (Tq, Hq, Dv)
            _tokens(dtype, sq, hq, dv),  # do
            make_fake_tensor(f32, (hq, sq), stride=(cute.sym_int64(), 1)),  # lse (Hq, Tq)
            _hs(f32, hq, sq_pad),  # lse, log2 units, padded per sequence
            _hs(f32, hq, sq_pad),  # dsum
            _cu(),
            None,  # dQ accumulator: zeroed by the launcher (padded per sequence)
        )
    else:
        lse = make_fake_tensor(f32, (b, hq, sq), stride=(cute.sym_int64(), cute.sym_int64(), 1))
        tensors = (
            _bshd(dtype, b, sq, hq, dv),  # o
            _bshd(dtype, b, sq, hq, dv),  # do
            lse,
            _bhs(f32, b, hq, sq_pad),  # lse, log2 units, padded
            _bhs(f32, b, hq, sq_pad),  # dsum
            None,
            _bhs(f32, b, hq, cute.sym_int32()),  # dQ accumulator (B, Hq, Sq_pad * D), zeroed
        )
    return cute.compile(
        AttentionBwdPreSm90(dv, varlen=varlen),
        *tensors,
        cutlass.Int32(0),  # max_seqlen_q (varlen grid)
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )


def compile_post(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.postprocess import AttentionBwdPostSm90

    dtype = _DTYPES[params["dtype"]]
    d = params["head_dim"]
    varlen = bool(params.get("varlen", False))
    b, sq, hq, sq_pad_d = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    if varlen:
        tensors = (
            _hs(cutlass.Float32, hq, sq_pad_d),  # dq accumulator (Hq, rows * D)
            _tokens(dtype, sq, hq, d),  # dq (Tq, Hq, D)
            _cu(),
        )
    else:
        tensors = (
            _bhs(cutlass.Float32, b, hq, sq_pad_d),  # dq accumulator
            _bshd(dtype, b, sq, hq, d),  # dq
            None,
        )
    return cute.compile(
        AttentionBwdPostSm90(
            d, params["tile_m"], varlen=varlen, halves=bool(params.get("dq_split", False))
        ),
        *tensors,
        cutlass.Int32(0),  # max_seqlen_q (varlen grid)
        cutlass.Float32(1.0),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=_options(arch, extra_options),
    )
