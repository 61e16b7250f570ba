"""The weight-gradient kernel's configurations (wgrad.py) and its analytical chooser of tile and
split. DSL-free. The kernel is the dense GEMM's, configured by a GemmConfig: no clusters,
tile_n a multiple of 64 input channels (im2col boxes), tile_m output channels (one or two
consumer warpgroups), the reduction over the N x Z x P x Q output pixels in k-tiles of 64.
"""

from __future__ import annotations

from dataclasses import dataclass

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

# The reduce split (compile key `reduce`, wgrad.py `_reduce_part`): each part bulk-reduce-adds
# its fp32 tile into its tile's one sum slot in L2 (`cp.reduce.async.bulk .add.f32`) and the
# last part reads that slot alone, where the parked split's last part reads every part's slot:
# ~0.25 us an L2 round trip, ahead 4 / 2 parts at a time (n32-c64-56x56-k64-1x1's 42 parts:
# ~3 us of its 17.4), so the parked chooser stops at 8-42 parts of 64x64 / 128x64 tiles, whose
# producer's ~0.3 us k-tile and re-reads of dY and X through L2 bound the 1x1s at 0.73-0.95x
# cuDNN (docs/conv/NOTES.md, "The 1x1 weight gradients at 0.73-0.85x"). Its tiles: tile_n <=
# 128 (the fp32 tile is staged in A's ring: tile_n <= stages x 32, which 128x256 misses). Not
# bitwise repeatable (the parts add in arrival order): the default only where the launcher
# takes it (launch.takes_reduce: measured 1x1s), never under deterministic algorithms.
WGRAD_REDUCE_CONFIGS = (WGRAD_SQUARE, WGRAD_SMALL_SQUARE, WGRAD_NARROW, WGRAD_SHORT, WGRAD_SMALL)
WGRAD_REDUCE_MAX_SPLITS = 264  # two waves of one tile
# `wgrad_time`'s terms, in us (H200; each from the 06:21 bench or the notes' fits):
# - a rectangles k-tile takes at least K_TILE_FLOOR_US: the 1x1 plans of 64x64 (16 KB a k-tile)
#   and 128x64 (24 KB) ran 0.26-0.32 us a k-tile less start and tail (c64-k64 on 42 SMs,
#   c256-k128, c1024-14x14-k512, the 7x7s), whatever the bytes: the producer thread's
#   per-k-tile instructions (the 18:47 fit: ~2.8 ns an instruction), not bandwidth;
# - dY and X once from HBM at HBM_BYTES_US (cuDNN's own 1x1s: 64-77 MB at 2.95-3.1 TB/s
#   with its launch), every tile's boxes L2 -> SM at L2_BYTES_US (c512-28x28-k256's 128x64 plan:
#   154 MB in its ~19.5 us less start and tail, 0.40 us a k-tile; c256-k1024 / c1024-k256 at
#   14x14: 77 MB in ~9.5 us); c1024-14x14-k512 and the 7x7s ran past 11 TB/s, which the model
#   overprices by 1.3x;
# - a wave pays START_US (WGRAD_START: launch, barriers, the ring's first fill);
# - the parked split's tail: ROUND_TRIP_US per ahead-group of parts the last one loads (the
#   03:50 fit, 0.23-0.26 us a part before the loads ahead); the reduce split's: every part's
#   fp32 tile through the L2's atomic units at RED_BYTES_US, which the attention backward
#   sustained without being bound by it (17 GB of bulk reduce-adds in ~9.6 ms, 1.8 TB/s:
#   docs/attention/BWD_NOTES.md, "What the MHA step does not wait on"), a floor, plus two
#   round trips (the reduce's completion before the count, the last part's read).
K_TILE_FLOOR_US = 0.29
HBM_BYTES_US = 3.3e6
L2_BYTES_US = 8.0e6
START_US = 2.4
ROUND_TRIP_US = 0.25
RED_BYTES_US = 1.8e6
UNIT_US = 0.426  # split_cost's unit: a 128x128 k-tile at 650 TF/s an SM's share


@dataclass(frozen=True)
class WgradPlan(SplitPlan):
    """The weight gradient's plan: its GemmConfig, pixel k-tiles per part, parts, output
    tiles; `reduce`: the parts bulk-reduce-added into one zeroed fp32 slot a tile (its
    workspace: tiles x tile_m x tile_n floats, kept zero by the kernel) instead of parked."""

    reduce: bool = False

    @property
    def workspace_floats(self) -> int:
        if self.reduce and self.parts > 1:
            return self.tiles * self.config.tile_m * self.config.tile_n
        return super().workspace_floats


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


def wgrad_time(cfg: GemmConfig, k: int, c: int, taps: int, k_tiles: int, splits: int,
               num_sms: int = NUM_SMS_H100_H200,
               reduce: bool = False) -> tuple[float, int, int]:  # fmt: skip
    """(us, k-tiles per part, parts) of the rectangles' plan `cfg` cut `splits` ways, by the
    terms above (`K_TILE_FLOOR_US` ...): the waves' starts, the longest of the CTAs' k-tiles
    (each max(K_TILE_FLOOR_US, its multiply-adds)), dY and X from HBM once and every tile's
    boxes through L2, plus the split's tail (`reduce`: the reduce split's, else the parked
    one's). The reduce chooser's model; it also prices the parked plans (the notes' table)."""
    cm, tm, tn = cfg.cluster_m, cfg.tile_m, cfg.tile_n
    per = _ceil(k_tiles, splits)
    parts = _ceil(k_tiles, per)
    tiles = wgrad_tiles(cfg, k, c, taps)
    waves = _ceil(tiles // cm * parts, num_sms // cm)
    mma = tm * tn / (128 * 128) / _WGRAD_EFFICIENCY[cfg] * UNIT_US
    pixels = k_tiles * 64
    hbm = pixels * (k + c) * 2 / HBM_BYTES_US
    l2 = tiles * pixels * (tm + tn / cm) * 2 / L2_BYTES_US
    stream = max(waves * per * max(K_TILE_FLOOR_US, mma), hbm, l2)
    tail = 0.0
    if parts > 1 and reduce:
        tail = parts * tiles * tm * tn * 4 / RED_BYTES_US + 2 * ROUND_TRIP_US
    elif parts > 1:
        ahead = max(1, 256 // tn)  # wgrad.py SUM_AHEAD // the fragment (tile_n / 2 floats)
        tail = (1 + _ceil(parts - 1, ahead)) * ROUND_TRIP_US
    return waves * START_US + stream + tail, per, parts


def choose_wgrad_reduce(k: int, c: int, taps: int, k_tiles: int,
                        num_sms: int = NUM_SMS_H100_H200,
                        configs: tuple = WGRAD_REDUCE_CONFIGS) -> WgradPlan:  # fmt: skip
    """The reduce split's plan for the rectangles' walk (`k_tiles` of them): the least
    `wgrad_time(..., reduce=True)` over `configs` (WGRAD_REDUCE_CONFIGS or some of them) and
    1 .. WGRAD_REDUCE_MAX_SPLITS parts of at least WGRAD_MIN_PER_SPLIT k-tiles (the workspace
    is one slot a tile)."""
    best = None
    for cfg in configs:
        tiles = wgrad_tiles(cfg, k, c, taps)
        limit = min(WGRAD_REDUCE_MAX_SPLITS, max(1, k_tiles // WGRAD_MIN_PER_SPLIT))
        for s in range(1, limit + 1):
            us, per, parts = wgrad_time(cfg, k, c, taps, k_tiles, s, num_sms, reduce=True)
            if best is None or us < best[0]:
                best = (us, WgradPlan(cfg, per, parts, tiles, reduce=parts > 1))
    return best[1]


def wgrad_prefers_reduce(k: int, c: int, taps: int, k_tiles: int,
                         num_sms: int = NUM_SMS_H100_H200) -> WgradPlan | None:  # fmt: skip
    """The reduce split's plan (`choose_wgrad_reduce`) of a problem on the rectangles' walk
    where `wgrad_time` puts it below the parked plan the launcher takes (`choose_wgrad`,
    tiled), else None: the cases the bench's `reduce` variant times."""
    parked = choose_wgrad(k, c, taps, k_tiles, num_sms, tiled=True)
    parked_us = wgrad_time(parked.config, k, c, taps, k_tiles, parked.parts, num_sms)[0]
    plan = choose_wgrad_reduce(k, c, taps, k_tiles, num_sms)
    plan_us = wgrad_time(plan.config, k, c, taps, k_tiles, plan.parts, num_sms, plan.reduce)[0]
    return plan if plan.reduce and plan_us < parked_us else None


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


def wgrad_params(dtype: str, cfg: GemmConfig, rect: int = 0, reduce: bool = False) -> tuple:
    """The weight-gradient kernel's compile key: the dtype, the pixel walk (`WGRAD_RECTS`), the
    tile's GemmConfig fields and `reduce` where set (the split's parts bulk-reduce-added into
    one sum slot a tile; the other keys as before)."""
    key = {"dtype": dtype, "rect": rect, **cfg.key(), **({"reduce": True} if reduce else {})}
    return tuple(sorted(key.items()))
