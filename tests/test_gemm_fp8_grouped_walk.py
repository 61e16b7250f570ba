"""The grouped FP8 GEMM's walk over its tiles (issue 21, docs/gemm/NOTES.md "The grouped FP8
GEMM at 0.86x DeepGEMM" and "band8 adopted"): scripts/fp8_grouped_walk.py's model of the order
(every cluster block once; the standard's bands of 8 cut the M-first walk's modeled HBM
re-reads) and the device scheduler, traced on the host, handing each cluster the blocks the
model puts at its work indices."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.bench.suites import gemm_fp8_grouped as suite_module
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from forgekernel.kernels.common.sm90.scheduler.static import (  # noqa: E402
    StaticSchedule,
    StaticScheduler,
)


def test_band_walks_visit_every_tile_once():
    """The model's mirror of the scheduler's banded order (scripts/fp8_grouped_walk.py `walk`)
    covers every cluster block once, bands of `swizzle` columns (a narrower last band) swept
    down M with N fastest; and it cuts the modeled HBM reads of a large up projection."""
    walk_module = load_script("fp8_grouped_walk")
    for blocks_m, blocks_n, s in ((64, 16, 6), (7, 28, 8), (5, 3, 6), (9, 14, 1)):
        order = walk_module.walk(blocks_m, blocks_n, s)
        assert sorted(order) == [(m, n) for m in range(blocks_m) for n in range(blocks_n)]
        if s > 1:
            first = order[: min(s, blocks_n) * 2]
            assert first[: min(s, blocks_n)] == [(0, n) for n in range(min(s, blocks_n))]
    case = next(c for c in suite_module.BENCH_CASES if c.name == "E8:4096x4096x7168")
    m_first, held = walk_module.hbm_reads(case.params, walk_module.M_FIRST, 45e6)
    banded, _ = walk_module.hbm_reads(case.params, GROUPED, 45e6)
    assert GROUPED.swizzle == 8 and walk_module.M_FIRST.swizzle == 1
    assert m_first > 8 * held and banded < 2 * held


@pytest.mark.parametrize("swizzle", [1, 6, 8])
def test_the_kernels_scheduler_walks_the_model_order(monkeypatch, swizzle):
    """The device scheduler (StaticScheduler, traced on the host with each CTA's block index
    served) hands every cluster of the grouped grid the blocks the walk model
    (scripts/fp8_grouped_walk.py `walk`) puts at its work indices: z, z + P, ... of a P-cluster
    grid, for the M-first walk, bands of 6 and the standard's bands of 8."""
    cfg = dataclasses.replace(GROUPED, swizzle=swizzle)
    where: dict = {}
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)
    monkeypatch.setattr(cute.arch, "block_idx", lambda: where["block"])
    monkeypatch.setattr(cute.arch, "grid_dim", lambda: where["grid"])
    tiles_m, tiles_n, clusters = 23, 28, 66  # 23 tile rows, N 3584; a persistent grid of 66
    rounds = -(-tiles_m * tiles_n // 2 // clusters)

    @cute.jit
    def visit(out: cute.Tensor, tm: Int32, tn: Int32, wave: Int32):
        schedule = StaticSchedule((tm, tn), (cfg.cluster_m, cfg.cluster_n), cfg.swizzle)
        grid = schedule.grid(wave)
        for z in cutlass.range(grid[2]):
            for y in cutlass.range_constexpr(cfg.cluster_n):
                where["block"], where["grid"] = (Int32(0), Int32(y), z), grid
                sched = StaticScheduler(schedule)
                work = sched.first()
                i = Int32(0)
                while sched.valid(work):
                    tile_m, tile_n = sched.tile(work)
                    out[z, y, i, 0], out[z, y, i, 1] = tile_m, tile_n
                    work = sched.next(work)
                    i = i + 1

    out = torch.full((clusters, 2, rounds, 2), -1, dtype=torch.int32)
    visit(from_dlpack(out), tiles_m, tiles_n, clusters)
    order = load_script("fp8_grouped_walk").walk(tiles_m, tiles_n // 2, swizzle)
    for z in range(clusters):
        for i, w in enumerate(range(z, len(order), clusters)):
            m, j = order[w]
            assert out[z, 0, i].tolist() == [m, 2 * j] and out[z, 1, i].tolist() == [m, 2 * j + 1]
        assert (out[z, :, len(range(z, len(order), clusters)) :] == -1).all()
