"""Block-scaled FP8 GEMM configurations (the dense GEMM's kernel with 8-bit operands and
1x128 / 128x128 scales, tile_k = 128 = one scale block): the standard set and the chooser.
DSL-free."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig

OUT_DTYPES = ("bfloat16", "float16")
# 128x128 with B multicast over a 2x1 cluster for M > 128; 64x128 with B shared by the two row
# tiles for M <= 128; M <= 64 with A's box only as tall as M (8 / 16 / 32 rows: a box reaching
# past M halves the streaming rate, docs/gemm/NOTES.md) and A multicast over a 1x2 cluster.
LARGE = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=2)
MID = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=2)
SKINNY = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2)
A_ROWS = (8, 16, 32)
DECODE = tuple(dataclasses.replace(SKINNY, a_rows=r) for r in A_ROWS)
# A multicast over a 1x2 cluster instead of B over 2x1, for M >= 8192: measured on the H200
# (scripts/fp8_tiles.py, 2026-12-01) 0.77 / 0.76x DeepGEMM at 16384x7168x18432 / 16384x5120x25600
# against LARGE's 0.73 / 0.68x, 1% ahead at 8192^3, even at M = 2048-8192 otherwise.
# Measured and dropped: 64-column epilogue sub-tiles two deep (never ahead by more than 1%).
LARGE_MCAST_A = dataclasses.replace(LARGE, cluster_m=1, cluster_n=2)
LARGE_M_MCAST_A = 8192
# 128 x 192 tiles (two scale blocks of B per tile: the dense kernel's `_mainloop_scaled`),
# DeepGEMM's width for prefill; prebuilt for scripts/fp8_tiles.py, not chosen until measured.
WIDE = dataclasses.replace(LARGE, tile_n=192)
WIDE_MCAST_A = dataclasses.replace(WIDE, cluster_m=1, cluster_n=2)
STANDARD_CONFIGS = (LARGE, MID, SKINNY, *DECODE, LARGE_MCAST_A, WIDE, WIDE_MCAST_A)


# The grouped (MoE, contiguous) layout: B holds every expert's (N, K) and each 128-row tile of
# A one expert's rows, so B is never multicast across tile rows (A over a 1x2 cluster).
GROUPED = LARGE_MCAST_A
GROUPED_WIDE = WIDE_MCAST_A


def params_for(out_dtype: str, cfg: GemmConfig, grouped: bool = False) -> tuple:
    """The compile key's baked-in part: the output dtype, the GemmConfig fields and, for the
    grouped layout, grouped=True (absent otherwise: older keys stay valid)."""
    key = {"out": out_dtype, **asdict(cfg), **({"grouped": True} if grouped else {})}
    return tuple(sorted(key.items()))


def choose_config(m: int, n: int, k: int) -> GemmConfig:
    if m <= 64:
        return next((c for c in DECODE if m <= c.a_rows), SKINNY)
    if m <= 128:
        return MID
    return LARGE_MCAST_A if m >= LARGE_M_MCAST_A else LARGE
