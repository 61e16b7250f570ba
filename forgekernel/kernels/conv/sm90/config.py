"""Implicit-GEMM convolution configurations: the frozen config, the standard set built ahead of
time, and the analytical chooser. DSL-free, so the torch layer can plan without the compiler.

The forward kernel computes Y (M, K) = A (M, CRS) W^T with M = N x Z x P x Q output pixels, K
output channels and a reduction over C input channels x T x R x S filter taps; a k-tile is
`tile_k` channels of one tap (kernel.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from forgekernel.kernels.common.sm90.constants import DTYPE_NAMES, NUM_SMS_H100_H200
from forgekernel.kernels.conv.sm90.geometry import RECT_WIDTHS, rect_count

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
    split: bool = False  # the reduction may be cut into parts (kernel.py; per_split at run time)

    def tag(self) -> str:
        """Short name for tables: 128x128_c1x1_s0 (split: _k)."""
        tag = f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}_s{self.stages}"
        return tag + ("_k" if self.split else "")

    @classmethod
    def from_params(cls, params: dict) -> ConvConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})


# Not yet measured per tile (the first GPU run, 2026-12-01, timed the chooser's picks only): the
# GEMM's figures (docs/gemm/NOTES.md) set the starting points. 128x256 with the weight tile
# multicast over a 2x1 cluster is the GEMM's best large tile; 128x128 keeps more SMs busy for
# K = 128 / 256 channels and small M; 128x64 serves K = 64 (ResNet's first stage) without
# computing a half-empty tile. Each has a split variant (kernel.py: the reduction cut into parts)
# for problems of few tiles.
LARGE = ConvConfig(tile_n=256, cluster_m=2)
SQUARE = ConvConfig(tile_n=128, cluster_m=2)
SMALL = ConvConfig(tile_n=128)
NARROW = ConvConfig(tile_n=64)
BASE_CONFIGS = (SQUARE, LARGE, SMALL, NARROW)
STANDARD_CONFIGS = BASE_CONFIGS + tuple(replace(c, split=True) for c in BASE_CONFIGS)
# The K = 128 conv3d layers' tile (docs/conv/NOTES.md, "256 x 128 adopted"): SQUARE's output
# channels on twice its rows, so that a ring stage carries 128x256's 1024 tensor cycles (two m64
# atoms a consumer warpgroup) and the per-stage cost is paid half as often per FLOP; the
# epilogue ring 2 deep (2 x 16 KB, 128x256's bytes) leaves 4 AB stages of 48 KB. 0.872 / 0.901 /
# 0.955 of SQUARE's time on the three K = 128 conv3d layers (H100, 2026-12-05 16:49). The
# forward's alone (the kernel builds no split and no data-gradient mode of it): not in
# BASE_CONFIGS; `choose_plan` takes it by `takes_tall`, on rectangles TALL_RECT wide.
TALL = ConvConfig(tile_m=256, tile_n=128, cluster_m=2, epi_stages=2)
TALL_RECT = 8  # 8 x 32 rectangles of 256 pixels, as measured
CANDIDATES = (
    ConvConfig(tile_n=256),
    ConvConfig(tile_m=64, tile_n=128),
    ConvConfig(tile_n=128, cluster_n=2),
)
# Tile efficiency relative to LARGE at full occupancy (the GEMM's H200 figures, 8192^3 class).
_EFFICIENCY = {LARGE: 1.0, SQUARE: 0.93, SMALL: 0.9, NARROW: 0.8}
# The im2col TMA's rate (H200, 2026-12-01, inferred from every forward and data-gradient
# figure): an SM receives about 128 pixel rows of 128 bytes per 0.75-0.8 us, twice the time of
# a 128x128 k-tile's multiply-adds at full speed (0.4 us). So a tile's speed is bounded by the
# multiply-adds per im2col row, tile_n x 64 x 2: 128x256 tiles ran at 620-690 TFLOP/s, 128x128
# at 360 (conv3d C = 128 -> K = 128), 128x64 at 160-200, whatever M was. In units of a 128x128
# k-tile at full speed, 128 rows cost:
IM2COL_ROWS_128 = 2.0
# The stride-1 forward's two A walks (choose_plan, plan_cost), refit from both walks timed on one
# tile each, twice (H200, 2026-12-02 15:48 and 18:47, scripts/conv_fwd_walks.py;
# tests/test_conv_walks_model.py replays both tables; docs/conv/NOTES.md, "The walks refit from
# 18:47"). Since the producer lost its run-time divisions (18:47) 128x128 c2x1 runs 630-650
# TFLOP/s on either walk and 128x64 ~1 unit a k-tile: A's 128 rows through either stride-1 box
# cost about FWD_ROWS_128, not the 12-01 rate (a user's 1x1, timed against no other walk, keeps
# IM2COL_ROWS_128). Where nothing else differs (conv3d, planes of 64 x 64 and more: no zero fill,
# as many tiles) the im2col walk ran 1-3% behind the rectangles on every tile (15:48: 2-7%): its
# k-tile costs FWD_IM2COL_K_TILE times theirs. A rectangle tile pays RECT_START once (its origin,
# 5-D boxes and stores; ~0.2 us, 128x64 with one k-tile a tile ran 10% behind). And the
# rectangles' zero-filled pixels (planes they do not divide) cost more than the multiply-adds of
# the waves they fill: at 28 x 28 and 14 x 14 (23% zero) the rectangles ran 6-7% behind im2col
# in as many waves; a rectangle's k-tile costs 1 + RECT_FILL x that zero-filled share (the term
# 18:47 added). Model against both tables (log time ratio of the walks, rms): 0.279 with the
# 15:48 fit (2.12 / 1.4 / 4.0), 0.138 now (0.038 without the 1x1 rows); the picks that moved:
# 28 x 28 and 14 x 14 3x3 to im2col (1.05-1.06x predicted, 6-7% measured), the split 7x7 to
# 128x128 split 2 (1.40x predicted by split_cost, untimed).
FWD_ROWS_128 = 1.0
FWD_IM2COL_K_TILE = 1.03
# A strided forward's im2col rows (choose_plan's `strided`): the stride-1 im2col walk's terms
# (FWD_ROWS_128 x FWD_IM2COL_K_TILE), not the 12-01 IM2COL_ROWS_128, which predates the
# producer's odometers and was never timed on strided boxes against anything else. The
# evidence is the strided forwards' stride-1 twins (the same GEMM: M, K, C, taps): one plan ran
# both n32-c512-14x14-k512-3x3-s2 and n32-c512-7x7-k512-3x3 (128x256 c2x1 split 4, im2col) in
# 24.2 / 24.3 us (H200, 2026-12-03 03:50 / 2026-12-02 18:47): the stride cost nothing there.
# At 2.0 the chooser split the three ResNet stride-2 3x3s (0.66-0.79x cuDNN), whose twins
# unsplit (or split 2 on 128x128) run 15.9-20.5 us; docs/conv/NOTES.md, "The stride-2
# forwards at 0.66-0.79x". scripts/conv_fwd_walks.py times each strided case's plans.
STRIDED_ROWS_128 = FWD_ROWS_128
RECT_START = 0.5
RECT_FILL = 0.3
MAX_PARTS = 16  # a split's parts (the last reads them all back)
MIN_PER_PART = 2  # k-tiles
MAX_WORKSPACE = 64 << 20  # fp32 partials (256 MB)
K_TILE = 64  # the reduction's k-tile (channels of a tap; pixels for the weight gradient)


def params_for(
    dtype: str, bias: bool, cfg: ConvConfig, dgrad: bool = False, rect: int = 0
) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value); `dgrad`: the
    data-gradient mode (kernel.py: W read N-major, taps reversed; no bias); `rect`: the
    stride-1 output rectangles' width (0: the im2col walk; geometry.RECT_WIDTHS)."""
    key = {"dtype": dtype, "bias": bias, "dgrad": dgrad, "rect": rect, **asdict(cfg)}
    return tuple(sorted(key.items()))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SplitPlan:
    """One launch of a kernel whose reduction may be split: its configuration, `per_split`
    k-tiles per part, `parts` (1: unsplit) and `tiles` output tiles (a tile's parts share its
    flag), and the fp32 partials of the workspace."""

    config: Any
    per_split: int
    parts: int
    tiles: int
    rect: int = 0  # the forward's stride-1 output rectangles' width (0: the im2col walk)

    @property
    def workspace_floats(self) -> int:
        if self.parts == 1:
            return 4  # never read: a placeholder the compiled function takes
        return self.parts * self.tiles * self.config.tile_m * self.config.tile_n


def split_cost(
    tile: tuple[int, int],
    tiles_mn: tuple[int, int],
    cluster: tuple[int, int],
    k_tiles: int,
    parts: int,
    num_sms: int,
    efficiency: float,
    im2col_rows: float = 0.0,
    row_rate: float = IM2COL_ROWS_128,
    start: float = 0.0,
    scale: float = 1.0,
) -> tuple[float, int, int]:
    """(time in units of one 128x128 k-tile at full speed, k-tiles per part, parts) of a tile
    (tile_m, tile_n) over tiles_mn output tiles with the reduction of `k_tiles` cut `parts`
    ways, clusters of `cluster` CTAs on `num_sms` SMs: the waves of CTAs (units over the clusters
    one wave holds: wave quantization) times each unit's k-tiles, plus, split, each part parking
    its fp32 tile and the last one reading all of them back, plus the epilogue (a stored
    128x128 16-bit tile or a parked fp32 one is as many bytes as one or two k-tiles of
    operands). A k-tile takes the longer of its multiply-adds and its `im2col_rows` pixel rows
    through A's box (`row_rate` per 128: IM2COL_ROWS_128, the im2col TMA), times `scale` (the
    stride-1 forward's walks: FWD_IM2COL_K_TILE, the rectangles' zero fill); a tile pays `start`
    once (the forward's rectangles: RECT_START)."""
    tm, tn = tile
    per = _ceil(k_tiles, parts)
    parts = _ceil(k_tiles, per)  # every part non-empty
    cm, cn = cluster
    blocks = _ceil(tiles_mn[0], cm) * _ceil(tiles_mn[1] * parts, cn)
    waves = _ceil(blocks, num_sms // (cm * cn))
    area = tm * tn / (128 * 128) / efficiency
    k_tile = max(area, row_rate * im2col_rows / 128) * scale
    operand = (tm + tn) * K_TILE * 2  # bytes of one k-tile of A and B
    epilogue = tm * tn * 2 / operand * area
    park = tm * tn * 4 / operand * area if parts > 1 else 0.0
    return waves * (per * k_tile + park + epilogue + start) + parts * park, per, parts


def m_tiles(cfg: ConvConfig, m: int, pixels=None, rect: int = 0) -> int:
    """The output tiles along M: tile_m pixels of the im2col walk, or (`rect` > 0) the
    rectangles of tile_m pixels covering `pixels` (N, Z, P, Q) (geometry.rect_count)."""
    if rect:
        return rect_count(*pixels, rect, cfg.tile_m)
    return _ceil(m, cfg.tile_m)


def split_tiles(cfg: ConvConfig, m: int, n: int, pixels=None, rect: int = 0) -> int:
    """The flags a split needs: output tiles with M's padded to whole clusters (the schedule's
    last cluster may hold a tile past M: it parks a part of its own); M's tiles are rectangles
    where `rect` > 0 (`m_tiles`)."""
    cm = cfg.cluster_m
    return _ceil(m_tiles(cfg, m, pixels, rect), cm) * cm * _ceil(n, cfg.tile_n)


def plan_cost(
    cfg: ConvConfig,
    rect: int,
    parts: int,
    m: int,
    n: int,
    c: int,
    taps: int = 1,
    num_sms: int = NUM_SMS_H100_H200,
    pixels=None,
    strided: bool = False,
) -> tuple[float, int, int]:
    """`split_cost` (time, k-tiles per part, parts) of tile `cfg` on walk `rect` (0: im2col)
    with the reduction cut `parts` ways, for `choose_plan`'s problem (its arguments). Stride 1
    (`pixels`): either box's rows at FWD_ROWS_128, the im2col walk's k-tile FWD_IM2COL_K_TILE
    times the rectangles', a rectangle tile's start RECT_START and its k-tiles 1 + RECT_FILL x
    the zero-filled share of the rectangles' pixels; `strided` (a strided forward, im2col
    only): rows at STRIDED_ROWS_128, the k-tile FWD_IM2COL_K_TILE times; otherwise (a user's
    1x1) the im2col walk at IM2COL_ROWS_128 (the 12-01 fit)."""
    tiles_mn = (m_tiles(cfg, m, pixels, rect), _ceil(n, cfg.tile_n))
    rate, start, scale = IM2COL_ROWS_128, 0.0, 1.0
    if rect:
        zero = 1 - m / (tiles_mn[0] * cfg.tile_m)
        rate, start, scale = FWD_ROWS_128, RECT_START, 1 + RECT_FILL * zero
    elif pixels is not None:
        rate, scale = FWD_ROWS_128, FWD_IM2COL_K_TILE
    elif strided:
        rate, scale = STRIDED_ROWS_128, FWD_IM2COL_K_TILE
    return split_cost(
        (cfg.tile_m, cfg.tile_n),
        tiles_mn,
        (cfg.cluster_m, cfg.cluster_n),
        _ceil(c, K_TILE) * taps,
        parts,
        num_sms,
        _EFFICIENCY[cfg],
        im2col_rows=cfg.tile_m / cfg.cluster_n,  # A's box shared by a cluster's row
        row_rate=rate,
        start=start,
        scale=scale,
    )


# takes_tall's class, each bound the measured rows' (n4-c128-16x64x64-k128 and
# n1-c128-16x128x128-k128, 3x3x3 and 1x3x3: M = 2^18, 54 and 18 k-tiles, 64 x 64 and 128 x 128
# planes, the plan before SQUARE unsplit on rectangles 8 wide, 1024 TALL tiles in 8 rounds
# against SQUARE's 2048 in 16)
TALL_K = 128  # output channels
TALL_MIN_M = 1 << 18  # output pixels
TALL_K_TILES = (18, 54)  # the reduction's k-tiles, least and most


def takes_tall(m: int, n: int, c: int, taps: int, num_sms: int, pixels) -> bool:
    """Whether a stride-1 forward whose plan is SQUARE unsplit on rectangles TALL_RECT wide
    (`choose_plan` asks only then) runs on TALL instead: K (`n`) = TALL_K; a 3-D convolution
    (`pixels` (N, Z, P, Q) with Z > 1) of more than one tap; TALL_K_TILES[0] .. [1] k-tiles;
    M >= TALL_MIN_M with TALL's 8 x 32 rectangles tiling every plane (P % 32 = Q % 8 = 0: no
    zero fill); and TALL's rounds of clusters on `num_sms` SMs at most half SQUARE's (its
    half as many tiles leave no partial round more)."""
    if pixels is None or n != TALL_K or taps == 1 or pixels[1] == 1 or m < TALL_MIN_M:
        return False
    k_tiles = _ceil(c, K_TILE) * taps
    rp = TALL.tile_m // TALL_RECT
    if not TALL_K_TILES[0] <= k_tiles <= TALL_K_TILES[1]:
        return False
    if pixels[2] % rp or pixels[3] % TALL_RECT:
        return False

    def rounds(cfg: ConvConfig) -> int:
        blocks = _ceil(split_tiles(cfg, m, n, pixels, TALL_RECT), cfg.cluster_m)
        return _ceil(blocks, num_sms // cfg.cluster_m)

    return 2 * rounds(TALL) <= rounds(SQUARE)


def choose_plan(
    m: int,
    n: int,
    c: int,
    taps: int = 1,
    num_sms: int = NUM_SMS_H100_H200,
    pixels=None,
    im2col: bool = True,
    strided: bool = False,
    *,
    forward: bool,
):
    """The forward (or data-gradient phase) launch for M output pixels, N output channels, C
    input channels and `taps` filter taps: the standard tile, walk and split of the least
    `plan_cost` (a split runs on the tile's split variant). `pixels` (N, Z, P, Q): a stride-1
    forward, whose output tiles may also be rectangles of each width of RECT_WIDTHS (tiles
    counted in rectangles, their zero-filled pixels paid as multiply-adds in waves and as
    RECT_FILL on every k-tile); None: the im2col walk only. The im2col walk on a tie, rect 8
    before 16 (the two ran within 1% where they tile alike, but one case); the im2col walk not
    offered with pixels where `im2col` is False (the launcher: an output the im2col walk's
    (M, K) rows would write through a scratch buffer and a copy, e.g. a strided data
    gradient's phase into its strided view of dx). `strided` (no pixels): a strided forward,
    its rows at STRIDED_ROWS_128; without (a user's 1x1) at IM2COL_ROWS_128. `forward`
    (keyword, required: a forward caller that left it out would silently get the plan before
    TALL): True for a forward, False for a data-gradient phase; on, TALL replaces SQUARE
    unsplit on rectangles TALL_RECT wide where `takes_tall` (outside `plan_cost`: the measured
    class, no fitted term)."""
    k_tiles = _ceil(c, K_TILE) * taps
    walks = (0,) + (RECT_WIDTHS if pixels is not None else ())
    if pixels is not None and not im2col:
        walks = RECT_WIDTHS
    best = None
    for cfg in BASE_CONFIGS:
        for rect in walks:
            tiles = split_tiles(cfg, m, n, pixels, rect)
            limit = min(MAX_PARTS, max(1, k_tiles // MIN_PER_PART))
            limit = min(limit, max(1, MAX_WORKSPACE // (tiles * cfg.tile_m * cfg.tile_n)))
            for want in range(1, limit + 1):
                cost, per, parts = plan_cost(
                    cfg, rect, want, m, n, c, taps, num_sms, pixels, strided
                )
                if best is None or cost < best[0]:
                    chosen = replace(cfg, split=True) if parts > 1 else cfg
                    best = (cost, SplitPlan(chosen, per, parts, tiles, rect))
    plan = best[1]
    if forward and plan.config == SQUARE and plan.rect == TALL_RECT:
        if takes_tall(m, n, c, taps, num_sms, pixels):
            tiles = split_tiles(TALL, m, n, pixels, TALL_RECT)
            return SplitPlan(TALL, k_tiles, 1, tiles, TALL_RECT)
    return plan


def choose_config(m: int, n: int, c: int, num_sms: int = NUM_SMS_H100_H200, taps: int = 1):
    """The configuration `choose_plan` picks for a forward (the im2col walk)."""
    return choose_plan(m, n, c, taps, num_sms, forward=True).config


def occupancy(cfg: ConvConfig, m: int, n: int, num_sms: int) -> float:
    """Busy fraction of the SMs over the whole run, unsplit: tiles over (waves x CTAs per
    wave)."""
    cm, cn = cfg.cluster_m, cfg.cluster_n
    tiles_m, tiles_n = _ceil(m, cfg.tile_m), _ceil(n, cfg.tile_n)
    clusters = _ceil(tiles_m, cm) * _ceil(tiles_n, cn)
    per_wave = num_sms // (cm * cn)
    return tiles_m * tiles_n / (_ceil(clusters, per_wave) * per_wave * cm * cn)
