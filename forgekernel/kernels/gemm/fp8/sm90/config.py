"""Block-scaled FP8 GEMM configurations (the dense GEMM's kernel with 8-bit operands and
1x128 / 128x128 scales, tile_k = 128 = one scale block, tile_n = 128): the standard set and
the chooser. DSL-free."""

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
# Prefill alternatives to LARGE (issue 21: LARGE runs at 0.65-0.77x of DeepGEMM there), prebuilt
# so that scripts/fp8_tiles.py times them on the GPU; choose_config picks neither until measured.
# Both compile for sm_90a without spills, as LARGE does. A multicast over a 1x2 cluster instead
# of B over 2x1; 64-column epilogue sub-tiles (half the epilogue's barriers), two of them deep so
# that the ring keeps LARGE's six 32 KB A+B stages. Tiles wider than 128 columns wait for the
# dense kernel to take them with FP8 (one block of B's scales per tile today).
LARGE_MCAST_A = dataclasses.replace(LARGE, cluster_m=1, cluster_n=2)
LARGE_EPI64 = dataclasses.replace(LARGE, epi_n=64, epi_stages=2)
PREFILL_CANDIDATES = (LARGE_MCAST_A, LARGE_EPI64)
STANDARD_CONFIGS = (LARGE, MID, SKINNY, *DECODE, *PREFILL_CANDIDATES)


def params_for(out_dtype: str, cfg: GemmConfig) -> tuple:
    """The compile key's baked-in part: the output dtype and the GemmConfig fields."""
    return tuple(sorted({"out": out_dtype, **asdict(cfg)}.items()))


def choose_config(m: int, n: int, k: int) -> GemmConfig:
    if m <= 64:
        return next((c for c in DECODE if m <= c.a_rows), SKINNY)
    if m <= 128:
        return MID
    return LARGE
