"""The masked grouped (MoE decode) layout's tile walk, device side: which (expert, m-tile,
n-tile) each CTA computes, from the per-expert row counts read on the device.

Expert e owns rows [0, masked_m[e]) of its (max_m, K) slice of A (the count clamped to
[0, max_m]); they are cut into ceil(rows / h) tiles of h rows (h: the configuration's a_rows,
else tile_m), each against all tiles_n column tiles of N. Only these tiles are numbered:
expert after expert, inside an expert n-tile after n-tile with its m-tiles fastest, so the
m-tiles that share one tile of the expert's weight run side by side (the weight comes from
DRAM once, from L2 for the others). CTA z of a grid of P takes numbers z, z + P, z + 2P, ...:
no atomics, every role of a CTA walks the same sequence on its own, and the work is balanced
whatever the counts (an empty expert costs one read of its count). Finding the expert that
holds number w reads each expert's count once per role: the walk only moves forward.

Usage (inside a `@cute.jit` helper; the state is four Int32 kept as loop-carried locals):

    walk = MaskedWalk(masked_m, max_m, tiles_n, h)
    work, expert, before, rows = walk.first()
    while walk.valid(expert):
        m_tile, n_tile, tile_rows = walk.tile(work, before, rows)
        ...
        work, expert, before, rows = walk.next(work, expert, before, rows)
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


class MaskedWalk:
    """`masked_m` int32 (E,) in global memory; `max_m` the rows of each expert's slice;
    `tiles_n` the column tiles of N; `h` (static) the rows of one m-tile. The grid is
    (1, 1, P): CTA z = block_idx z (`cta` and `ctas` given instead: the walk of CTA `cta` of
    `ctas`, as tests run it on the host). A DSL value (its run-time attributes travel
    through the loops that use it, as the static scheduler's do)."""

    _dynamic = ("masked_m", "experts", "max_m", "tiles_n", "cta", "ctas")

    def __extract_mlir_values__(self) -> list:
        return extract_mlir_values(tuple(getattr(self, name) for name in self._dynamic))

    def __new_from_mlir_values__(self, values: list):
        rebuilt = copy.copy(self)
        old = tuple(getattr(self, name) for name in self._dynamic)
        for name, value in zip(self._dynamic, new_from_mlir_values(old, values)):
            setattr(rebuilt, name, value)
        return rebuilt

    def __init__(
        self,
        masked_m: cute.Tensor,
        max_m: Int32,
        tiles_n: Int32,
        h: int,
        cta: Int32 | None = None,
        ctas: Int32 | None = None,
    ):
        self.masked_m = masked_m
        self.experts = masked_m.shape[0]
        self.max_m = max_m
        self.tiles_n = tiles_n
        self.h = h
        self.cta = cute.arch.block_idx()[2] if cta is None else cta
        self.ctas = cute.arch.grid_dim()[2] if ctas is None else ctas

    @cute.jit
    def _rows(self, expert: Int32) -> Int32:
        """Expert `expert`'s row count clamped to [0, max_m] (a count past max_m would reach
        the next expert's rows); the last expert's past the end (the walk stops there)."""
        count = self.masked_m[cutlass.min(expert, self.experts - 1)]
        return cute.arch.make_warp_uniform(cutlass.max(cutlass.min(count, self.max_m), 0))

    def _span(self, rows: Int32) -> Int32:
        """Tiles of an expert with `rows` rows."""
        return (rows + (self.h - 1)) // self.h * self.tiles_n

    @cute.jit
    def _seek(self, work: Int32, expert: Int32, before: Int32, rows: Int32):
        """Forward to the expert holding tile number `work` (or past the last expert)."""
        span = self._span(rows)
        while expert < self.experts and work >= before + span:
            before = before + span
            expert = expert + 1
            rows = self._rows(expert)
            span = self._span(rows)
        return expert, before, rows

    @cute.jit
    def first(self):
        """(work, expert, before, rows): this CTA's first tile number, its expert, the tiles
        of the experts before it, and its row count."""
        expert, before, rows = self._seek(self.cta, Int32(0), Int32(0), self._rows(Int32(0)))
        return self.cta, expert, before, rows

    def valid(self, expert: Int32) -> cutlass.Boolean:
        return cutlass.Boolean(expert < self.experts)

    @cute.jit
    def next(self, work: Int32, expert: Int32, before: Int32, rows: Int32):
        work = work + self.ctas
        expert, before, rows = self._seek(work, expert, before, rows)
        return work, expert, before, rows

    @cute.jit
    def tile(self, work: Int32, before: Int32, rows: Int32):
        """(m-tile, n-tile, rows of the m-tile that are the expert's) of tile number `work`."""
        m_tiles = (rows + (self.h - 1)) // self.h
        local = work - before
        n_tile = local // m_tiles
        m_tile = local - n_tile * m_tiles
        tile_rows = cutlass.min(rows - m_tile * self.h, self.h)
        return (
            cute.arch.make_warp_uniform(m_tile),
            cute.arch.make_warp_uniform(n_tile),
            cute.arch.make_warp_uniform(tile_rows),
        )
