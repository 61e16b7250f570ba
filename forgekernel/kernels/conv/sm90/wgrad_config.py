"""The weight-gradient kernel's configurations (wgrad.py) and its analytical chooser of tile and
split. DSL-free. The kernel is the dense GEMM's, configured by a GemmConfig: no clusters,
tile_n a multiple of 64 input channels (im2col boxes), tile_m output channels (one or two
consumer warpgroups), the reduction over the N x Z x P x Q output pixels in k-tiles of 64.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from forgekernel.kernels.common.sm90.constants import NUM_SMS_H100_H200
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# Not yet measured: the efficiencies below are the GEMM's (docs/gemm/NOTES.md) for its large
# tiles, guesses for the small ones (bandwidth-bound: more operand bytes per multiply-add).
WGRAD_LARGE = GemmConfig(tile_m=128, tile_n=256, cluster_m=1)
WGRAD_SQUARE = GemmConfig(tile_m=128, tile_n=128, cluster_m=1)
WGRAD_NARROW = GemmConfig(tile_m=128, tile_n=64, cluster_m=1)
WGRAD_SHORT = GemmConfig(tile_m=64, tile_n=128, cluster_m=1)
WGRAD_SMALL = GemmConfig(tile_m=64, tile_n=64, cluster_m=1)
WGRAD_CONFIGS = (WGRAD_SQUARE, WGRAD_LARGE, WGRAD_NARROW, WGRAD_SHORT, WGRAD_SMALL)
_WGRAD_EFFICIENCY = {
    WGRAD_LARGE: 1.0,
    WGRAD_SQUARE: 0.93,
    WGRAD_NARROW: 0.8,
    WGRAD_SHORT: 0.8,
    WGRAD_SMALL: 0.6,
}
PIXEL_TILE = 64  # the reduction's k-tile: output pixels
WGRAD_MAX_SPLITS = 64
WGRAD_MIN_PER_SPLIT = 4  # pixel k-tiles
WGRAD_MAX_WORKSPACE = 64 << 20  # fp32 partials (256 MB)


@dataclass(frozen=True)
class WgradPlan:
    """One weight gradient's launch: the tile, `per_split` pixel k-tiles per split, `splits`
    (the grid's y), `tiles` (its x) and the fp32 partials of the split-K workspace."""

    config: GemmConfig
    per_split: int
    splits: int
    tiles: int

    @property
    def workspace_floats(self) -> int:
        if self.splits == 1:
            return 4  # never read: a placeholder the compiled function takes
        return self.splits * self.tiles * self.config.tile_m * self.config.tile_n


def wgrad_tiles(cfg: GemmConfig, k: int, c: int, taps: int) -> int:
    """Output tiles of dW (K, taps x C): tile_m output channels x tile_n input channels of one
    tap."""
    return _ceil(k, cfg.tile_m) * _ceil(c, cfg.tile_n) * taps


def wgrad_cost(cfg: GemmConfig, k: int, c: int, taps: int, pixels: int, splits: int,
               num_sms: int) -> tuple[float, int, int]:  # fmt: skip
    """(estimated time in units of one 128x128 k-tile at full speed, per_split, splits) of
    `cfg` with the reduction cut `splits` ways: waves of CTAs times each one's k-tiles, plus,
    split, each part parking its fp32 tile and the last one reading them all back (a parked
    128x128 partial is as many bytes as two k-tiles of operands)."""
    k_tiles = _ceil(pixels, PIXEL_TILE)
    per = _ceil(k_tiles, splits)
    splits = _ceil(k_tiles, per)  # every split non-empty
    tiles = wgrad_tiles(cfg, k, c, taps)
    waves = _ceil(tiles * splits, num_sms)
    area = cfg.tile_m * cfg.tile_n / (128 * 128) / _WGRAD_EFFICIENCY[cfg]
    part = cfg.tile_m * cfg.tile_n * 4 / ((cfg.tile_m + cfg.tile_n) * PIXEL_TILE * 2)
    park = part if splits > 1 else 0.0
    reduce = splits * part if splits > 1 else 0.0
    return (waves * (per + park) + reduce) * area, per, splits


def choose_wgrad(k: int, c: int, taps: int, pixels: int,
                 num_sms: int = NUM_SMS_H100_H200) -> WgradPlan:  # fmt: skip
    """The weight gradient's tile and split (K output channels, C input channels, `taps` filter
    taps, `pixels` = N x Z x P x Q the reduction): the cheapest by `wgrad_cost` over the tiles
    and splits whose workspace fits."""
    k_tiles = _ceil(pixels, PIXEL_TILE)
    best = None
    for cfg in WGRAD_CONFIGS:
        tiles = wgrad_tiles(cfg, k, c, taps)
        limit = min(WGRAD_MAX_SPLITS, max(1, k_tiles // WGRAD_MIN_PER_SPLIT))
        limit = min(limit, max(1, WGRAD_MAX_WORKSPACE // (tiles * cfg.tile_m * cfg.tile_n)))
        for s in range(1, limit + 1):
            cost, per, splits = wgrad_cost(cfg, k, c, taps, pixels, s, num_sms)
            if best is None or cost < best[0]:
                best = (cost, WgradPlan(cfg, per, splits, tiles))
    return best[1]


def wgrad_params(dtype: str, cfg: GemmConfig) -> tuple:
    """The weight-gradient kernel's compile key: the dtype and the tile's GemmConfig fields."""
    return tuple(sorted({"dtype": dtype, **asdict(cfg)}.items()))
