"""The fused data gradient's plan of a conv_dgrad suite case, as the launcher chooses it
(shared by tests/test_conv_dgrad_candidates.py and tests/test_conv_dgrad_park.py)."""

from __future__ import annotations

import torch

from forgekernel.bench.suites import conv_dgrad as S
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import launch
from forgekernel.ops import conv as op


def by_name():
    return {case.name: case for case in S.BENCH_CASES + S.CHECK_CASES}


def plan(case, config=None):
    """The launcher's FusedPlan for `case`'s real problem (None where it does not fuse)."""
    p = case.params
    g = op._geometry_of(p["stride"], p["padding"], p["padding"], p["dilation"], p["kernel"])
    input_dhw, output_dhw = (1, *p["spatial"]), (1, *L.output_spatial(p))
    if not launch._fuses(g, input_dhw, output_dhw):
        return None
    fused = launch.fused_dgrad(g, input_dhw, output_dhw)
    dx_ndhw = (p["n"], *input_dhw)
    args = (torch.bfloat16, dx_ndhw, p["k"], p["c"], fused, fused.walk, None, config)
    return launch._choose_fused(*args)[2]


def signature(plan):
    """(tile_m, tile_n, cluster_m, split, k-tiles per part, N tiles)."""
    cfg = plan.config
    return cfg.tile_m, cfg.tile_n, cfg.cluster_m, plan.split, plan.per_split, plan.tiles_n
