"""The conv_dgrad bench's candidate plans (bench/suites/conv_dgrad.py `CANDIDATES`; docs/conv/
NOTES.md, "The data gradient's worst cases after 14:19"): variants only on the cases they were
made for, each plan recounted by the launcher as intended on its case's real problem, every
compiled function it asks for a standard build (no candidate build, no source moved), and each
variant's runner computing the gradient (the CPU models of the compiled functions, fp64) on a
small problem of its case's filter, stride and channels."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from forgekernel.bench.suites import conv_dgrad as S
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, SPEC, emulate, launch
from forgekernel.kernels.conv.sm90.config import LARGE, SMALL, SQUARE, SplitPlan
from forgekernel.kernels.conv.sm90.dgrad_config import FusedPlan, fused_config
from forgekernel.ops import conv as op

F64 = torch.float64
WORST = "n32-c1024-14x14-k2048-1x1-s2"


@pytest.fixture
def model(monkeypatch):
    """The launcher's compiled functions replaced by the CPU models; every key asked for kept
    as (spec name, params)."""
    keys = []
    seeds = iter(range(10_000))

    def stand_in(spec, params):
        keys.append((spec.name, dict(params)))
        return emulate.stand_in(spec, params, next(seeds))

    monkeypatch.setattr(launch, "get_kernel", stand_in)
    launch.clear_plans()
    yield keys
    launch.clear_plans()


def _by_name():
    return {case.name: case for case in S.BENCH_CASES + S.CHECK_CASES}


def test_variants_only_on_their_cases():
    cases = _by_name()
    assert set(S.CANDIDATES) <= {case.name for case in S.BENCH_CASES}
    for name, case in cases.items():
        assert set(S.variants(case)) == set(S.CANDIDATES.get(name, {})), name
    assert set(S.variants(cases[WORST])) == {"whole", "square", "phase_rows"}
    assert S.suite().variants_for(cases[WORST]).keys() == {"whole", "square", "phase_rows"}


def _fused_problem(case):
    """(the FusedDgrad, dx's (N, D, H, W)) of `case`'s fused launch."""
    p = case.params
    g = op._geometry_of(p["stride"], p["padding"], p["padding"], p["dilation"], p["kernel"])
    input_dhw, output_dhw = (1, *p["spatial"]), (1, *L.output_spatial(p))
    return launch.fused_dgrad(g, input_dhw, output_dhw), (p["n"], *input_dhw)


# case -> variant -> (tile (m, n, cluster_m), k-tiles per part, parts per phase, N tiles)
INTENDED = {
    WORST: {
        "whole": ((128, 256, 2), 32, (1, 1, 1, 1), 4),
        "square": ((128, 128, 2), 11, (3, 1, 1, 1), 8),
    },
    "n8-c320-64x64-k320-3x3-s2": {
        "whole": ((128, 256, 2), 20, (1, 1, 1, 1), 2),
        "square": ((128, 128, 2), 10, (2, 1, 1, 1), 3),
    },
    "n8-c640-32x32-k640-3x3-s2": {"square": ((128, 128, 2), 20, (2, 1, 1, 1), 5)},
    "n32-c512-14x14-k512-3x3-s2": {"square1": ((128, 128, 1), 16, (2, 1, 1, 1), 4)},
}


@pytest.mark.parametrize(
    "name, variant", [(c, v) for c, vs in INTENDED.items() for v in vs]
)  # fmt: skip
def test_a_fused_candidate_recounts_as_intended(model, name, variant):
    """The launcher's plan for the case's real problem: the tile, k-tiles per part, each
    phase's parts and N tiles intended, split exactly where a phase has parts, and its
    compiled function a standard conv_dgrad_sm90 build (bf16)."""
    case = _by_name()[name]
    fused, dx_ndhw = _fused_problem(case)
    kp, cp = case.params["k"], case.params["c"]
    given = S.CANDIDATES[name][variant]
    _, _, plan, _ = launch._choose_fused(
        torch.bfloat16, dx_ndhw, kp, cp, fused, fused.walk, None, given
    )
    (tm, tn, cm), per, parts, tiles_n = INTENDED[name][variant]
    cfg = plan.config
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == (tm, tn, cm, 1)
    k_tiles = tuple(-(-kp // 64) * fused.tap_count(phase) for phase in fused.order)
    assert plan.per_split == per and plan.tiles_n == tiles_n
    assert tuple(max(1, -(-k // per)) for k in k_tiles) == parts
    assert plan.split == cfg.split == (max(parts) > 1)
    spec, params = model[-1]
    standard = [dict(q) for q in DGRAD_SPEC.standard_params()]
    assert spec == DGRAD_SPEC.name and {**params, "dtype": "bfloat16"} in standard


def test_phase_rows_runs_the_forward_dgrad_mode_on_im2col_rows(model):
    """`phase_rows` on the 1x1 stride 2: the per-phase path (dx zeroed, one launch), the
    forward kernel's data-gradient mode on the im2col walk (rect 0), 128x128 c2x1 unsplit:
    a standard conv_fprop_sm90 build."""
    case = _by_name()[WORST]
    p = dict(case.params, n=1, spatial=(6, 6))
    dx = _run(p, S.CANDIDATES[WORST]["phase_rows"])
    assert dx is not None
    ((spec, params),) = model
    assert spec == SPEC.name
    assert (params["dgrad"], params["rect"], params["split"]) == (True, 0, False)
    assert (params["tile_n"], params["cluster_m"]) == (128, 2)
    standard = [dict(q) for q in SPEC.standard_params()]
    assert {**params, "dtype": "bfloat16"} in standard


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
def test_every_variant_computes_the_gradient(model, name, variant):
    """Each variant's runner on its case's filter, stride, padding and channels (the same
    k-tiles per phase, so the same parts) at batch 1 on a 6x6 map: dx the reference's."""
    p = dict(_by_name()[name].params, n=1, spatial=(6, 6))
    _run(p, S.CANDIDATES[name][variant])


def test_the_candidates_are_the_plans_named():
    """The table's plans, spelled out (a FusedPlan carries only its tile and k-tiles per part:
    the launcher recounts the rest)."""
    plans = S.CANDIDATES[WORST]
    assert plans["whole"] == FusedPlan(fused_config(LARGE), 32, 0, 0, 0, 0)
    assert plans["square"] == FusedPlan(fused_config(replace(SQUARE, split=True)), 11, 0, 0, 0, 0)
    assert plans["phase_rows"] == SplitPlan(SQUARE, 32, 1, 112)
    assert S.CANDIDATES["n32-c512-14x14-k512-3x3-s2"]["square1"].config == fused_config(
        replace(SMALL, split=True)
    )
