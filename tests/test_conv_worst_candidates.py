"""The bench variants of the forward's and data gradient's worst cases after 18:58
(bench/suites/conv_fwd.py `CANDIDATES`, conv_dgrad.py `WORST`; docs/conv/NOTES.md, "The
forward's and data gradient's worst cases after 18:58"): each sits on its case only, differs
from the launcher's own plan, recounts at the case's real size as the section's table says,
asks for a standard build only, and computes the case (the CPU models of the compiled
functions, fp64) on a small problem of its case's filter, stride and channels (the same
k-tiles per phase, so the same parts)."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.suites import conv_dgrad, conv_fwd
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, SPEC, launch
from forgekernel.ops import conv as op

F64 = torch.float64
FWD, DGRAD = conv_fwd.CANDIDATES, conv_dgrad.WORST
ALL = [(conv_fwd, c, v) for c, vs in FWD.items() for v in vs] + [
    (conv_dgrad, c, v) for c, vs in DGRAD.items() for v in vs
]


def _case(suite, name):
    return next(c for c in suite.BENCH_CASES if c.name == name)


def _candidates(suite) -> dict:
    return FWD if suite is conv_fwd else DGRAD


def _standard(spec) -> list[dict]:
    return [dict(p) for p in spec.standard_params()]


def _phase_plans(case, config) -> list:
    """The launcher's SplitPlan of each phase of `case`'s real problem (forward: one), and the
    compile key asked for, without running anything."""
    p = case.params
    g = op._geometry_of(p["stride"], p["padding"], p["padding"], p["dilation"], p["kernel"])
    bf = torch.bfloat16
    if p["op"] == "fwd":
        m = p["n"] * L.output_spatial(p)[0] * L.output_spatial(p)[1]
        strided = g.stride != (1, 1, 1)
        pixels = None if strided else (p["n"], 1, *L.output_spatial(p))
        taps = p["kernel"][0] * p["kernel"][1]
        key = (bf, False, m, p["k"], p["c"], taps, None, config, False, pixels, True, strided)
        return [launch._choose(*key)]
    input_dhw, output_dhw = (1, *p["spatial"]), (1, *L.output_spatial(p))
    phases, _ = launch._phases(g, input_dhw, output_dhw)
    plans = []
    for phase in phases:
        taps = 1
        for t in phase.taps:
            taps *= len(t)
        dhw = [len(range(a, size, s)) for a, size, s in zip(phase.offset, input_dhw, g.stride)]
        m = p["n"] * dhw[0] * dhw[1] * dhw[2]
        rows = len(phases) == 1  # a strided phase's view of dx is not contiguous
        key = (bf, False, m, p["c"], p["k"], taps, None, config, True, (p["n"], *dhw), rows,
               False)  # fmt: skip
        plans.append(launch._choose(*key))
    return plans


def _fused_plan(case, config=None):
    p = case.params
    g = op._geometry_of(p["stride"], p["padding"], p["padding"], p["dilation"], p["kernel"])
    input_dhw, output_dhw = (1, *p["spatial"]), (1, *L.output_spatial(p))
    fused = launch.fused_dgrad(g, input_dhw, output_dhw)
    dx_ndhw = (p["n"], *input_dhw)
    args = (torch.bfloat16, dx_ndhw, p["k"], p["c"], fused, fused.walk, None, config)
    return launch._choose_fused(*args)


def _split(plan):
    """(tile_m, tile_n, cluster_m, split, k-tiles per part, parts, tiles, rect)."""
    c = plan.config
    return (c.tile_m, c.tile_n, c.cluster_m, c.split, plan.per_split, plan.parts, plan.tiles,
            plan.rect)  # fmt: skip


# (suite, case) -> the launcher's own plan (what the path takes at 18:58) and each variant's,
# recounted at the real size: (tile_m, tile_n, cluster_m, split, per part, parts, tiles, rect)
# per phase; the fused launches (tile_m, tile_n, cluster_m, split, per part, N tiles)
M1568 = {
    None: [(128, 128, 2, True, 36, 2, 56, 0)],
    "small5": [(128, 128, 1, True, 15, 5, 52, 0)],
    "small2": [(128, 128, 1, True, 36, 2, 52, 0)],
}
PLANS = {
    (conv_fwd, "n32-c512-7x7-k512-3x3"): M1568,
    (conv_fwd, "n32-c512-14x14-k512-3x3-s2"): M1568,
    (conv_dgrad, "n32-c512-7x7-k512-3x3"): M1568,
    # C 320 at 64 x 64's `phases` and `whole` were decided at 21:48 (`whole` is the standard
    # since the park weight refit; its old plan is conv_dgrad.PARK's `was`)
}


def test_the_variants_sit_on_their_cases_only():
    """Every bench and check case carries exactly its own candidates (besides the stem's and
    `as_gemm`); the tables below cover every candidate."""
    for suite, table in ((conv_fwd, FWD), (conv_dgrad, DGRAD)):
        assert set(table) <= {c.name for c in suite.BENCH_CASES}
        for case in suite.BENCH_CASES + suite.CHECK_CASES:
            got = set(suite.variants(case)) - {
                "as_gemm",
                "stem_copy",
                "im2col",
                "was",
                "launcher",
                "no_pdl",
                "pdl_late",
            }
            assert got == set(table.get(case.name, {})), case.name
    assert {(s, c, v) for s, c, v in ALL} == {
        (s, c, v) for (s, c), vs in PLANS.items() for v in vs if v is not None
    }


def _plans_of(suite, case, config):
    fused = case.params["op"] == "dgrad" and case.params["stride"] != (1, 1)
    if fused and not isinstance(config, launch.SplitPlan):
        plan = _fused_plan(case, config)[2]
        c = plan.config
        return (c.tile_m, c.tile_n, c.cluster_m, plan.split, plan.per_split, plan.tiles_n)
    return [_split(got[2]) for got in _phase_plans(case, config)]


@pytest.mark.parametrize("suite, name, variant", ALL, ids=lambda v: getattr(v, "__name__", v))
def test_each_variant_recounts_as_the_table_and_is_a_standard_build(
    conv_models, suite, name, variant
):
    """At the case's real size: the launcher's own plan and the variant's as PLANS says, the
    two different, and every compiled function asked for a standard build."""
    case = _case(suite, name)
    table = PLANS[(suite, name)]
    plan = _candidates(suite)[name][variant]
    assert _plans_of(suite, case, None) == table[None]
    conv_models.clear()
    assert _plans_of(suite, case, plan) == table[variant] != table[None]
    standard = {DGRAD_SPEC.name: _standard(DGRAD_SPEC), SPEC.name: _standard(SPEC)}
    assert conv_models and all(params in standard[spec] for spec, params in conv_models)


@pytest.mark.parametrize("suite, name, variant", ALL, ids=lambda v: getattr(v, "__name__", v))
def test_each_variant_computes_the_case(conv_models, suite, name, variant):
    """The variant's runner on its case's filter, stride, padding and channels at batch 1 on
    a 6 x 6 map (the forward's: 6 x 6 outputs): the result the reference's, from the
    variant's tile."""
    p = _case(suite, name).params
    spatial = (6 * p["stride"][0], 6 * p["stride"][1]) if p["op"] == "fwd" else (6, 6)
    case = L.conv_case(p["op"], 1, p["c"], p["k"], spatial, p["kernel"][0], p["stride"][0])
    inputs = L.make_inputs(case, F64, torch.device("cpu"), torch.Generator().manual_seed(0))
    out = torch.full(L.shapes(case.params)["y" if p["op"] == "fwd" else "x"], float("nan"),
                     dtype=F64).contiguous(memory_format=torch.channels_last)  # fmt: skip
    got = suite.variants(_case(suite, name))[variant](inputs, out)
    want = L.reference(inputs).to(F64)  # the reference comes back in fp32
    assert got is out and torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()
    cfg = _candidates(suite)[name][variant].config
    tile = {f: getattr(cfg, f) for f in ("tile_n", "cluster_m", "split")}
    # its tile ran
    assert conv_models and all({f: key[f] for f in tile} == tile for _, key in conv_models)
