"""Compile the sm90 convolution forward against fake tensors: every size and stride but the
channel one is dynamic, and so is the geometry (padding, stride, dilation: Int32 arguments).

fn(x, w, y, bias, work, flags, pad_lo_d, pad_lo_h, pad_lo_w, pad_hi_d, pad_hi_h, pad_hi_w,
stride_d, stride_h, stride_w, dil_d, dil_h, dil_w, per_split, max_clusters) with x (N, D, H, W,
C), w (K, T, R, S, C), y (N x Z x P x Q, K), bias (K,) or None as compiled; work fp32 and flags
int32 with a split reduction (params "split"), else None. The data-gradient mode (params "dgrad"):
x = dY (N, Z, P, Q, K), w = W (K, T', R', S', C) (any strides: a phase's taps), y (M, C), no
bias. Stride-1 rectangles (params "rect" 8 / 16, kernel.py): y (N, Z, P, Q, K)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.conv.sm90.config import CHANNEL_ALIGN, ConvConfig
from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90
from forgekernel.runtime.pdl import built_on, trigger_of


def compile_conv_fprop(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The forward convolution of `params` (a compile key: dtype, bias and the ConvConfig
    fields) for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    c = cute.sym_int32(divisibility=CHANNEL_ALIGN)
    k = cute.sym_int32(divisibility=CHANNEL_ALIGN)
    dgrad = params.get("dgrad", False)
    taps = tuple(cute.sym_int32() for _ in range(3))
    x = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4)) + (c,))
    # c: the reduction's channels, k: the output's; the data gradient's W is (c, taps, k)
    w = fake.rowmajor(dtype, (c, *taps, k) if dgrad else (k, *taps, c))
    rect = params.get("rect", 0)
    # y (M, K) for the im2col walk, (N, Z, P, Q, K) for the stride-1 rectangles
    y = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4 if rect else 1)) + (k,))
    bias = make_fake_tensor(dtype, (k,), stride=(1,), assumed_align=16) if params["bias"] else None
    cfg = ConvConfig.from_params(params)
    kernel = ConvFpropSm90(
        cfg,
        bias=params["bias"],
        dgrad=dgrad,
        rect=rect,
        pdl=built_on(params),
        trigger=trigger_of(params),
    )
    work = flags = None
    if cfg.split:
        work = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=16)
        flags = fake.offsets()
    geometry = [cutlass.Int32(0)] * 6 + [cutlass.Int32(1)] * 6
    return cute.compile(
        kernel,
        x,
        w,
        y,
        bias,
        work,
        flags,
        *geometry,
        cutlass.Int32(1),
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
