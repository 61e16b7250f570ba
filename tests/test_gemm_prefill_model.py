"""The GEMM chooser's prefill model (config.py `prefill_time`, plan.py) on the CPU: it
reproduces the H200 times of the measured tiles, it keeps the measured tile the earlier rule
picked unless a challenger (the 64-row tile, stream K) or a one-wave tile (config.FIT, its
efficiency assumed) is predicted faster by the margin (config.py `_CHALLENGER_MARGIN`), what it
picks on the cases of issue 17, that of two configurations timed side by side on the H200 it
picks the faster or one within 2.5% of it, and the decode / FP8 stream-K plans are the earlier
ones."""

from __future__ import annotations

import dataclasses

import pytest

from forgekernel.bench.suites import gemm as suite
from forgekernel.kernels.gemm.dense.sm90 import config
from forgekernel.kernels.gemm.dense.sm90.config import (
    DECODE_STREAM,
    FIT,
    FIT_112,
    FIT_144,
    FIT_160,
    FIT_224,
    LARGE,
    LARGE_STREAM,
    MID,
    SMALL,
    SQUARE,
    SWAP,
    SWAP_80,
    SWAP_208,
    SWAP_TALL_80,
    TALL_80,
    TALL_96,
    WIDE,
    WIDE_STREAM,
    choose_config,
    prefill_rivals,
    prefill_time,
    stream_plan,
)

SMS = 132


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def earlier_rule(m: int, n: int, k: int) -> config.GemmConfig:
    """The chooser before the model (main de8331c) for M > 128: SMALL up to 256 rows, then the
    tile of the most useful busy area, weighted by its efficiency."""
    if m <= 256:
        return SMALL

    def score(c):
        cm, cn = c.cluster_m, c.cluster_n
        tm, tn = _ceil(m, c.tile_m), _ceil(n, c.tile_n)
        wave = SMS // (cm * cn)
        occupancy = tm * tn / (_ceil(_ceil(tm, cm) * _ceil(tn, cn), wave) * wave * cm * cn)
        utilization = m * n / (tm * c.tile_m * tn * c.tile_n)
        return {LARGE: 1.0, WIDE: 0.965, SQUARE: 0.93}[c] * occupancy * utilization

    return max((LARGE, WIDE, SQUARE), key=score)


# (M, N, K, configuration, graph us): H200, 2026-12-02 (benchmarks/results/sm_90a/gemm.json)
MEASURED = [
    (8192, 8192, 8192, LARGE, 1639.6),
    (4096, 4096, 4096, LARGE, 202.8),
    (1000, 3000, 4104, WIDE, 43.1),
    (512, 6144, 4096, WIDE, 41.7),
    (256, 8192, 8192, SMALL, 57.7),
    (129, 10240, 8192, SMALL, 106.2),
    (512, 3584, 3584, SQUARE, 24.2),
    (300, 28672, 4096, SQUARE, 208.9),
    (4096, 576, 7168, WIDE, 66.0),
    (3000, 576, 7168, SQUARE, 47.9),
    (512, 7168, 16384, LARGE, 204.0),
    (1024, 3584, 18944, LARGE, 231.9),
    (777, 4096, 14336, LARGE, 175.4),
    (5000, 6144, 4096, WIDE, 393.4),
    (2048, 7168, 5120, SQUARE, 233.9),
    (512, 10240, 5120, WIDE, 97.5),
]


@pytest.mark.parametrize(("m", "n", "k", "cfg", "us"), MEASURED)
def test_the_model_reproduces_the_measured_tiles(m, n, k, cfg, us):
    assert prefill_time(cfg, m, n, k, SMS) == pytest.approx(us, rel=0.08)


def _shapes():
    cases = suite.BENCH_CASES + suite.CHECK_CASES + suite.SANITIZE_CASES
    return sorted({(c.params["m"], c.params["n"], c.params["k"]) for c in cases})


@pytest.mark.parametrize(("m", "n", "k"), [s for s in _shapes() if s[0] > 128])
def test_the_measured_tile_stays_unless_a_challenger_wins_by_the_margin(m, n, k):
    rivals = prefill_rivals(m, n, k, SMS)
    assert rivals["tile"] == earlier_rule(m, n, k)
    assert rivals["challenger"] in (MID, *config.PREFILL_STREAM) and rivals["fit"] in FIT
    assert ("swap" in rivals) == config.swap_applies(m, n, False)  # B "nk"
    assert rivals.get("swap", SWAP[0]) in SWAP
    chosen = choose_config(m, n, k, SMS)
    if chosen != rivals["tile"]:
        others = [cfg for kind, cfg in rivals.items() if kind != "tile"]
        assert chosen in others
        assert prefill_time(chosen, m, n, k) == min(prefill_time(c, m, n, k) for c in others)
        margin = config._CHALLENGER_MARGIN
        assert prefill_time(chosen, m, n, k) < margin * prefill_time(rivals["tile"], m, n, k)


def test_the_fit_tiles_take_the_assumed_efficiency_and_are_built():
    """Not measured yet: each FIT tile's rate is the intensity rule's (NOTES "Tiles for the
    one-wave ..."), and `forgekernel build` prebuilds them."""
    assumed = {FIT_224: 0.988, FIT_160: 0.953, FIT_144: 0.942, FIT_112: 0.916}
    assumed |= {TALL_80: 0.905, TALL_96: 0.930}
    for cfg, eff in assumed.items():
        assert config._EFFICIENCY[cfg] == pytest.approx(eff, abs=5e-4), cfg.tag()
        assert cfg in config.STANDARD_CONFIGS and cfg in config.PREFILL
    assert config.assumed_efficiency(WIDE) == pytest.approx(0.972, abs=5e-4)
    assert config.assumed_efficiency(LARGE) == 1.0


# The refit chooser (H200 bench of 2026-12-02 07:00, graph us of the pick against its rival),
# then the one-wave tiles (config.FIT, efficiencies assumed: model us of the pick against the
# earlier pick; unmeasured until the bench's variants time them side by side).
@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [
        # swapped, 224 x 4 tiles of 128x80 (tokens 80 at a time), 7 rounds: 128.8 vs 192x96
        # 154.8 vs MID 180.7 us (MID measured ~176)
        (300, 28672, 4096, SWAP_80),
        # swapped, 54 x 2 tiles of 192x80, one round: 53.8 vs 192x80 55.2 vs MID 74.4 us
        (129, 10240, 8192, SWAP_TALL_80),
        # swapped, 32 x 4 = 128 tiles of 128x208: 150.0 vs LARGE 180.5 us (179.5 measured)
        (777, 4096, 14336, SWAP_208),
        (4096, 576, 7168, FIT_144),  # 32 x 4 = 128 tiles: 55.6 vs WIDE 68.8 us (WIDE 69.0)
        (512, 10240, 5120, FIT_160),  # 4 x 64 tiles, 2 rounds: 85.8 vs WIDE 98.8 us (101.2)
        (512, 7168, 16384, FIT_224),  # 4 x 32 = 128 tiles: 182.7 vs LARGE 201.6 us (217.9)
        (1024, 3584, 18944, FIT_224),  # 8 x 16 = 128 tiles: 210.9 vs LARGE 232.7 us (242.4)
        (2048, 7168, 5120, FIT_224),  # 227.8 vs SQUARE 241.8 us (241.2)
        (2048, 5120, 25600, SQUARE),  # 835.1 vs LARGE_STREAM 996.8 us
        (1024, 51200, 5120, FIT_224),  # 794.1 vs LARGE_STREAM 799.2 us (806.0; LARGE 877.8)
        (3000, 576, 7168, SQUARE),  # WIDE_STREAM 13% slower by the model, 192x80 within 3%
        (512, 3584, 3584, FIT_112),  # 4 x 32 = 128 tiles: 23.8 vs SQUARE 25.9 us (24.2)
        (5000, 6144, 4096, WIDE),  # LARGE_STREAM 0.6% faster by the model: under the margin
        (8192, 8192, 8192, LARGE),  # 1706.5 vs LARGE_STREAM 1683.2 us: under the margin
        (256, 8192, 8192, SMALL),
    ],
)
def test_issue_17_cases(m, n, k, want):
    assert choose_config(m, n, k, SMS) == want


# B "kn": no swap (a "kn" weight as the kernel's A would be M-major): the unswapped picks.
@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [(300, 28672, 4096, TALL_96), (129, 10240, 8192, TALL_80), (777, 4096, 14336, LARGE)],
)
def test_b_kn_keeps_the_unswapped_pick(m, n, k, want):
    assert choose_config(m, n, k, SMS, b_kn=True) == want
    assert "swap" not in prefill_rivals(m, n, k, SMS, b_kn=True)


def test_the_swap_takes_the_assumed_efficiency_and_is_built_nk_only():
    """Not measured yet (the intensity rule on the kernel's tile); `forgekernel build`
    prebuilds each swapped tile for B "nk" in both dtypes, never "kn"."""
    from forgekernel.kernels.gemm.dense.sm90 import _standard_params

    assumed = {SWAP_80: 0.881, SWAP_208: 0.980, SWAP_TALL_80: 0.905}
    built = [dict(p) for p in _standard_params() if dict(p).get("swap")]
    assert sorted((p["dtype"], p["b_kn"], p["tile_m"], p["tile_n"]) for p in built) == sorted(
        (d, False, c.tile_m, c.tile_n) for d in ("bfloat16", "float16") for c in SWAP
    )
    for cfg, eff in assumed.items():
        assert config._EFFICIENCY[cfg] == pytest.approx(eff, abs=5e-4), cfg.tag()
        assert cfg in config.STANDARD_CONFIGS and cfg in config.PREFILL
    # the unswapped keys do not name the field (their compile keys as before)
    assert all("swap" not in dict(p) for p in _standard_params() if not dict(p).get("swap"))
    assert dict(config.params_for("bfloat16", False, SWAP_80))["swap"] is True


def test_the_swap_is_timed_on_the_kernels_output():
    """The model times a swapped tile over the (N, M) output the kernel sees."""
    m, n, k = 300, 28672, 4096
    unswapped = dataclasses.replace(SWAP_80, swap=False)
    config._EFFICIENCY[unswapped] = config._EFFICIENCY[SWAP_80]
    try:
        assert prefill_time(SWAP_80, m, n, k) == prefill_time(unswapped, n, m, k)
    finally:
        del config._EFFICIENCY[unswapped]


MID_STREAMED = dataclasses.replace(MID, stream_k=True)  # timed by the bench, not standard
# (M, N, K, {configuration: graph us}): H200 bench of 2026-12-02 07:00, each case with the
# chooser's pick of then and its rival. Left out: 300x28672x4096 (MID streamed 200.2, SQUARE
# 206.9 us), where the chooser now picks MID tiled, not timed yet.
MEASURED_PAIRS = [
    (1024, 3584, 18944, {LARGE: 242.4, LARGE_STREAM: 269.1}),
    (2048, 7168, 5120, {SQUARE: 241.2, LARGE_STREAM: 256.7}),
    (2048, 5120, 25600, {SQUARE: 835.1, LARGE_STREAM: 996.8}),
    (512, 10240, 5120, {WIDE: 101.2, LARGE_STREAM: 103.8}),
    (4096, 576, 7168, {WIDE: 69.0, WIDE_STREAM: 69.4}),
    (1024, 51200, 5120, {LARGE_STREAM: 806.0, LARGE: 877.8}),
    (777, 4096, 14336, {LARGE: 179.5, MID_STREAMED: 365.7}),
    (129, 10240, 8192, {MID: 75.1, SMALL: 112.0}),
    (512, 7168, 16384, {LARGE: 217.9, LARGE_STREAM: 214.1}),
    (8192, 8192, 8192, {LARGE: 1706.5, LARGE_STREAM: 1683.2}),
]


@pytest.mark.parametrize(
    ("m", "n", "k", "us"), MEASURED_PAIRS, ids=[f"{m}x{n}x{k}" for m, n, k, _ in MEASURED_PAIRS]
)
def test_the_chooser_picks_the_measured_faster_or_within_2_5_percent(m, n, k, us):
    """Between the measured kinds ("tile", "challenger"); where a FIT tile (unmeasured) is
    predicted faster than that pick by the margin, the chooser takes it instead."""
    rivals = prefill_rivals(m, n, k, SMS)
    tile, challenger = rivals["tile"], rivals["challenger"]
    margin = config._CHALLENGER_MARGIN
    faster = prefill_time(challenger, m, n, k) < margin * prefill_time(tile, m, n, k)
    measured_pick = challenger if faster else tile
    assert measured_pick in us, measured_pick.tag()
    assert us[measured_pick] <= 1.025 * min(us.values())
    chosen = choose_config(m, n, k, SMS)
    assert chosen in (measured_pick, rivals["fit"], rivals.get("swap"))


def _earlier_stream_plan(cfg, m, n, k, num_sms, min_k):
    tiles = _ceil(m, cfg.tile_m) * _ceil(n, cfg.tile_n)
    total = tiles * _ceil(k, cfg.tile_k)
    ctas = max(1, min(num_sms, total // min_k))
    per = _ceil(total, ctas)
    return per, _ceil(total, per), tiles


@pytest.mark.parametrize("cfg", [*DECODE_STREAM, config.GemmConfig(tile_n=128, stream_k=True,
                                  cluster_m=1, tile_k=128)], ids=lambda c: c.tag())  # fmt: skip
def test_one_cta_stream_plans_are_the_earlier_ones(cfg):
    """Decode's and FP8's plans (clusters of one, every block streamed) as before."""
    for m in (1, 5, 33, 64, 128, 300):
        for n in (8, 576, 4096, 51200):
            for k in (8, 1024, 7168, 16384):
                for min_k in (8, 16):
                    got = stream_plan(cfg, m, n, k, SMS, min_k)
                    assert got == _earlier_stream_plan(cfg, m, n, k, SMS, min_k)
