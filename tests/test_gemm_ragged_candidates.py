"""The candidates for the slowest bench cases of the H200 run of 2026-12-03 03:50 (config.py
`RAGGED_CANDIDATES`, docs/gemm/NOTES.md "Ragged candidates"), on the CPU: the bench times each
beside the chooser's pick on its case (the suite's variants) while the pick stays as it is,
`forgekernel build --candidates` prebuilds each, each launches (shared memory), and the
model's reasons for them hold (plans, L2 traffic, rounds)."""

from __future__ import annotations

import dataclasses

import pytest

from forgekernel.bench.suites import gemm as suite
from forgekernel.kernels.gemm.dense.sm90 import SPEC, config
from forgekernel.kernels.gemm.dense.sm90.config import (
    FIT_240,
    RAGGED_CANDIDATES,
    SWAP_208,
    SWAP_208_C21,
    SWAP_STREAM_144,
    SWAP_STREAM_144_C2,
    SWAP_TALL_80,
    SWAP_TALL_144,
    TALL_80,
    TALL_80_C14,
    WIDE,
    choose_config,
    prefill_rivals,
    prefill_time,
    split_for,
)
from forgekernel.kernels.gemm.dense.sm90.plan import grid_blocks

# the picks of the 03:50 run (and of today's chooser): the standard stays until measured
PICKS = {
    (129, 10240, 8192): SWAP_TALL_80,
    (3000, 576, 7168): TALL_80,
    (777, 4096, 14336): SWAP_208,
    (5000, 6144, 4096): WIDE,
}


def _case(m: int, n: int, k: int):
    return next(c for c in suite.BENCH_CASES if c.name == f"{m}x{n}x{k}")


@pytest.mark.parametrize("mnk", list(RAGGED_CANDIDATES), ids=str)
def test_the_bench_times_each_candidate_beside_the_unchanged_pick(mnk):
    m, n, k = mnk
    case = _case(m, n, k)
    assert case.params["b_layout"] == "nk"
    pick = choose_config(m, n, k)
    assert pick == PICKS[mnk]
    rivals = prefill_rivals(m, n, k)
    kinds = suite.variants(case)
    for kind, cfg in RAGGED_CANDIDATES[mnk].items():
        assert kind in kinds and kind not in rivals, kind
        assert cfg != pick and cfg not in rivals.values(), kind  # none timed twice
    assert set(kinds) == {k_ for k_, c in rivals.items() if c != pick} | set(RAGGED_CANDIDATES[mnk])


def test_only_the_listed_cases_and_nk_take_candidates():
    listed = {f"{m}x{n}x{k}" for m, n, k in RAGGED_CANDIDATES}
    names = {kind for group in RAGGED_CANDIDATES.values() for kind in group}
    for case in suite.BENCH_CASES + suite.CHECK_CASES:
        extra = names & set(suite.variants(case))
        assert not extra or case.name in listed, case.name
    kn = dataclasses.replace(_case(129, 10240, 8192), params={
        **_case(129, 10240, 8192).params, "b_layout": "kn"})  # fmt: skip
    assert not names & set(suite.variants(kn))


def test_every_candidate_is_prebuilt_with_the_candidates():
    """bf16 "nk" (the bench's dtype and layout), through `forgekernel build --candidates`."""
    built = set(SPEC.candidate_params())
    for group in RAGGED_CANDIDATES.values():
        for cfg in group.values():
            assert cfg in config.CANDIDATES
            assert config.params_for("bfloat16", False, cfg) in built, cfg.tag()
    assert len(config.CANDIDATES) == len(set(config.CANDIDATES))


def test_the_candidates_rates_are_assumed_from_their_base_tiles():
    eff = config._EFFICIENCY
    plain = dataclasses.replace(SWAP_STREAM_144, stream_k=False)
    assert eff[plain] == pytest.approx(0.95 * config.assumed_efficiency(plain))
    assert eff[SWAP_208_C21] == eff[SWAP_208] and eff[TALL_80_C14] == eff[TALL_80]
    assert eff[FIT_240] == config.assumed_efficiency(FIT_240) == pytest.approx(0.994, abs=5e-4)
    # none of them is a standard configuration the chooser weighs
    everything = {c for g in RAGGED_CANDIDATES.values() for c in g.values()} - {SWAP_TALL_80}
    assert not everything & set(config.PREFILL + config.PREFILL_STREAM)


def test_129_tokens_stream_the_weight_over_every_sm():
    """80 weight tiles of 128 rows, the 129 tokens in one 144-wide tile, 78 k-tiles a CTA of
    the 128, no data-parallel round; the 2x1 cluster: 40 blocks over 66 clusters."""
    m, n, k = 129, 10240, 8192
    one = split_for(SWAP_STREAM_144, n, m, k)
    two = split_for(SWAP_STREAM_144_C2, n, m, k)
    assert (one.tiles, one.blocks, one.k_tiles, one.dp_rounds) == (80, 80, 128, 0)
    assert (one.per, one.ctas) == (78, 132)
    assert (two.blocks, two.per, two.clusters, two.ctas) == (40, 78, 66, 132)
    # the pick leaves 24 SMs idle: 54 x 2 tiles of 192x80
    assert grid_blocks(SWAP_TALL_80, n, m) == (54, 2, 54)


def _l2_kb(cfg, m: int, n: int, k: int) -> float:
    """KB every CTA reads from L2 over the problem: per k-tile A / cluster_n + B / cluster_m."""
    km, kn = (n, m) if cfg.swap else (m, n)
    tiles_m, tiles_n, _ = grid_blocks(cfg, km, kn)
    row = cfg.tile_k * 2 / 1024
    per = cfg.tile_m * row / cfg.cluster_n + cfg.tile_n * row / cfg.cluster_m
    return tiles_m * tiles_n * -(-k // cfg.tile_k) * per


@pytest.mark.parametrize(
    ("mnk", "cfg", "ratio"),
    [
        ((129, 10240, 8192), SWAP_STREAM_144_C2, 0.84),  # vs SWAP_TALL_80
        ((3000, 576, 7168), SWAP_TALL_80, 0.89),  # vs TALL_80: 576 = 3 x 192, 3040 tokens
        ((3000, 576, 7168), TALL_80_C14, 0.73),
        ((777, 4096, 14336), SWAP_208_C21, 0.85),
        ((777, 4096, 14336), SWAP_TALL_144, 0.91),
        ((5000, 6144, 4096), FIT_240, 0.90),
    ],
    ids=str,
)
def test_the_candidates_read_less_from_l2_than_the_pick(mnk, cfg, ratio):
    assert _l2_kb(cfg, *mnk) / _l2_kb(PICKS[mnk], *mnk) == pytest.approx(ratio, abs=0.01)


def test_the_model_on_the_candidates():
    """What the model says (its reasons in the notes): 128x240 fills 7.9 of 8 rounds where
    WIDE fills 9.7 of 10 (2.7% faster); the swapped stream K within 2% of the pick with the
    streamed k-iterations priced `_STREAM_SLOWDOWN` slower (15% faster without); the rest no
    faster by the model (clusters and stages are not in it)."""
    assert prefill_time(FIT_240, 5000, 6144, 4096) == pytest.approx(387.2, abs=0.1)
    assert prefill_time(WIDE, 5000, 6144, 4096) == pytest.approx(397.8, abs=0.1)
    assert prefill_time(SWAP_STREAM_144, 129, 10240, 8192) == pytest.approx(55.8, abs=0.1)
    assert prefill_time(SWAP_TALL_80, 129, 10240, 8192) == pytest.approx(56.7, abs=0.1)
    for mnk, group in RAGGED_CANDIDATES.items():
        for cfg in group.values():
            assert prefill_time(cfg, *mnk) >= 0.97 * prefill_time(PICKS[mnk], *mnk) or (
                cfg == FIT_240
            ), cfg.tag()
