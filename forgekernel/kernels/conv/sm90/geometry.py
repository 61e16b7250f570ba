"""Convolution geometry on the host (DSL-free, torch-free): output extents, the im2col TMA
descriptor's corners and limits, the kernel's geometry arguments, and the data gradient's split
into stride-1 forward convolutions, one per output phase.

Every geometry is 3-D, per (D, H, W) with filter extents (T, R, S); a 2-D convolution is
D = T = 1 with no padding, stride 1 and dilation 1 along D. Padding may differ below and above
(torch's padding="same" with an even filter; the data gradient's phases).

Forward, per spatial dim:  out[o] = sum_f in[o*stride - pad_lo + f*dil] * w[f], zero outside,
    O = (I + pad_lo + pad_hi - dil*(F - 1) - 1) // stride + 1.

Data gradient, per dim (`dgrad_phases`): din[i] = sum_{o, f: o*stride - pad_lo + f*dil = i}
dout[o] w[f]. For the phase a = i mod stride (i = a + stride*j) the taps that reach it are those
with f*dil = a + pad_lo (mod stride); with g = gcd(dil, stride) they are f0, f0 + stride/g, ...,
and tap f reads dout[j + (a + pad_lo - f*dil) / stride]: consecutive taps are dil/g apart in
dout. Read in reverse tap order, that is a stride-1 forward convolution of dout with the phase's
flipped taps, dilation dil/g, padding below -(a + pad_lo - f_last*dil)/stride, writing
J = ceil((I - a) / stride) outputs: no multiply-add on the zeros a transposed convolution
would insert. A phase that no tap reaches is zero. Stride 1 is one phase with every tap.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

Triple = tuple[int, int, int]

# The im2col tensor map of a 5-D (N, D, H, W, C) tensor (cuTensorMapEncodeIm2col, PTX
# cp.async.bulk.tensor .im2col): the pixel box corners are signed 5-bit fields per spatial dim
# (the 16 corner bits split over three dims), the per-load filter offsets unsigned 5-bit
# fields, the traversal (element) strides 1..8.
CORNER_MIN, CORNER_MAX = -16, 15
MAX_FILTER_OFFSET = 31
MAX_STRIDE = 8
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Geometry:
    """One convolution's geometry, each field per (D, H, W): filter extents (T, R, S), padding
    below and above, stride and dilation."""

    filter: Triple
    pad_lo: Triple
    pad_hi: Triple
    stride: Triple = (1, 1, 1)
    dilation: Triple = (1, 1, 1)

    def output(self, input_dhw: Triple) -> Triple:
        """Output extents (Z, P, Q) of an input (D, H, W) (<= 0 where the window never fits)."""
        return tuple(
            (i + lo + hi - d * (f - 1) - 1) // s + 1
            for i, f, lo, hi, s, d in zip(
                input_dhw, self.filter, self.pad_lo, self.pad_hi, self.stride, self.dilation
            )
        )

    def lower_corner(self) -> Triple:
        """The im2col bounding box's lower corner: where the first window starts."""
        return tuple(-p for p in self.pad_lo)

    def upper_corner(self) -> Triple:
        """The bounding box's upper corner, relative to the last input element: where the last
        window may start."""
        return tuple(hi - (f - 1) * d for hi, f, d in zip(self.pad_hi, self.filter, self.dilation))

    def descriptor_problem(self) -> str | None:
        """Why the im2col descriptor cannot encode this geometry, or None."""
        dims = "DHW"
        for i in range(3):
            lo, up = self.lower_corner()[i], self.upper_corner()[i]
            offset = (self.filter[i] - 1) * self.dilation[i]
            if not CORNER_MIN <= lo <= CORNER_MAX:
                return (
                    f"padding {self.pad_lo[i]} along {dims[i]} is past the im2col TMA's reach "
                    f"(its box corner -padding must lie in [{CORNER_MIN}, {CORNER_MAX}])"
                )
            if not CORNER_MIN <= up <= CORNER_MAX:
                return (
                    f"padding {self.pad_hi[i]} - (kernel size {self.filter[i]} - 1) x dilation "
                    f"{self.dilation[i]} = {up} along {dims[i]} is outside the im2col TMA's "
                    f"[{CORNER_MIN}, {CORNER_MAX}]"
                )
            if offset > MAX_FILTER_OFFSET:
                return (
                    f"(kernel size {self.filter[i]} - 1) x dilation {self.dilation[i]} = "
                    f"{offset} along {dims[i]} is past the im2col TMA's {MAX_FILTER_OFFSET}"
                )
            if not 1 <= self.stride[i] <= MAX_STRIDE:
                return f"stride {self.stride[i]} along {dims[i]} is outside 1..{MAX_STRIDE}"
        return None

    def kernel_args(self) -> tuple[int, ...]:
        """The compiled function's geometry arguments: padding below, padding above, stride,
        dilation, each (d, h, w)."""
        return (*self.pad_lo, *self.pad_hi, *self.stride, *self.dilation)


@dataclass(frozen=True)
class Phase:
    """One output phase of a data gradient: din[offset + stride*j] for j < extent, per dim, is
    the stride-1 forward convolution `fprop` of dout with the filter taps `taps` in reverse."""

    offset: Triple
    extent: Triple
    taps: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    fprop: Geometry

    def empty(self) -> bool:
        """No tap reaches the phase (its entries are zero) or it holds no entry."""
        return any(not t for t in self.taps) or any(e <= 0 for e in self.extent)


def _phase_1d(a: int, size: int, out: int, f: int, lo: int, s: int, d: int):
    """(extent, taps, pad_lo, pad_hi, dilation) of phase a along one dim (module docstring)."""
    extent = -(-(size - a) // s)
    g = math.gcd(d, s)
    taps = tuple(t for t in range(f) if (t * d - a - lo) % s == 0)
    if not taps:
        return extent, taps, 0, 0, 1
    dil = d // g
    pad_lo = -((a + lo - taps[-1] * d) // s)
    pad_hi = extent - out - pad_lo + dil * (len(taps) - 1)
    return extent, taps, pad_lo, pad_hi, dil


def _dgrad_phases(geometry: Geometry, input_dhw: Triple, output_dhw: Triple) -> tuple[Phase, ...]:
    """The data gradient of a convolution with `geometry` from input (D, H, W) to output
    (Z, P, Q), as stride-1 forward convolutions, one per phase (stride_d x stride_h x stride_w
    of them, in (d, h, w) order)."""
    g = geometry
    per_dim = [
        [
            _phase_1d(a, input_dhw[i], output_dhw[i], g.filter[i], g.pad_lo[i], g.stride[i],
                      g.dilation[i])
            for a in range(g.stride[i])
        ]
        for i in range(3)
    ]  # fmt: skip
    phases = []
    for ad in range(g.stride[0]):
        for ah in range(g.stride[1]):
            for aw in range(g.stride[2]):
                parts = (per_dim[0][ad], per_dim[1][ah], per_dim[2][aw])
                fprop = Geometry(
                    filter=tuple(max(len(p[1]), 1) for p in parts),
                    pad_lo=tuple(p[2] for p in parts),
                    pad_hi=tuple(p[3] for p in parts),
                    dilation=tuple(p[4] for p in parts),
                )
                phases.append(
                    Phase(
                        offset=(ad, ah, aw),
                        extent=tuple(p[0] for p in parts),
                        taps=tuple(p[1] for p in parts),
                        fprop=fprop,
                    )
                )
    return tuple(phases)


# The launcher's: cached, it asks for the same phases on every call (tens of microseconds of
# Python each). Never called where torch.compile traces (the validation calls the uncached one).
dgrad_phases = functools.lru_cache(maxsize=1024)(_dgrad_phases)


def dgrad_geometry_problem(geometry: Geometry, input_dhw: Triple, output_dhw: Triple):
    """Why a phase of the data gradient cannot run on the im2col TMA, or None."""
    for phase in _dgrad_phases(geometry, input_dhw, output_dhw):
        if not phase.empty():
            problem = phase.fprop.descriptor_problem()
            if problem:
                return f"data gradient phase {phase.offset}: {problem}"
    return None
