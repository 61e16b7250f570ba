"""The convolution leaf's host side on the CPU, in fp64: geometry (output extents, the im2col
descriptor's corners and limits, the kernel's argument order), the CPU model of the compiled
forward kernel (kernels/conv/sm90/emulate.py: the im2col TMA walk from the corners, the k-tile
order, the tile grid) against torch's convolution, the launcher (channel padding, scratch
outputs, the data gradient by output phase) with the model as the
compiled function, and the tile chooser."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.kernels.conv.sm90.config import (
    MAX_PARTS,
    MAX_WORKSPACE,
    NARROW,
    STANDARD_CONFIGS,
    ConvConfig,
    SplitPlan,
    choose_config,
    choose_plan,
    occupancy,
    params_for,
    split_cost,
    split_tiles,
)
from forgekernel.kernels.conv.sm90.geometry import Geometry, dgrad_geometry_problem, dgrad_phases
from forgekernel.runtime import scratch

F64 = torch.float64
SMALL_TILES = ConvConfig(tile_m=64, tile_n=64)


@pytest.fixture
def model_kernel(monkeypatch):
    """The launcher's compiled functions replaced by the CPU models; the compile keys asked
    for are recorded."""
    keys = []

    def get_kernel(spec, params):
        keys.append(dict(params))
        return emulate.stand_in(spec, params)

    launch._plans.clear()
    launch._wgrad_plans.clear()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    yield keys
    launch._plans.clear()
    launch._wgrad_plans.clear()


def _geometry(f, pad, stride=(1, 1, 1), dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), tuple(stride), tuple(dil))


def _random_geometries(count: int, seed: int = 0):
    """(input DHW, Geometry) with kernels 1..7, stride 1..3, dilation 1..2, padding 0..3 (up to
    the kernel's reach), asymmetric sometimes; D = T = 1 (2-D) a third of the time."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        flat = rng.random() < 0.35
        f = [1 if flat and i == 0 else rng.randint(1, 7 if i else 3) for i in range(3)]
        dil = [1 if f[i] == 1 else rng.randint(1, 2) for i in range(3)]
        lo = [rng.randint(0, min(3, dil[i] * (f[i] - 1))) for i in range(3)]
        hi = [v if rng.random() < 0.7 else rng.randint(0, 3) for v in lo]
        stride = [1 if flat and i == 0 else rng.randint(1, 3) for i in range(3)]
        size = [1 if flat and i == 0 else rng.randint(1, 12) for i in range(3)]
        g = _geometry(f, lo, stride, dil, hi)
        if all(o > 0 for o in g.output(tuple(size))) and g.descriptor_problem() is None:
            out.append((tuple(size), g))
    return out


def _torch_conv(x, w, bias, g: Geometry):
    """torch's conv3d of (N, C, D, H, W) with `g`'s (possibly asymmetric) padding."""
    pad = [v for d in (2, 1, 0) for v in (g.pad_lo[d], g.pad_hi[d])]
    return F.conv3d(F.pad(x, pad), w, bias, stride=g.stride, dilation=g.dilation)


def _cl5(t):
    return t.permute(0, 2, 3, 4, 1)


def _close(got, want) -> bool:
    """Equal up to the fp32 rounding of a split's parked partials (the launcher may split a
    small problem's reduction; an indexing error is O(1))."""
    return torch.allclose(got, want, rtol=1e-6, atol=1e-5)


def _fprop_and_wgrad_agree(x, w, bias, g: Geometry) -> None:
    """The launcher's forward and weight gradient (NaN-poisoned outputs) against torch's."""
    want = _torch_conv(x, w, bias, g)
    y = torch.full(_cl5(want).shape, float("nan"), dtype=F64)
    launch.fprop(_cl5(x), _cl5(w.detach()), bias, y, g)
    assert _close(y, _cl5(want))
    dy = torch.randn_like(want)
    (dw_want,) = torch.autograd.grad(want, w, dy)
    dw = torch.full(_cl5(w).shape, float("nan"), dtype=F64)
    launch.wgrad(_cl5(dy), _cl5(x), dw, g)
    assert _close(dw, _cl5(dw_want))


# ---------------------------------------------------------------- geometry
@pytest.mark.parametrize("size, g", _random_geometries(40))
def test_output_extents_and_the_im2col_walk_agree_with_torch(size, g):
    x = torch.empty(1, 1, *size, device="meta")
    w = torch.empty(1, 1, *g.filter, device="meta")
    want = tuple(_torch_conv(x, w, None, g).shape[2:])
    assert g.output(size) == want
    # the descriptor's bounding box, walked with the stride, visits exactly the outputs
    assert emulate.traversal(size, g) == want


def test_corners_kernel_arguments_and_descriptor_limits():
    g = _geometry((3, 5, 7), (1, 2, 3), (1, 2, 3), (1, 1, 2), pad_hi=(0, 2, 4))
    assert g.lower_corner() == (-1, -2, -3)
    assert g.upper_corner() == (0 - 2, 2 - 4, 4 - 12)
    assert g.kernel_args() == (1, 2, 3, 0, 2, 4, 1, 2, 3, 1, 1, 2)
    assert g.descriptor_problem() is None
    assert _geometry((1, 7, 7), (0, 3, 3)).descriptor_problem() is None
    bad = {
        "padding 17 along H": _geometry((1, 3, 3), (0, 17, 1)),
        "= 32 along W": _geometry((1, 3, 17), (0, 1, 16), dil=(1, 1, 2)),
        "= -18 along W": _geometry((1, 3, 7), (0, 1, 0), dil=(1, 1, 3)),
        "stride 9 along H": _geometry((1, 3, 3), (0, 1, 1), stride=(1, 9, 1)),
    }
    for words, geometry in bad.items():
        assert words in geometry.descriptor_problem()


def test_k_tiles_run_channel_block_fastest_then_s_r_t():
    """The order of W (K, T, R, S, C) in memory: B's k-tile kt and A's name one (c block, tap)."""
    c_blocks, taps = 3, (2, 3, 4)
    seen = [emulate.k_tile_coords(kt, c_blocks, taps) for kt in range(c_blocks * 24)]
    want = [
        (cb, (t, r, s))
        for t in range(2)
        for r in range(3)
        for s in range(4)
        for cb in range(c_blocks)
    ]
    assert seen == want


# ---------------------------------------------------------------- the kernel model
@pytest.mark.parametrize(
    "n, c, k, size, g, cfg",
    [
        (2, 5, 7, (3, 9, 11), _geometry((3, 3, 3), (1, 1, 1)), SMALL_TILES),
        (1, 70, 130, (1, 13, 10), _geometry((1, 3, 3), (0, 2, 1), (1, 2, 3), (1, 2, 1)),
         SMALL_TILES),
        (3, 8, 9, (4, 7, 6), _geometry((2, 1, 3), (1, 0, 2), (2, 1, 2), (2, 1, 1)), SMALL_TILES),
        (2, 136, 72, (1, 12, 13), _geometry((1, 2, 2), (0, 0, 1), pad_hi=(0, 1, 0)), ConvConfig()),
        (1, 16, 300, (1, 9, 30), _geometry((1, 1, 1), (0, 0, 0)), ConvConfig(tile_n=256)),
    ],
)  # fmt: skip
def test_the_kernel_model_is_torchs_convolution(n, c, k, size, g, cfg):
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    bias = torch.randn(k, dtype=F64)
    want = _torch_conv(x, w, bias, g)
    y = torch.full((want[:, 0].numel(), k), float("nan"), dtype=F64)
    emulate.run(_cl5(x).contiguous(), _cl5(w).contiguous(), y, bias, g, cfg)
    assert torch.allclose(y.view(*_cl5(want).shape), _cl5(want), atol=1e-10)


def test_an_im2col_box_wraps_rows_and_images_and_zero_fills():
    """One box of the walk starting mid-row, reaching past the last image."""
    g = _geometry((1, 3, 3), (0, 1, 1))
    x = torch.randn(2, 1, 3, 4, 5, dtype=F64)
    m0, rows = 7, 20  # pixel 7 of 2 x 3 x 4 = 24: row 1, col 3 of image 0 .. past image 1
    box = emulate.im2col_box(x, g, m0, rows, (0, 1, 1), 0, 8)
    assert torch.equal(box[:, 5:], torch.zeros(rows, 3, dtype=F64))
    assert torch.equal(box[17:], torch.zeros(3, 8, dtype=F64))  # n = 2: past the batch
    for j in range(17):
        n, rest = divmod(m0 + j, 12)
        p, q = divmod(rest, 4)
        assert torch.equal(box[j, :5], x[n, 0, p, q])  # tap (1, 1) with padding 1: the centre


# ---------------------------------------------------------------- the launcher
def test_fprop_pads_channels_and_writes_views(model_kernel):
    """C = 3 and K = 5 run zero-padded to 8; an output view that is not compact is written
    through a scratch buffer; nothing is written outside it."""
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    x, w, bias = torch.randn(2, 3, 1, 9, 9, dtype=F64), torch.randn(5, 3, 1, 3, 3, dtype=F64), None
    want = _torch_conv(x, w, bias, g)
    host = torch.full((2, 1, 5, 5, 9), 7.0, dtype=F64)
    y = host[..., 2:7]  # (N, Z, P, Q, K) view with a row stride of 9
    launch.fprop(_cl5(x), _cl5(w), bias, y, g)
    assert _close(y, _cl5(want))
    assert torch.equal(host[..., :2], torch.full_like(host[..., :2], 7.0))
    assert model_kernel[-1]["bias"] is False


def test_fprop_copies_a_misaligned_bias(model_kernel):
    """A bias view off a 16-byte boundary (b[1:]) reaches the kernel as an aligned copy: the
    exported function rejects misaligned tensors."""
    g = _geometry((1, 3, 3), (0, 1, 1))
    x, w = torch.randn(2, 8, 1, 6, 7, dtype=F64), torch.randn(8, 8, 1, 3, 3, dtype=F64)
    bias = torch.randn(9, dtype=F64)[1:]
    assert bias.data_ptr() % 16
    y = torch.empty(2, 1, 6, 7, 8, dtype=F64)
    launch.fprop(_cl5(x), _cl5(w), bias, y, g)
    assert _close(y, _cl5(_torch_conv(x, w, bias, g)))


def test_fprop_without_channels_is_the_bias_and_without_pixels_is_nothing(model_kernel):
    g = _geometry((1, 3, 3), (0, 1, 1))
    bias = torch.randn(8, dtype=F64)
    y = torch.full((1, 1, 4, 4, 8), float("nan"), dtype=F64)
    launch.fprop(torch.empty(1, 1, 4, 4, 0, dtype=F64), torch.empty(8, 1, 3, 3, 0, dtype=F64),
                 bias, y, g)  # fmt: skip
    assert torch.equal(y, bias.expand_as(y))
    launch.fprop(torch.empty(0, 1, 4, 4, 8), torch.empty(8, 1, 3, 3, 8), None,
                 torch.empty(0, 1, 4, 4, 8), g)  # fmt: skip
    assert model_kernel == []


@pytest.mark.parametrize(
    "size, f, pad, stride, dil",
    [
        ((3, 9, 11), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
        ((1, 12, 11), (1, 3, 3), (0, 1, 1), (1, 2, 2), (1, 1, 1)),
        ((1, 13, 10), (1, 4, 5), (0, 2, 1), (1, 2, 3), (1, 2, 1)),
        ((5, 7, 9), (3, 1, 3), (1, 0, 2), (2, 1, 2), (2, 1, 2)),
        ((1, 9, 9), (1, 1, 1), (0, 0, 0), (1, 2, 2), (1, 1, 1)),
        ((1, 10, 10), (1, 7, 7), (0, 3, 3), (1, 2, 2), (1, 1, 1)),
        ((1, 11, 10), (1, 3, 3), (0, 0, 0), (1, 3, 3), (1, 2, 2)),
        ((1, 8, 9), (1, 2, 2), (0, 0, 0), (1, 2, 2), (1, 1, 1)),
        ((1, 9, 8), (1, 2, 2), (0, 1, 1), (1, 2, 2), (1, 1, 1)),  # phases with padding < 0
    ],
)
def test_dgrad_by_output_phase_is_the_gradient(model_kernel, size, f, pad, stride, dil):
    g = _geometry(f, pad, stride, dil)
    x = torch.randn(2, 8, *size, dtype=F64, requires_grad=True)
    w = torch.randn(16, 8, *f, dtype=F64)
    y = _torch_conv(x, w, None, g)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
    launch.dgrad(_cl5(dy), _cl5(w), dx, g)
    assert _close(dx, _cl5(want))
    assert dgrad_geometry_problem(g, size, tuple(y.shape[2:])) is None


def test_dgrad_phases_split_the_taps_and_skip_the_zeros():
    # 3x3 stride 2 padding 1: along each dim phase 0 takes tap 1, phase 1 taps 0 and 2
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    phases = dgrad_phases(g, (1, 8, 7), g.output((1, 8, 7)))
    assert [p.offset for p in phases] == [(0, a, b) for a in range(2) for b in range(2)]
    assert [p.taps[1:] for p in phases] == [((1,), (1,)), ((1,), (0, 2)), ((0, 2), (1,)),
                                           ((0, 2), (0, 2))]  # fmt: skip
    assert [p.extent for p in phases] == [(1, 4, 4), (1, 4, 3), (1, 4, 4), (1, 4, 3)]
    # multiply-adds: 120 = (1 x 4 + 2 x 4) rows x (1 x 4 + 2 x 3) columns, against 9 x 8 x 7 =
    # 504 for a stride-1 convolution over dy with zeros inserted
    taps = sum(len(p.taps[1]) * len(p.taps[2]) * p.extent[1] * p.extent[2] for p in phases)
    assert taps == 120
    # dilation 2 with stride 2: the odd phases see no tap
    g = _geometry((1, 3, 3), (0, 2, 2), (1, 2, 2), (1, 2, 2))
    empty = [p.offset for p in dgrad_phases(g, (1, 8, 8), g.output((1, 8, 8))) if p.empty()]
    assert empty == [(0, 0, 1), (0, 1, 0), (0, 1, 1)]


def test_negative_phase_padding_becomes_a_crop():
    """2x2 stride 2 padding 1: phase 0 stops short of dy's end, phase 1 starts inside it; the
    kernel model refuses padding < 0, so the launcher's crop is what the dgrad test ran."""
    g = _geometry((1, 2, 2), (0, 1, 1), (1, 2, 2))
    phases = dgrad_phases(g, (1, 8, 8), g.output((1, 8, 8)))
    assert {(p.fprop.pad_lo[1], p.fprop.pad_hi[1]) for p in phases} == {(0, -1), (-1, 0)}
    x = torch.randn(1, 1, 5, 5, 8, dtype=F64)
    cropped, cg = launch._cropped(x, phases[0].fprop)
    assert cg.pad_lo == (0, 0, 0) and cg.pad_hi == (0, 0, 0)
    assert torch.equal(cropped, x[:, :, :4, :4])
    assert cg.output((1, 4, 4)) == phases[0].fprop.output((1, 5, 5))


def test_phase_filter_takes_the_taps_reversed_with_channels_swapped():
    g = _geometry((1, 5, 3), (0, 2, 1), (1, 2, 2))
    w = torch.randn(4, 1, 5, 3, 6, dtype=F64)  # (K, T, R, S, C)
    for phase in dgrad_phases(g, (1, 9, 9), g.output((1, 9, 9))):
        got = launch.phase_filter(w, phase)
        r_taps, s_taps = phase.taps[1][::-1], phase.taps[2][::-1]
        want = w[:, :, list(r_taps)][:, :, :, list(s_taps)].permute(4, 1, 2, 3, 0)
        assert torch.equal(got, want) and got.is_contiguous()


# ---------------------------------------------------------------- configurations
def test_the_chooser_picks_standard_tiles_and_whole_splits():
    for m, n, c, taps in itertools.product(
        (1, 100, 1568, 3136, 100352), (3, 64, 96, 256, 2048), (3, 64, 512), (1, 9, 27)
    ):
        plan = choose_plan(m, n, c, taps, 132, forward=True)
        cfg = plan.config
        assert cfg in STANDARD_CONFIGS and 0 < occupancy(cfg, m, n, 132) <= 1
        assert cfg.split == (plan.parts > 1)  # a split runs on the split variant only
        k_tiles = -(-c // 64) * taps
        assert (plan.parts - 1) * plan.per_split < k_tiles <= plan.parts * plan.per_split
        assert plan.parts <= MAX_PARTS and plan.workspace_floats <= MAX_WORKSPACE
        assert n > 64 or cfg.tile_n == 64  # K <= 64: the narrow tile (no half-empty tiles)
    key = dict(params_for("bfloat16", True, STANDARD_CONFIGS[0]))
    assert key["dtype"] == "bfloat16" and key["bias"] is True and key["tile_k"] == 64
    assert list(key) == sorted(key)


def test_the_chooser_splits_what_leaves_the_chip_idle():
    """3x3 on 7 x 7 maps at batch 32 (n32-c512-7x7-k512-3x3: 0.37x cuDNN on 2026-12-01): 13 row
    tiles, a third of the chip busy unsplit; split, about a wave. A large problem is not split
    (its waves are many and full)."""
    plan = choose_plan(32 * 7 * 7, 512, 512, 9, 132, forward=True)
    assert plan.parts > 1 and plan.tiles * plan.parts >= 100
    assert choose_plan(8 * 128 * 128, 512, 512, 9, 132, forward=True).parts == 1
    # a split plan's cost counts its waves: 2 parts of 52 tiles fill 104 of 132 SMs, not 2 waves
    one, _, _ = split_cost((128, 128), (13, 4), (1, 1), 72, 1, 132, 1.0)
    two, _, _ = split_cost((128, 128), (13, 4), (1, 1), 72, 2, 132, 1.0)
    assert two < 0.6 * one


def test_launcher_plans_per_problem(model_kernel):
    g = _geometry((1, 1, 1), (0, 0, 0))
    x, w = torch.randn(1, 1, 4, 4, 16, dtype=F64), torch.randn(512, 1, 1, 1, 16, dtype=F64)
    launch.fprop(x, w, None, torch.empty(1, 1, 4, 4, 512, dtype=F64), g)
    launch.fprop(x, w, None, torch.empty(1, 1, 4, 4, 512, dtype=F64), g, NARROW)
    assert ConvConfig.from_params(model_kernel[0]) == choose_config(16, 512, 16)
    assert ConvConfig.from_params(model_kernel[1]) == NARROW


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("per_split", [1, 3, 5])
def test_a_split_reduction_is_the_convolution_and_its_gradient(monkeypatch, per_split, cluster_m):
    """Forward (bias) and data gradient (the reversed B walk started mid-tap: K = 72 is two
    channel blocks, 3 and 5 k-tiles per part start parts at odd blocks) with the reduction cut
    into parts, run in a random order, parked in fp32 and summed by the last one to arrive; with
    2x1 clusters, M's tiles (an odd number) padded: the tile past M parks parts of its own."""
    seeds = iter(range(100))
    monkeypatch.setattr(
        launch, "get_kernel", lambda spec, params: emulate.stand_in(spec, params, next(seeds))
    )
    launch._plans.clear()
    cfg = replace(SMALL_TILES, split=True, cluster_m=cluster_m)
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    x = torch.randn(2, 24, 1, 11, 9, dtype=F64, requires_grad=True)
    w, bias = torch.randn(72, 24, 1, 3, 3, dtype=F64), torch.randn(72, dtype=F64)
    want = _torch_conv(x, w, bias, g)
    m, k_tiles = want[:, 0].numel(), 9  # 60 pixels: one M tile; 24 channels: one block; 9 taps
    plan = SplitPlan(cfg, per_split, -(-k_tiles // per_split), split_tiles(cfg, m, 72))
    assert plan.tiles == 2 * cluster_m
    y = torch.full(_cl5(want).shape, float("nan"), dtype=F64)
    launch.fprop(_cl5(x.detach()), _cl5(w), bias, y, g, plan)
    assert _close(y, _cl5(want))
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
    # the fused kernel's split variant: a phase of k k-tiles in ceil(k / ceil(most / 3)) parts
    launch.dgrad(_cl5(dy), _cl5(w), dx, g, cfg)
    assert _close(dx, _cl5(dx_want))
    launch._plans.clear()


@pytest.mark.parametrize(
    "c, f, pad, stride, dil, pad_hi",
    [
        (3, (1, 7, 7), (0, 3, 3), (1, 1, 1), (1, 1, 1), None),  # a stride-1 7x7 (the stem folds)
        (5, (1, 3, 2), (0, 1, 0), (1, 1, 2), (1, 2, 1), (0, 2, 1)),  # asymmetric padding
        (16, (1, 2, 2), (0, 0, 0), (1, 1, 1), (1, 1, 1), None),
    ],
)
def test_few_channels_run_as_a_1x1_convolution_of_the_im2col(monkeypatch, c, f, pad, stride, dil,
                                                             pad_hi):  # fmt: skip
    """C padded to at most 16 with 4 or more taps (2-D): the forward and the weight gradient
    launch their kernels once each on the explicit im2col, R x S x C channels (rounded up to 8)
    through a 1x1 geometry, and give the convolution and its weight gradient."""
    seen = []

    def get_kernel(spec, params):
        model = emulate.stand_in(spec, params)

        def fn(*args):
            seen.append((spec.name, args[1].shape[-1], args[2].shape))
            return model(*args)

        return fn

    launch._plans.clear()
    launch._wgrad_plans.clear()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    g = _geometry(f, pad, stride, dil, pad_hi)
    x = torch.randn(2, c, 1, 13, 12, dtype=F64)
    w = torch.randn(24, c, *f, dtype=F64, requires_grad=True)
    bias = torch.randn(24, dtype=F64)
    _fprop_and_wgrad_agree(x, w, bias, g)
    width = -(-(f[1] * f[2] * c) // 8) * 8
    assert [(name, ch) for name, ch, _ in seen] == [
        ("conv_fprop_sm90", width),
        ("conv_wgrad_sm90", width),
    ]
    # y: the 1x1 at stride 1 on the chooser's walk (im2col rows on a problem this small:
    # config.py RECT_START; (N, Z, P, Q, K) on rectangles); dw 1x1
    assert len(seen[0][2]) in (2, 5) and seen[0][2][-1] == 24
    assert tuple(seen[1][2][1:4]) == (1, 1, 1)


def test_one_plane_padded_in_depth_is_not_the_2d_im2col(model_kernel):
    """conv3d of a single input plane (D = T = 1) padded in depth has Z = 3 output planes: not
    the few-channel path (its im2col makes one plane; on the device the kernel would read the
    next image's windows into planes 1 and 2), the implicit GEMM for both the forward and the
    weight gradient."""
    g = _geometry((1, 3, 3), (1, 1, 1))
    x = torch.randn(2, 3, 1, 7, 6, dtype=F64)
    w = torch.randn(8, 3, 1, 3, 3, dtype=F64, requires_grad=True)
    assert _torch_conv(x, w, None, g).shape[2] == 3
    assert not launch.few_channels(_cl5(x), _cl5(w), g)
    _fprop_and_wgrad_agree(x, w, None, g)


def test_one_split_plan_for_every_phase_is_sized_per_phase(model_kernel):
    """A SplitPlan given to the data gradient serves every phase (4, 2, 2 and 1 taps at 3x3
    stride 2): each launch's parts and tiles are counted for its own phase, so the workspace
    is big enough for each (the model checks the size; a fresh workspace here)."""
    scratch.release()
    g = _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))
    x = torch.randn(2, 24, 1, 11, 9, dtype=F64, requires_grad=True)
    w = torch.randn(72, 24, 1, 3, 3, dtype=F64)
    want = _torch_conv(x, w, None, g)
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    plan = SplitPlan(replace(SMALL_TILES, split=True), per_split=1, parts=1, tiles=1)
    dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
    launch.dgrad(_cl5(dy), _cl5(w), dx, g, plan)
    assert _close(dx, _cl5(dx_want))
    scratch.release()
