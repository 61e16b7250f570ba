"""Shared memory of every standard GEMM configuration as kernel.py allocates it (its
`SharedStorage`: the barriers, then A's, B's and C's rings each aligned to 1 KB, then the FP8
scales, the whole rounded up to 1 KB), against the 232,448 bytes a CTA may opt into on sm_90.
`tile.ring_stages` counts neither the alignment nor the scales' tail: where it fills shared
memory to the byte, the launch asks 1 KB too much (FIT_112 and SWAP_208 on the H200,
2026-12-02 13:50: 233,472 bytes), so config.py gives those two a stage less. CPU only."""

from __future__ import annotations

import dataclasses

import pytest

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
from forgekernel.kernels.gemm.dense.sm90 import config as dense
from forgekernel.kernels.gemm.dense.sm90 import masked_config as masked
from forgekernel.kernels.gemm.dense.sm90.tile import ring_stages
from forgekernel.kernels.gemm.fp8.sm90 import config as fp8

ALIGN = 1024


def _up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def allocated(cfg, elem_bytes: int = 2, c_bytes: int = 2, scaled: bool = False) -> int:
    """Bytes of kernel.py's SharedStorage for `cfg` (its stages: cfg.stages or, at 0,
    `ring_stages`, as GemmSm90.__init__ takes them)."""
    stages = cfg.stages or ring_stages(cfg, elem_bytes, c_bytes, cfg.tile_m * 4 if scaled else 0)
    row = cfg.tile_k * elem_bytes
    a_rows = cfg.a_rows or cfg.tile_m
    end = stages * 2 * 8 + 2 * 4  # ab_barriers (Int64), split_last (Int32)
    end = _up(end) + (a_rows * stages + cfg.tile_m - a_rows) * row  # sA: the compact ring
    end = _up(end) + (cfg.tile_n + cfg.tile_n % 16) * row * stages  # sB: whole 16-row pairs
    end = _up(end) + cfg.epi_stages * cfg.tile_m * cfg.epi_n * c_bytes  # sC
    end += 4 * (cfg.tile_m * stages if scaled else 1)  # sSF (one Float32 unscaled)
    return _up(end)


def test_the_count_is_the_launch_failures():
    """FIT_112 and SWAP_208 at `ring_stages`' count (7 and 5) asked 233,472 bytes on the H200."""
    for cfg in (dense.FIT_112, dense.SWAP_208):
        assert allocated(dataclasses.replace(cfg, stages=0)) == 233_472, cfg.tag()


STANDARD = [
    *(pytest.param(c, 2, False, id=f"dense-{c.tag()}") for c in dense.STANDARD_CONFIGS),
    *(pytest.param(c, 1, True, id=f"fp8-{c.tag()}") for c in fp8.STANDARD_CONFIGS),
    *(pytest.param(c, 1, True, id=f"fp8-masked-{c.tag()}") for c in masked.STANDARD_CONFIGS),
]


@pytest.mark.parametrize(("cfg", "elem_bytes", "scaled"), STANDARD)
def test_every_standard_configuration_fits(cfg, elem_bytes, scaled):
    assert allocated(cfg, elem_bytes, 2, scaled) <= SMEM_CAPACITY


def test_only_the_two_overridden_tiles_would_overfill():
    """At `ring_stages`' count, exactly FIT_112 and SWAP_208 overfill, and config.py gives them
    one stage less; every other standard configuration fits at the count the kernel takes."""
    over = set()
    for cfg, elem_bytes, scaled in (p.values for p in STANDARD):
        free = dataclasses.replace(cfg, stages=0)
        if allocated(free, elem_bytes, 2, scaled) > SMEM_CAPACITY:
            over.add(cfg)
            assert cfg.stages == ring_stages(free, elem_bytes, 2) - 1, cfg.tag()
    assert over == {dense.FIT_112, dense.SWAP_208}


@pytest.mark.parametrize("cfg", dense.CANDIDATES, ids=lambda c: c.tag())
def test_every_dense_candidate_fits(cfg):
    """The tuning candidates (`forgekernel build --candidates`) launch too."""
    assert allocated(cfg) <= SMEM_CAPACITY
