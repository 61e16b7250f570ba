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


# The chooser covers this many times the expected rows. expected_m is a mean (routed tokens x
# top-k / experts): the counts spread around it, and an expert past its tile takes several
# m-tiles, each streaming the expert's weight tile again. The bench's variants (every tile on
# each case, H200 2026-12-03 16:49, graph, time / the covering tile's): one cover lost on every
# case whose mean sits near a tile's rows, 8-9 expected rows on 16 rows 0.86-0.97x the time with
# 32, 29-32 on 32 rows 0.79-0.91x with 64; a double cover picks the fastest tile or one within
# 1.2 % of it on 13 of the 14 DeepSeek-V3 cases (3 expected rows stay on 8, 76 on 128: at
# 7168x2048 rows64 ran 0.977 of it). Measured with it 2026-12-04 17:55: 1.097x DeepGEMM graph,
# 1.060x eager (was 1.013x / 0.990x).
COVER = 2


def choose_config(expected_m: int) -> GemmConfig:
    """The smallest tile whose rows cover COVER x `expected_m` (experts with more rows take
    several m-tiles, their weight tile re-read from L2 by CTAs running side by side)."""
    want = COVER * expected_m
    return next((c for c in STANDARD_CONFIGS if want <= rows_per_tile(c)), ROWS_128)


def expected_for(rows: int) -> int:
    """An expected_m `choose_config` maps to the tile of `rows` (a tile's rows): what forces a
    tile through the op's hint."""
    return max(1, rows // COVER)


def params_for(out_dtype: str, cfg: GemmConfig) -> tuple:
    """The compile key's baked-in part: the output dtype and the GemmConfig fields."""
    return tuple(sorted({"out": out_dtype, **cfg.key()}.items()))
