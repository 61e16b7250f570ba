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
# tiles, guesses for the small ones (bandwidth-bound: more operand bytes per multiply-add). B's
# im2col rows bound every tile (config.IM2COL_ROWS_128): tile_n rows per k-tile, halved by a 2x1
# cluster's multicast, so the clustered tiles are the fast ones where K has two K tiles.
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

# The weight gradient's plan: its GemmConfig, pixel k-tiles per part, parts, output tiles.
WgradPlan = SplitPlan


def wgrad_tiles(cfg: GemmConfig, k: int, c: int, taps: int) -> int:
    """Output tiles of dW (K, taps x C): tile_m output channels (K tiles padded to whole
    clusters) x tile_n input channels of one tap."""
    return _ceil(k, cfg.tile_m * cfg.cluster_m) * cfg.cluster_m * _ceil(c, cfg.tile_n) * taps


def wgrad_cost(cfg: GemmConfig, k: int, c: int, taps: int, k_tiles: int, splits: int,
               num_sms: int, tiled: bool = False) -> tuple[float, int, int]:  # fmt: skip
    """`config.split_cost` of `cfg` on the weight gradient (K output channels, C input
    channels, `taps` taps, `k_tiles` pixel k-tiles) with its reduction cut `splits` ways; B's
    rows count against the im2col TMA's rate unless `tiled` (the stride-1 rectangles: tiled
    TMAs, no such rate)."""
    cm = cfg.cluster_m
    tiles_mn = (_ceil(k, cfg.tile_m * cm) * cm, _ceil(c, cfg.tile_n) * taps)
    tile = (cfg.tile_m, cfg.tile_n)
    return split_cost(
        tile,
        tiles_mn,
        (cm, 1),
        k_tiles,
        splits,
        num_sms,
        _WGRAD_EFFICIENCY[cfg],
        im2col_rows=0.0 if tiled else cfg.tile_n / cm,  # B's boxes, shared by the cluster
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


def wgrad_params(dtype: str, cfg: GemmConfig, rect: int = 0) -> tuple:
    """The weight-gradient kernel's compile key: the dtype, the pixel walk (`WGRAD_RECTS`) and
    the tile's GemmConfig fields."""
    return tuple(sorted({"dtype": dtype, "rect": rect, **cfg.key()}.items()))
