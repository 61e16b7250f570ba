"""Compile the sm90 convolution weight gradient against fake tensors: every size and stride but
the channel one is dynamic, and so is the geometry (padding, stride, dilation: Int32 arguments)
and the split (k-tiles per split).

fn(dy, x, dw, work, flags, pad_lo_d, pad_lo_h, pad_lo_w, pad_hi_d, pad_hi_h, pad_hi_w, stride_d,
stride_h, stride_w, dil_d, dil_h, dil_w, per_split) with dy (N x Z x P x Q, K) (the im2col
walk, `rect` 0) or (N, Z, P, Q, K) (the stride-1 rectangles), x (N, D, H, W, C), dw (K, T, R, S,
C), work fp32, flags int32 (wgrad.py)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.conv.sm90.config import CHANNEL_ALIGN
from forgekernel.kernels.conv.sm90.wgrad import ConvWgradSm90
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig
from forgekernel.runtime.pdl import built_on, trigger_of


def compile_conv_wgrad(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The weight gradient of `params` (a compile key: dtype, `rect`, `reduce` where set and the
    GemmConfig fields of its tile) for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    c = cute.sym_int32(divisibility=CHANNEL_ALIGN)
    k = cute.sym_int32(divisibility=CHANNEL_ALIGN)
    rect = params["rect"]
    dy = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4 if rect else 1)) + (k,))
    x = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4)) + (c,))
    dw = fake.rowmajor(dtype, (k,) + tuple(cute.sym_int32() for _ in range(3)) + (c,))
    work = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=16)
    kernel = ConvWgradSm90(
        GemmConfig.from_params(params),
        rect,
        params.get("reduce", False),
        pdl=built_on(params),
        trigger=trigger_of(params),
    )
    geometry = [cutlass.Int32(0)] * 6 + [cutlass.Int32(1)] * 6
    return cute.compile(
        kernel,
        dy,
        x,
        dw,
        work,
        fake.offsets(),
        *geometry,
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
