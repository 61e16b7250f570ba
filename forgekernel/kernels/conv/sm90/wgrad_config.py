"""The weight-gradient kernel's configurations (wgrad.py) and its analytical chooser of tile and
split. DSL-free. The kernel is the dense GEMM's, configured by a GemmConfig: no clusters,
tile_n a multiple of 64 input channels (im2col boxes), tile_m output channels (one or two
consumer warpgroups), the reduction over the N x Z x P x Q output pixels in k-tiles of 64.
"""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import NUM_SMS_H100_H200
from forgekernel.kernels.conv.sm90.config import MAX_WORKSPACE, SplitPlan, split_cost
from forgekernel.kernels.conv.sm90.geometry import RECT_WIDTHS
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# Not yet measured: the efficiencies below are the GEMM's (docs/gemm/NOTES.md) for its large
# tiles, guesses for the small ones (bandwidth-bound: more operand bytes per multiply-add). On
# the im2col walk B's rows (tile_n per k-tile, halved by a 2x1 cluster's multicast) and the
# producer's k-tile bound the small tiles (`wgrad_cost`).
WGRAD_LARGE = GemmConfig(tile_m=128, tile_n=256, cluster_m=2)
WGRAD_SQUARE = GemmConfig(tile_m=128, tile_n=128, cluster_m=2)
WGRAD_WIDE = GemmConfig(tile_m=128, tile_n=256, cluster_m=1)
WGRAD_SMALL_SQUARE = GemmConfig(tile_m=128, tile_n=128, cluster_m=1)
WGRAD_NARROW = GemmConfig(tile_m=128, tile_n=64, cluster_m=1)
WGRAD_SHORT = GemmConfig(tile_m=64, tile_n=128, cluster_m=1)
WGRAD_SMALL = GemmConfig(tile_m=64, tile_n=64, cluster_m=1)
WGRAD_CONFIGS = (
    WGRAD_SQUARE,
    WGRAD_LARGE,
    WGRAD_WIDE,
    WGRAD_SMALL_SQUARE,
    WGRAD_NARROW,
    WGRAD_SHORT,
    WGRAD_SMALL,
)
_WGRAD_EFFICIENCY = {
    WGRAD_LARGE: 1.0,
    WGRAD_SQUARE: 0.93,
    WGRAD_WIDE: 1.0,
    WGRAD_SMALL_SQUARE: 0.93,
    WGRAD_NARROW: 0.8,
    WGRAD_SHORT: 0.8,
    WGRAD_SMALL: 0.6,
}
# The pixel walk of a compile key (`rect`): the stride-1 path's rectangles of `rect` output
# columns x 64 / rect rows (geometry.rect_width), or 0, the im2col TMA's linear walk (other
# strides). The first standard key (the representative build) walks rectangles.
WGRAD_RECTS = (*RECT_WIDTHS, 0)
WGRAD_MAX_SPLITS = 64
WGRAD_MIN_PER_SPLIT = 4  # pixel k-tiles
# The im2col walk's (strides other than 1) k-tile and CTA costs, refit 2026-12-02 from the 18:47
# bench (docs/conv/NOTES.md, "The weight gradient's worst cases, 18:47"), in split_cost's unit
# (a 128x128 k-tile's multiply-adds at full speed, ~0.43 us on the H200):
# - B's 128 im2col rows cost WGRAD_IM2COL_ROWS_128 = 1.0, not config.IM2COL_ROWS_128 = 2.0: the
#   forward's 128x128 c2x1 tile ran its 128 im2col rows a k-tile at 656 TF/s (conv_k128_probe,
#   18:47), so the "rate" was the producer's arithmetic, which the old 2.0 had absorbed;
# - the producer thread's k-tile costs at least WGRAD_IM2COL_FLOOR: its old loop (339 SASS
#   instructions, nine run-time divisions on 128x128 c2x1) ran ~0.89 us a k-tile at 18:47; the
#   odometer's (wgrad.py `_produce_wgrad`, no division, 44-139 instructions by tile) is taken
#   at the forward's after its own odometer: ~0.26 us a 128x64 im2col k-tile (c64-56x56 3x3,
#   conv_fwd_walks 18:47, less its epilogue's share), 0.6 here: a guess for the probe to fit;
# - a CTA pays WGRAD_START once beyond its epilogue (launch, barriers, the ring's first fill):
#   ~2.4 us, from n8-c1280-16x16 (900 CTAs of 8 k-tiles: 66.8 us) against n8-c320-64x64 (108
#   CTAs of 128: 116.8 us).
# The tiled walk (stride 1) keeps the old terms: none of these was fitted on it.
WGRAD_IM2COL_ROWS_128 = 1.0
WGRAD_IM2COL_FLOOR = 0.6
WGRAD_START = 5.5
# Stride 1 takes the im2col walk where its plan's cost is below WGRAD_WALK_MARGIN x the
# rectangles' (`wgrad_prefers_im2col`), each with WGRAD_START a wave: the rectangles' model
# without it ran 1.31x under the 03:50 times of the 24 stride-1 cases (median), 0.99x with it.
# The margin keeps n32-c128-28x28-k128-3x3 on rectangles (its stride-2 twin
# n32-c128-56x56-k128-3x3-s2, the same GEMM on the im2col walk, ran 21.2 us against its 20.3);
# n32-c512-7x7-k512-3x3 (36.2 us, 0.539x cuDNN) and n32-c256-14x14-k256-3x3 (21.1 us) move to
# the im2col walk, whose twins (n32-c512-14x14-k512-3x3-s2, n32-c256-28x28-k256-3x3-s2: the
# same plans) ran 19.6 and 18.4 us: the rectangles of a 7x7 or 14x14 map are 23% zero.
WGRAD_WALK_MARGIN = 0.875

# The weight gradient's plan: its GemmConfig, pixel k-tiles per part, parts, output tiles.
WgradPlan = SplitPlan


def wgrad_tiles(cfg: GemmConfig, k: int, c: int, taps: int) -> int:
    """Output tiles of dW (K, taps x C): tile_m output channels (K tiles padded to whole
    clusters) x tile_n input channels of one tap."""
    return _ceil(k, cfg.tile_m * cfg.cluster_m) * cfg.cluster_m * _ceil(c, cfg.tile_n) * taps


def wgrad_cost(cfg: GemmConfig, k: int, c: int, taps: int, k_tiles: int, splits: int,
               num_sms: int, tiled: bool = False,
               started: bool = False) -> tuple[float, int, int]:  # fmt: skip
    """`config.split_cost` of `cfg` on the weight gradient (K output channels, C input
    channels, `taps` taps, `k_tiles` pixel k-tiles) with its reduction cut `splits` ways. The
    im2col walk: a k-tile takes the longest of its multiply-adds, B's rows (tile_n / cluster_m
    a CTA, WGRAD_IM2COL_ROWS_128 per 128) and the producer's WGRAD_IM2COL_FLOOR, and a CTA pays
    WGRAD_START; `tiled` (the stride-1 rectangles: tiled TMAs) the multiply-adds alone, and
    WGRAD_START too where `started` (the walks compared: `wgrad_prefers_im2col`)."""
    cm = cfg.cluster_m
    tiles_mn = (_ceil(k, cfg.tile_m * cm) * cm, _ceil(c, cfg.tile_n) * taps)
    tile = (cfg.tile_m, cfg.tile_n)
    rows, start = 0.0, WGRAD_START if started else 0.0
    if not tiled:  # in units of 128 rows at 1.0 a row-block: split_cost's row_rate 1.0
        rows = 128 * max(WGRAD_IM2COL_ROWS_128 * cfg.tile_n / cm / 128, WGRAD_IM2COL_FLOOR)
        start = WGRAD_START
    return split_cost(
        tile,
        tiles_mn,
        (cm, 1),
        k_tiles,
        splits,
        num_sms,
        _WGRAD_EFFICIENCY[cfg],
        im2col_rows=rows,
        row_rate=1.0,
        start=start,
    )


def choose_wgrad(k: int, c: int, taps: int, k_tiles: int, num_sms: int = NUM_SMS_H100_H200,
                 tiled: bool = False) -> WgradPlan:  # fmt: skip
    """The weight gradient's tile and split (K output channels, C input channels, `taps` filter
    taps, `k_tiles` pixel k-tiles the reduction: ceil(N x Z x P x Q / 64) on the im2col walk,
    the rectangles on the stride-1 `tiled` one): the cheapest by `wgrad_cost` over the tiles
    and splits whose workspace fits."""
    best = None
    for cfg in WGRAD_CONFIGS:
        tiles = wgrad_tiles(cfg, k, c, taps)
        limit = min(WGRAD_MAX_SPLITS, max(1, k_tiles // WGRAD_MIN_PER_SPLIT))
        limit = min(limit, max(1, MAX_WORKSPACE // (tiles * cfg.tile_m * cfg.tile_n)))
        for s in range(1, limit + 1):
            cost, per, splits = wgrad_cost(cfg, k, c, taps, k_tiles, s, num_sms, tiled)
            if best is None or cost < best[0]:
                best = (cost, WgradPlan(cfg, per, splits, tiles))
    return best[1]


def wgrad_prefers_im2col(k: int, c: int, taps: int, rect_k_tiles: int, im2col_k_tiles: int,
                         num_sms: int = NUM_SMS_H100_H200) -> bool:  # fmt: skip
    """Whether a stride-1 weight gradient runs faster on the im2col walk (`im2col_k_tiles`
    of 64 pixels) than on the rectangles (`rect_k_tiles`, zero-filled where the map is no
    multiple of them): each walk's `choose_wgrad` plan, the rectangles' with WGRAD_START a
    wave as the im2col walk's, the im2col walk's below WGRAD_WALK_MARGIN x the rectangles'."""
    rect = choose_wgrad(k, c, taps, rect_k_tiles, num_sms, tiled=True)
    rect_cost = wgrad_cost(rect.config, k, c, taps, rect_k_tiles, rect.parts, num_sms, True, True)
    im2col = choose_wgrad(k, c, taps, im2col_k_tiles, num_sms)
    im2col_cost = wgrad_cost(im2col.config, k, c, taps, im2col_k_tiles, im2col.parts, num_sms)
    return im2col_cost[0] < WGRAD_WALK_MARGIN * rect_cost[0]


def wgrad_params(dtype: str, cfg: GemmConfig, rect: int = 0) -> tuple:
    """The weight-gradient kernel's compile key: the dtype, the pixel walk (`WGRAD_RECTS`) and
    the tile's GemmConfig fields."""
    return tuple(sorted({"dtype": dtype, "rect": rect, **cfg.key()}.items()))
