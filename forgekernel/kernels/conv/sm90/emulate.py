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

The fused data gradient (dgrad_kernel.py, `fused_run` / `compiled_fused`): every phase in one
launch over the shared walk, decoded from the packed arguments the way the kernel decodes them
(the schedule's M axis (phase slot, part, M tile), each phase's k-tiles on the walk's offsets and
W's taps, the split parked per unit) and stored row by row into dX's strided phase view.

Accumulation is in fp64 (the kernel's is fp32): the model checks indexing, not rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forgekernel.kernels.conv.sm90.config import ConvConfig
from forgekernel.kernels.conv.sm90.geometry import (
    RECT_PIXELS,
    Geometry,
    rect_count,
    rect_k_tiles,
    rect_origin,
)


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


def rect_box(
    t: torch.Tensor, origin: tuple, rq: int, c0: int, cols: int, pixels: int = RECT_PIXELS
) -> torch.Tensor:
    """The (pixels, cols) tile one tiled TMA load of a rectangle writes from t (N, D, H, W, C):
    rows the rq x pixels / rq positions at origin (n, d, h0, w0), w fastest; channels c0 ..
    c0 + cols - 1; zero outside t (coordinates below 0 included)."""
    n_img, d, h, w, c = t.shape
    i = torch.arange(pixels)
    n, di, hi, wi = origin[0], origin[1], origin[2] + i // rq, origin[3] + i % rq
    inside = (hi >= 0) & (hi < h) & (wi >= 0) & (wi < w) & (0 <= di < d) & (0 <= n < n_img)
    box = torch.zeros(pixels, cols, dtype=torch.float64)
    ch = torch.arange(c0, max(c0, min(c0 + cols, c)))  # none past C (a tile past K)
    if inside.any() and len(ch):
        sel = inside.nonzero().squeeze(1)
        box[sel[:, None], (ch - c0)[None, :]] = t[n, di, hi[sel], wi[sel]][:, ch].double()
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


def dgrad_b_k_tiles(k_tiles: int, c_blocks: int, k0: int = 0, count: int | None = None):
    """B's k-tile for each of A's k-tiles k0 .. k0 + count - 1 in the data-gradient mode,
    counted as the producer counts them (kernel.py `_produce`): channel block cb of tap
    taps - 1 - j for A's (cb, j), the countdown started at the part's first k-tile."""
    count = k_tiles - k0 if count is None else count
    cb = k0 % c_blocks
    order, tap_b = [], k_tiles - c_blocks - (k0 - cb)
    for _ in range(count):
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


def split_sum(acc, slots, flags, tile: int, tiles: int, part: int, parts: int):
    """The split reduction both kernels run: part `part` of `tile` stores its partial sum in slot
    part x tiles + tile (in the workspace's dtype) and counts itself in flags[tile]; the last of
    the `parts` to arrive resets the flag and gets the sum of every slot (fp64), the others None."""
    slots[part * tiles + tile] = acc.to(slots.dtype)
    flags[tile] += 1
    if int(flags[tile]) < parts:
        return None
    flags[tile] = 0
    return sum(slots[p * tiles + tile].double() for p in range(parts))


def reduce_sum(acc, sums, flags, tile: int, parts: int):
    """The weight gradient's reduce split (wgrad.py `_reduce_part`): part of `tile` adds its
    partial sum into the tile's sum slot sums[tile] (fp32, in arrival order) and counts itself
    in flags[tile]; the last of the `parts` to arrive resets the flag, takes the slot and
    zeroes it (the next launch adds into zero), the others get None."""
    sums[tile] += acc.to(sums.dtype)
    flags[tile] += 1
    if int(flags[tile]) < parts:
        return None
    flags[tile] = 0
    total = sums[tile].double()
    sums[tile] = 0
    return total


def run(x, w, y, bias, geometry: Geometry, cfg: ConvConfig, dgrad: bool = False,
        split=None, rect: int = 0) -> None:  # fmt: skip
    """y (M, K) = the forward convolution as the kernel computes it (module docstring);
    `dgrad`: the data-gradient mode (w (K, T, R, S, C) read N-major, taps reversed); `split`:
    (k-tiles per part, workspace, flags, the order the units run in or None), each tile's
    k-tiles cut into parts, each parked in slot part x tiles + tile and counted in
    flags[tile], the last to arrive summing them in part order (wgrad_run's protocol). `rect`
    > 0 (stride 1): y is (N, Z, P, Q, K) and M tile i the rectangle `geometry.rect_origin(i)`
    of rect x tile_m / rect outputs, A's box x's rectangle shifted by the tap (`rect_box`:
    zero outside x), its rows stored to the rectangle's pixels inside Y (the rest clipped)."""
    y5 = y
    if rect:
        if geometry.stride != (1, 1, 1) or y.dim() != 5:
            raise AssertionError(f"the rectangles walk stride 1, y (N, Z, P, Q, K): {y.shape}")
        y = y.reshape(-1, y.shape[-1])
    m_rows, k = y.shape
    n_img, d, h, wd, c = x.shape
    taps = tuple(w.shape[1:4])
    z, p, q = traversal((d, h, wd), geometry)
    if n_img * z * p * q != m_rows:
        raise AssertionError(f"the walk visits {n_img}x{z}x{p}x{q} pixels, y has {m_rows} rows")
    m_tiles = rect_count(n_img, z, p, q, rect, cfg.tile_m) if rect else -(-m_rows // cfg.tile_m)
    if dgrad and (w.shape[0] != c or w.shape[-1] != k):
        raise AssertionError(f"dgrad: W {tuple(w.shape)} is not ({c}, taps, {k})")
    c_blocks = -(-c // cfg.tile_k)
    k_tiles = c_blocks * taps[0] * taps[1] * taps[2]
    per, work, flags, order = split or (k_tiles, None, None, None)
    parts = -(-k_tiles // per)
    # M tiles padded to whole clusters: a tile past M reads zeros, stores nothing (kernel.py)
    cm = cfg.cluster_m
    tiles_m, tiles_n = -(-m_tiles // cm) * cm, -(-k // cfg.tile_n)
    tiles = tiles_m * tiles_n
    if parts > 1 and (work.numel() < parts * tiles * cfg.tile_m * cfg.tile_n or
                      flags.numel() < tiles or bool(flags[:tiles].any())):  # fmt: skip
        raise AssertionError("the split needs parts x tiles workspace slots and zero flags")
    slots = work[: parts * tiles * cfg.tile_m * cfg.tile_n] if parts > 1 else None
    slots = slots.view(parts * tiles, cfg.tile_m, cfg.tile_n) if parts > 1 else None
    box_b = filter_box_dgrad if dgrad else filter_box
    for unit in order if order is not None else range(tiles * parts):
        tile, part = unit % tiles, unit // tiles
        m0, n0 = (tile % tiles_m) * cfg.tile_m, (tile // tiles_m) * cfg.tile_n
        k0 = part * per
        count = min(k0 + per, k_tiles) - k0
        b_tiles = dgrad_b_k_tiles(k_tiles, c_blocks, k0, count) if dgrad else range(k0, k0 + count)
        acc = torch.zeros(cfg.tile_m, cfg.tile_n, dtype=torch.float64)
        if rect:
            corner = rect_origin(tile % tiles_m, z, p, q, rect, cfg.tile_m)
        for kt, kt_b in zip(range(k0, k0 + count), b_tiles):
            cb, tap = k_tile_coords(kt, c_blocks, taps)
            if rect:
                at = [
                    o + t_ * dil - lo
                    for o, t_, dil, lo in zip(corner[1:], tap, geometry.dilation, geometry.pad_lo)
                ]
                a = rect_box(x, (corner[0], *at), rect, cb * cfg.tile_k, cfg.tile_k, cfg.tile_m)
            else:
                a = im2col_box(x, geometry, m0, cfg.tile_m, tap, cb * cfg.tile_k, cfg.tile_k)
            cb_b, tap_b = k_tile_coords(kt_b, c_blocks, taps)
            b = box_b(w, n0, cfg.tile_n, tap_b, cb_b * cfg.tile_k, cfg.tile_k)
            acc += a @ b.T
        if parts > 1:
            acc = split_sum(acc, slots, flags, tile, tiles, part, parts)
            if acc is None:
                continue
        if bias is not None:
            cols = torch.arange(n0, n0 + cfg.tile_n).clamp(max=bias.shape[0] - 1)
            acc += bias[cols].double()[None, :]
        width = min(cfg.tile_n, k - n0)
        if rect:  # the rectangle's rows inside Y (the TMA store clips the rest)
            n, zo, p0, q0 = corner
            i = torch.arange(cfg.tile_m)
            pi, qi = p0 + i // rect, q0 + i % rect
            sel = ((pi < p) & (qi < q)).nonzero().squeeze(1)
            if n < n_img:  # a tile past the last image (cluster padding) stores nothing
                y5[n, zo, pi[sel], qi[sel], n0 : n0 + width] = acc[sel, :width].to(y.dtype)
            continue
        rows = max(0, min(cfg.tile_m, m_rows - m0))
        y[m0 : m0 + rows, n0 : n0 + width] = acc[:rows, :width].to(y.dtype)


def compiled(params, order_seed: int | None = None) -> Callable[..., None]:
    """A stand-in for the compiled function of compile key `params` (`order_seed`: a split's
    units run in a random order, as a GPU may)."""
    cfg = ConvConfig.from_params(dict(params))
    rect = dict(params).get("rect", 0)

    def fn(x, w, y, bias, work, flags, *args):
        geometry_args, per_split, _max_clusters = args[:12], args[12], args[13]
        if (work is not None) != cfg.split or (flags is not None) != cfg.split:
            raise AssertionError("the workspace and flags go with a split configuration")
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
        split = None
        if cfg.split:
            order = None
            if order_seed is not None:
                c_blocks = -(-x.shape[-1] // cfg.tile_k)
                k_tiles = c_blocks * w.shape[1] * w.shape[2] * w.shape[3]
                cm = cfg.cluster_m
                m_tiles = -(-y.shape[0] // cfg.tile_m)
                if rect:
                    m_tiles = rect_count(*y.shape[:4], rect, cfg.tile_m)
                tiles = -(-m_tiles // cm) * cm * -(-y.shape[-1] // cfg.tile_n)
                units = tiles * -(-k_tiles // per_split)
                gen = torch.Generator().manual_seed(order_seed)
                order = torch.randperm(units, generator=gen).tolist()
            split = (per_split, work, flags, order)
        if (y.dim() == 5) != bool(rect):
            raise AssertionError(f"y {tuple(y.shape)}: (M, K) for im2col, 5-D for rectangles")
        run(x, w, y, bias, g, cfg, bool(dict(params).get("dgrad", False)), split, rect)

    return fn


# ---------------------------------------------------------------- the weight gradient
def wgrad_run(dy, x, dw, work, flags, geometry: Geometry, cfg, per_split: int, order=None,
              rect: int = 0, reduce: bool = False):  # fmt: skip
    """dw (K, T, R, S, C) = the weight gradient as the kernel (wgrad.py) computes it: CTA
    (tile, split) of the grid sums its pixel k-tiles of A = dY^T (tile_m x 64 boxes, zero past
    K and M) times B = im2col(x) (`tile_n / 64` boxes of 64 pixels x 64 channels at the tap,
    the block index clamped to the last one). `rect` > 0 (stride 1): dy is (N, Z, P, Q, K)
    and a k-tile is the rectangle `geometry.rect_origin` of rect x 64 / rect outputs, A's box
    dy's rectangle, B's x's rectangle shifted by the tap (`rect_box`: zero outside, the
    padding). With several splits, each part is parked in
    slot split x tiles + tile of `work` and counted in `flags[tile]`, and the last part to
    arrive (CTAs run in `order`, default the launch order) sums the slots in split order and
    stores; the flag is left zero. `reduce` (the reduce split): each part adds into its tile's
    one slot of `work` instead (zero at entry, left zero: `reduce_sum`). fp64 accumulation
    (indexing, not rounding)."""
    k = dy.shape[-1]
    m_rows = dy.numel() // max(k, 1)
    taps = tuple(dw.shape[1:4])
    c = dw.shape[-1]
    z, p, q = traversal(tuple(x.shape[1:4]), geometry)
    if x.shape[0] * z * p * q != m_rows:
        raise AssertionError(f"the walk visits {x.shape[0]}x{z}x{p}x{q} pixels, dy has {m_rows}")
    if rect:
        if geometry.stride != (1, 1, 1) or dy.dim() != 5 or tuple(dy.shape[1:4]) != (z, p, q):
            raise AssertionError(f"the rectangles walk stride 1, dy (N, Z, P, Q, K): {dy.shape}")
        k_tiles = rect_k_tiles(x.shape[0], z, p, q, rect)
    elif dy.dim() != 2:
        raise AssertionError(f"the im2col walk reads dy as (M, K), got {tuple(dy.shape)}")
    else:
        k_tiles = -(-m_rows // 64)
    tm, tn, box = cfg.tile_m, cfg.tile_n, 64
    boxes, c_boxes = tn // box, -(-c // box)
    cm = cfg.cluster_m  # K tiles padded to whole clusters (a tile past K stores nothing)
    tiles_m, c_tiles = -(-k // (tm * cm)) * cm, -(-c // tn)
    tiles = tiles_m * c_tiles * taps[0] * taps[1] * taps[2]
    splits = -(-k_tiles // per_split)
    held = tiles if reduce else splits * tiles  # the workspace's tile slots
    if splits > 1 and work.numel() < held * tm * tn:
        raise AssertionError(f"workspace {work.numel()} < {held} tiles")
    if flags.numel() < tiles or bool(flags[:tiles].any()):
        raise AssertionError("the flags must be zero, one per tile")
    slots = work[: held * tm * tn].view(held, tm, tn) if splits > 1 else None
    if reduce and splits > 1 and bool(slots.any()):
        raise AssertionError("the reduce split's sum slots must be zero")
    for cta in order if order is not None else range(tiles * splits):
        tile, split = cta % tiles, cta // tiles
        tile_m, tile_n = tile % tiles_m, tile // tiles_m
        c_tile, tap_index = tile_n % c_tiles, tile_n // c_tiles
        _, tap = k_tile_coords(tap_index, 1, taps)
        acc = torch.zeros(tm, tn, dtype=torch.float64)
        blocks = [min(c_tile * boxes + j, c_boxes - 1) for j in range(boxes)]
        for kt in range(split * per_split, min((split + 1) * per_split, k_tiles)):
            if rect:
                n, zo, p0, q0 = rect_origin(kt, z, p, q, rect)
                a = rect_box(dy, (n, zo, p0, q0), rect, tile_m * tm, tm)
                lo, dil = geometry.pad_lo, geometry.dilation
                at = [o + f * dl - pd for o, f, dl, pd in zip((zo, p0, q0), tap, dil, lo)]
                b = torch.cat([rect_box(x, (n, *at), rect, cb * box, box) for cb in blocks], 1)
            else:
                a = torch.zeros(box, tm, dtype=torch.float64)
                part = dy[kt * box : (kt + 1) * box, tile_m * tm : (tile_m + 1) * tm]
                a[: part.shape[0], : part.shape[1]] = part.double()
                b = torch.cat([im2col_box(x, geometry, kt * box, box, tap, cb * box, box)
                               for cb in blocks], dim=1)  # fmt: skip
            acc += a.T @ b
        if splits > 1 and reduce:
            acc = reduce_sum(acc, slots, flags, tile, splits)
        elif splits > 1:
            acc = split_sum(acc, slots, flags, tile, tiles, split, splits)
        if acc is None:
            continue
        rows = max(0, min(tm, k - tile_m * tm))
        cols = min(tn, c - c_tile * tn)
        t, r, s = tap
        dst = dw[tile_m * tm : tile_m * tm + rows, t, r, s, c_tile * tn : c_tile * tn + cols]
        dst.copy_(acc[:rows, :cols].to(dw.dtype))


def compiled_wgrad(params, order_seed: int | None = None) -> Callable[..., None]:
    """A stand-in for the weight-gradient kernel's compiled function of compile key `params`
    (`order_seed`: run the CTAs in a random order, as a GPU may)."""
    from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig

    cfg = GemmConfig.from_params(dict(params))
    rect = dict(params)["rect"]
    reduce = dict(params).get("reduce", False)

    def fn(dy, x, dw, work, flags, *args):
        geometry_args, per_split = args[:12], args[12]
        g = Geometry(
            filter=tuple(dw.shape[1:4]),
            pad_lo=tuple(geometry_args[0:3]),
            pad_hi=tuple(geometry_args[3:6]),
            stride=tuple(geometry_args[6:9]),
            dilation=tuple(geometry_args[9:12]),
        )
        for name, t in (("dy", dy), ("x", x), ("dw", dw)):
            if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st % 8 for st in t.stride()[:-1]):
                raise AssertionError(f"{name} is not TMA-ready: {t.stride()}")
        if dy.shape[-1] != dw.shape[0] or x.shape[-1] != dw.shape[-1]:
            raise AssertionError("dy, x and dw disagree on the channels")
        order = None
        if order_seed is not None:
            n, z, p, q, _ = dy.shape if rect else (1, 1, 1, dy.shape[0], 0)
            k_tiles = rect_k_tiles(n, z, p, q, rect) if rect else -(-dy.shape[0] // 64)
            cm = cfg.cluster_m
            tiles = -(-dw.shape[0] // (cfg.tile_m * cm)) * cm * -(-dw.shape[-1] // cfg.tile_n)
            ctas = tiles * dw.shape[1] * dw.shape[2] * dw.shape[3] * -(-k_tiles // per_split)
            gen = torch.Generator().manual_seed(order_seed)
            order = torch.randperm(ctas, generator=gen).tolist()
        wgrad_run(dy, x, dw, work, flags, g, cfg, per_split, order, rect, reduce)

    return fn


# ---------------------------------------------------------------- the fused data gradient
def unpack_fused(args) -> dict:
    """The fused kernel's geometry arguments (geometry.FusedDgrad.kernel_args) decoded with the
    kernel's shifts and masks: the walk, per dim stride / w_step / offset_step, each slot's
    phase (ad, ah, aw) and per phase and dim (count, walk offset, W's tap)."""
    pad_lo, pad_hi, codes, taps, order = args[0:3], args[3:6], args[6:9], args[9:12], args[12]
    stride = [c & 0xF for c in codes]
    walk = Geometry(tuple((c >> 16) & 0xFF for c in codes), tuple(pad_lo), tuple(pad_hi))
    slots = stride[0] * stride[1] * stride[2]
    phases = [((order >> 4 * p) >> 2 & 1, (order >> 4 * p) >> 1 & 1, order >> 4 * p & 1)
              for p in range(slots)]  # fmt: skip

    def phase_taps(dim: int, a: int) -> tuple[int, int, int]:
        code = taps[dim] >> 16 * a & 0xFFFF
        return code & 0xF, code >> 8 & 0xFF, code >> 4 & 0xF

    return {
        "walk": walk,
        "stride": stride,
        "w_step": [c >> 4 & 0xF for c in codes],
        "offset_step": [c >> 8 & 0xFF for c in codes],
        "phases": phases,
        "taps": {ph: [phase_taps(i, a) for i, a in enumerate(ph)] for ph in phases},
    }


def fused_units(cfg, m_rows: int, c_blocks: int, per_split: int, t: dict):
    """The schedule's M axis as the kernel walks it: for each slot (phase, in order), its parts
    (a phase of k k-tiles: max(1, ceil(k / per_split))), each `slot_tiles` M tiles (padded to
    whole clusters). Returns (slot_tiles, [(phase, k-tiles, parts, first M index)])."""
    cm = cfg.cluster_m
    tiles_m = -(-m_rows // cfg.tile_m)
    slot_tiles = -(-tiles_m // cm) * cm
    slots, base = [], 0
    for ph in t["phases"]:
        k = c_blocks * t["taps"][ph][0][0] * t["taps"][ph][1][0] * t["taps"][ph][2][0]
        parts = max(1, -(-k // per_split))
        slots.append((ph, k, parts, base))
        base += parts * slot_tiles
    return slot_tiles, slots


def _phase_rows(dx_shape, m0: int, rows: int, j_dhw, phase, stride):
    """dX coordinates (n, d, h, w) of walk rows m0 .. m0 + rows - 1 of `phase`, and which of
    them exist (n < N, every coordinate inside dX): the row-addressed epilogue's decode."""
    m = torch.arange(m0, m0 + rows)
    jd, jh, jw = j_dhw
    coords = [m // (jw * jh * jd), m // (jw * jh) % jd, m // jw % jh, m % jw]
    coords[1:] = [a + s * j for a, s, j in zip(phase, stride, coords[1:])]
    valid = coords[0] < dx_shape[0]
    for crd, extent in zip(coords[1:], dx_shape[1:4]):
        valid &= crd < extent
    return coords, valid


def fused_run(dy, w, dx, work, flags, args, cfg: ConvConfig, per_split: int, order=None):
    """dx (N, D, H, W, C) = the data gradient as the fused kernel computes it (module
    docstring): dy (N, Z', P', Q', K) the walk's input (cropped), w (K, T, R, S, C) whole;
    `order`: the units in the order they run (default the schedule's). Each unit (M-axis index
    u_m, N tile) of a split phase parks in slot n x units_m + u_m and counts itself in the
    flag of its output tile; the last sums the phase's parts in part order."""
    t = unpack_fused(args)
    walk = t["walk"]
    n_img, k_red = dy.shape[0], dy.shape[-1]
    c_out = dx.shape[-1]
    j_dhw = tuple(-(-dx.shape[1 + i] // t["stride"][i]) for i in range(3))
    z, p, q = traversal(tuple(dy.shape[1:4]), walk)
    if (z, p, q) != j_dhw:
        raise AssertionError(f"the walk visits {(z, p, q)}, the longest phase is {j_dhw}")
    if w.shape[0] != k_red or w.shape[-1] != c_out:
        raise AssertionError(f"W {tuple(w.shape)} is not ({k_red}, taps, {c_out})")
    m_rows = n_img * z * p * q
    tm, tn = cfg.tile_m, cfg.tile_n
    c_blocks = -(-k_red // cfg.tile_k)
    slot_tiles, slots = fused_units(cfg, m_rows, c_blocks, per_split, t)
    units_m = sum(parts * slot_tiles for _, _, parts, _ in slots)
    tiles_n = -(-c_out // tn)
    tiles = len(slots) * slot_tiles * tiles_n
    split = units_m > len(slots) * slot_tiles
    if split != cfg.split and split:
        raise AssertionError("a phase in parts needs the split configuration")
    if split:
        if work.numel() < units_m * tiles_n * tm * tn or flags.numel() < tiles:
            raise AssertionError("the split needs a workspace slot per unit and a flag per tile")
        if bool(flags[:tiles].any()):
            raise AssertionError("the flags must be zero")
        parked = work[: units_m * tiles_n * tm * tn].view(units_m * tiles_n, tm, tn)
    for unit in order if order is not None else range(units_m * tiles_n):
        u_m, tile_n = unit % units_m, unit // units_m
        slot = max(i for i, s in enumerate(slots) if s[3] <= u_m)
        phase, k, parts, base = slots[slot]
        part, local = divmod(u_m - base, slot_tiles)
        (nt, ot, ft), (nr, orr, fr), (ns, os_, fs) = t["taps"][phase]
        k0 = part * per_split
        count = min(per_split, k - k0) if k else 0
        acc = torch.zeros(tm, tn, dtype=torch.float64)
        for kt in range(k0, k0 + count):
            cb, (it, ir, is_) = k_tile_coords(kt, c_blocks, (nt, nr, ns))
            steps, wsteps = t["offset_step"], t["w_step"]
            tap = (ot + it * steps[0], orr + ir * steps[1], os_ + is_ * steps[2])
            w_tap = (ft - it * wsteps[0], fr - ir * wsteps[1], fs - is_ * wsteps[2])
            a = im2col_box(dy, walk, local * tm, tm, tap, cb * cfg.tile_k, cfg.tile_k)
            b = filter_box_dgrad(w, tile_n * tn, tn, w_tap, cb * cfg.tile_k, cfg.tile_k)
            acc += a @ b.T
        if parts > 1:
            parked[tile_n * units_m + u_m] = acc.to(parked.dtype)
            tile = tile_n * len(slots) * slot_tiles + slot * slot_tiles + local
            flags[tile] += 1
            if int(flags[tile]) < parts:
                continue
            flags[tile] = 0
            first = tile_n * units_m + base + local
            acc = sum(parked[first + r * slot_tiles].double() for r in range(parts))
        coords, valid = _phase_rows(dx.shape, local * tm, tm, j_dhw, phase, t["stride"])
        rows = valid.nonzero().squeeze(1)
        c0, width = tile_n * tn, min(tn, c_out - tile_n * tn)
        n, d, h, w_ = (crd[rows] for crd in coords)
        dx[n, d, h, w_, c0 : c0 + width] = acc[rows, :width].to(dx.dtype)


def compiled_fused(params, order_seed: int | None = None) -> Callable[..., None]:
    """A stand-in for the fused data-gradient kernel's compiled function of compile key
    `params` (`order_seed`: its units run in a random order, as a GPU may)."""
    cfg = ConvConfig.from_params(dict(params))

    def fn(dy, w, dx, work, flags, *args):
        geometry_args, per_split = args[:13], args[13]
        if (work is not None) != cfg.split or (flags is not None) != cfg.split:
            raise AssertionError("the workspace and flags go with a split configuration")
        for name, t in (("dy", dy), ("w", w), ("dx", dx)):
            if t.data_ptr() % 16 or t.stride(-1) != 1 or any(st % 8 for st in t.stride()[:-1]):
                raise AssertionError(f"{name} is not 16-byte aligned in rows: {t.stride()}")
        if min(geometry_args[:6]) < 0:
            raise AssertionError(f"negative padding reached the kernel: {geometry_args[:6]}")
        order = None
        if order_seed is not None:
            t = unpack_fused(geometry_args)
            c_blocks = -(-dy.shape[-1] // cfg.tile_k)
            j = [-(-dx.shape[1 + i] // t["stride"][i]) for i in range(3)]
            m_rows = dy.shape[0] * j[0] * j[1] * j[2]
            slot_tiles, slots = fused_units(cfg, m_rows, c_blocks, per_split, t)
            units = sum(s[2] for s in slots) * slot_tiles * -(-dx.shape[-1] // cfg.tile_n)
            gen = torch.Generator().manual_seed(order_seed)
            order = torch.randperm(units, generator=gen).tolist()
        fused_run(dy, w, dx, work, flags, geometry_args, cfg, per_split, order)

    return fn


# ---------------------------------------------------------------- the stem's fold
def fold_run(x, folded, off_h: int, off_w: int, channels: int, half: int) -> None:
    """folded (N, Hs, Ws, 2 half) = the fold of x (N, H, W, C) as fold.py writes it: every
    pixel (zero fill included), channel a x half + b x C + c from x (2i + a - off_h, 2j + b -
    off_w, c), zero outside x."""
    n, hs, ws, width = folded.shape
    if width != 2 * half or x.shape[-1] != channels or folded.stride(-1) != 1:
        raise AssertionError(f"x {tuple(x.shape)} / folded {tuple(folded.shape)} off the key")
    if folded.data_ptr() % 16 or any(st % 8 for st in folded.stride()[:-1]):
        raise AssertionError("the folded image's pixels are stored 16 bytes at a time")
    out = torch.zeros(n, hs, ws, 2, half, dtype=folded.dtype)
    h_x, w_x = x.shape[1], x.shape[2]
    for a in range(2):
        h = 2 * torch.arange(hs) + a - off_h
        for b in range(2):
            w = 2 * torch.arange(ws) + b - off_w
            inside = ((h >= 0) & (h < h_x))[:, None] & ((w >= 0) & (w < w_x))[None, :]
            got = x[:, h.clamp(0, h_x - 1)][:, :, w.clamp(0, w_x - 1)]
            zero = torch.zeros((), dtype=x.dtype)
            out[..., a, b * channels : (b + 1) * channels] = torch.where(
                inside[None, :, :, None], got, zero
            )
    folded.copy_(out.view(n, hs, ws, width))


def compiled_fold(params) -> Callable[..., None]:
    """A stand-in for the stem fold's compiled function of compile key `params`."""
    p = dict(params)

    def fn(x, folded, off_h, off_w):
        fold_run(x, folded, int(off_h), int(off_w), p["channels"], p["half"])

    return fn


def stand_in(spec, params, order_seed: int | None = None) -> Callable[..., None]:
    """The model of the leaf's kernel `spec` (forward / data gradient, fused data gradient, or
    weight gradient) for compile key `params`: what the tests put in place of
    `runtime.cache.get_kernel` (`order_seed`: its units in a random order)."""
    if spec.name == "conv_wgrad_sm90":
        return compiled_wgrad(params, order_seed)
    if spec.name == "conv_dgrad_sm90":
        return compiled_fused(params, order_seed)
    if spec.name == "conv_stem_fold_sm90":
        return compiled_fold(params)
    return compiled(params, order_seed)
