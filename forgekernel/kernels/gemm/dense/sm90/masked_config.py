"""The masked grouped (MoE decode) FP8 GEMM's configurations: the standard set and the chooser
by the caller's expected rows per expert (DeepGEMM's `expected_m` hint; the counts themselves
stay on the device). DSL-free.

Decode is bound by streaming each expert's weight once: tiles of 128 columns (one block of B's
scales) cover an expert's rows in one m-tile where they can, so that E x N / 128 tiles (1024
for 32 experts at N = 4096) spread the weight over all SMs. One consumer warpgroup of 64 rows
with A's box only as tall as the expected rows (8 / 16 / 32: a box taller than needed moves
A bytes nobody stores, a box reaching past the expert re-reads the next one's rows), two of
128 rows above 64 expected rows. No clusters: tiles of one cluster may belong to different
experts and a skipped tile leaves no peer waiting.
"""

from __future__ import annotations

import dataclasses

from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig

OUT_DTYPES = ("bfloat16", "float16")
_ROWS = GemmConfig(tile_m=64, tile_n=128, tile_k=128, cluster_m=1, cluster_n=1)
DECODE = tuple(dataclasses.replace(_ROWS, a_rows=r) for r in (8, 16, 32))
ROWS_64 = _ROWS
ROWS_128 = dataclasses.replace(_ROWS, tile_m=128)
STANDARD_CONFIGS = (*DECODE, ROWS_64, ROWS_128)


def rows_per_tile(cfg: GemmConfig) -> int:
    """The rows of an expert one tile covers: A's box (a_rows), else the whole tile."""
    return cfg.a_rows or cfg.tile_m


def choose_config(expected_m: int) -> GemmConfig:
    """The smallest tile whose rows cover `expected_m` (experts with more rows take several
    m-tiles, their weight tile re-read from L2 by CTAs running side by side)."""
    return next((c for c in STANDARD_CONFIGS if expected_m <= rows_per_tile(c)), ROWS_128)


def params_for(out_dtype: str, cfg: GemmConfig) -> tuple:
    """The compile key's baked-in part: the output dtype and the GemmConfig fields."""
    return tuple(sorted({"out": out_dtype, **cfg.key()}.items()))
