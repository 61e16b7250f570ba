"""The contiguous grouped layout's tile walk for the FP4-weight GEMM, device side: tokens sorted
by expert in A (M, K), each expert's rows padded to a multiple of 128 (DeepGEMM's contiguous
layout: padding rows' index -1), m_indices int32 (M,) each row's expert.

Tiles are (token tile t of h rows, weight tile n of 128 rows), numbered w = n x tiles_t + t
(token tiles fastest: the token tiles of one expert, which share a weight tile, run side by
side). A tile whose first row is padding (index < 0) is skipped: h divides 128, so a tile
never straddles two experts' segments and its expert is its first row's. CTA z of a grid of
P takes the numbers z, z + P, ... that are not skipped; every role walks the same sequence.

Same interface as `MaskedWalk` (dense/sm90/masked.py): state (work, expert, before, rows),
`before` and `rows` unused here; `expert` is -1 past the end.
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


class ContiguousWalk:
    """`m_indices` int32 (M,); `tiles_n` the weight tiles of N; `h` (static) the tokens per
    tile. The grid is (1, 1, P) (`cta`, `ctas` given instead: as tests run it on the host)."""

    _dynamic = ("m_indices", "rows_m", "tiles_t", "tiles_n", "cta", "ctas")

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
        m_indices: cute.Tensor,
        tiles_n: Int32,
        h: int,
        cta: Int32 | None = None,
        ctas: Int32 | None = None,
    ):
        self.m_indices = m_indices
        self.rows_m = m_indices.shape[0]
        self.tiles_t = (self.rows_m + (h - 1)) // h
        self.tiles_n = tiles_n
        self.h = h
        self.cta = cute.arch.block_idx()[2] if cta is None else cta
        self.ctas = cute.arch.grid_dim()[2] if ctas is None else ctas

    @cute.jit
    def _seek(self, work: Int32):
        """(work, expert) of the first tile from `work` on (stepping by the grid) whose first
        row is an expert's; expert -1 past the last tile."""
        total = self.tiles_t * self.tiles_n
        expert = Int32(-1)
        while work < total and expert < 0:
            expert = cute.arch.make_warp_uniform(self.m_indices[work % self.tiles_t * self.h])
            if expert < 0:
                work = work + self.ctas
        if work >= total:
            expert = Int32(-1)
        return work, expert

    @cute.jit
    def first(self):
        work, expert = self._seek(self.cta)
        return work, expert, Int32(0), Int32(0)

    def valid(self, expert: Int32) -> cutlass.Boolean:
        return cutlass.Boolean(expert >= 0)

    @cute.jit
    def next(self, work: Int32, expert: Int32, before: Int32, rows: Int32):
        work, expert = self._seek(work + self.ctas)
        return work, expert, before, rows

    @cute.jit
    def tile(self, work: Int32, before: Int32, rows: Int32):
        """(token tile, weight tile, rows of the token tile inside M)."""
        tile_t = work % self.tiles_t
        tile_rows = cutlass.min(self.rows_m - tile_t * self.h, self.h)
        return (
            cute.arch.make_warp_uniform(tile_t),
            cute.arch.make_warp_uniform(work // self.tiles_t),
            cute.arch.make_warp_uniform(tile_rows),
        )
