"""The fused data gradient's park weight refit from 21:48 (dgrad_config PARK_WEIGHT 2.0 -> 2.3;
docs/conv/NOTES.md, "The park weight refit from 21:48") and its bench variants (bench/suites/
conv_dgrad.py `PARK`, `MOVED_PARK`): C 320 at 64 x 64 takes the plan measured faster (128x128
c2x1 unsplit), no plan measured faster than its alternative (16:45's candidates, 21:48's
variants) loses its place, the suite cases the refit moves are exactly `PARK`'s (no check
case: the sanitizers' splits stay), each `was` recounts as the plan at 2.0, asks for a standard
build and computes the gradient (the CPU models of the compiled functions, fp64)."""

from __future__ import annotations

import pytest
import torch
from conv_dgrad_plans import by_name as _by_name  # tests/ is on the path
from conv_dgrad_plans import plan as _plan
from conv_dgrad_plans import signature as _signature

from forgekernel.bench.suites import conv_dgrad as S
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, dgrad_config, launch
from forgekernel.kernels.conv.sm90.config import LARGE, SMALL, SQUARE

F64 = torch.float64


def _case(n, c, k, hw, f):
    return L.conv_case("dgrad", n, c, k, (hw, hw), f, 2, f // 2 if f > 2 else 0)


def _before(monkeypatch):
    """The park weight before 21:48 (the 16:45 refit's)."""
    monkeypatch.setattr(dgrad_config, "PARK_WEIGHT", 2.0)
    launch.clear_plans()


def _key(plan):
    """A plan as the bench hands it over: its base tile, and k-tiles per part if split."""
    cfg = plan.config
    return cfg.tile_n, cfg.cluster_m, plan.split and plan.per_split


def _plain(cfg, per):
    """The key of the plan `S._fused(cfg, per, ...)` asks for (per None: unsplit)."""
    return cfg.tile_n, cfg.cluster_m, per or False


# Every pair of plans measured on one case (H200; graph / eager ratios of the faster to the
# slower in both timings, all >= 3% apart): (case, faster plan, slower plan). The chooser may
# take a third plan, never the slower one.
MEASURED = [
    # 16:45: the candidates against the chooser's plan then
    (_case(32, 1024, 2048, 14, 1), (LARGE, None), (LARGE, 8)),  # whole 0.689 / 0.718
    (_case(32, 1024, 2048, 14, 1), (SQUARE, 11), (LARGE, 8)),  # square 0.906 / 0.897
    (_case(32, 512, 512, 14, 3), (SMALL, 16), (LARGE, 16)),  # square1 0.910 / 0.910
    (_case(8, 320, 320, 64, 3), (LARGE, None), (LARGE, 10)),  # whole 0.857 / 0.865
    (_case(8, 320, 320, 64, 3), (SQUARE, 10), (LARGE, 10)),  # square 0.823 / 0.819
    (_case(8, 640, 640, 32, 3), (SQUARE, 20), (LARGE, 20)),  # square 0.907 / 0.935
    # 21:48: the standard against `was` (16:45's moves) and C 320's `whole`
    (_case(8, 320, 320, 64, 3), (SQUARE, None), (SQUARE, 10)),  # whole 0.838 / 0.861
    (_case(32, 256, 256, 28, 3), (SMALL, None), (LARGE, 8)),  # was 1.398 / 1.315
    (_case(32, 192, 384, 28, 2), (SMALL, None), (LARGE, None)),  # was 1.096 / 1.072
    (_case(64, 384, 768, 14, 2), (SQUARE, None), (LARGE, None)),  # was 1.105 / 1.097
    (_case(64, 512, 512, 14, 3), (SQUARE, None), (LARGE, 16)),  # was 1.161 / 1.187
    (_case(16, 1024, 2048, 14, 1), (SMALL, None), (SMALL, 8)),  # was 1.489 / 1.352
    (_case(1, 1280, 1280, 32, 3), (SQUARE, 40), (LARGE, 16)),  # was 1.293 / 1.240
    (_case(1, 512, 512, 128, 3), (SQUARE, 16), (LARGE, 16)),  # was 1.026 / 1.039
]


def test_the_weight():
    assert dgrad_config.PARK_WEIGHT == 2.3


def test_c320_takes_the_unsplit_plan_measured_faster(conv_models):
    """C 320 at 64 x 64: the 128x128 c2x1 unsplit (`whole` at 21:48), a standard build."""
    plan = _plan(_by_name()["n8-c320-64x64-k320-3x3-s2"])
    assert _signature(plan) == (128, 128, 2, False, 20, 3)
    spec, params = conv_models[-1]
    assert spec == DGRAD_SPEC.name and params in [dict(q) for q in DGRAD_SPEC.standard_params()]


@pytest.mark.parametrize("case, faster, slower", MEASURED, ids=lambda v: getattr(v, "name", ""))
def test_no_plan_measured_slower_is_taken(conv_models, case, faster, slower):
    """The chooser takes the faster plan of every measured pair, or a third one: never the
    slower (the 16:45 plan was the slower one on the pairs C 320 at 21:48 decided)."""
    assert _plain(*faster) != _plain(*slower)
    assert _key(_plan(case)) != _plain(*slower)


def test_the_suite_cases_the_refit_moves_are_parks(conv_models, monkeypatch):
    """Over the bench and check cases the refit moves C 320 at 64 x 64 and the two MOVED_PARK
    classes, each carrying its old plan as `was`; no check case moves (the sanitizers' split
    cases keep their parts)."""
    cases = _by_name()
    after = {name: _plan(case) for name, case in cases.items()}
    _before(monkeypatch)
    before = {name: _plan(case) for name, case in cases.items()}
    moved = {n for n in cases if after[n] is not None and after[n] != before[n]}
    assert moved == set(S.PARK)
    assert {case.name for case in S.MOVED_PARK} <= set(S.PARK)
    assert not set(S.PARK) & (set(S.CANDIDATES) | set(S.WORST))
    for case in S.SANITIZE_CASES:
        assert after[case.name] == before[case.name], case.name


@pytest.mark.parametrize("name", sorted(S.PARK))
def test_was_is_the_plan_before_the_park_refit(conv_models, monkeypatch, name):
    """Each `was` recounts as the chooser's plan at PARK_WEIGHT 2.0, which it no longer takes,
    and asks for a standard build."""
    case = _by_name()[name]
    now = _plan(case)
    was = _plan(case, S.PARK[name]["was"])
    spec, params = conv_models[-1]
    assert spec == DGRAD_SPEC.name and params in [dict(q) for q in DGRAD_SPEC.standard_params()]
    _before(monkeypatch)
    assert was == _plan(case) != now


@pytest.mark.parametrize("name", sorted(S.PARK))
def test_every_park_variant_computes_the_gradient(conv_models, name):
    """The `was` runner on its case's filter, stride, padding and channels at batch 1 on a
    6x6 map (the same k-tiles per phase, so the same parts): dx the reference's."""
    p = dict(_by_name()[name].params, n=1, spatial=(6, 6))
    case = L.conv_case("dgrad", p["n"], p["c"], p["k"], p["spatial"], p["kernel"][0],
                       p["stride"][0])  # fmt: skip
    inputs = L.make_inputs(case, F64, torch.device("cpu"), torch.Generator().manual_seed(0))
    out = torch.full(L.shapes(case.params)["x"], float("nan"), dtype=F64)
    out = out.contiguous(memory_format=torch.channels_last)
    dx = S.variants(_by_name()[name])["was"](inputs, out)
    want = L.reference(inputs).to(F64)  # the reference comes back in fp32
    assert dx is out and torch.allclose(dx, want, rtol=1e-5, atol=1e-4), (dx - want).abs().max()
