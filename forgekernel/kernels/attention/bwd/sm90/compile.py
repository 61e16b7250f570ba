"""Compile the sm90 attention-backward kernels against fake tensors: B, Sq, Sk, Hq, Hkv and every
stride but the innermost are dynamic; dtype, head dims, flags (varlen included) and tiles are
baked in.

Fixed length passes None for the cu_seqlens tensors and 0 for the max lengths; varlen passes
packed (T, H, D) tensors, (Hq, T) lse, (Hq, rows) workspaces and int32 (B + 1,) offsets."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor

from forgekernel.kernels.attention.bwd.sm90.config import BwdConfig
from forgekernel.kernels.common.sm90 import fake

F32, I32 = cutlass.Float32, cutlass.Int32


def _io(dtype, *shape):
    # (B, S, H, D) or packed (T, H, D): D contiguous, the other strides multiples of 8
    # elements (16 bytes: TMA-ready)
    return fake.rowmajor(dtype, shape)


def _ws(dtype, *shape):
    # fp32 / int32 workspace (B, H, rows) or varlen (H, rows): rows a multiple of 4 (16 bytes)
    return fake.rowmajor(dtype, shape, divisibility=4)


def _plain(dtype, *shape):
    # contiguous last mode, other strides unconstrained, no alignment assumed
    return fake.rowmajor(dtype, shape, divisibility=1, align=None)


def compile_main(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.kernel import AttentionBwdSm90

    dtype = fake.dtype_of(params["dtype"])
    d, dv = params["head_dim"], params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    sq_pad, sq_pad_d, n_mblk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    # dk, dv; head_split: compact fp32 accumulators (strides from the shape: fewer runtime
    # scalars live through the step loop for the epilogue's additions)
    dkv = (_io(dtype, b, sk, hkv, d), _io(dtype, b, sk, hkv, dv))
    if params.get("head_split", False):
        dkv = tuple(
            make_fake_compact_tensor(
                F32, (b, sk, hkv, w), stride_order=(3, 2, 1, 0), assumed_align=16
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
        tensors = (
            _io(dtype, sq, hq, d),  # q (Tq, Hq, D)
            _io(dtype, sk, hkv, d),  # k
            _io(dtype, sk, hkv, dv),  # v
            _io(dtype, sq, hq, dv),  # do
            _ws(F32, hq, sq_pad),  # lse (log2 units, padded per sequence)
            _ws(F32, hq, sq_pad),  # dsum
            _ws(F32, hq, sq_pad_d),  # dq accumulator
            _io(dtype, sk, hkv, d),  # dk
            _io(dtype, sk, hkv, dv),  # dv
            _ws(I32, hq, sq_pad),  # semaphores, one per workspace row
            fake.offsets(),
            fake.offsets(),
        )
    else:
        tensors = (
            _io(dtype, b, sq, hq, d),  # q
            _io(dtype, b, sk, hkv, d),  # k
            _io(dtype, b, sk, hkv, dv),  # v
            _io(dtype, b, sq, hq, dv),  # do
            _ws(F32, b, hq, sq_pad),  # lse (log2 units, padded)
            _ws(F32, b, hq, sq_pad),  # dsum
            _ws(F32, b, hq, sq_pad_d),  # dq accumulator
            *dkv,
            _plain(I32, b, hq, n_mblk),  # semaphores (persistent: [0, 0, 0] the tile counter)
            None,
            None,
        )
    return cute.compile(
        kernel,
        *tensors,
        I32(0),  # max_seqlen_k (varlen grid; persistent: the CTA count)
        F32(1.0),
        F32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )


def compile_pre(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.preprocess import AttentionBwdPreSm90

    dtype = fake.dtype_of(params["dtype"])
    dv = params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    b, sq, hq, sq_pad = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    if varlen:
        tensors = (
            _io(dtype, sq, hq, dv),  # o (Tq, Hq, Dv)
            _io(dtype, sq, hq, dv),  # do
            _plain(F32, hq, sq),  # lse (Hq, Tq)
            _ws(F32, hq, sq_pad),  # lse, log2 units, padded per sequence
            _ws(F32, hq, sq_pad),  # dsum
            fake.offsets(),
            None,  # dQ accumulator: zeroed by the launcher (padded per sequence)
        )
    else:
        tensors = (
            _io(dtype, b, sq, hq, dv),  # o
            _io(dtype, b, sq, hq, dv),  # do
            _plain(F32, b, hq, sq),  # lse
            _ws(F32, b, hq, sq_pad),  # lse, log2 units, padded
            _ws(F32, b, hq, sq_pad),  # dsum
            None,
            _ws(F32, b, hq, cute.sym_int32()),  # dQ accumulator (B, Hq, Sq_pad * D), zeroed
        )
    return cute.compile(
        AttentionBwdPreSm90(dv, varlen=varlen),
        *tensors,
        I32(0),  # max_seqlen_q (varlen grid)
        fake.stream(),
        options=fake.options(arch, extra_options),
    )


def compile_post(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    from forgekernel.kernels.attention.bwd.sm90.postprocess import AttentionBwdPostSm90

    dtype = fake.dtype_of(params["dtype"])
    d = params["head_dim"]
    varlen = bool(params.get("varlen", False))
    b, sq, hq, sq_pad_d = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    if varlen:
        tensors = (
            _ws(F32, hq, sq_pad_d),  # dq accumulator (Hq, rows * D)
            _io(dtype, sq, hq, d),  # dq (Tq, Hq, D)
            fake.offsets(),
        )
    else:
        tensors = (
            _ws(F32, b, hq, sq_pad_d),  # dq accumulator
            _io(dtype, b, sq, hq, d),  # dq
            None,
        )
    return cute.compile(
        AttentionBwdPostSm90(
            d, params["tile_m"], varlen=varlen, halves=bool(params.get("dq_split", False))
        ),
        *tensors,
        I32(0),  # max_seqlen_q (varlen grid)
        F32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
