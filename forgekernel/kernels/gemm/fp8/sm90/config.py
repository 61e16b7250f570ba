"""Block-scaled FP8 GEMM configurations (the dense GEMM's kernel with 8-bit operands and
1x128 / 128x128 scales, tile_k = 128 = one scale block): the standard set and the chooser.
DSL-free."""

from __future__ import annotations

import dataclasses

from forgekernel.kernels.gemm.dense.sm90.config import (
    _CHIP_MB_PER_US,
    _START_US,
    NUM_SMS_H100_H200,
    GemmConfig,
    _ceil,
    max_ctas,
    stream_plan,
)
from forgekernel.kernels.gemm.dense.sm90.plan import grid_blocks

OUT_DTYPES = ("bfloat16", "float16")
# 128x128 with B multicast over a 2x1 cluster for M > 128; 64x128 with B shared by the two row
# tiles for M <= 128; M <= 64 with A's box only as tall as M (8 / 16 / 32 rows: a box reaching
# past M halves the streaming rate, docs/gemm/NOTES.md) and A multicast over a 1x2 cluster.
# The 128-row tiled tiles take a 3-deep epilogue ring (24 KB) for a sixth AB stage (the staged
# scales, 512 B a stage, left room for 5 beside a 4-deep one): measured on the H200
# (scripts/fp8_tiles.py, 2026-12-02 15:48) 16384x7168x18432 4.517 -> 4.399 ms, 16384x5120x25600
# 4.430 -> 4.210, 4096x36864x7168 2.098 -> 2.000; 4096x7168x2048 and 8192^3 within 0.3%.
# Their producer loads the scales two k-tiles ahead (`scale_ahead`, docs/gemm/NOTES.md "Why
# 8192^3 runs at 850 TFLOP/s"): on the H200 (2026-12-02 18:47) 8192^3 1.308 -> 1.200 ms (c1x2)
# and 1.301 -> 1.208 (c2x1), 8192x8192x7680 1.082 -> 1.011; the prefill shapes not yet timed.
# A's scales read M-major (`scale_mn_major`: one 16-byte load a producer lane per k-tile instead
# of 4 from 128 rows K/128 x 4 bytes apart; docs/gemm/NOTES.md "A's scales M-major"): the rule
# is on for the 128-row tiled tiles (LARGE, LARGE_MCAST_A and with it GROUPED), off for stream
# K and the 64-row tiles. Off until scripts/fp8_tiles.py's `_mn` rows decide: adopting it is
# this line (new compile keys: rebuild gemm_fp8_sm90, check gemm_fp8 and gemm_fp8_grouped).
SCALE_MN_MAJOR = False
# Both 128-row tiled tiles load their scales by a warp of their own (`scale_warp`: the TMA warp
# issues only TMA, no k-tile's loads wait on a scale LDG): LARGE two k-tiles ahead (its lead),
# LARGE_MCAST_A (below) four. Measured on the H100 (scripts/fp8_tiles.py `--twins prefill square`,
# 2026-12-07 12:05, ms one warp -> scale warp two ahead / four ahead): LARGE 4096x7168x2048
# 0.1206 -> 0.1086 / 0.1100, 4096x36864x7168 2.0430 -> 1.9519 / 1.9573; LARGE_MCAST_A
# 16384x7168x18432 3.9378 -> 3.9349 / 3.9534, 16384x5120x25600 3.9586 -> 3.9331 / 3.9349,
# 8192^3 1.0410 -> 1.0024 / 0.9723 (DeepGEMM 0.1039, 1.7861, 3.2518, 3.2365, 0.8970).
# docs/gemm/NOTES.md "Measured: next/integration50" and "next/fp8-tiled-sw".
LARGE = GemmConfig(
    tile_m=128,
    tile_n=128,
    tile_k=128,
    cluster_m=2,
    epi_stages=3,
    scale_ahead=2,
    scale_mn_major=SCALE_MN_MAJOR,
    scale_warp=True,
)
MID = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=2)
SKINNY = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2)
A_ROWS = (8, 16, 32)
DECODE = tuple(dataclasses.replace(SKINNY, a_rows=r) for r in A_ROWS)
# A multicast over a 1x2 cluster instead of B over 2x1, for M >= 8192: measured on the H200
# (scripts/fp8_tiles.py, 2026-12-01) 0.77 / 0.76x DeepGEMM at 16384x7168x18432 / 16384x5120x25600
# against LARGE's 0.73 / 0.68x, 1% ahead at 8192^3, even at M = 2048-8192 otherwise.
# Measured and dropped: 64-column epilogue sub-tiles two deep (never ahead by more than 1%);
# 128x192 tiles (0.44-0.80x DeepGEMM, behind 128x128 on every shape; docs/gemm/NOTES.md).
# A's scales read M-major on this tile (`scale_mn_major`; K-major callers' scales transposed by
# the launcher): measured 2026-12-05 02:42 (scripts/fp8_tiles.py, docs/gemm/NOTES.md "The scales
# four ahead and M-major"): 8192^3 1.2195 -> 1.0880 ms, 16384x7168x18432 -3.5 %, the rest within
# 0.3 %; on LARGE's 2x1 tile neutral to 3 % slower (K = 2048), so LARGE keeps K-major.
# Walked in bands of 8 cluster columns (`swizzle` 8: 16 n-tiles, 2048 columns, swept down M with
# N fastest inside a band; the grouped layout's walk) instead of M first, which reads A's rows
# from HBM again for every cluster column once M outgrows the L2: measured on the H100
# (scripts/fp8_tiles.py `--twins`, 2026-12-07 00:14 and 00:20, ms M first -> bands)
# 16384x7168x18432 4.288 -> 3.924 and 4.328 -> 3.929, 16384x5120x25600 4.229 -> 3.919 and
# 4.275 -> 3.994, 8192^3 1.102 -> 1.040 and 1.078 -> 1.019, 8192x4608x7168 0.558 -> 0.503.
# LARGE (c2x1, A resident) keeps M first: its band twins -2.7 % to +5 % (docs/gemm/NOTES.md
# "next/fp8-band8").
LARGE_MCAST_A = dataclasses.replace(
    LARGE, cluster_m=1, cluster_n=2, scale_mn_major=True, swizzle=8, scale_ahead=4
)
LARGE_M_MCAST_A = 8192
# Stream K (the kernel's `stream_k`: every tile's k-tiles cut evenly over one wave of CTAs,
# partials parked after promotion) for problems whose tiles would leave most SMs idle: the
# 64-row tile with A's short box for M <= 64, 128x128 above. A part runs at least
# STREAM_MIN_K k-tiles (1024 of K) against the 64 KB / 32 KB fp32 partial it may park.
STREAM_DECODE = tuple(
    GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=1, stream_k=True, a_rows=r)
    for r in (*A_ROWS, 0)
)
STREAM = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, stream_k=True)
STREAM_MIN_K = 8
# Measured and dropped (H200, 2026-12-02 07:00): 128x256 in two 128-column halves with B
# multicast over a 2x1 cluster (DeepGEMM's 256x128 schedule transposed) ran 947-1002 TFLOP/s a
# tile against the 1270 predicted, 2-5% behind the 128-column tile on all six prefill shapes;
# its mainloop is removed (docs/gemm/NOTES.md "FP8 prefill: the 128x256 tile").
STANDARD_CONFIGS = (LARGE, MID, SKINNY, *DECODE, LARGE_MCAST_A, *STREAM_DECODE, STREAM)


# Narrow full-K tiles (docs/gemm/NOTES.md "Narrow full-K FP8 tiles", "Narrow adopted"):
# DeepGEMM's mid / decode blocks (64x32, 64x48, 64x64, 64x80, ... over the whole K, one CTA a
# tile) where the 128-column tiles leave SMs idle (the chooser streamed K over few 64x128 /
# 128x128 tiles and parked fp32 partials, or ran a partial wave of them). Widths not dividing
# 128 straddle two blocks of B's scales (tile.py `straddles`; kernel.py selects one per 8-column
# group). The model
# (`narrow_time`, us): T0 + each round of tiles at the slower of its k-tiles' latency, (c0 +
# tile_m tile_n / 32 tensor cycles) at 1.75 GHz, and the round's weight bytes (once a column)
# at the chip's 4.1 TB/s; c0 = 270 cycles fitted on the one measured 64-row full-K row
# (128x7168x16384, MID: 128 k-tiles in 40.8 us graph, H200 2026-12-05 04:20). T0 = 2.3 us and
# 4.1 TB/s are the decode model's (dense config.py `_START_US`, `_CHIP_MB_PER_US`).
NARROW_WIDTHS = (32, 48, 64, 80, 96, 112)
NARROW_C0 = 270
NARROW_T0_US = _START_US
NARROW_GHZ = 1.75
NARROW_CHIP_MB_PER_US = _CHIP_MB_PER_US


# The tiles of A's whole 64-row box (M > 32) load their scales by a warp of their own, four
# k-tiles ahead (`scale_warp`, `scale_ahead` 4: no k-tile's TMA waits on a scale load, and the
# L1 miss every 8th k-tile is hidden): measured on the H100 (scripts/fp8_tiles.py `--twins`,
# 2026-12-07 10:00, ms one warp one ahead -> scale warp four ahead) 64x4096x7168 0.0153 ->
# 0.0146, 128x1536x7168 0.0117 -> 0.0106, 512x576x7168 0.0131 -> 0.0117, 128x7168x16384
# 0.0500 -> 0.0481 (DeepGEMM 0.0135 / 0.0105 / 0.0117 / 0.0489); the scale warp one ahead was
# 1-3 % slower than one warp. The decode boxes (8 / 16 / 32 rows) keep one warp: mixed there
# (1x10240x5120 -2.3 %, 1x7168x16384 -0.6 %, 16x7168x2048 +1.9 %). docs/gemm/NOTES.md
# "Measured: next/fp8-narrow-scales".
NARROW_SCALE_AHEAD = 4


def narrow_config(m: int, tile_n: int) -> GemmConfig:
    """The 64-row full-K tile of `tile_n` columns for M rows: A's box as the decode tiles take
    it (8 / 16 / 32 rows), no cluster, an epilogue sub-tile dividing tile_n; A's whole box (M >
    32) with the scales loaded by their own warp, NARROW_SCALE_AHEAD k-tiles ahead."""
    rows = next((r for r in A_ROWS if m <= r), 0)
    return GemmConfig(
        tile_m=64, tile_n=tile_n, tile_k=128, cluster_m=1, a_rows=rows,
        epi_n=32 if tile_n % 32 == 0 else 16, scale_warp=not rows,
        scale_ahead=1 if rows else NARROW_SCALE_AHEAD,
    )  # fmt: skip


def one_warp_scales(cfg: GemmConfig) -> GemmConfig:
    """`cfg` with its scales loaded by the TMA warp, as the standard before the scale warp: one
    k-tile ahead on the 64-row tiles, two on the 128-row ones (the bench's `one_warp_scales`
    variant, a candidate build)."""
    return dataclasses.replace(cfg, scale_warp=False, scale_ahead=1 if cfg.tile_m == 64 else 2)


def narrow_time(cfg: GemmConfig, m: int, n: int, k: int, c0: float = NARROW_C0,
                num_sms: int = NUM_SMS_H100_H200) -> float:  # fmt: skip
    """Predicted us of a full-K tile on (M, N, K) (the model above)."""
    tiles_m = _ceil(m, cfg.tile_m)
    tiles = tiles_m * _ceil(n, cfg.tile_n)
    latency = (c0 + cfg.tile_m * cfg.tile_n / 32) / (NARROW_GHZ * 1e3)
    per_tile = _ceil(k, 128) * latency
    t, left = NARROW_T0_US, tiles
    while left:
        busy = min(left, num_sms)
        # the tiles of one column share its weight (walked M first: the L2 serves the rest)
        columns = max(busy / tiles_m, 1)
        t += max(per_tile, columns * cfg.tile_n * k / 1e6 / NARROW_CHIP_MB_PER_US)
        left -= busy
    return t


def narrow(
    m: int, n: int, k: int, widths: tuple[int, ...] = NARROW_WIDTHS,
    num_sms: int = NUM_SMS_H100_H200,
) -> GemmConfig:  # fmt: skip
    """The model's best narrow full-K tile of `widths` on (M, N, K) (`choose_config`'s pick in
    `takes_narrow`'s class; the bench's `narrow_even` of the widths dividing 128, which never
    straddle two scale blocks)."""
    cands = [narrow_config(m, w) for w in widths]
    return min(cands, key=lambda c: narrow_time(c, m, n, k, num_sms=num_sms))


# Every narrow tile `narrow` can pick (A's box of 8 / 16 / 32 rows or the whole 64, each width:
# all 24 are picked somewhere in `takes_narrow`'s class): standard builds beside
# STANDARD_CONFIGS (the spec's `standard_params`, with their partial-wave band form: one CTA a
# tile, grids of 1 to a whole wave), so the chooser's pick never compiles at first call.
NARROW_CONFIGS = tuple(narrow_config(r or 64, w) for r in (*A_ROWS, 0) for w in NARROW_WIDTHS)


# The grouped (MoE, contiguous) layout: B holds every expert's (N, K) and each 128-row tile of
# A one expert's rows, so B is never multicast across tile rows (A over a 1x2 cluster). The dense
# tile's ring since 18:47 (6 stages beside a 3-deep epilogue, the scales two k-tiles ahead):
# 0.818x DeepGEMM on the 5-stage one-ahead ring (2026-12-02 18:47), 0.857x on this one (12-03
# 03:50). Walked in bands (`swizzle` 8: 8 cluster columns, 16 n-tiles, swept down M with N
# fastest inside a band) where M first sweeps all of A (up to 940 MB) once per cluster column
# against a 50 MB L2 (scripts/fp8_grouped_walk.py: 2.2-10.8x the bytes of A and B on 13 of the
# 24 bench cases, bands of 8 1.0-2.1x). Measured on the H200 (2026-12-03
# 06:21, band ms / M-first ms, 24 cases): graph median 0.966x, best 0.812x (E128:128x1536x2048),
# worst 1.021x (E8:4096x4096x7168); eager median 0.938x, worst 1.003x. Bands of 6 (DeepGEMM's 8
# blocks of 192 columns) measured and dropped: graph median 0.966x, worst 1.024x; eager 0.954x.
# docs/gemm/NOTES.md "Measured 2026-12-03 06:21 (H200): band8 adopted". (LARGE_MCAST_A walks
# the same bands since 2026-12-07.)
# (Its scales by the TMA warp two ahead, K-major: as measured.)
GROUPED = dataclasses.replace(LARGE_MCAST_A, scale_mn_major=False, scale_warp=False, scale_ahead=2)
# Its scales by a warp of their own, four k-tiles ahead (what won on the narrow tiles,
# 2026-12-07): a candidate build, the grouped bench's `f4_sw` variant.
GROUPED_F4_SW = dataclasses.replace(GROUPED, scale_warp=True, scale_ahead=4)


def params_for(out_dtype: str, cfg: GemmConfig, grouped: bool = False) -> tuple:
    """The compile key's baked-in part: the output dtype, the GemmConfig fields and, for the
    grouped layout, grouped=True (absent otherwise: older keys stay valid)."""
    key = {"out": out_dtype, **cfg.key(), **({"grouped": True} if grouped else {})}
    return tuple(sorted(key.items()))


def tiled_config(m: int) -> GemmConfig:
    """The 128-column data-parallel configuration for M rows (one CTA per output tile)."""
    if m <= 64:
        return next((c for c in DECODE if m <= c.a_rows), SKINNY)
    if m <= 128:
        return MID
    return LARGE_MCAST_A if m >= LARGE_M_MCAST_A else LARGE


def streamed_config(m: int) -> GemmConfig:
    """The stream-K configuration for M rows."""
    if m <= 64:
        return next(c for c in STREAM_DECODE if not c.a_rows or m <= c.a_rows)
    return STREAM


def fewest_ctas(cfg: GemmConfig, num_sms: int = NUM_SMS_H100_H200) -> int:
    """The fewest CTAs the chooser launches `cfg` on: one cluster, but LARGE_MCAST_A, taken
    for M >= LARGE_M_MCAST_A only (that many rows in tile rows of its clusters, up to a whole
    wave)."""
    size = cfg.cluster_m * cfg.cluster_n
    if cfg != LARGE_MCAST_A:
        return size
    rows = _ceil(_ceil(LARGE_M_MCAST_A, cfg.tile_m), cfg.cluster_m)
    return min(rows, num_sms // size) * size


def busy_ctas(cfg: GemmConfig, m: int, n: int, num_sms: int = NUM_SMS_H100_H200) -> int:
    """CTAs a data-parallel configuration keeps busy in its first wave: the output tiles in
    whole clusters, at most one per SM."""
    cm, cn = cfg.cluster_m, cfg.cluster_n
    clusters = _ceil(_ceil(m, cfg.tile_m), cm) * _ceil(_ceil(n, cfg.tile_n), cn)
    return min(clusters, num_sms // (cm * cn)) * cm * cn


# Narrow adopted (H100, 2026-12-05 14:41, CUDA-graph replays; docs/gemm/NOTES.md "Measured
# 2026-12-05 14:41" and "Narrow adopted"): `narrow`'s pick / the chooser's plan before it
# (`wide_config`), < 1 narrow faster: 16x7168x2048 0.718, 1x10240x5120 0.880, 64x4096x7168
# 0.927, 128x1536x7168 0.821, 512x576x7168 0.734: the 128-column tiles keeping 56, 80, 32, 24
# and 20 CTAs busy (stream K or a partial wave), the narrow picks one round of 112, 128, 128, 96
# and 96 CTAs. 64x36864x7168 0.964 (288 tiles of 64x128: every SM busy; narrow's 384 tiles three
# rounds): the wide plan kept, a 3.6 % gain not taken outside the measured class. The class is
# what was measured, not what the model merely prefers (it is optimistic where narrow runs two
# rounds or few CTAs: 128x8192x7168's 256 tiles of 64x64 model 27.8 us against MID's 19.1;
# 1x576x7168's 18 CTAs 13.0 against stream K's ~4.7): M <= NARROW_MAX_M (the largest measured
# M), the 128-column data-parallel tiles keeping fewer CTAs busy than their config's most on
# the chip (`max_ctas`: whole clusters), and the pick's grid one round of at least half the SMs
# (num_sms // 2) and of more CTAs than the 128-column tiles keep busy.
NARROW_MAX_M = 512


def narrow_tiles(cfg: GemmConfig, m: int, n: int) -> int:
    """The tiles (= CTAs, one a tile, no cluster) of a narrow full-K tile on (M, N)."""
    return grid_blocks(cfg, m, n)[2]


def narrow_pick(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> GemmConfig | None:
    """`narrow`'s full-K tile on (M, N, K) where the chooser takes it, else None: M <=
    NARROW_MAX_M, the 128-column tiles (`tiled_config`) keeping fewer CTAs busy in their first
    wave than their config's most (`max_ctas`), and `narrow`'s pick one round of tiles, at least
    half the SMs and more than those busy CTAs (`num_sms // 2 <= tiles <= num_sms`, `tiles >
    busy`)."""
    if m > NARROW_MAX_M:
        return None
    tiled = tiled_config(m)
    busy = busy_ctas(tiled, m, n, num_sms)
    if busy >= max_ctas(tiled, num_sms):
        return None
    pick = narrow(m, n, k, num_sms=num_sms)
    tiles = narrow_tiles(pick, m, n)
    return pick if num_sms // 2 <= tiles <= num_sms and tiles > busy else None


def takes_narrow(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> bool:
    """Whether `choose_config` takes `narrow`'s full-K tile on (M, N, K) (`narrow_pick`)."""
    return narrow_pick(m, n, k, num_sms) is not None


def choose_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> GemmConfig:
    """`narrow_pick`'s full-K tile in its class (the measured mid / decode shapes whose
    128-column tiles leave SMs idle and whose narrow grid is one round of at least half the
    SMs), else `wide_config`'s."""
    return narrow_pick(m, n, k, num_sms) or wide_config(m, n, k, num_sms)


def wide_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> GemmConfig:
    """The 128-column plan (the chooser before narrow, the bench's `was`): by M
    (`tiled_config`), unless its tiles keep at most half the SMs busy and stream K would spread
    the work over at least twice as many (the few-tile mid shapes: 512x576x7168 has 20 tiles of
    128x128, 128x1536x7168 24 of 64x128; decode against a short weight)."""
    tiled = tiled_config(m)
    busy = busy_ctas(tiled, m, n, num_sms)
    if 2 * busy <= num_sms:
        stream = streamed_config(m)
        _, ctas, _ = stream_plan(stream, m, n, k, num_sms, STREAM_MIN_K)
        if ctas >= 2 * busy:
            return stream
    return tiled
