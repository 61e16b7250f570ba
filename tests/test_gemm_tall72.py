"""The 72-column tiles (config.py TALL_72 / SWAP_TALL_72, docs/gemm/NOTES.md "72 columns"), on
the CPU: what they cover on the two cases they were made for against the 80-column picks they
replace, that the chooser never gives them a B "kn" weight nor moves another bench case, the
shared memory kernel.py allocates for them (B's ring of 80 rows), and that the kernel refuses
the forms its 80-row B ring does not take."""

from __future__ import annotations

import pytest

from forgekernel.bench.suites import gemm as suite
from forgekernel.kernels.gemm.dense.sm90 import SPEC, config
from forgekernel.kernels.gemm.dense.sm90.config import (
    SWAP_TALL_72,
    SWAP_TALL_80,
    TALL_72,
    TALL_80,
    choose_config,
    prefill_time,
    takes_kn,
)
from forgekernel.kernels.gemm.dense.sm90.plan import grid_blocks
from forgekernel.kernels.gemm.dense.sm90.tile import ring_stages

# the bench cases whose pick moves to a 72-column tile, with the kernel's (M, N) and the CTAs
MOVED = {
    (3000, 576, 7168): (TALL_72, TALL_80, (3000, 576), 128),
    (129, 10240, 8192): (SWAP_TALL_72, SWAP_TALL_80, (10240, 129), 108),
}


@pytest.mark.parametrize("mnk", list(MOVED), ids=str)
def test_the_same_round_over_less_dead_area(mnk):
    """One round of the same CTAs as the 80-column pick, 72/80 of its columns: 3000x576 in
    8 column tiles of 72 (576: none dead; 80: 640), 129 tokens in 2 of 72 (144; 80: 160)."""
    new, old, (km, kn), ctas = MOVED[mnk]
    assert choose_config(*mnk) == new
    for cfg in (new, old):
        tiles_m, tiles_n, blocks = grid_blocks(cfg, km, kn)
        assert blocks * cfg.cluster_m * cfg.cluster_n == ctas <= 132
    assert grid_blocks(new, km, kn)[1] * 72 == (576 if kn == 576 else 144)
    # the model: 72/80 of the work at the assumed rate (0.91 / 0.826 against 0.942 / 0.856)
    ratio = prefill_time(new, *mnk) / prefill_time(old, *mnk)
    assert 0.93 < ratio < 0.94


def test_no_other_bench_case_moves():
    """Over the bench's cases only the two above pick a 72-column tile."""
    for case in suite.BENCH_CASES:
        p = case.params
        m, n, k = p["m"], p["n"], p["k"]
        picked = choose_config(m, n, k, b_kn=p["b_layout"] == "kn")
        assert (picked.tile_n == 72) == ((m, n, k) in MOVED), case.name


@pytest.mark.parametrize("m", [129, 300, 1026, 2000, 3000, 5000])
@pytest.mark.parametrize(("n", "k"), [(576, 7168), (520, 4104), (720, 4096), (1152, 4096)])
def test_b_kn_never_takes_them(m, n, k):
    assert takes_kn(choose_config(m, n, k, b_kn=True))
    assert not takes_kn(TALL_72) and not takes_kn(SWAP_TALL_72) and takes_kn(TALL_80)


def test_built_nk_only():
    params = set(SPEC.standard_params())
    for dtype in config.DTYPES:
        for cfg in (TALL_72, SWAP_TALL_72):
            assert config.params_for(dtype, False, cfg) in params
            assert config.params_for(dtype, True, cfg) not in params


def test_b_ring_rows():
    """B's ring holds 80 rows a stage for 72 columns: with the 8-column epilogue ring (12 KB,
    not 24) TALL_72 keeps six stages where TALL_80 has five."""
    assert ring_stages(TALL_72) == 6 and ring_stages(TALL_80) == 5


def test_the_kernel_refuses_what_the_80_row_ring_does_not_take():
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    GemmSm90(TALL_72)
    for bad, kwargs in (
        (TALL_72, {"b_kn": True}),
        (config.GemmConfig(tile_n=72, epi_n=8), {}),  # cluster_m 2: B's box split in two
        (config.GemmConfig(tile_n=72, cluster_m=1, epi_n=8), {"masked": True}),
        (config.GemmConfig(tile_n=72, cluster_m=1, epi_n=16), {}),  # 16 does not divide 72
    ):
        with pytest.raises(ValueError):
            GemmSm90(bad, **kwargs)


@pytest.mark.parametrize("m,n,k", [(6272, 256, 1024), (6272, 512, 1024), (4000, 600, 4096)])
def test_unswapped_72_columns_only_where_72_divides_n(m, n, k):
    """6272x256x1024 (a 1x1 convolution as a GEMM) ran 10.4 us on TALL_72 against 8.9 on the
    128x128 tile (2026-12-05): the unswapped 72-column tile is a candidate only where it covers N
    exactly."""
    assert choose_config(m, n, k, 132) is not TALL_72
    assert "fit" not in config.prefill_rivals(m, n, k, 132) or (
        config.prefill_rivals(m, n, k, 132)["fit"] is not TALL_72
    )
