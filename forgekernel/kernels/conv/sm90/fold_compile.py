"""Compile the stem's fold (fold.py) against fake tensors: x (N, H, W, C) with every size and
stride dynamic but C (any alignment: a 3-channel pixel is 6 bytes), the folded image (N, Hs,
Ws, 2 half) with its pixel static and 16-byte aligned; the offsets Int32s.

fn(x, folded, off_h, off_w)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.conv.sm90.fold import StemFoldSm90


def compile_stem_fold(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The fold of `params` (a compile key: dtype, channels, half) for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    c, half = params["channels"], params["half"]
    x = fake.rowmajor(dtype, (*(cute.sym_int32() for _ in range(3)), c), divisibility=1, align=None)
    folded = fake.rowmajor(dtype, (*(cute.sym_int32() for _ in range(3)), 2 * half), 2 * half)
    return cute.compile(
        StemFoldSm90(c, half),
        x,
        folded,
        cutlass.Int32(0),
        cutlass.Int32(0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
