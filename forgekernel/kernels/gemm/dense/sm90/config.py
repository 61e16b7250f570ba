"""GEMM configurations: the standard set built ahead of time and the analytical chooser (the
frozen config itself is `tile.py`'s, re-exported here). DSL-free, so the torch layer can pick a
kernel without the compiler. Device code imports `tile.py`, never this module: refitting the
chooser's model leaves every kernel's source hash (and its GPU record) as it is."""

from __future__ import annotations

import dataclasses

from forgekernel.kernels.common.sm90.constants import (
    DTYPE_NAMES,
    NUM_SMS_H100_H200,
)
from forgekernel.kernels.gemm.dense.sm90.plan import (
    StreamSplit,
    hbm_us,
    restream_mb_per_us,
    stream_split,
    stream_us,
    tiled_us,
)
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig, ring_stages

DTYPES = DTYPE_NAMES  # every standard kernel is built for each

# Measured on the H200 (bf16, docs/gemm/NOTES.md): 128x256 cooperative with B multicast over a
# 2x1 cluster is the best large-shape tile; 128x192 keeps 128 of 132 SMs busy where 128x256
# leaves a quarter idle (1000x3000x4104: 0.99 vs 0.79 of cuBLAS); 128x128 with B multicast
# where both leave many idle (512x3584x3584: 0.90 vs 0.65, 2048x5120x25600: 1.06 vs 0.90).
# Skinny M is bound by the L2->SM traffic, so it takes narrow tiles that put 128 CTAs on the
# chip with one operand multicast: M <= 64 64x64 with A shared by 2 CTAs, and A's box only
# as tall as M (a box reaching past M, zero-filled, halved the streaming rate: 1x24576x4096
# 0.62 -> 0.98 of cuBLAS); where `decode_time` predicts it faster, stream K over
# `_STREAM_MIN_K`-long ranges (1x576x7168: 0.57 -> 0.94); M <= 128 64x128 with B shared by the
# 2 row tiles (0.97 at 128x8192x8192).
LARGE = GemmConfig()
WIDE = GemmConfig(tile_n=192)
SMALL = GemmConfig(tile_n=128, cluster_m=1)
SQUARE = GemmConfig(tile_n=128, cluster_m=2)
SKINNY_64 = GemmConfig(tile_m=64, tile_n=64, cluster_m=1, cluster_n=2)
SKINNY_128 = GemmConfig(tile_m=64, tile_n=128, cluster_m=2)
A_ROWS = (8, 16, 32, 0)  # A box heights of the decode configurations (0: the whole tile)
# The tiled decode configurations at 13 stages: with the compact A ring's count (22 / 17 stages at
# a8 / a32, 2026-12-02 04:21 to 15:48) the one-round cases ran ~1.1 us slower; 13 again on the
# H200 (2026-12-02 18:47, scripts/gemm_worst_probe.py, since removed): 1x4608x3584 12.5 -> 11.3 us,
# 1x4096x4096 12.5 -> 11.1, 32x5120x5120 (a32) 16.7 -> 15.7, 4x28672x4096 59.9 -> 59.0.
DECODE = tuple(dataclasses.replace(SKINNY_64, a_rows=r, stages=13) for r in A_ROWS[:-1])
DECODE_STREAM = tuple(
    GemmConfig(tile_m=64, tile_n=64, cluster_m=1, stream_k=True, a_rows=r) for r in A_ROWS
)
# M > 128 past a multiple of 128 (129, 300, 777 rows): 64-row tiles waste at most 63 rows where
# 128-row tiles waste up to 127. A 2x1 cluster of 64-row tiles is a 128-row block again (its
# dead CTA row), so the two N tiles of a 1x2 cluster share A instead (B, the wide operand, is
# read by each: 36 KB a k-tile and CTA, SMALL's 32 KB at the same FLOP rate).
MID = GemmConfig(tile_m=64, tile_n=256, cluster_m=1, cluster_n=2)
# Stream K on the prefill tiles, cluster blocks as units (both CTAs of a cluster walk the same
# k-ranges, the multicast kept; kernel.py): for tile counts that leave the last wave mostly
# empty (1024x51200x5120: 12.1 rounds of 128x256, 8% faster streamed). MID streamed (the 1x2
# cluster) ran 1.6-2.2x its prediction on the H200 (300x28672x4096, 777x4096x14336,
# 2026-12-02): out of the standard set (docs/gemm/NOTES.md "Mid-size M").
LARGE_STREAM = dataclasses.replace(LARGE, stream_k=True)
WIDE_STREAM = dataclasses.replace(WIDE, stream_k=True)
# Tiles sized so that about 128 of them cover a one-wave problem (cuBLAS's widths read in our
# orientation, docs/gemm/NOTES.md "Tiles for the one-wave and few-hundred-row shapes"): 128x224
# (512x7168x16384, 1024x3584x18944: 128 tiles where 128x256 gives 112), 128x144 (4096x576x7168:
# 4 N tiles of 576), 128x112 (512x3584x3584), 128x160 (512x10240x5120), with B multicast over a
# 2x1 cluster as LARGE; 144 / 112 columns take 16-column epilogue sub-tiles. 192-row tiles (three
# consumer warpgroups at 152 registers) with A multicast over a 1x2 cluster: 129 rows in one
# tile row (129x10240x8192), 3000 rows in 16 (3000x576x7168).
FIT_224 = GemmConfig(tile_n=224)
FIT_160 = GemmConfig(tile_n=160)
FIT_144 = GemmConfig(tile_n=144, epi_n=16)
# FIT_112 and SWAP_208 fill shared memory to the byte by `tile.ring_stages` (7 x 30 KB and 5 x 42
# KB + a 16 KB epilogue = 215,040 of 215,040 free): the launch asked 233,472 of 232,448 bytes (the
# buffers' 1 KB alignment) and failed on the H200 (2026-12-02 13:50), so they take a stage less
# (tests/test_gemm_smem_fit.py: the kernel's allocation with its alignment, every standard
# configuration; the fix in `ring_stages` waits for the next kernel change, docs/gemm/NOTES.md).
FIT_112 = GemmConfig(tile_n=112, epi_n=16, stages=6)
TALL_80 = GemmConfig(tile_m=192, tile_n=80, cluster_m=1, cluster_n=2, epi_n=16)
TALL_96 = GemmConfig(tile_m=192, tile_n=96, cluster_m=1, cluster_n=2)
# 192x72 (docs/gemm/NOTES.md "72 columns"): 576 = 8 x 72 columns (3000x576x7168: TALL_80's 128
# CTAs computed 640 of 576 columns, 0.92x cuBLAS), 129 tokens in 2 x 72 swapped (SWAP_TALL_72
# below; 2 x 80 read 31 dead columns, 0.88x), cuBLAS's own 192x72 there. B's ring loads 80 rows
# for the 72 (kernel.py `_setup`), so B "nk" and cluster_m 1 only; 8-column epilogue sub-tiles.
# Only where 72 divides N (`fits_n`): on 6272x256x1024 (conv_fwd's c1024 -> k256 1x1 as
# a GEMM) it computed 288 of 256 columns in one wave and ran 10.4 us against 128x128 c2x1's 8.9
# (2026-12-05 04:2x; the rate model weighs the waste, not the short K's 8-column epilogue).
TALL_72 = GemmConfig(tile_m=192, tile_n=72, cluster_m=1, cluster_n=2, epi_n=8)
FIT = (FIT_224, FIT_160, FIT_144, FIT_112, TALL_80, TALL_96, TALL_72)
# Walks and multicasts the rate model does not see, each a twin the chooser puts in for its
# pick (`walked`; docs/gemm/NOTES.md "The two cases under 0.95x on the H100"). LARGE in bands
# of 6 N blocks: M first, a round of 66 clusters spans 16,896 rows of A, so at M = 16384 an A
# past the L2 leaves HBM once per N column at 2.6 TB/s (the H100's copy: 3.0); a band of 6
# touches 2,816 rows and 6 B tiles a round (0.7 TB/s). The two M = 16384 suite cases ran
# 0.921x / 0.987x cuBLAS on the H100 (2026-12-05 16:42; eager 0.930x / 0.928x) against 1.030x
# / 1.038x on the H200 (04:18), every M-first rival within 1% of LARGE there.
LARGE_BAND = dataclasses.replace(LARGE, swizzle=6)
# FIT_144 with A multicast over the 4 N tiles' two clusters instead of B over two M tiles: where
# A is the operand streamed from HBM (4096x576x7168: 58.7 MB, B 8.3 MB in L2). Every one-round
# tile that multicasts the streamed weight ran 5.6-6.0 TF/s an SM on the H100 (FIT_224 / 160 /
# 112, SWAP_208), FIT_144 there 4.83 (0.883x cuBLAS; 5.41 and 1.039x on the H200).
FIT_144_A = dataclasses.replace(FIT_144, cluster_m=1, cluster_n=2)
# The swap (docs/gemm/NOTES.md "The swap"): C^T = B A^T for a few hundred tokens, the weight's N
# rows as the kernel's M and the tokens as WGMMA's N, so tokens cost 16 rows at a time, not 64
# or 128 (300 rows: 3 x 80 + 60; 777: 4 x 208 - 55); the weight's tile multicast over a 1x2
# cluster to two token tiles; C through an M-major view (64 x 16 boxes). B "nk" only (a "kn"
# weight would be an M-major A, untested). For 64 < M <= `SWAP_MAX_M`, M < N (`swap_applies`).
# Walked with the tokens (the kernel's N) fastest: the token tiles of one weight tile run in one
# round and the weight leaves HBM once (M fastest read it once per cluster column of tokens):
# 300x28672x4096 140.2 -> 126.6 us graph, 140.9 -> 123.6 eager (2026-12-02 18:47); 129 and 777
# tokens (one column) unchanged. Their rates below stay the M-fastest fits (conservative: at 512
# tokens, 512x10240x5120, tokens-first SWAP_80 ran 129 us, the pick 83.8).
SWAP_80 = GemmConfig(tile_n=80, cluster_m=1, cluster_n=2, epi_n=16, swap=True, raster_along_m=False)
SWAP_208 = GemmConfig(
    tile_n=208, cluster_m=1, cluster_n=2, epi_n=16, swap=True, stages=4, raster_along_m=False
)
SWAP_TALL_80 = dataclasses.replace(TALL_80, swap=True, raster_along_m=False)
SWAP_TALL_72 = dataclasses.replace(TALL_72, swap=True, raster_along_m=False)
SWAP = (SWAP_80, SWAP_208, SWAP_TALL_80, SWAP_TALL_72)
SWAP_MAX_M = 1024
PREFILL = (LARGE, WIDE, SQUARE, SMALL, MID, *FIT, *SWAP)
PREFILL_STREAM = (LARGE_STREAM, WIDE_STREAM)
STANDARD_CONFIGS = (
    LARGE,
    WIDE,
    SMALL,
    SQUARE,
    SKINNY_64,
    SKINNY_128,
    *DECODE,
    *DECODE_STREAM,
    MID,
    *PREFILL_STREAM,
    *FIT,  # TALL_72 "nk" only (__init__.py `_standard_params`)
    *SWAP,  # "nk" only
    LARGE_BAND,
    FIT_144_A,
)


def takes_kn(cfg: GemmConfig) -> bool:
    """Whether `cfg` runs on a B "kn" (N-major) weight: not swapped, tile_n a multiple of 16
    (B's ring past one is K-major only, kernel.py `_setup`)."""
    return not cfg.swap and cfg.tile_n % 16 == 0


def fits_n(cfg: GemmConfig, n: int) -> bool:
    """Whether `cfg` is a candidate for N: a tile whose B ring loads past tile_n (tile_n not a
    multiple of 16: TALL_72's ring loads 80 rows, kernel.py `_setup`) only where tile_n divides
    N, so that no tile of it computes dead columns (TALL_72 comment)."""
    return cfg.swap or cfg.tile_n % 16 == 0 or n % cfg.tile_n == 0


# Tile rate relative to LARGE with every SM busy (8192^3 class shapes, H200): WIDE and SQUARE
# from the sweeps of 2026-11-30, SMALL from 256x8192x8192 (one round of 128 tiles, 57.7 us on
# 2026-12-02); MID from the bench's variants of 2026-12-02 07:00 (0.67-0.78 over 129x10240x8192,
# 256x8192x8192, 512x3584x3584: one round each; docs/gemm/NOTES.md "Mid-size M").
_EFFICIENCY = {LARGE: 1.0, WIDE: 0.965, SQUARE: 0.93, SMALL: 0.92, MID: 0.70}


def assumed_efficiency(cfg: GemmConfig) -> float:
    """A tile's rate relative to LARGE before any measurement, by its arithmetic intensity
    I = tile_m tile_n / (tile_m + tile_n) between SQUARE (I 64, 0.93) and LARGE (85.3, 1.0):
    0.93 + 0.0033 (I - 64), at most 1.0 (0.97 for 192 rows). It gives WIDE 0.972 (fitted
    0.965); not for 64-row tiles (MID: 0.89 by it, 0.70 measured)."""
    intensity = cfg.tile_m * cfg.tile_n / (cfg.tile_m + cfg.tile_n)
    return min(0.97 if cfg.tile_m > 128 else 1.0, 0.93 + 0.0033 * (intensity - 64))


# Measured on the H200 bench of 2026-12-02 13:49 (its variant table: every FIT / swapped tile
# timed beside the chooser's pick; docs/gemm/NOTES.md "Refit from the FIT / swap bench"): fit
# with a free scale per case over the graph and eager times together (the earlier rates fixed).
# The intensity rule above had them 0.4-4% low for the FIT tiles, 5% high for the swapped ones.
_EFFICIENCY.update({FIT_224: 0.997, FIT_160: 0.982, FIT_144: 0.966, TALL_80: 0.942, TALL_96: 0.939})
_EFFICIENCY.update({SWAP_80: 0.842, SWAP_TALL_80: 0.856})
# FIT_112 and SWAP_208 (launched at 6 / 4 stages) from the bench of 2026-12-02 15:48, the same
# way: 512x3584x3584 and 4096x4096x4096 (FIT_112 0.872 / 0.843, 0.974 / 0.872 graph / eager;
# the intensity rule had 0.916), 777x4096x14336 (SWAP_208 0.934 / 0.943; assumed 0.932).
_EFFICIENCY.update({FIT_112: 0.889, SWAP_208: 0.938})
# ASSUMED until timed (docs/gemm/NOTES.md "72 columns"): the 80-column tiles' measured rates x the
# intensity rule's ratio of 72 to 80 columns (0.892 / 0.905): TALL_80 0.942 -> 0.928, SWAP_TALL_80
# 0.856 -> 0.843.
_EFFICIENCY.update({TALL_72: 0.91, SWAP_TALL_72: 0.826})
# The twins `walked` puts in compute at their tile's rate (the model has no walk or multicast).
_EFFICIENCY.update({LARGE_BAND: _EFFICIENCY[LARGE], FIT_144_A: _EFFICIENCY[FIT_144]})
# Decode 64x112 (a8): 4x28672x4096 in two even rounds of 256 tiles (64 columns: 3.4 rounds):
# 60.1 -> 56.9 us graph, 71.3 -> 68.6 eager on 2026-12-02 18:47; a candidate until the decode
# chooser weighs widths (`decode_time` cannot tell them apart). Measured there and dropped
# (docs/gemm/NOTES.md "The slowest cases of the 15:48 bench"): 64x48 decode tiles, 64x256 a16,
# FIT_112 / SWAP_208 with a stage back, WIDE swizzled N-first, and swapped stream K (wrong
# output on the H200: splitk.sum_parts dropped the last floats of 72- and 40-float fragments,
# fixed on next/swap-sk; timed on 2026-12-03 16:35, 59.8-61.9 / 63.6-65.8 us on 129x10240x8192,
# 1.03-1.08x the pick: dropped again, docs/gemm/NOTES.md "Measured 2026-12-03 16:35").
DECODE_112 = GemmConfig(tile_m=64, tile_n=112, cluster_m=1, cluster_n=2, epi_n=16, a_rows=8)
# Candidates timed as bench variants of one case beside the pick (`CASE_CANDIDATES`, the
# suite's variants; docs/gemm/NOTES.md "256 tokens: candidates"), none chosen. The ragged ones
# of 2026-12-03 03:50 were timed at 16:35 and dropped (NOTES "Measured 2026-12-03 16:35").
# 256x8192x8192 runs SMALL (128x128 c1x1: 2 x 64 tiles, one round) at cuBLAS's time in graph
# timing (58.1 / 58.7 us) and 0.85-0.88x of it eager in all seven benches since 2026-12-02
# 06:54 (64.1 / 55.4): SMALL, the one configuration timed there without a cluster, runs 10%
# slower eager than graph; every 2-CTA one and cuBLAS 4-11% faster. Three walks of the same
# 128 tiles of 128x128, one round, tell which part of the cluster it is: the weight's tile
# multicast to the two token rows (SQUARE: 0.994x cuBLAS eager in the probe of 2026-12-02
# 18:47, the pick 0.964x in that run, never timed in the bench), the tokens' tile multicast to
# two weight columns instead (each weight tile read by both CTAs as SMALL does), and SMALL with
# the two readers of a weight tile 64 CTAs apart in launch order instead of adjacent.
SMALL_C12 = GemmConfig(tile_n=128, cluster_m=1, cluster_n=2)
SMALL_N = dataclasses.replace(SMALL, raster_along_m=False)
# 256 rows: SMALL, the pick before SQUARE (`prefill_rivals`), timed beside it as `small`.
CASE_CANDIDATES: dict[tuple[int, int, int], dict[str, GemmConfig]] = {
    (256, 8192, 8192): {"small": SMALL, "small_c12": SMALL_C12, "small_n": SMALL_N},
    # the 80-column picks the 72-column tiles replace, timed beside them (NOTES "72 columns")
    (3000, 576, 7168): {"tall80": TALL_80},
    (129, 10240, 8192): {"swaptall80": SWAP_TALL_80},
    # decode: 64x112 a8 where 64 columns leave a part-filled last round (4x28672x4096: 3.4
    # rounds against 1.94; 5% faster in the probe of 2026-12-02 18:47, `DECODE_112` above;
    # 4x37888x3584 4.5 against 2.6, 1x24576x4096 2.9 against 1.7): timed for a width rule
    (4, 28672, 4096): {"n112": DECODE_112},
    (4, 37888, 3584): {"n112": DECODE_112},
    (1, 24576, 4096): {"n112": DECODE_112},
}
# Their rates (`prefill_time`) are ASSUMED until timed: SMALL's (the same tile; neither clusters
# nor the walk are in the model).
_EFFICIENCY.update({SMALL_C12: _EFFICIENCY[SMALL], SMALL_N: _EFFICIENCY[SMALL]})
# The twins' rivals timed by scripts/gemm_worst_probe.py (docs/gemm/NOTES.md "The two cases
# under 0.95x on the H100"): LARGE walked N first (a band of all N blocks: A once, B from the L2
# every round), FIT_144 walked N first (the 4 CTAs reading one A tile adjacent in launch order).
LARGE_N = dataclasses.replace(LARGE, raster_along_m=False)
FIT_144_N = dataclasses.replace(FIT_144, raster_along_m=False)
# Further configurations for tuning (`forgekernel build --candidates`, `forgekernel.tune_gemm`,
# scripts/gemm_sweep.py); bf16 "nk" prebuilt, anything else compiles on first use.
CANDIDATES = (
    GemmConfig(cluster_m=1),
    GemmConfig(epi_n=64),
    GemmConfig(tile_m=64, tile_n=64, cluster_m=1),
    GemmConfig(tile_m=128, tile_n=64, cluster_m=1, cluster_n=2),
    SMALL_C12,
    GemmConfig(tile_m=64, tile_n=256, cluster_m=2),
    DECODE_112,
    SMALL_N,
    LARGE_N,
    FIT_144_N,
)


def params_for(dtype: str, b_kn: bool, cfg: GemmConfig) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value)."""
    return tuple(sorted({"dtype": dtype, "b_kn": b_kn, **cfg.key()}.items()))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def fewest_ctas(cfg: GemmConfig) -> int:
    """The fewest CTAs the chooser launches `cfg` on: one cluster (any config's grid is a
    whole number of clusters; a problem of one block takes one)."""
    return cfg.cluster_m * cfg.cluster_n


def max_ctas(cfg: GemmConfig, num_sms: int = NUM_SMS_H100_H200) -> int:
    """The most: a whole wave of clusters (the launchers' max_clusters)."""
    size = cfg.cluster_m * cfg.cluster_n
    return num_sms // size * size


def stream_plan(
    cfg: GemmConfig,
    m: int,
    n: int,
    k: int,
    num_sms: int = NUM_SMS_H100_H200,
    min_k: int | None = None,
) -> tuple[int, int, int]:
    """(k-iterations per cluster, CTAs, tiles) of a stream-K configuration with every block
    streamed (the decode and FP8 plans): all blocks' k-tiles cut into equal ranges, one per
    cluster of a wave, none shorter than `min_k` k-tiles (default `_STREAM_MIN_K`: a part
    parks a tile-sized fp32 partial)."""
    split = stream_split(cfg, m, n, k, num_sms, min_k or _STREAM_MIN_K, data_parallel=False)
    return split.per, split.ctas, split.tiles


def split_for(
    cfg: GemmConfig, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200
) -> StreamSplit:
    """The launch plan of a stream-K configuration (`plan.stream_split`): decode (M <= 64)
    streams every block, as `decode_time` models it; larger M streams only the last two rounds,
    as `plan.stream_us` models it."""
    return stream_split(cfg, m, n, k, num_sms, _STREAM_MIN_K, data_parallel=m > 64)


_STREAM_MIN_K = 16


# Decode time model (us, MB): the weight streams at min(chip rate, active CTAs x per-CTA rate),
# a CTA's rate being its bytes of B in flight over the loaded latency. Fitted to the H200 suite
# of 2026-12-01 (13-stage 64x64 ring, 104 KB in flight): 1x4096x4096 (64 CTAs) 10.7 us,
# 16x10240x8192 (160 tiles: a second round of 28 CTAs) 47.1 us, 1x24576x4096 49.6 us tiled
# against 52.5 streamed, 1x576x7168 streamed 9.7 against tiled 15.7 us: chip 4.1 TB/s, 78 GB/s
# a CTA (latency 1.33 us), 2.3 us launch and ramp, 1.3 us for each unit a CTA parks and 0.5 us
# for each part the last one sums (a tile-sized fp32 read back from L2).
# The compact A ring (22 stages at 8 rows, 176 KB) predicts 132 GB/s a CTA at that latency;
# until an H200 run measures it (scripts/gemm_split_probe.py), a CTA's rate is capped at the
# 78 GB/s measured, so the choices stay those the figures above support.
_CHIP_MB_PER_US = 4.1
_LATENCY_US = 1.33
_CTA_MAX_MB_PER_US = 0.078
_START_US = 2.3
_PARK_US = 1.3
_SUM_US = 0.5


def decode_time(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200):
    """Predicted time (us) of a 64-row decode configuration on (M <= 64, N, K): the tiled
    one's rounds of tiles (the last with fewer CTAs), or stream K's one even wave plus the
    units each CTA parks."""
    in_flight = ring_stages(cfg) * cfg.tile_n * cfg.tile_k * 2 / 1e6
    cta_rate = min(in_flight / _LATENCY_US, _CTA_MAX_MB_PER_US)

    def stream_time(mb: float, ctas: int) -> float:
        return mb / min(_CHIP_MB_PER_US, ctas * cta_rate)

    tile_mb = cfg.tile_n * k * 2 / 1e6
    if not cfg.stream_k:
        tiles = _ceil(m, cfg.tile_m) * _ceil(n, cfg.tile_n)
        rounds, rest = divmod(tiles, num_sms)
        t = rounds * stream_time(num_sms * tile_mb, num_sms)
        return _START_US + t + (stream_time(rest * tile_mb, rest) if rest else 0.0)
    per, ctas, tiles = stream_plan(cfg, m, n, k, num_sms)
    k_tiles = _ceil(k, cfg.tile_k)
    parked = 0 if per % k_tiles == 0 else 1 if k_tiles % per == 0 else 2
    parts = 1 if not parked else _ceil(k_tiles, per) + (parked == 2)
    split = _PARK_US * parked + _SUM_US * parts * (parked > 0)
    return _START_US + stream_time(tiles * tile_mb, ctas) + split


def choose_config(
    m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200, b_kn: bool = False
) -> GemmConfig:
    """Analytical default (no tuning at call time): M <= 64 the faster by `decode_time` of the
    tiled and the stream-K decode configuration for M's A box; 64 < M <= 128 the skinny
    64x128 tile (bound by streaming B); larger M `prefill_config` (b_kn: no swap)."""
    if m <= 64:
        rows = next(i for i, r in enumerate(A_ROWS) if not r or m <= r)
        tiled = DECODE[rows] if rows < len(DECODE) else SKINNY_64
        pair = (tiled, DECODE_STREAM[rows])
        return min(pair, key=lambda c: decode_time(c, m, n, k, num_sms))
    if m <= 128:
        return SKINNY_128
    return prefill_config(m, n, k, num_sms, b_kn)


# A challenger replaces the measured tile only if `prefill_time` predicts it this much faster.
# Refit on the H200 bench of 2026-12-02 07:00 (each M > 128 case timed with its rival: MID's
# efficiency, plan.py `_STREAM_SLOWDOWN`, this margin): over the 32 cases, the chooser now picks
# the faster of the two measured configurations on all but six, none more than 2.4% slower
# (docs/gemm/NOTES.md "Mid-size M").
_CHALLENGER_MARGIN = 0.97
# A tiled configuration whose tile is taller (wider) than the problem the kernel sees has
# nothing to move its last tile row (column) back over (kernel.py `_tail_pads`): its TMA boxes
# read past the tensor, zero-filled, at about half the streaming rate. Fit on 129x10240x8192
# (192x80 over 129 rows: 74.9 us graph, 1.34x SWAP_TALL_80 where the rates alone said 1.03x;
# the bench of 2026-12-02 13:49), the one measured case.
_PAST_EDGE_SLOWDOWN = 1.40


def prefill_config(
    m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200, b_kn: bool = False
) -> GemmConfig:
    """M > 128: the measured tile (`prefill_rivals`' "tile") unless the fastest of the
    challenger, the fitted tile ("fit") and the swapped one ("swap", where it applies) is
    predicted `_CHALLENGER_MARGIN` faster; then its twin where `walked` puts one in."""
    rivals = prefill_rivals(m, n, k, num_sms, b_kn)
    tile = rivals.pop("tile")
    best = min(rivals.values(), key=lambda c: prefill_time(c, m, n, k, num_sms))
    faster = prefill_time(best, m, n, k, num_sms) < (
        _CHALLENGER_MARGIN * prefill_time(tile, m, n, k, num_sms)
    )
    return walked(best if faster else tile, m, n, k, num_sms)


# An A that the L2 (50 MB on the H100 and H200) cannot hold; the M-first re-read rate past which
# LARGE takes its bands: the M = 8192 cases read 1.31 TB/s and match or beat cuBLAS on both
# cards, the M = 16384 ones 2.62 (above); M = 12288 reads 1.97 and keeps its walk (unmeasured).
_L2_MB = 50.0
_RESTREAM_MAX_MB_PER_US = 2.2


def walked(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> GemmConfig:
    """The pick's twin for (M, N, K) where its walk or multicast streams A badly (the twins'
    comments): LARGE in bands (`LARGE_BAND`) where its M-first rounds re-read an A larger than
    the L2 faster than `_RESTREAM_MAX_MB_PER_US`; FIT_144 with A multicast (`FIT_144_A`) where
    A outweighs B four times (M >= 4 N) and its N tiles pair up. Else `cfg`."""
    if cfg == LARGE and m * k * 2 / 1e6 > _L2_MB:
        rate = restream_mb_per_us(cfg, m, k, num_sms, _EFFICIENCY[LARGE])
        return LARGE_BAND if rate > _RESTREAM_MAX_MB_PER_US else cfg
    if cfg == FIT_144 and m >= 4 * n and _ceil(n, cfg.tile_n) % 2 == 0:
        return FIT_144_A
    return cfg


def swap_applies(m: int, n: int, b_kn: bool) -> bool:
    """Whether the swapped tiles (`SWAP`) are candidates: 64 < M <= `SWAP_MAX_M` tokens, the
    shorter side (M < N: the weight's rows fill the kernel's 128-row tiles), B "nk"."""
    return not b_kn and 64 < m <= SWAP_MAX_M and m < n


def prefill_rivals(
    m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200, b_kn: bool = False
) -> dict[str, GemmConfig]:
    """The prefill configurations `prefill_config` weighs on (M > 128, N, K), each the
    fastest of its kind by `prefill_time`: "tile", of the measured tiles (SQUARE up to 256
    rows, measured: the comment below; above, LARGE, WIDE or SQUARE: the rounds of
    tiles and useful area the earlier occupancy x utilization x efficiency rule weighed),
    "challenger", of MID and the stream-K tiles, "fit", of the tiles sized for one wave
    (`FIT`), and where `swap_applies`, "swap", of the swapped tiles (`SWAP`; rates measured
    2026-12-02 13:49 but FIT_112's and SWAP_208's). The bench times the ones not chosen beside
    the chosen (suite variants)."""
    # 128 < M <= 256: SQUARE, no longer SMALL. On 256x8192x8192 SQUARE / SMALL time 0.997 graph
    # and 0.839 eager on the H200 (2026-12-05 04:10), 0.850 graph and 0.913 eager on the H100
    # (14:29): never slower, SMALL reading the weight twice where SQUARE multicasts it to both
    # token rows. A sweep of 768 points (M 129-256, N 576-57344, K 512-14336) moves SMALL's 24
    # picks to SQUARE and nothing else (docs/gemm/NOTES.md "256 rows").
    measured = (SQUARE,) if m <= 256 else (LARGE, WIDE, SQUARE)
    fit = tuple(c for c in FIT if (not b_kn or takes_kn(c)) and fits_n(c, n))
    groups = (("tile", measured), ("challenger", (MID, *PREFILL_STREAM)), ("fit", fit))
    if swap_applies(m, n, b_kn):
        groups += (("swap", SWAP),)
    return {
        kind: min(group, key=lambda c: prefill_time(c, m, n, k, num_sms)) for kind, group in groups
    }


def prefill_time(cfg: GemmConfig, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200):
    """Predicted time (us) of a prefill configuration (`PREFILL`, `PREFILL_STREAM`) on (M, N,
    K): its rounds of tiles (swapped: over the (N, M) output the kernel sees; a tile taller or
    wider than that output `_PAST_EDGE_SLOWDOWN` slower), or its stream-K plan (`plan.py`),
    and never under its bytes."""
    eff = _EFFICIENCY[dataclasses.replace(cfg, stream_k=False)]
    km, kn = (n, m) if cfg.swap else (m, n)  # the problem the kernel sees
    if not cfg.stream_k and (km < cfg.tile_m or kn < cfg.tile_n):
        eff /= _PAST_EDGE_SLOWDOWN
    if cfg.stream_k:
        t = stream_us(split_for(cfg, km, kn, k, num_sms), cfg, k, num_sms, eff)
    else:
        t = tiled_us(cfg, km, kn, k, num_sms, eff)
    return max(t, hbm_us(m, n, k))


def prefill_times(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200):
    """{configuration: `prefill_time`} over every prefill configuration."""
    return {c: prefill_time(c, m, n, k, num_sms) for c in PREFILL + PREFILL_STREAM}
