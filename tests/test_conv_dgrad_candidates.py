"""The fused data gradient's chooser after the 16:45 refit (dgrad_config FUSED_ROWS_128 and
PARK_WEIGHT; docs/conv/NOTES.md, "Measured 2026-12-03 16:45"; PARK_WEIGHT since refit again,
tests/test_conv_dgrad_park.py) and the conv_dgrad bench's `was`
variants (bench/suites/conv_dgrad.py `CANDIDATES`): the launcher's own plan function takes the
four plans measured faster on their cases, every suite case the refit moves is either one of
them or carries its old plan as a `was` variant, each `was` recounts as the old chooser's plan,
every compiled function asked for is a standard build, and each variant's runner computes the
gradient (the CPU models of the compiled functions, fp64) on a small problem of its case's
filter, stride and channels."""

from __future__ import annotations

import pytest
import torch
from conv_dgrad_plans import by_name as _by_name  # tests/ is on the path
from conv_dgrad_plans import plan as _plan
from conv_dgrad_plans import signature as _signature

from forgekernel.bench.suites import conv_dgrad as S
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, dgrad_config, launch

F64 = torch.float64


def _before_refit(monkeypatch):
    """The fused chooser's terms before 16:45 (config.IM2COL_ROWS_128, the bytes' park)."""
    monkeypatch.setattr(dgrad_config, "FUSED_ROWS_128", 2.0)
    monkeypatch.setattr(dgrad_config, "PARK_WEIGHT", 1.0)
    launch.clear_plans()


def _at_1645(monkeypatch):
    """The fused chooser's terms of the 16:45 refit (before the 21:48 park weight refit)."""
    monkeypatch.setattr(dgrad_config, "PARK_WEIGHT", 2.0)
    launch.clear_plans()


# the plans measured >= 3% faster than the chooser's in both timings (H200, 16:45); C 320's
# 128x128 c2x1 split per 10 (`square`) gave way at 21:48 to its unsplit twin (`whole`, 0.838x /
# 0.861x of it; the park weight refit, tests/test_conv_dgrad_park.py)
ADOPTED = {
    "n32-c1024-14x14-k2048-1x1-s2": (128, 256, 2, False, 32, 4),  # whole
    "n8-c320-64x64-k320-3x3-s2": (128, 128, 2, False, 20, 3),  # whole (21:48)
    "n8-c640-32x32-k640-3x3-s2": (128, 128, 2, True, 20, 5),  # square
    "n32-c512-14x14-k512-3x3-s2": (128, 128, 1, True, 16, 4),  # square1
}


@pytest.mark.parametrize("name", sorted(ADOPTED))
def test_the_chooser_takes_the_plans_measured_faster(conv_models, name):
    """The launcher's own choice on each measured case is the plan that won, a standard
    conv_dgrad_sm90 build."""
    plan = _plan(_by_name()[name])
    assert _signature(plan) == ADOPTED[name]
    spec, params = conv_models[-1]
    standard = [dict(q) for q in DGRAD_SPEC.standard_params()]
    assert spec == DGRAD_SPEC.name and params in standard


def test_every_suite_case_the_refit_moves_is_measured_or_a_variant(conv_models, monkeypatch):
    """Over the bench and check cases (but the classes the 21:48 refit added): the cases whose
    plan the 16:45 refit moves are the four measured ones, the `was` cases and the small check
    cases (their split only)."""
    cases = _by_name()
    _at_1645(monkeypatch)
    after = {name: _plan(case) for name, case in cases.items()}
    _before_refit(monkeypatch)
    before = {name: _plan(case) for name, case in cases.items()}
    moved = {n for n in cases if after[n] is not None and after[n] != before[n]}
    bench = {case.name for case in S.BENCH_CASES} - {case.name for case in S.MOVED_PARK}
    assert moved & bench == set(ADOPTED) | set(S.CANDIDATES)
    for name in moved - bench:  # a check case: its tile kept, its parts recut
        assert after[name].config.tile_n == before[name].config.tile_n, name


@pytest.mark.parametrize("name", sorted(S.CANDIDATES))
def test_was_is_the_plan_before_the_refit(conv_models, monkeypatch, name):
    """Each `was` variant recounts as the old chooser's plan of its case, which today's
    chooser no longer takes."""
    case = _by_name()[name]
    now = _plan(case)
    was = _plan(case, S.CANDIDATES[name]["was"])
    _before_refit(monkeypatch)
    assert was == _plan(case) != now


def test_variants_only_on_their_cases():
    cases = _by_name()
    assert set(S.CANDIDATES) <= {case.name for case in S.BENCH_CASES}
    for name, case in cases.items():
        # the 1x1s' (tests/test_conv_as_gemm.py), the 18:58 worst cases' (test_conv_worst_...),
        # the 21:48 park refit's (test_conv_dgrad_park.py)
        plans = set(S.variants(case)) - {"as_gemm"} - set(S.WORST.get(name, {}))
        plans -= set(S.PARK.get(name, {})) | {"no_pdl", "pdl_late"}  # PDL's measures
        assert plans == set(S.CANDIDATES.get(name, {})), name
    assert not any(name in S.CANDIDATES for name in ADOPTED)


def _run(p: dict, plan) -> torch.Tensor:
    """The variant's runner on params `p` (fp64 on the CPU) against the reference."""
    case = L.conv_case("dgrad", p["n"], p["c"], p["k"], p["spatial"], p["kernel"][0],
                       p["stride"][0])  # fmt: skip
    assert case.params["padding"] == p["padding"]
    inputs = L.make_inputs(case, F64, torch.device("cpu"), torch.Generator().manual_seed(0))
    out = torch.full(L.shapes(case.params)["x"], float("nan"), dtype=F64)
    out = out.contiguous(memory_format=torch.channels_last)
    dx = S.run_plan(plan, inputs, out)
    want = L.reference(inputs).to(F64)
    # the reference comes back in fp32
    assert dx is out and torch.allclose(dx, want, rtol=1e-5, atol=1e-4), (dx - want).abs().max()
    return dx


@pytest.mark.parametrize(
    "name, variant", [(c, v) for c, vs in S.CANDIDATES.items() for v in vs]
)  # fmt: skip
def test_every_variant_computes_the_gradient(conv_models, name, variant):
    """Each variant's runner on its case's filter, stride, padding and channels (the same
    k-tiles per phase, so the same parts) at batch 1 on a 6x6 map: dx the reference's."""
    p = dict(_by_name()[name].params, n=1, spatial=(6, 6))
    _run(p, S.CANDIDATES[name][variant])


@pytest.mark.parametrize("name", sorted(ADOPTED))
def test_the_chosen_plan_computes_the_gradient(conv_models, name):
    """The standard path (no plan handed over) on each measured case's filter, stride and
    channels at batch 1 on a 6x6 map: dx the reference's."""
    p = dict(_by_name()[name].params, n=1, spatial=(6, 6))
    _run(p, None)
