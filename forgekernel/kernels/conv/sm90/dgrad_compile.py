"""Compile the fused data gradient (dgrad_kernel.py) against fake tensors: every size and
stride but the channel one is dynamic, and so are the walk's padding and the packed phase
tables (Int32 arguments).

fn(dy, w, dx, work, flags, pad_lo_d, pad_lo_h, pad_lo_w, pad_hi_d, pad_hi_h, pad_hi_w, walk_d,
walk_h, walk_w, taps_d, taps_h, taps_w, order, per_split, max_clusters) with dy (N, Z', P', Q',
K), w (K, T, R, S, C) (any strides), dx (N, D, H, W, C) (any strides); work fp32 and flags int32
with a split (params "split"), else None (geometry.FusedDgrad.kernel_args: the codes)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.conv.sm90.config import CHANNEL_ALIGN, ConvConfig
from forgekernel.kernels.conv.sm90.dgrad_kernel import ConvDgradSm90
from forgekernel.runtime.pdl import built_on, trigger_of


def compile_conv_dgrad(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The fused data gradient of `params` (a compile key: dtype and the ConvConfig fields)
    for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    k = cute.sym_int32(divisibility=CHANNEL_ALIGN)  # dY's channels: the reduction's
    c = cute.sym_int32(divisibility=CHANNEL_ALIGN)  # dX's
    dy = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4)) + (k,))
    w = fake.rowmajor(dtype, (k, *(cute.sym_int32() for _ in range(3)), c))
    dx = fake.rowmajor(dtype, tuple(cute.sym_int32() for _ in range(4)) + (c,))
    cfg = ConvConfig.from_params(params)
    work = flags = None
    if cfg.split:
        work = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=16)
        flags = fake.offsets()
    geometry = [cutlass.Int32(0)] * 6 + [cutlass.Int32(1)] * 7
    return cute.compile(
        ConvDgradSm90(cfg, pdl=built_on(params), trigger=trigger_of(params)),
        dy,
        w,
        dx,
        work,
        flags,
        *geometry,
        cutlass.Int32(1),
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
