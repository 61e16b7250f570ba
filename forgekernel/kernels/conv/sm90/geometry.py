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

The fused data gradient (`fused_dgrad`, strides 1 or 2 per dim, not all 1) runs every phase in
one launch over one im2col walk of dout: per dim, tap f of phase a reads dout[j + e] with
e = (a + pad_lo - f*dil) / stride; with L the least e over all phases, every phase is a
stride-1 forward convolution whose window for output j starts at j + L and whose taps sit at
offsets e - L of a shared "walk" filter of max(e) - L + 1 taps (padding below -L). The walk
visits J = ceil(I / stride) outputs per dim, the longest phase's extent; a phase one shorter
(I odd) computes one extra output per row there, never stored. Phase a's i-th tap (its taps
reversed, as above) is at walk offset o0 + i*(dil/g) and reads W's tap f_last - i*(stride/g).
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


# The stride-1 walks over output pixels in rectangles of one (image, output plane), rq along Q
# by pixels // rq along P, loaded by tiled TMAs (zero past P and Q): the weight gradient's
# reduction k-tiles (wgrad.py, RECT_PIXELS = 64 pixels) and the forward's output tiles
# (kernel.py, tile_m = 128 pixels).
RECT_PIXELS = 64
RECT_WIDTHS = (8, 16)  # rq: the compiled rectangles (wgrad 8x8, 16x4; forward 8x16, 16x8)


def rect_shape(pixels: int, rq: int) -> tuple[int, int, int, int]:
    """A rectangle's box over (Q, P, Z, N): rq columns x pixels / rq rows of one plane."""
    return (rq, pixels // rq, 1, 1)


def rect_width(p: int, q: int, pixels: int = RECT_PIXELS) -> int:
    """The rectangle width rq of RECT_WIDTHS for a P x Q output plane: the fewest rectangles
    of `pixels` (the least zero-filled fraction), the first on a tie."""
    return min(RECT_WIDTHS, key=lambda rq: rect_count(1, 1, p, q, rq, pixels))


def rect_count(n: int, z: int, p: int, q: int, rq: int, pixels: int = RECT_PIXELS) -> int:
    """The number of rectangles of `pixels` covering N images of Z x P x Q outputs."""
    return n * z * -(-p // (pixels // rq)) * -(-q // rq)


def rect_k_tiles(n: int, z: int, p: int, q: int, rq: int) -> int:
    """The number of rectangles (pixel k-tiles) covering N images of Z x P x Q outputs."""
    return rect_count(n, z, p, q, rq)


def rect_origin(
    kt: int, z: int, p: int, q: int, rq: int, pixels: int = RECT_PIXELS
) -> tuple[int, int, int, int]:
    """(n, z, p0, q0): rectangle kt's image, output plane and first output row and column, Q's
    rectangles fastest, then P's, Z, N (the kernels' `_rect`)."""
    rp = pixels // rq
    tq, tp = -(-q // rq), -(-p // rp)
    qt, rest = kt % tq, kt // tq
    pt, rest = rest % tp, rest // tp
    return rest // z, rest % z, pt * rp, qt * rq


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


# ---------------------------------------------------------------- the fused data gradient
MAX_FUSED_STRIDE = 2  # phases per dim the fused kernel's tables hold
MAX_PHASE_TAPS = 15  # 4-bit fields of the packed tables (kernel sizes <= 7: <= 4 taps a phase)


@dataclass(frozen=True)
class PhaseTaps:
    """The taps of one phase along one dim in the fused walk: `count` (0: the phase is zero),
    the walk offset of its first tap (its last one in W: `w_tap`), taps reversed."""

    count: int
    offset: int
    w_tap: int

    def packed(self) -> int:
        """count (bits 0-3), W's tap (4-7), walk offset (8-15; < 32: the descriptor's reach, so
        phase 1's copy << 16 stays clear of the sign bit)."""
        return self.count | self.w_tap << 4 | self.offset << 8


@dataclass(frozen=True)
class FusedDgrad:
    """Every phase of a strided data gradient as one launch (module docstring): `walk`, the
    stride-1 forward geometry over dout with the shared walk filter; per dim (D, H, W) the
    phases (stride) and, per phase, its taps; `order`: the phases (ad, ah, aw) heaviest first
    (the kernel's schedule takes them in this order: a static round robin wants the long
    tiles first), phases with no tap last."""

    walk: Geometry
    stride: Triple
    w_step: Triple  # W's taps of a phase: w_tap, w_tap - w_step, ...
    offset_step: Triple  # their walk offsets: offset, offset + offset_step, ...
    taps: tuple[tuple[PhaseTaps, ...], tuple[PhaseTaps, ...], tuple[PhaseTaps, ...]]
    order: tuple[Triple, ...]

    def phase_taps(self, phase: Triple) -> tuple[PhaseTaps, PhaseTaps, PhaseTaps]:
        return tuple(self.taps[i][a] for i, a in enumerate(phase))

    def tap_count(self, phase: Triple) -> int:
        return math.prod(t.count for t in self.phase_taps(phase))

    def kernel_args(self, walk: Geometry | None = None) -> tuple[int, ...]:
        """The fused kernel's geometry arguments: the walk's padding below and above (d, h, w;
        `walk`: the walk as the launcher cropped it, default self.walk), per dim the walk code
        (stride | w_step << 4 | offset_step << 8 | walk filter << 16), per dim the taps code
        (phase 0's `PhaseTaps.packed` | phase 1's << 16), and the order code (phase
        ad*4 + ah*2 + aw of slot p in bits 4p..4p+3)."""
        walk = walk or self.walk
        codes = tuple(
            s | ws << 4 | os << 8 | f << 16
            for s, ws, os, f in zip(self.stride, self.w_step, self.offset_step, walk.filter)
        )
        taps = tuple(
            sum(t.packed() << (16 * a) for a, t in enumerate(per_dim)) for per_dim in self.taps
        )
        order = sum((ad * 4 + ah * 2 + aw) << (4 * p) for p, (ad, ah, aw) in enumerate(self.order))
        return (*walk.pad_lo, *walk.pad_hi, *codes, *taps, order)


def _fused_1d(size: int, out: int, f: int, lo: int, s: int, d: int):
    """One dim of `fused_dgrad`: (walk filter, walk padding below / above, w_step,
    offset_step, the phases' PhaseTaps)."""
    g = math.gcd(d, s)
    per_phase = []  # (a, taps, e of the phase's last tap, e of its first)
    for a in range(s):
        taps = [t for t in range(f) if (t * d - a - lo) % s == 0]
        if taps:
            per_phase.append((a, taps, (a + lo - taps[-1] * d) // s, (a + lo - taps[0] * d) // s))
        else:
            per_phase.append((a, taps, None, None))
    least = min(e_last for _, t, e_last, _ in per_phase if t)
    most = max(e_first for _, t, _, e_first in per_phase if t)
    walk_taps = most - least + 1
    extent = -(-size // s)  # phase 0's: the longest
    pad_hi = extent - out + least + walk_taps - 1
    phases = tuple(
        PhaseTaps(len(taps), e_last - least, taps[-1]) if taps else PhaseTaps(0, 0, 0)
        for _, taps, e_last, _ in per_phase
    )
    return walk_taps, -least, pad_hi, s // g, d // g, phases


def _fused_dgrad(geometry: Geometry, input_dhw: Triple, output_dhw: Triple) -> FusedDgrad:
    g = geometry
    dims = [
        _fused_1d(input_dhw[i], output_dhw[i], g.filter[i], g.pad_lo[i], g.stride[i],
                  g.dilation[i])
        for i in range(3)
    ]  # fmt: skip
    walk = Geometry(
        filter=tuple(d[0] for d in dims),
        pad_lo=tuple(d[1] for d in dims),
        pad_hi=tuple(d[2] for d in dims),
    )
    taps = tuple(d[5] for d in dims)
    phases = [
        (ad, ah, aw)
        for ad in range(g.stride[0])
        for ah in range(g.stride[1])
        for aw in range(g.stride[2])
    ]
    count = [math.prod(taps[i][a].count for i, a in enumerate(p)) for p in phases]
    order = tuple(p for _, p in sorted(zip(count, phases), key=lambda cp: -cp[0]))
    return FusedDgrad(
        walk=walk,
        stride=tuple(g.stride),
        w_step=tuple(d[3] for d in dims),
        offset_step=tuple(d[4] for d in dims),
        taps=taps,
        order=order,
    )


def fused_dgrad_problem(geometry: Geometry, input_dhw: Triple, output_dhw: Triple):
    """Why the data gradient cannot run as one fused launch, or None: strides 1 or 2 per dim
    (not all 1: a stride-1 gradient is one plain launch), the walk on the im2col TMA, and the
    packed tables' fields."""
    if max(geometry.stride) == 1 or max(geometry.stride) > MAX_FUSED_STRIDE:
        return f"stride {geometry.stride}: the fused kernel takes strides 1 or 2, not all 1"
    plan = _fused_dgrad(geometry, input_dhw, output_dhw)
    if max(t.count for per_dim in plan.taps for t in per_dim) > MAX_PHASE_TAPS:
        return f"more than {MAX_PHASE_TAPS} taps in a phase"
    if max(geometry.filter) > 16:
        return "W's taps past the packed tables' 4-bit fields"
    problem = plan.walk.descriptor_problem()
    return f"the fused walk: {problem}" if problem else None


# The launcher's, cached like `dgrad_phases`.
fused_dgrad = functools.lru_cache(maxsize=1024)(_fused_dgrad)
