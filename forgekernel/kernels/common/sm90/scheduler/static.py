"""Static persistent tile scheduler over a 2-D grid of output tiles, cluster-aware.

The tiles are cut into cluster-shaped blocks (cluster_m x cluster_n tiles); block b of the
raster is work index b. The grid holds P = min(blocks, max_active_clusters) clusters and cluster
z takes the work indices z, z + P, z + 2P, ...; each CTA of a cluster takes its own tile of the
block (its rank in the cluster along M and N).

Raster: the blocks along the major axis (M if `raster_along_m`, else N) come fastest. With
`swizzle` s > 1 the minor axis is cut into groups of s blocks, walked group by group; inside a
group the minor coordinate comes fastest, so the walk sweeps the major axis over a band of s
minor blocks whose operand tiles stay in L2. A last, narrower group holds the remaining minor
blocks: no work index names a tile beyond the problem.

Host side (inside the `@cute.jit` launcher): `StaticSchedule(...)` and its `grid(...)`; the
schedule goes to the kernel as an argument. Device side:

    sched = StaticScheduler(schedule)
    work = sched.first()
    while sched.valid(work):
        tile_m, tile_n = sched.tile(work)
        ...
        work = sched.next(work)
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values


class _Staged:
    """The DSL's value protocol (kernel arguments, loop-carried values): the attributes named in
    `_dynamic` travel as run-time values, every other attribute is baked in."""

    _dynamic: tuple[str, ...] = ()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self._dynamic)

    def __extract_mlir_values__(self) -> list:
        return extract_mlir_values(self._values())

    def __new_from_mlir_values__(self, values: list):
        rebuilt = copy.copy(self)
        for name, value in zip(self._dynamic, new_from_mlir_values(self._values(), values)):
            setattr(rebuilt, name, value)
        return rebuilt


class StaticSchedule(_Staged):
    """The schedule's parameters: built on the host, an argument of the kernel. `tiles_mn`:
    the number of output tiles along M and N (dynamic); `cluster_mn`, `swizzle`,
    `raster_along_m`: baked in."""

    _dynamic = ("blocks", "minor_blocks", "group")

    def __init__(
        self,
        tiles_mn: tuple,
        cluster_mn: tuple[int, int],
        swizzle: int = 1,
        raster_along_m: bool = True,
    ):
        if swizzle < 1:
            raise ValueError(f"swizzle must be >= 1, got {swizzle}")
        self.cluster_mn = tuple(cluster_mn)
        self.swizzle = swizzle
        self.raster_along_m = raster_along_m
        blocks_m = cute.ceil_div(tiles_mn[0], cluster_mn[0])
        blocks_n = cute.ceil_div(tiles_mn[1], cluster_mn[1])
        major, minor = (blocks_m, blocks_n) if raster_along_m else (blocks_n, blocks_m)
        self.blocks = Int32(major * minor)
        self.minor_blocks = Int32(minor)
        # A group's work indices: swizzle minor blocks for each major one.
        self.group = cute.fast_divmod_create_divisor_v2(Int32(swizzle * major))

    def grid(self, max_active_clusters) -> tuple:
        """The launch grid: (cluster_m, cluster_n, persistent clusters)."""
        return (*self.cluster_mn, cutlass.min(self.blocks, max_active_clusters))


class StaticScheduler(_Staged):
    """The device side: which tile this CTA computes for each of its work indices."""

    _dynamic = ("schedule", "cta_mn", "cluster", "clusters")

    def __init__(self, schedule: StaticSchedule):
        # The grid is (cluster_m, cluster_n, P): x and y are the CTA's rank in its cluster.
        cta_m, cta_n, cluster = cute.arch.block_idx()
        self.schedule = schedule
        self.cta_mn = (cta_m, cta_n)
        self.cluster = cluster
        self.clusters = cute.arch.grid_dim()[2]

    def first(self) -> Int32:
        return self.cluster

    def next(self, work: Int32) -> Int32:
        return work + self.clusters

    def valid(self, work: Int32) -> Boolean:
        return Boolean(cute.arch.make_warp_uniform(work < self.schedule.blocks))

    def tile(self, work: Int32) -> tuple:
        """(tile_m, tile_n) of this CTA for work index `work`."""
        s = self.schedule
        group, rest = divmod(work, s.group)
        if s.swizzle == 1:
            major, minor = rest, group
        else:
            width = cutlass.min(Int32(s.swizzle), s.minor_blocks - group * s.swizzle)
            major = rest // width
            minor = group * s.swizzle + rest % width
        block_mn = (major, minor) if s.raster_along_m else (minor, major)
        return tuple(
            cute.arch.make_warp_uniform(Int32(b) * c + Int32(r))
            for b, c, r in zip(block_mn, s.cluster_mn, self.cta_mn)
        )
