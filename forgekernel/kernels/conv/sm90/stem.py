"""The stem (a 2-D stride-2 convolution of few input channels: ResNet's C = 3, 7x7, pad 3) as a
stride-1 convolution of 64 channels that the standard kernels run unchanged: no im2col buffer.
Host code: torch, the standard kernels' launchers and the fold kernel (fold.py) where asked
(docs/conv/NOTES.md, "The stem as its own kernel").

The fold (space-to-depth), per spatial dim of the stem (stride 2, dilation 1, padding lo):
- x, padded by lo + e below (e = lo % 2: an even offset), is cut into 2x2 pixel blocks, each
  stored as one pixel of 4 x cs channels (cs = 4 for C <= 4, 8 for C <= 8; sub-pixel (a, b)'s
  channel c at a x 2 cs + b x C + c, zero past 2C in each block row):
  the folded image (N, Hs, Ws, 4 cs), Hs = P + R' - 1, R' = ceil((R + e) / 2), zero where x is
  not (the padding, the channels past C, the block rows past x);
- output p reads folded rows p .. p + R' - 1 (tap r of the stem, shifted to r + e = 2 r' + a):
  stride 1;
- along W the S' folded pixels a window reads are adjacent, S' x 4 cs contiguous elements:
  the folded image seen with W stride 4 cs and S' x 4 cs channels (an overlapping view, no
  copy; `overlap=False`: that view's compact copy) makes the window one "pixel". The stem is
  then the stride-1 R' x 1 convolution of that view, C' = S' x 4 cs channels (ResNet: 4 x 1 of
  64 channels, 4 k-tiles of 64, 256 reduction columns of which 147 are the stem's), with the
  filter folded alike (`fold_filter`) and its weight gradient unfolded (`unfold_filter_grad`).

`launch.fprop` / `launch.wgrad` run it on the forward's / weight gradient's stride-1 walks (the
rectangles or the im2col walk: one TMA box a k-tile, the view's window a box row). The folded
image is written by one zero fill and one strided copy (four on odd sizes), or by the fold
kernel in one pass (`kernel=True`).
"""

from __future__ import annotations

import dataclasses

import torch

from forgekernel.kernels.conv.sm90 import STEM_FOLD_SPEC, fold_params, launch
from forgekernel.kernels.conv.sm90.geometry import Geometry
from forgekernel.runtime.device import dtype_name, on_device

# What folds: 2-D, stride 2 and dilation 1 along H and W, at most this many input channels
# (cs = 4 or 8: the folded pixel 16 or 32 channels, 32 or 64 bytes) and launch's few-channel
# filters (FEW_CHANNELS_TAPS taps or more).
MAX_CHANNELS = 8


@dataclasses.dataclass(frozen=True)
class Fold:
    """One stem's fold: per (H, W) the shift e, the folded taps (R', S'), the folded image's
    extents (Hs, Ws), x's first folded pixel (i0, j0); cs channels a sub-pixel; the output
    extents (P, Q)."""

    shift: tuple[int, int]
    taps: tuple[int, int]
    extents: tuple[int, int]
    origin: tuple[int, int]
    cs: int
    out: tuple[int, int]

    @property
    def pixel(self) -> int:
        """Channels of a folded pixel (a 2x2 block of cs-channel pixels)."""
        return 4 * self.cs

    @property
    def channels(self) -> int:
        """Channels of the convolution the stem becomes: S' folded pixels."""
        return self.taps[1] * self.pixel

    def geometry(self) -> Geometry:
        """The folded convolution's: R' x 1 taps, stride 1, no padding."""
        return Geometry((1, self.taps[0], 1), (0, 0, 0), (0, 0, 0))


def fits(x: torch.Tensor, w: torch.Tensor, geometry: Geometry) -> bool:
    """Whether the convolution of x (N, D, H, W, C) with w (K, T, R, S, C) folds: launch's few
    channels (2-D, one output plane, several taps) with C <= MAX_CHANNELS, stride 2 and
    dilation 1 along H and W, padding >= 0."""
    if x.shape[-1] > MAX_CHANNELS or not launch.few_channels(x, w, geometry):
        return False
    return (
        geometry.stride[1:] == (2, 2)
        and geometry.dilation[1:] == (1, 1)
        and min(geometry.pad_lo + geometry.pad_hi) >= 0
    )


def plan(c: int, rs: tuple[int, int], geometry: Geometry, out_pq: tuple[int, int]) -> Fold:
    """The fold of a stem of c channels, filter rs = (R, S), output (P, Q)."""
    shift = tuple(geometry.pad_lo[1 + i] % 2 for i in range(2))
    taps = tuple(-(-(f + e) // 2) for f, e in zip(rs, shift))
    extents = tuple(o + t - 1 for o, t in zip(out_pq, taps))
    origin = tuple((geometry.pad_lo[1 + i] + shift[i]) // 2 for i in range(2))
    cs = 4 if c <= 4 else 8
    return Fold(shift, taps, extents, origin, cs, tuple(out_pq))


def fold_input(
    x: torch.Tensor, fold: Fold, overlap: bool = True, kernel: bool = False
) -> torch.Tensor:
    """x (N, 1, H, W, C) as the folded convolution's input (N, 1, Hs, Q, S' x 4 cs): the
    overlapping view of the folded image (W stride 4 cs), or its compact copy (`overlap`
    False: S' x the folded image's bytes). The folded image written by the fold kernel
    (`kernel`: fold.py, one pass) or by torch (a zero fill and a strided copy). A folded pixel
    holds padded x's (2i + a, 2j + b) at channel a x 2 cs + b x C + c: each block row's two
    pixels stay one run of 2C elements, so that on even sizes x is copied in whole runs of 4C
    bytes (int32 elements: half as many as bf16 ones, and one dim fewer for torch's strided
    copy)."""
    n, _, h, w_, c = x.shape
    (hs, ws), (i0, j0), half = fold.extents, fold.origin, fold.pixel // 2
    if kernel:
        folded = x.new_empty(n, hs, ws, fold.pixel)
        fn = launch.get_kernel(STEM_FOLD_SPEC, fold_params(dtype_name(x.dtype), c))
        with on_device(x.device):
            fn(x[:, 0], folded, 2 * i0, 2 * j0)
        return _windows(folded, fold, overlap)
    folded = x.new_zeros(n, hs, ws, fold.pixel)
    rows = folded.view(n, hs, ws, 2, half)[..., : 2 * c].permute(0, 1, 3, 2, 4)  # (N,Hs,a,Ws,2C)
    hx, wx = min(h, 2 * (hs - i0)), min(w_, 2 * (ws - j0))  # x past the windows: unread
    planes = x[:, 0, :hx, :wx]
    if hx % 2 == 0 and wx % 2 == 0:  # one copy of (N, H / 2, a, W / 2, 2C) runs
        src = planes.unflatten(1, (hx // 2, 2)).reshape(n, hx // 2, 2, wx // 2, 2 * c)
        dst = rows[:, i0 : i0 + hx // 2, :, j0 : j0 + wx // 2]
        if _as_words(src) is not None and _as_words(dst) is not None:
            _as_words(dst).copy_(_as_words(src))
        else:
            dst.copy_(src)
    else:  # one copy per sub-pixel parity
        blocks = rows.unflatten(4, (2, c))  # (N, Hs, a, Ws, b, C)
        for a in range(2):
            for b in range(2):
                src = planes[:, a::2, b::2]
                hi, wi = src.shape[1], src.shape[2]
                blocks[:, i0 : i0 + hi, a, j0 : j0 + wi, b].copy_(src)
    return _windows(folded, fold, overlap)


def _windows(folded: torch.Tensor, fold: Fold, overlap: bool) -> torch.Tensor:
    """The folded image (N, Hs, Ws, 4 cs) seen as the windows (N, 1, Hs, Q, S' x 4 cs), or
    their compact copy."""
    n, hs, ws, p = folded.shape
    view = folded.as_strided(
        (n, 1, hs, fold.out[1], fold.channels), (hs * ws * p, hs * ws * p, ws * p, p, 1)
    )
    return view if overlap else view.contiguous()


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """A 16-bit t seen as int32 pairs along its last dim, or None where it cannot be."""
    try:
        return t.view(torch.int32)
    except RuntimeError:
        return None


def _grid(fold: Fold, k: int, c: int, t: torch.Tensor) -> torch.Tensor:
    """The folded filter (K, R', S', 2, half) of the zero-padded tap grid t (K, 2R', 2S', C):
    channel a x half + b x C + c of folded tap (r', s') is tap (2r' + a, 2s' + b)'s c."""
    (rp, sp), half = fold.taps, fold.pixel // 2
    runs = t.view(k, rp, 2, sp, 2 * c).permute(0, 1, 3, 2, 4)  # (K, R', S', a, 2C)
    out = t.new_zeros(k, rp, sp, 2, half)
    out[..., : 2 * c] = runs
    return out


def fold_filter(w: torch.Tensor, fold: Fold) -> torch.Tensor:
    """w (K, 1, R, S, C) as the folded filter (K, 1, R', 1, S' x 4 cs): tap (r, s) at (r + e_h,
    s + e_w) of a 2R' x 2S' grid, zero elsewhere and past C."""
    k, _, r, s, c = w.shape
    (rp, sp), (eh, ew) = fold.taps, fold.shift
    grid = w.new_zeros(k, 2 * rp, 2 * sp, c)
    grid[:, eh : eh + r, ew : ew + s] = w[:, 0]
    return _grid(fold, k, c, grid).reshape(k, 1, rp, 1, fold.channels)


def unfold_filter_grad(dw_folded: torch.Tensor, fold: Fold, dw: torch.Tensor) -> None:
    """dw (K, 1, R, S, C) = the stem's taps of the folded gradient (K, 1, R', 1, S' x 4 cs)."""
    k, _, r, s, c = dw.shape
    (rp, sp), (eh, ew), half = fold.taps, fold.shift, fold.pixel // 2
    runs = dw_folded.reshape(k, rp, sp, 2, half)[..., : 2 * c]  # (K, R', S', a, 2C)
    grid = runs.permute(0, 1, 3, 2, 4).reshape(k, 2 * rp, 2 * sp, c)
    dw[:, 0].copy_(grid[:, eh : eh + r, ew : ew + s])


def fprop(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    geometry: Geometry,
    overlap: bool = True,
    config=None,
    kernel: bool = False,
) -> None:
    """y (N, 1, P, Q, K) = the stem conv(x, w) (+ bias) (`fits`), as launch.fprop of the fold
    (`kernel`: written by the fold kernel)."""
    fold = plan(x.shape[-1], tuple(w.shape[2:4]), geometry, tuple(y.shape[2:4]))
    xf = fold_input(x, fold, overlap, kernel)
    launch.fprop(xf, fold_filter(w, fold), bias, y, fold.geometry(), config)


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    geometry: Geometry,
    overlap: bool = True,
    wgrad_plan=None,
    kernel: bool = False,
) -> None:
    """dw (K, 1, R, S, C) = the stem's weight gradient at dy (N, 1, P, Q, K) (`fits`), as
    launch.wgrad of the fold (`kernel`: written by the fold kernel)."""
    fold = plan(x.shape[-1], tuple(dw.shape[2:4]), geometry, tuple(dy.shape[2:4]))
    xf = fold_input(x, fold, overlap, kernel)
    dw_folded = dw.new_empty(dw.shape[0], 1, fold.taps[0], 1, fold.channels)
    launch.wgrad(dy, xf, dw_folded, fold.geometry(), wgrad_plan)
    unfold_filter_grad(dw_folded, fold, dw)
