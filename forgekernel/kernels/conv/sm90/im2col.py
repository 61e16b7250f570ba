"""The im2col TMA of a channels-last activation X (N, D, H, W, C), shared by the forward kernel
(A: output pixels x input channels of one tap) and the weight-gradient kernel (B: the same box,
its pixels walking the reduction). Device-side helper (DSL), host-built descriptor.

The descriptor's bounding box of window starts per (D, H, W) runs from the lower corner
-padding below to the upper corner padding above - (F - 1) x dilation, traversed with the
stride; the filter offsets of a load are the tap's (s, r, t) x dilation. Padding and every
ragged edge are the TMA's zero fill (kernel.py's docstring has the limits)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def im2col_atom(mX, taps, geometry, smem_layout, box, multicast: int = 1):
    """(atom, coordinate tensor) of the im2col TMA of mX (N, D, H, W, C) seen as
    ((W, H, D, N), C), one load a `box` = (pixels, channels) tile written through
    `smem_layout` (one stage's). The coordinate tensor is (M, (C, S, R, T)): M output pixels
    flat over (Q, P, Z, N), the channels and the filter taps. `taps`: (T, R, S); `geometry`:
    (padding below, padding above, stride, dilation), each (d, h, w) Int32s."""
    pad_lo, pad_hi, stride, dil = geometry
    whd = [2, 1, 0]  # (d, h, w) -> (w, h, d)
    mA = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 2, 1, 0, 4]))
    mA = cute.group_modes(mA, 0, 4)
    op = (
        cpasync.CopyBulkTensorIm2ColG2SMulticastOp()
        if multicast > 1
        else cpasync.CopyBulkTensorIm2ColG2SOp()
    )
    return cpasync.make_im2col_tma_atom(
        op,
        mA,
        smem_layout,
        (box[0], (box[1],)),
        lower_corner_whd=tuple(-pad_lo[i] for i in whd),
        upper_corner_whd=tuple(pad_hi[i] - (taps[i] - 1) * dil[i] for i in whd),
        lower_padding_whd=tuple(pad_lo[i] for i in whd),
        upper_padding_whd=tuple(pad_hi[i] for i in whd),
        stride_whd=tuple(stride[i] for i in whd),
        lower_srt=(0, 0, 0),
        stride_srt=tuple(dil[i] for i in whd),
        num_multicast=multicast,
    )
