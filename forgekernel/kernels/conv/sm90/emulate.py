"""A CPU model of the compiled forward kernel (torch only), for the tests: it takes the compiled
function's arguments, fn(x, w, y, bias, *geometry, max_clusters), and computes y the way the
kernel is built to, tile by tile and k-tile by k-tile, so that the launcher, the data-gradient
phase split and the kernel's indexing are checked against torch's convolution on a CPU.

What it models (kernel.py's docstring):
- the im2col TMA walk: the bounding box of window starts per (D, H, W) runs from the lower
  corner to (extent - 1 + upper corner), traversed with the stride; a box of `tile_m` pixels
  starts at pixel m0 (N, Z, P, Q order) and walks on, wrapping into the next row, plane and
  image; each pixel reads `tile_k` channels at the tap's offset (s, r, t) x dilation from its
  window start; anything outside X (padding, n >= N, c >= C) reads zero;
- the k-tile order: channel block fastest, then S, R, T, for A and for B alike;
- the tile grid over (M, K), ragged tiles clipped at the store, the bias added to the fp32
  accumulator before the conversion;
- the data-gradient mode (params "dgrad"): W (K, T', R', S', C) read as B = (C, (K, S, R, T)),
  B's k-tiles walking the taps in reverse with the producer's own countdown.

Accumulation is in fp64 (the kernel's is fp32): the model checks indexing, not rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forgekernel.kernels.conv.sm90.config import ConvConfig
from forgekernel.kernels.conv.sm90.geometry import Geometry


def traversal(x_dhw: tuple[int, int, int], geometry: Geometry) -> tuple[int, int, int]:
    """The number of window starts the im2col walk visits per (D, H, W): the bounding box
    [lower corner, extent - 1 + upper corner] stepped by the stride."""
    return tuple(
        max(0, (x - 1 + up - lo) // s + 1)
        for x, lo, up, s in zip(
            x_dhw, geometry.lower_corner(), geometry.upper_corner(), geometry.stride
        )
    )


def im2col_box(
    x: torch.Tensor, geometry: Geometry, m0: int, rows: int, tap: tuple[int, int, int],
    c0: int, cols: int,
) -> torch.Tensor:  # fmt: skip
    """The (rows, cols) tile one im2col TMA load writes: pixels m0 .. m0 + rows - 1 of the
    walk, channels c0 .. c0 + cols - 1, at filter tap (t, r, s); zero outside x."""
    n_img, d, h, w, c = x.shape
    z, p, q = traversal((d, h, w), geometry)
    m = torch.arange(m0, m0 + rows)
    qi, pi, zi, ni = m % q, (m // q) % p, (m // (q * p)) % z, m // (q * p * z)
    starts = [
        lo + i * s for lo, i, s in zip(geometry.lower_corner(), (zi, pi, qi), geometry.stride)
    ]
    coords = [start + t * dil for start, t, dil in zip(starts, tap, geometry.dilation)]
    inside = ni < n_img
    for crd, extent in zip(coords, (d, h, w)):
        inside &= (crd >= 0) & (crd < extent)
    box = torch.zeros(rows, cols, dtype=torch.float64)
    ch = torch.arange(c0, min(c0 + cols, c))
    if inside.any() and len(ch):
        sel = inside.nonzero().squeeze(1)
        gathered = x[ni[sel], coords[0][sel], coords[1][sel], coords[2][sel]][:, ch]
        box[sel[:, None], (ch - c0)[None, :]] = gathered.double()
    return box


def filter_box(
    w: torch.Tensor, n0: int, rows: int, tap: tuple[int, int, int], c0: int, cols: int
) -> torch.Tensor:
    """The (rows, cols) tile of W (K, T, R, S, C) seen as (K, (C, S, R, T)) one B load writes:
    output channels n0.., channels c0.. of tap (t, r, s); zero past K and C."""
    k, c = w.shape[0], w.shape[-1]
    box = torch.zeros(rows, cols, dtype=torch.float64)
    t, r, s = tap
    part = w[n0 : min(n0 + rows, k), t, r, s, c0 : min(c0 + cols, c)]
    box[: part.shape[0], : part.shape[1]] = part.double()
    return box


def filter_box_dgrad(
    w: torch.Tensor, n0: int, rows: int, tap: tuple[int, int, int], c0: int, cols: int
) -> torch.Tensor:
    """The data-gradient mode's B tile: W (K, T, R, S, C) seen as (C, (K, S, R, T)), output
    channels (W's C) n0.., reduction channels (W's K) c0.. of tap (t, r, s); zero past both."""
    k, c = w.shape[0], w.shape[-1]
    box = torch.zeros(rows, cols, dtype=torch.float64)
    t, r, s = tap
    part = w[c0 : min(c0 + cols, k), t, r, s, n0 : min(n0 + rows, c)].T
    box[: part.shape[0], : part.shape[1]] = part.double()
    return box


def dgrad_b_k_tiles(k_tiles: int, c_blocks: int) -> list[int]:
    """B's k-tile for each of A's in the data-gradient mode, counted as the producer counts
    them (kernel.py `_produce`): channel block cb of tap taps - 1 - j for A's (cb, j)."""
    order, cb, tap_b = [], 0, k_tiles - c_blocks
    for _ in range(k_tiles):
        order.append(tap_b + cb)
        cb += 1
        if cb == c_blocks:
            cb, tap_b = 0, tap_b - c_blocks
    return order


def k_tile_coords(kt: int, c_blocks: int, taps: tuple[int, int, int]) -> tuple[int, tuple]:
    """k-tile kt as (channel block, (t, r, s)): (C blocks, S, R, T) colexicographic."""
    t_, r_, s_ = taps
    cb, rest = kt % c_blocks, kt // c_blocks
    s, rest = rest % s_, rest // s_
    r, t = rest % r_, rest // r_
    return cb, (t, r, s)


def run(x, w, y, bias, geometry: Geometry, cfg: ConvConfig, dgrad: bool = False) -> None:
    """y (M, K) = the forward convolution as the kernel computes it (module docstring);
    `dgrad`: the data-gradient mode (w (K, T, R, S, C) read N-major, taps reversed)."""
    m_rows, k = y.shape
    n_img, d, h, wd, c = x.shape
    taps = tuple(w.shape[1:4])
    z, p, q = traversal((d, h, wd), geometry)
    if n_img * z * p * q != m_rows:
        raise AssertionError(f"the walk visits {n_img}x{z}x{p}x{q} pixels, y has {m_rows} rows")
    if dgrad and (w.shape[0] != c or w.shape[-1] != k):
        raise AssertionError(f"dgrad: W {tuple(w.shape)} is not ({c}, taps, {k})")
    c_blocks = -(-c // cfg.tile_k)
    k_tiles = c_blocks * taps[0] * taps[1] * taps[2]
    b_tiles = dgrad_b_k_tiles(k_tiles, c_blocks) if dgrad else range(k_tiles)
    box_b = filter_box_dgrad if dgrad else filter_box
    for m0 in range(0, m_rows, cfg.tile_m):
        for n0 in range(0, k, cfg.tile_n):
            acc = torch.zeros(cfg.tile_m, cfg.tile_n, dtype=torch.float64)
            for kt, kt_b in zip(range(k_tiles), b_tiles):
                cb, tap = k_tile_coords(kt, c_blocks, taps)
                a = im2col_box(x, geometry, m0, cfg.tile_m, tap, cb * cfg.tile_k, cfg.tile_k)
                cb_b, tap_b = k_tile_coords(kt_b, c_blocks, taps)
                b = box_b(w, n0, cfg.tile_n, tap_b, cb_b * cfg.tile_k, cfg.tile_k)
                acc += a @ b.T
            if bias is not None:
                cols = torch.arange(n0, n0 + cfg.tile_n).clamp(max=bias.shape[0] - 1)
                acc += bias[cols].double()[None, :]
            rows, width = min(cfg.tile_m, m_rows - m0), min(cfg.tile_n, k - n0)
            y[m0 : m0 + rows, n0 : n0 + width] = acc[:rows, :width].to(y.dtype)


def compiled(params) -> Callable[..., None]:
    """A stand-in for the compiled function of compile key `params`."""
    cfg = ConvConfig.from_params(dict(params))

    def fn(x, w, y, bias, *args):
        geometry_args, _max_clusters = args[:12], args[12]
        g = Geometry(
            filter=tuple(w.shape[1:4]),
            pad_lo=tuple(geometry_args[0:3]),
            pad_hi=tuple(geometry_args[3:6]),
            stride=tuple(geometry_args[6:9]),
            dilation=tuple(geometry_args[9:12]),
        )
        if (bias is not None) != bool(dict(params)["bias"]):
            raise AssertionError("the kernel was compiled for the other bias flag")
        for name, t in (("x", x), ("w", w), ("y", y), ("bias", bias)):
            if t is not None and (t.data_ptr() % 16 or t.stride(-1) != 1):
                # the exported function rejects these ("Misaligned Tensor data")
                raise AssertionError(f"{name} is not 16-byte aligned with a unit last stride")
        if min(geometry_args[:6]) < 0:
            raise AssertionError(f"negative padding reached the kernel: {geometry_args[:6]}")
        for name, t in (("x", x), ("w", w), ("y", y)):
            if any(st % 8 for st in t.stride()[:-1]):
                raise AssertionError(f"{name}'s strides {t.stride()} are not 16-byte multiples")
        run(x, w, y, bias, g, cfg, dgrad=bool(dict(params).get("dgrad", False)))

    return fn
