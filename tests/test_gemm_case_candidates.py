"""The candidates timed as bench variants of one case (config.py `CASE_CANDIDATES`,
docs/gemm/NOTES.md "256 tokens: candidates"), on the CPU: the bench times each beside the
chooser's pick on its case (the suite's variants) while the pick stays as it is, `forgekernel
build` prebuilds each (standard or `--candidates`), and the model's reasons for them hold (one
round of the same tiles, the L2 reads a k-tile, the predicted times of the notes)."""

from __future__ import annotations

import dataclasses

import pytest

from forgekernel.bench.suites import gemm as suite
from forgekernel.kernels.gemm.dense.sm90 import SPEC, config
from forgekernel.kernels.gemm.dense.sm90.config import (
    CASE_CANDIDATES,
    DECODE,
    SMALL,
    SMALL_C12,
    SMALL_N,
    SQUARE,
    SWAP_TALL_72,
    TALL_72,
    choose_config,
    prefill_rivals,
    prefill_time,
)
from forgekernel.kernels.gemm.dense.sm90.plan import grid_blocks

# the chooser's picks: SQUARE on 256x8192x8192 since 2026-12-05 (config.py prefill_rivals), the
# 72-column tiles that replace the 80-column picks of 3000x576x7168 and 129x10240x8192, which
# are timed beside them (NOTES "72 columns")
PICKS = {(256, 8192, 8192): SQUARE, (3000, 576, 7168): TALL_72, (129, 10240, 8192): SWAP_TALL_72}
# decode: the 64x64 a8 ring, timed against 64x112 a8 (config.py `DECODE_112`)
PICKS.update(dict.fromkeys([(4, 28672, 4096), (4, 37888, 3584), (1, 24576, 4096)], DECODE[0]))


def _case(m: int, n: int, k: int):
    return next(c for c in suite.BENCH_CASES if c.name == f"{m}x{n}x{k}")


def test_the_listed_cases_are_the_picks_of_the_last_run():
    assert set(CASE_CANDIDATES) == set(PICKS)


@pytest.mark.parametrize("mnk", list(CASE_CANDIDATES), ids=str)
def test_the_bench_times_each_candidate_beside_the_unchanged_pick(mnk):
    m, n, k = mnk
    case = _case(m, n, k)
    assert case.params["b_layout"] == "nk"
    pick = choose_config(m, n, k)
    assert pick == PICKS[mnk]
    rivals = prefill_rivals(m, n, k) if m > 128 else {}
    kinds = suite.variants(case)
    kinds.pop("no_pdl", None)  # the PDL variant of the short cases (test_pdl.py)
    for kind, cfg in CASE_CANDIDATES[mnk].items():
        assert kind in kinds and kind not in rivals, kind
        assert cfg != pick and cfg not in rivals.values(), kind  # none timed twice
    assert set(kinds) == {k_ for k_, c in rivals.items() if c != pick} | set(CASE_CANDIDATES[mnk])


def test_only_the_listed_cases_and_nk_take_candidates():
    listed = {f"{m}x{n}x{k}" for m, n, k in CASE_CANDIDATES}
    names = {kind for group in CASE_CANDIDATES.values() for kind in group}
    for case in suite.BENCH_CASES + suite.CHECK_CASES:
        extra = names & set(suite.variants(case))
        assert not extra or case.name in listed, case.name
    case = _case(256, 8192, 8192)
    kn = dataclasses.replace(case, params={**case.params, "b_layout": "kn"})
    assert not names & set(suite.variants(kn))


def test_every_candidate_is_prebuilt():
    """bf16 "nk" (the bench's dtype and layout): SQUARE standard, the others through
    `forgekernel build --candidates`."""
    built = set(SPEC.candidate_params()) | set(SPEC.standard_params())
    for group in CASE_CANDIDATES.values():
        for cfg in group.values():
            assert cfg in config.CANDIDATES or cfg in config.STANDARD_CONFIGS, cfg.tag()
            assert config.params_for("bfloat16", False, cfg) in built, cfg.tag()
    assert len(config.CANDIDATES) == len(set(config.CANDIDATES))


def test_the_candidates_rates_are_assumed_from_small():
    eff = config._EFFICIENCY
    assert eff[SMALL_C12] == eff[SMALL_N] == eff[SMALL] == 0.92
    # none of the new ones is a standard configuration the chooser weighs
    assert not {SMALL_C12, SMALL_N} & set(config.PREFILL + config.PREFILL_STREAM)


def _l2_kb_per_k_tile(cfg) -> float:
    """KB a CTA reads from L2 a k-tile: A / cluster_n + B / cluster_m."""
    row = cfg.tile_k * 2 / 1024
    return cfg.tile_m * row / cfg.cluster_n + cfg.tile_n * row / cfg.cluster_m


@pytest.mark.parametrize(
    ("cfg", "kb"), [(SMALL, 32), (SQUARE, 24), (SMALL_C12, 24), (SMALL_N, 32)], ids=str
)
def test_the_same_128_tiles_in_one_round(cfg, kb):
    """256 x 8192: 2 x 64 tiles of 128x128, 128 CTAs, one round of 132 SMs; what differs is
    the operand a cluster shares (the weight's tile by SQUARE, the tokens' by SMALL_C12) and
    the walk (SMALL_N: the two readers of a weight tile 64 CTAs apart)."""
    tiles_m, tiles_n, blocks = grid_blocks(cfg, 256, 8192)
    assert (tiles_m, tiles_n) == (2, 64) and blocks * cfg.cluster_m * cfg.cluster_n == 128
    assert _l2_kb_per_k_tile(cfg) == kb


def test_the_model_on_the_candidates():
    """What the model says (NOTES "256 tokens: candidates"): SQUARE 1% faster than SMALL (its
    0.93 against 0.92), the other two SMALL's time (clusters and walks are not in it); none
    `_CHALLENGER_MARGIN` faster than the pick on the model alone (SQUARE is the pick by
    measurement: config.py prefill_rivals' comment)."""
    mnk = (256, 8192, 8192)
    assert prefill_time(SMALL, *mnk) == pytest.approx(57.8, abs=0.05)
    assert prefill_time(SQUARE, *mnk) == pytest.approx(57.2, abs=0.05)
    assert prefill_time(SMALL_C12, *mnk) == prefill_time(SMALL_N, *mnk) == prefill_time(SMALL, *mnk)
    for cfg in CASE_CANDIDATES[mnk].values():
        assert prefill_time(cfg, *mnk) >= config._CHALLENGER_MARGIN * prefill_time(SQUARE, *mnk)
