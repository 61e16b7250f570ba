"""The fused strided data gradient (kernels/conv/sm90/dgrad_kernel.py) on the CPU, in fp64: the
shared walk (geometry.fused_dgrad) against the per-phase split it replaces, its packed tables
decoded as the kernel decodes them, the schedule's (phase, part, M tile) walk and the
row-addressed epilogue replayed in torch (every entry of dX written once, nothing else), the
CPU model of the kernel (emulate.fused_run) through the launcher against autograd on odd
sizes, every kernel size 1 to 7, dilation, asymmetric padding, 3-D and mixed strides, split
phases run in random orders with 2x1 clusters, and the chooser."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.kernels.conv.sm90.config import MAX_WORKSPACE, ConvConfig
from forgekernel.kernels.conv.sm90.dgrad_config import (
    FUSED_BASE,
    FUSED_CONFIGS,
    FusedPlan,
    choose_fused,
    fused_config,
    fused_cost,
    fused_layout,
    fused_plan,
)
from forgekernel.kernels.conv.sm90.geometry import (
    Geometry,
    dgrad_phases,
    fused_dgrad,
    fused_dgrad_problem,
)

F64 = torch.float64
TILES_64 = ConvConfig(tile_m=64, tile_n=64)


@pytest.fixture
def model(monkeypatch):
    """The launcher's compiled functions replaced by the CPU models, the fused kernel's units
    in a fresh random order on every launch."""
    seeds = iter(range(10_000))
    monkeypatch.setattr(
        launch, "get_kernel", lambda spec, params: emulate.stand_in(spec, params, next(seeds))
    )
    launch.clear_plans()
    yield
    launch.clear_plans()


def _geometry(f, pad, stride, dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), tuple(stride), tuple(dil))


def _torch_conv(x, w, g: Geometry):
    pad = [v for d in (2, 1, 0) for v in (g.pad_lo[d], g.pad_hi[d])]
    return F.conv3d(F.pad(x, pad), w, None, stride=g.stride, dilation=g.dilation)


def _cl5(t):
    return t.permute(0, 2, 3, 4, 1)


def _dgrad_agrees(n, c, k, size, g: Geometry, config=None) -> None:
    """The launcher's data gradient (NaN-poisoned dx) against autograd's."""
    x = torch.randn(n, c, *size, dtype=F64, requires_grad=True)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    y = _torch_conv(x, w, g)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
    launch.dgrad(_cl5(dy), _cl5(w), dx, g, config)
    assert torch.allclose(dx, _cl5(want), rtol=1e-6, atol=1e-5)


def _random_strided(count: int, seed: int = 0):
    """(input DHW, Geometry) with strides 1 or 2 (not all 1), kernels 1..7, dilation 1..2,
    padding 0..3 (asymmetric sometimes); 2-D half the time."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        flat = rng.random() < 0.5
        f = [1 if flat and i == 0 else rng.randint(1, 7 if i else 3) for i in range(3)]
        dil = [1 if f[i] == 1 else rng.randint(1, 2) for i in range(3)]
        lo = [rng.randint(0, min(3, dil[i] * (f[i] - 1))) for i in range(3)]
        hi = [v if rng.random() < 0.7 else rng.randint(0, 3) for v in lo]
        stride = [1 if flat and i == 0 else rng.randint(1, 2) for i in range(3)]
        size = [1 if flat and i == 0 else rng.randint(1, 12) for i in range(3)]
        g = _geometry(f, lo, stride, dil, hi)
        out_dhw = g.output(tuple(size))
        if min(out_dhw) > 0 and max(stride) == 2 and g.descriptor_problem() is None:
            out.append((tuple(size), g))
    return out


# ---------------------------------------------------------------- the walk
@pytest.mark.parametrize("size, g", _random_strided(40))
def test_the_walk_holds_every_phase_with_its_taps_reversed(size, g):
    """Per phase and dim the fused walk's taps are the per-phase split's, reversed: W's tap
    w_tap - i w_step is the phase's (count - 1 - i)-th, and walk offset offset + i offset_step
    less the walk's padding below is where the phase's own forward convolution puts that tap
    (its i x dilation less its padding below); the walk visits the longest phase's extent."""
    out = g.output(size)
    assert fused_dgrad_problem(g, size, out) is None
    fused = fused_dgrad(g, size, out)
    for phase in dgrad_phases(g, size, out):
        for dim, (t, taps) in enumerate(zip(fused.phase_taps(phase.offset), phase.taps)):
            assert t.count == len(taps)
            w_taps = [t.w_tap - i * fused.w_step[dim] for i in range(t.count)]
            assert w_taps == list(taps[::-1])
            if not taps:
                continue
            walk = [t.offset + i * fused.offset_step[dim] - fused.walk.pad_lo[dim]
                    for i in range(t.count)]  # fmt: skip
            own = [i * phase.fprop.dilation[dim] - phase.fprop.pad_lo[dim] for i in range(t.count)]
            assert walk == own
            assert max(walk) + fused.walk.pad_lo[dim] < fused.walk.filter[dim]
    extents = tuple(-(-s // st) for s, st in zip(size, g.stride))
    assert fused.walk.output(tuple(out)) == extents
    assert sorted(fused.order) == sorted(p.offset for p in dgrad_phases(g, size, out))
    counts = [fused.tap_count(p) for p in fused.order]
    assert counts == sorted(counts, reverse=True)  # the longest first, the empty last


def test_the_packed_tables_decode_as_the_kernel_reads_them():
    """7x7 stride 2 over an odd 3-D input (eight phases, every field in use): kernel_args
    decoded with the kernel's shifts and masks give back the plan."""
    g = _geometry((3, 7, 5), (1, 3, 2), (2, 2, 2), (1, 2, 1))
    size = (7, 13, 11)
    fused = fused_dgrad(g, size, g.output(size))
    t = emulate.unpack_fused(fused.kernel_args())
    assert t["walk"] == fused.walk
    assert t["stride"] == list(fused.stride) and t["w_step"] == list(fused.w_step)
    assert t["offset_step"] == list(fused.offset_step)
    assert t["phases"] == list(fused.order)
    for phase in fused.order:
        want = [(p.count, p.offset, p.w_tap) for p in fused.phase_taps(phase)]
        assert t["taps"][phase] == want
    assert all(0 <= a < 2**31 for a in fused.kernel_args())  # Int32 arguments


def test_strides_past_2_or_all_1_are_not_fused():
    size = (1, 9, 9)
    for stride, fused in (((1, 2, 2), True), ((1, 1, 2), True), ((1, 1, 1), False),
                          ((1, 3, 3), False), ((1, 2, 3), False)):  # fmt: skip
        g = _geometry((1, 3, 3), (0, 1, 1), stride)
        assert (fused_dgrad_problem(g, size, g.output(size)) is None) == fused


# ---------------------------------------------------------------- the schedule and the rows
@pytest.mark.parametrize("cfg", [TILES_64, replace(TILES_64, cluster_m=2), FUSED_BASE[0]])
@pytest.mark.parametrize("per_split", [1, 3, 1000])
def test_every_entry_of_dx_is_written_once(cfg, per_split):
    """The schedule's M axis (slot, part, M tile) and the row decode replayed for 3x3 stride 2
    over an odd 2-D input and 1x1x1 stride 2 in 3-D (seven phases of no tap): the last part of
    each output tile writes its rows, and every entry of dX is written exactly once."""
    for size, g in (((1, 13, 11), _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))),
                    ((5, 7, 6), _geometry((1, 1, 1), (0, 0, 0), (2, 2, 2)))):  # fmt: skip
        fused = fused_dgrad(g, size, g.output(size))
        t = emulate.unpack_fused(fused.kernel_args())
        n_img, c, c_blocks = 3, 136, 2
        j = tuple(-(-s // st) for s, st in zip(size, fused.stride))
        m_rows = n_img * math.prod(j)
        slot_tiles, slots = emulate.fused_units(cfg, m_rows, c_blocks, per_split, t)
        k_tiles = tuple(k for _, k, _, _ in slots)
        assert (slot_tiles, tuple(s[2] for s in slots)) == fused_layout(
            cfg, m_rows, c, k_tiles, per_split
        )[:2]
        writes = torch.zeros(n_img, *size, c, dtype=torch.int32)
        start = 0
        for phase, k, parts, first in slots:
            assert k == c_blocks * fused.tap_count(phase) and first == start
            start += parts * slot_tiles
            for local in range(slot_tiles):
                for tile_n in range(-(-c // cfg.tile_n)):
                    coords, valid = emulate._phase_rows(
                        writes.shape, local * cfg.tile_m, cfg.tile_m, j, phase, fused.stride
                    )
                    rows = valid.nonzero().squeeze(1)
                    n, d, h, w = (crd[rows] for crd in coords)
                    c0 = tile_n * cfg.tile_n
                    writes[n, d, h, w, c0 : c0 + cfg.tile_n] += 1
        assert bool((writes == 1).all())


@pytest.mark.parametrize(
    "size, f, pad, stride, dil",
    [
        ((1, 13, 11), (1, 3, 3), (0, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((1, 12, 12), (1, 3, 3), (0, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((1, 15, 15), (1, 1, 1), (0, 0, 0), (1, 2, 2), (1, 1, 1)),
        ((1, 10, 9), (1, 2, 2), (0, 0, 0), (1, 2, 2), (1, 1, 1)),
        ((1, 9, 8), (1, 2, 2), (0, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((1, 17, 15), (1, 4, 4), (0, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((1, 11, 12), (1, 5, 5), (0, 2, 2), (1, 2, 2), (1, 1, 1)),
        ((1, 13, 11), (1, 7, 7), (0, 3, 3), (1, 2, 2), (1, 1, 1)),
        ((1, 14, 14), (1, 3, 3), (0, 2, 2), (1, 2, 2), (1, 2, 2)),
        ((1, 9, 8), (1, 3, 3), (0, 1, 1), (1, 2, 1), (1, 1, 1)),
        ((5, 6, 7), (3, 3, 3), (1, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((5, 7, 6), (3, 3, 3), (1, 1, 1), (2, 2, 2), (1, 1, 1)),
        ((5, 7, 6), (1, 1, 1), (0, 0, 0), (2, 2, 2), (1, 1, 1)),
        ((4, 9, 8), (2, 4, 3), (0, 1, 1), (2, 2, 2), (1, 1, 2)),
    ],
)
@pytest.mark.parametrize("cfg", [TILES_64, replace(TILES_64, cluster_m=2, split=True)])
def test_the_fused_kernel_model_is_the_gradient(model, size, f, pad, stride, dil, cfg):
    """Odd sizes, C = 24 output channels (a ragged N tile) and K = 72 reduction channels (a
    part-filled second block); the split variant with FORCED_PARTS parts per phase, its units in
    a random order over 2x1 clusters."""
    _dgrad_agrees(2, 24, 72, size, _geometry(f, pad, stride, dil), cfg)


@pytest.mark.parametrize("size, g", _random_strided(25, seed=1))
def test_random_strided_gradients(model, size, g):
    """Random geometries, the chooser's plan (tiles of 128 rows: one or a few M tiles)."""
    _dgrad_agrees(1, 16, 24, size, g)


@pytest.mark.parametrize("per_split", [1, 2, 5])
def test_split_phases_in_any_order_sum_the_same(model, per_split):
    """Split phases summed in part order whatever order the units ran in: two launches (fresh
    random orders) give the same bits (the model refuses flags left set: the second launch
    starts from zero ones)."""
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    dy = torch.randn(2, 1, 6, 5, 136, dtype=F64)
    w = torch.randn(136, 1, 3, 3, 40, dtype=F64)
    plan = FusedPlan(replace(TILES_64, split=True, cluster_m=2), per_split, 0, 0, 0, 0)
    runs = []
    for _ in range(2):
        dx = torch.full((2, 1, 11, 10, 40), float("nan"), dtype=F64)
        launch.dgrad(dy, w, dx, g, plan)
        runs.append(dx)
    assert torch.equal(runs[0], runs[1])
    assert not torch.isnan(runs[0]).any()


def test_dx_a_strided_view_is_written_in_place_and_nothing_else(model):
    """dx the first 40 of 56 channels of a buffer (rows of 56): written through its strides,
    the other channels untouched."""
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    x = torch.randn(1, 40, 1, 9, 7, dtype=F64, requires_grad=True)
    w = torch.randn(24, 40, 1, 3, 3, dtype=F64)
    y = _torch_conv(x, w, g)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    host = torch.full((1, 1, 9, 7, 56), 7.0, dtype=F64)
    launch.dgrad(_cl5(dy), _cl5(w), host[..., :40], g)
    assert torch.allclose(host[..., :40], _cl5(want), rtol=1e-6, atol=1e-5)
    assert bool((host[..., 40:] == 7.0).all())


def test_a_mutated_walk_fails(model, monkeypatch):
    """The model reads what the tables say: W's taps read forwards (w_step negated) give a
    wrong gradient, so the tests above would catch a kernel that did."""
    real = launch.fused_dgrad

    def forwards(*args):
        plan = real(*args)
        return dataclasses.replace(plan, w_step=tuple(-s for s in plan.w_step))

    monkeypatch.setattr(launch, "fused_dgrad", forwards)
    with pytest.raises(AssertionError):
        _dgrad_agrees(1, 16, 24, (1, 9, 9), _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2)))


# ---------------------------------------------------------------- the chooser
@pytest.mark.parametrize(
    "m, n, k_tiles",
    [
        (100352, 256, (32, 16, 16, 8)),  # the point: N32 C256 112x112 K512 3x3
        (25088, 128, (8, 4, 4, 2)),
        (25088, 256, (16, 0, 0, 0)),  # 1x1: three phases of no tap
        (1568, 512, (32, 16, 16, 8)),
        (512, 1280, (80, 40, 40, 20)),
        (1, 8, (1, 0, 0, 0)),
        (40, 64, (8, 4, 4, 2, 4, 2, 2, 1)),
    ],
)
def test_the_fused_chooser(m, n, k_tiles):
    """A fused tile with the split variant exactly when some phase is cut into parts, the
    workspace within bounds, every unit at most per_split k-tiles, and a plan never costlier
    than the unsplit one of its tile."""
    plan = choose_fused(m, n, k_tiles, 132)
    base = replace(plan.config, split=False)
    assert base in FUSED_BASE and plan.config in FUSED_CONFIGS
    assert plan.config.split == plan.split
    assert plan.workspace_floats <= MAX_WORKSPACE
    assert plan == fused_plan(plan.config, m, n, k_tiles, plan.per_split)
    cost = fused_cost(base, m, n, k_tiles, plan.per_split, 132)
    assert cost <= fused_cost(base, m, n, k_tiles, max(max(k_tiles), 1), 132) + 1e-9


def test_a_forward_configuration_names_its_fused_variant():
    for cfg in FUSED_BASE:
        assert fused_config(replace(cfg, epi_n=32, epi_stages=4)) == cfg


def test_a_fused_plan_for_a_gradient_that_does_not_fuse_is_refused(model):
    """A FusedPlan handed to a data gradient the fused kernel does not take (stride 3: a launch
    per phase) is a ValueError naming why, not an AttributeError from the per-phase chooser."""
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 3, 3))
    dy = torch.randn(1, 1, 3, 3, 16, dtype=F64)
    w = torch.randn(16, 1, 3, 3, 8, dtype=F64)
    dx = torch.zeros(1, 1, 9, 9, 8, dtype=F64)
    with pytest.raises(ValueError, match="stride"):
        launch.dgrad(dy, w, dx, g, FusedPlan(FUSED_BASE[0], 1, 0, 0, 0, 0))
