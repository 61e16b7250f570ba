"""Implicit-GEMM convolution configurations: the frozen config, the standard set built ahead of
time, and the analytical chooser. DSL-free, so the torch layer can plan without the compiler.

The forward kernel computes Y (M, K) = A (M, CRS) W^T with M = N x Z x P x Q output pixels, K
output channels and a reduction over C input channels x T x R x S filter taps; a k-tile is
`tile_k` channels of one tap (kernel.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from forgekernel.kernels.common.sm90.constants import DTYPE_NAMES, NUM_SMS_H100_H200

DTYPES = DTYPE_NAMES
CHANNEL_ALIGN = 8  # TMA rows are 16-byte multiples: C and K are multiples of 8 (16 bits)


@dataclass(frozen=True)
class ConvConfig:
    """Everything baked into one compiled convolution besides the dtype and the bias flag."""

    tile_m: int = 128  # output pixels per tile
    tile_n: int = 128  # output channels per tile
    tile_k: int = 64  # input channels per k-tile (128 bytes: one swizzle row)
    cluster_m: int = 1  # CTAs along M sharing each weight tile (multicast)
    cluster_n: int = 1  # CTAs along N sharing each activation tile (im2col multicast)
    stages: int = 0  # 0: as many as fit in shared memory
    epi_stages: int = 4
    epi_n: int = 32  # epilogue sub-tile = (tile_m, epi_n)
    swizzle: int = 1  # raster group size, in clusters (L2 reuse)
    raster_along_m: bool = True

    def tag(self) -> str:
        """Short name for tables: 128x128_c1x1_s0."""
        return f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}_s{self.stages}"

    @classmethod
    def from_params(cls, params: dict) -> ConvConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})


# Not yet measured (no GPU run of this leaf): the GEMM's figures (docs/gemm/NOTES.md) set the
# starting points. 128x256 with the weight tile multicast over a 2x1 cluster is the GEMM's best
# large tile; 128x128 keeps more SMs busy for K = 128 / 256 channels and small M; 128x64 serves
# K = 64 (ResNet's first stage) without computing a half-empty tile.
LARGE = ConvConfig(tile_n=256, cluster_m=2)
SQUARE = ConvConfig(tile_n=128, cluster_m=2)
SMALL = ConvConfig(tile_n=128)
NARROW = ConvConfig(tile_n=64)
STANDARD_CONFIGS = (SQUARE, LARGE, SMALL, NARROW)
CANDIDATES = (
    ConvConfig(tile_n=256),
    ConvConfig(tile_m=64, tile_n=128),
    ConvConfig(tile_n=128, cluster_n=2),
)
# Tile efficiency relative to LARGE at full occupancy (the GEMM's H200 figures, 8192^3 class).
_EFFICIENCY = {LARGE: 1.0, SQUARE: 0.93, SMALL: 0.9, NARROW: 0.8}


def params_for(dtype: str, bias: bool, cfg: ConvConfig, dgrad: bool = False) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value); `dgrad`: the
    data-gradient mode (kernel.py: W read N-major, taps reversed; no bias)."""
    key = {"dtype": dtype, "bias": bias, "dgrad": dgrad, **asdict(cfg)}
    return tuple(sorted(key.items()))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def occupancy(cfg: ConvConfig, m: int, n: int, num_sms: int) -> float:
    """Busy fraction of the SMs over the whole run: tiles over (waves x CTAs per wave)."""
    cm, cn = cfg.cluster_m, cfg.cluster_n
    tiles_m, tiles_n = _ceil(m, cfg.tile_m), _ceil(n, cfg.tile_n)
    clusters = _ceil(tiles_m, cm) * _ceil(tiles_n, cn)
    per_wave = num_sms // (cm * cn)
    return tiles_m * tiles_n / (_ceil(clusters, per_wave) * per_wave * cm * cn)


def utilization(cfg: ConvConfig, m: int, n: int, c: int) -> float:
    """Useful fraction of the multiply-adds: ragged M and N tiles and the zero channels of a
    last k-tile that C does not fill (C = 96 in k-tiles of 64: a quarter wasted)."""
    mn = m * n / (_ceil(m, cfg.tile_m) * cfg.tile_m * _ceil(n, cfg.tile_n) * cfg.tile_n)
    return mn * c / (_ceil(c, cfg.tile_k) * cfg.tile_k)


def choose_config(m: int, n: int, c: int, num_sms: int = NUM_SMS_H100_H200) -> ConvConfig:
    """Analytical default for M output pixels, N output channels and C input channels: the
    standard tile with the most useful work per SM-time, weighted by how fast it runs when the
    SMs are busy. N <= 64 takes the narrow tile outright."""
    if n <= 64:
        return NARROW
    return max(
        _EFFICIENCY,
        key=lambda cfg: (
            _EFFICIENCY[cfg] * occupancy(cfg, m, n, num_sms) * utilization(cfg, m, n, c)
        ),
    )
