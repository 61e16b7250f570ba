"""scripts/gemm_worst_probe.py on the CPU (loaded from its file): every row is a configuration
the launcher takes on its case (A box, B "nk", shared memory as kernel.py allocates it), the
swapped stream-K rows come last, and the swapped tiles' tokens-first walk is what the probe
times (the weight's tiles of one token column adjacent in the raster)."""

from __future__ import annotations

import pytest
from script_modules import load_script  # tests/ is on the path
from test_gemm_smem_fit import allocated  # tests/ is on the path (pytest, rootdir-less)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
from forgekernel.kernels.gemm.dense.sm90.config import SWAP, SWAP_N, choose_config


@pytest.fixture(scope="module")
def script():
    return load_script("gemm_worst_probe")


def test_every_row_launches_on_its_case(script):
    rows = script.cases([])
    assert len(rows) == sum(len(c) for c in script.PROBES.values())
    for case, label, cfg in rows:
        m, n, k = (case.params[x] for x in "mnk")
        assert cfg.fits(m) and case.params["b_layout"] == "nk", label
        assert allocated(cfg) <= SMEM_CAPACITY, label
        assert cfg.tile_n % 16 == 0 and cfg.tile_n % cfg.epi_n == 0, label  # kernel.py's rule
        assert cfg != choose_config(m, n, k), label  # a rival, not the pick again
    risky = [cfg.swap and cfg.stream_k for _, _, cfg in rows]
    assert risky == sorted(risky) and any(risky)  # the swapped stream-K rows last


def test_only_the_case_filter_is_taken(script):
    rows = script.cases(["300x28672x4096"])
    assert {case.name for case, _, _ in rows} == {"300x28672x4096"}
    assert [cfg for _, _, cfg in rows] == [SWAP_N[0], SWAP_N[2]]


def test_the_tokens_first_twins_differ_only_in_the_walk():
    for standard, twin in zip(SWAP, SWAP_N, strict=True):
        assert standard.raster_along_m and not twin.raster_along_m
        assert twin.key() == {**standard.key(), "raster_along_m": False}
