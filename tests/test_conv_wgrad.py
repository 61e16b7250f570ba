"""The implicit-GEMM weight gradient (kernels/conv/sm90/wgrad.py) on the CPU, in fp64: the model
of its tile walk (emulate.wgrad_run: A = dY^T boxes, B = im2col boxes of 64 pixels x 64
channels at the tile's tap, the block index clamped, the split's pixel range, the parts parked
and summed in split order by the last to arrive) against autograd's weight gradient, for every
tile and several splits over ragged geometries; the sum independent of the CTAs' order and the
flags left zero; the launcher (channel padding, scratch dw, one launch, the workspace reused);
the chooser of tile and split. The stride-1 walk's rectangles (geometry.rect_*): every output
pixel in exactly one, the rest zero-filled outside the output; the model with rectangles
against autograd; the launcher takes them at stride 1, the im2col walk otherwise."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.kernels.conv.sm90.config import MAX_WORKSPACE, split_cost
from forgekernel.kernels.conv.sm90.geometry import (
    RECT_PIXELS,
    RECT_WIDTHS,
    Geometry,
    rect_k_tiles,
    rect_origin,
    rect_width,
)
from forgekernel.kernels.conv.sm90.wgrad_config import (
    _WGRAD_EFFICIENCY,
    WGRAD_CONFIGS,
    WGRAD_IM2COL_FLOOR,
    WGRAD_LARGE,
    WGRAD_MAX_SPLITS,
    WGRAD_SMALL,
    WGRAD_SMALL_SQUARE,
    WGRAD_SQUARE,
    WGRAD_START,
    WgradPlan,
    choose_wgrad,
    wgrad_cost,
    wgrad_prefers_im2col,
    wgrad_tiles,
)
from forgekernel.runtime import scratch

F64 = torch.float64


def _geometry(f, pad, stride=(1, 1, 1), dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), tuple(stride), tuple(dil))


def _cl5(t):
    return t.permute(0, 2, 3, 4, 1)


def _problem(n, c, k, size, g: Geometry, seed=0):
    """x, dy (channels-last 5-D, fp64) and autograd's dw (K, T, R, S, C) of conv3d with g."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, *size, dtype=F64, generator=gen)
    w = torch.randn(k, c, *g.filter, dtype=F64, requires_grad=True)
    pad = [v for d in (2, 1, 0) for v in (g.pad_lo[d], g.pad_hi[d])]
    y = F.conv3d(F.pad(x, pad), w, stride=g.stride, dilation=g.dilation)
    dy = torch.randn(y.shape, dtype=F64, generator=gen)
    (dw,) = torch.autograd.grad(y, w, dy)
    return _cl5(x).contiguous(), _cl5(dy).contiguous(), _cl5(dw)


def _stream_k_workspace():
    """The stream-K partials and flags the last launches used (runtime/scratch.py's entries)."""
    work = next(v[0] for key, v in scratch._SLOTS.items() if key[0] == "stream_k.partials")
    flags = next(v for key, v in scratch._FLAGS.items() if key[0] == "stream_k.flags")
    return work, flags


def _close(got, want) -> bool:
    """Equal up to the fp32 rounding of the parked partials (an indexing error is O(1))."""
    return torch.allclose(got, want, rtol=1e-6, atol=1e-5)


def _k_tiles(dy, rect):
    n, z, p, q, k = dy.shape
    return rect_k_tiles(n, z, p, q, rect) if rect else math.ceil(dy.numel() // k / 64)


def _run_model(x, dy, dw_shape, g, cfg, per_split, order=None, rect=0):
    k = dw_shape[0]
    dw = torch.full(dw_shape, float("nan"), dtype=F64)
    taps = math.prod(dw_shape[1:4])
    tiles = wgrad_tiles(cfg, k, dw_shape[-1], taps)
    splits = math.ceil(_k_tiles(dy, rect) / per_split)
    work = torch.zeros(max(4, splits * tiles * cfg.tile_m * cfg.tile_n), dtype=torch.float32)
    flags = torch.zeros(tiles, dtype=torch.int32)
    a = dy if rect else dy.reshape(-1, k)
    emulate.wgrad_run(a, x, dw, work, flags, g, cfg, per_split, order, rect)
    return dw, flags


PROBLEMS = [
    # n, c, k, (D, H, W), geometry: ragged K and C, stride, dilation, asymmetric padding, 3-D
    (2, 72, 136, (1, 9, 7), _geometry((1, 3, 3), (0, 2, 2), dil=(1, 2, 2))),
    (2, 24, 40, (1, 13, 11), _geometry((1, 5, 5), (0, 2, 2), (1, 2, 2))),
    (1, 8, 16, (4, 6, 6), _geometry((3, 3, 3), (1, 1, 1))),
    (3, 200, 8, (1, 6, 5), _geometry((1, 2, 3), (0, 0, 1), pad_hi=(0, 1, 0))),
]
# stride 1, the rectangles' cases besides PROBLEMS' stride-1 ones: a plane past 8 x 8 in both
# dims with padding larger than the filter's reach (rectangles reading only zeros of x), no
# padding (x wider than the output: B nonzero past Q, A zero there) with dilation 3, a 3-D
# filter dilated in depth
RECT_PROBLEMS = [
    *(problem for problem in PROBLEMS if problem[-1].stride == (1, 1, 1)),
    (2, 16, 24, (1, 19, 21), _geometry((1, 3, 3), (0, 3, 2), pad_hi=(0, 0, 4))),
    (1, 24, 16, (1, 18, 13), _geometry((1, 3, 2), (0, 0, 0), dil=(1, 3, 2))),
    (2, 8, 8, (3, 5, 9), _geometry((2, 3, 3), (1, 1, 1), dil=(2, 1, 1))),
]


@pytest.mark.parametrize("cfg", WGRAD_CONFIGS, ids=lambda c: f"{c.tile_m}x{c.tile_n}")
@pytest.mark.parametrize("n, c, k, size, g", PROBLEMS)
def test_the_model_is_the_weight_gradient_for_every_tile_and_split(cfg, n, c, k, size, g):
    x, dy, want = _problem(n, c, k, size, g)
    k_tiles = -(-(dy.numel() // k) // 64)
    for per_split in sorted({k_tiles, max(1, k_tiles // 3), 1}):
        dw, flags = _run_model(x, dy, want.shape, g, cfg, per_split)
        assert _close(dw, want), (per_split, (dw - want).abs().max())
        assert not flags.any()  # every launch leaves the flags zero


@pytest.mark.parametrize("cfg", [WGRAD_SQUARE, WGRAD_SMALL], ids=lambda c: c.tag())
@pytest.mark.parametrize("rect", RECT_WIDTHS)
@pytest.mark.parametrize("n, c, k, size, g", RECT_PROBLEMS)
def test_the_rectangles_model_is_the_weight_gradient(cfg, rect, n, c, k, size, g):
    """The stride-1 walk (a 2x1 cluster's tile and a 64x64 one), unsplit and split."""
    x, dy, want = _problem(n, c, k, size, g)
    k_tiles = _k_tiles(dy, rect)
    for per_split in sorted({k_tiles, max(1, k_tiles // 3)}):
        dw, flags = _run_model(x, dy, want.shape, g, cfg, per_split, rect=rect)
        assert _close(dw, want), (per_split, (dw - want).abs().max())
        assert not flags.any()


@pytest.mark.parametrize("rq", RECT_WIDTHS)
@pytest.mark.parametrize("n, z, p, q", [(1, 1, 7, 7), (2, 1, 14, 14), (3, 2, 28, 5), (1, 3, 9, 17)])
def test_the_rectangles_cover_every_output_pixel_once(rq, n, z, p, q):
    """rect_origin's walk (the kernel's `_rect`) over rect_k_tiles rectangles: each output pixel
    of (N, Z, P, Q) in exactly one rectangle, every other position of a rectangle past P or Q
    (zero-filled by the TMA in dY: it adds nothing), none past N or Z."""
    rp = RECT_PIXELS // rq
    hits = torch.zeros(n, z, p, q, dtype=torch.int64)
    outside = 0
    for kt in range(rect_k_tiles(n, z, p, q, rq)):
        ni, zi, p0, q0 = rect_origin(kt, z, p, q, rq)
        assert 0 <= ni < n and 0 <= zi < z and p0 < p and q0 < q
        assert p0 % rp == 0 and q0 % rq == 0
        for i in range(RECT_PIXELS):
            pi, qi = p0 + i // rq, q0 + i % rq
            if pi < p and qi < q:
                hits[ni, zi, pi, qi] += 1
            else:
                outside += 1
    assert bool((hits == 1).all())
    padded = n * z * -(-p // rp) * rp * -(-q // rq) * rq
    assert outside == padded - n * z * p * q


def test_the_rectangle_width_wastes_the_least():
    for q in range(1, 130):
        rq = rect_width(q, q)
        area = rect_k_tiles(1, 1, q, q, rq)
        assert all(area <= rect_k_tiles(1, 1, q, q, w) for w in RECT_WIDTHS)
    assert rect_width(56, 56) == 8 and rect_width(7, 7) == 8 and rect_width(28, 28) == 16
    assert rect_k_tiles(32, 1, 56, 56, 8) == 32 * 49  # 56 x 56: no zero-filled pixel


def test_the_sum_does_not_depend_on_the_order_the_parts_finish():
    n, c, k, size, g = 3, 72, 136, (1, 12, 12), _geometry((1, 3, 3), (0, 1, 1))
    x, dy, _ = _problem(n, c, k, size, g, seed=3)
    cfg = WGRAD_SMALL
    ref, _ = _run_model(x, dy, (k, *g.filter, c), g, cfg, 1)
    tiles = wgrad_tiles(cfg, k, c, math.prod(g.filter))
    splits = -(-(dy.numel() // k) // 64)
    assert splits > 2
    for seed in range(3):
        order = torch.randperm(tiles * splits, generator=torch.Generator().manual_seed(seed))
        dw, _ = _run_model(x, dy, (k, *g.filter, c), g, cfg, 1, order.tolist())
        assert torch.equal(dw, ref)  # bitwise: the parts are summed in split order


@pytest.fixture
def model_kernel(conv_wgrad_models):
    """The compiled functions replaced by the CPU models (the weight gradient's running its
    CTAs in a random order); (compile key, workspace pointer) of each launch recorded."""
    return conv_wgrad_models(
        lambda params, dy, work, flags, per: (
            dict(params, dy_shape=tuple(dy.shape)),
            work.data_ptr(),
            flags.data_ptr(),
            per,
        )
    )


@pytest.mark.parametrize(
    "n, c, k, size, g",
    [
        (2, 3, 5, (1, 17, 19), _geometry((1, 3, 3), (0, 1, 1))),  # C, K padded to 8
        (1, 3, 16, (1, 30, 30), _geometry((1, 7, 7), (0, 3, 3), (1, 2, 2))),  # the stem
        (2, 64, 64, (1, 9, 9), _geometry((1, 1, 1), (0, 0, 0))),  # 1x1
        (2, 16, 24, (1, 7, 4), _geometry((1, 1, 1), (0, 0, 0))),  # 1x1, 56 pixels: one plane
        (2, 16, 24, (1, 7, 4), _geometry((1, 1, 1), (0, 1, 0))),  # 1x1 padded: its own plane
        *PROBLEMS,
    ],
)
def test_launcher_gives_the_weight_gradient(model_kernel, n, c, k, size, g):
    x, dy, want = _problem(n, c, k, size, g)
    dw = torch.full(want.shape, float("nan"), dtype=F64)
    launch.wgrad(dy, x, dw, g)
    assert _close(dw, want)
    assert len(model_kernel) == 1
    # stride 1 (the stem: its 1x1 over the im2col) walks rectangles, other strides the im2col
    stem = launch.few_channels(x, want, g)
    key = model_kernel[0][0]
    if g.stride == (1, 1, 1) or stem:
        assert key["rect"] == rect_width(*key["dy_shape"][2:4])
    else:
        assert key["rect"] == 0
    m = dy.numel() // k
    # an unpadded 1x1 (the stem's included) over a multiple of 8 pixels: one plane of 8-pixel rows
    flat = math.prod(g.filter) == 1 or stem
    if flat and m % 8 == 0 and not any(g.pad_lo + g.pad_hi):
        assert key["dy_shape"][:4] == (1, 1, m // 8, 8)


def test_launcher_splits_and_reuses_its_workspace(model_kernel):
    """A forced split over a long reduction: the same workspace and flags on every call (no
    allocation, no fill per call), left zero by each launch; dw written in place. C = 24:
    the implicit GEMM (C <= 16 would take the few-channel path, another problem)."""
    n, c, k, size, g = 4, 24, 24, (1, 16, 16), _geometry((1, 3, 3), (0, 1, 1))
    x, dy, want = _problem(n, c, k, size, g)
    plan = WgradPlan(WGRAD_SMALL, per_split=3, parts=6, tiles=9)
    for _ in range(3):
        dw = torch.full(want.shape, float("nan"), dtype=F64)
        launch.wgrad(dy, x, dw, g, plan)
        assert _close(dw, want)
    assert len({(w, f) for _, w, f, _ in model_kernel}) == 1
    assert {per for *_, per in model_kernel} == {3}
    work, flags = _stream_k_workspace()
    assert not flags.any() and work.numel() >= 6 * 9 * 64 * 64


def test_a_given_plan_is_sized_for_the_problem(model_kernel):
    """A plan's splits and tiles are what the kernel counts (the workspace and flags are sized
    by them): a plan made for another problem (here one split and one tile) still gets a
    workspace its kernel does not write past (the model checks the size)."""
    n, c, k, size, g = 4, 24, 24, (1, 16, 16), _geometry((1, 3, 3), (0, 1, 1))
    x, dy, want = _problem(n, c, k, size, g)
    dw = torch.full(want.shape, float("nan"), dtype=F64)
    launch.wgrad(dy, x, dw, g, WgradPlan(WGRAD_SMALL, per_split=3, parts=1, tiles=1))
    assert _close(dw, want)
    work, flags = _stream_k_workspace()
    assert work.numel() >= 6 * 9 * 64 * 64 and flags.numel() >= 9


def test_the_chooser_fills_the_chip_within_its_limits():
    for k, c, taps, pixels in itertools.product(
        (8, 64, 136, 512, 2048), (8, 64, 96, 256, 1280), (1, 4, 9, 27, 49), (64, 1568, 100352)
    ):
        k_tiles = -(-pixels // 64)
        plan = choose_wgrad(k, c, taps, k_tiles, 132, tiled=bool(taps % 2))
        cfg = plan.config
        assert cfg in WGRAD_CONFIGS and plan.tiles == wgrad_tiles(cfg, k, c, taps)
        assert 1 <= plan.parts <= WGRAD_MAX_SPLITS
        # every split non-empty, together exactly the reduction
        assert (plan.parts - 1) * plan.per_split < k_tiles <= plan.parts * plan.per_split
        assert plan.parts == 1 or plan.workspace_floats <= MAX_WORKSPACE
    # the point: 18 tiles of 128x256 would fill 14% of the chip unsplit
    for tiled in (False, True):
        plan = choose_wgrad(256, 256, 9, 32 * 56 * 56 // 64, 132, tiled=tiled)
        assert plan.tiles * plan.parts > 0.9 * 132
        # a long reduction into one 64x64 tile is spread over many CTAs
        plan = choose_wgrad(64, 64, 1, 32 * 56 * 56 // 64, 132, tiled=tiled)
        assert plan.config == WGRAD_SMALL and plan.parts >= 16


def test_small_maps_take_the_im2col_walk_at_stride_1():
    """The walks compared at stride 1 (each plan with WGRAD_START a wave, the im2col walk's
    below WGRAD_WALK_MARGIN x the rectangles'): of conv_wgrad's 24 stride-1 cases only the two
    whose rectangles are 23% zero (7x7 and 14x14 maps under a 3x3) leave the rectangles; the
    unpadded 1x1s (one plane, no zero fill) and the large maps keep them."""
    from forgekernel.bench.suites.conv_wgrad import BENCH_CASES

    probe = _probe()  # its `_walk`: the launcher's walks of a bench case
    moved = set()
    for case in BENCH_CASES:
        p = dict(case.params)
        rect, kt = probe._walk(p)
        if rect == 0:  # strides other than 1
            continue
        taps = p["kernel"][0] * p["kernel"][1]
        im2col = probe._walk(p, im2col=True)[1]
        if wgrad_prefers_im2col(p["k"], p["c"], taps, kt, im2col, 132):
            moved.add(case.name)
    assert moved == {"n32-c512-7x7-k512-3x3", "n32-c256-14x14-k256-3x3"}
    # the 7x7 case: 128x256 c2x1 over the 25 k-tiles of 64 pixels, one part (its
    # stride-2 twin n32-c512-14x14-k512-3x3-s2's plan, 19.6 us at 03:50)
    plan = choose_wgrad(512, 512, 9, 25, 132)
    assert (plan.config, plan.parts) == (WGRAD_LARGE, 1)


def test_the_launcher_takes_the_im2col_walk_the_chooser_prefers(model_kernel, monkeypatch):
    """A stride-1 problem whose walks the chooser compares in favour of the im2col walk (here
    forced) launches the im2col key (rect 0) with dy as (M, K), and gives the gradient; the
    decision is cached per problem and forgotten by clear_plans."""
    n, c, k, size, g = 2, 16, 24, (1, 7, 7), _geometry((1, 3, 3), (0, 1, 1))
    x, dy, want = _problem(n, c, k, size, g)
    asked = []

    def prefers(*args):
        asked.append(args)
        return True

    monkeypatch.setattr(launch, "wgrad_prefers_im2col", prefers)
    launch.clear_plans()
    for _ in range(2):
        dw = torch.full(want.shape, float("nan"), dtype=F64)
        launch.wgrad(dy, x, dw, g)
        assert _close(dw, want)
    assert len(asked) == 1  # cached
    for key, *_ in model_kernel:
        assert key["rect"] == 0 and key["dy_shape"] == (n * 7 * 7, k)
    launch.clear_plans()


def test_the_tiled_walk_keeps_its_cost():
    """The 18:47 refit (WGRAD_IM2COL_ROWS_128, WGRAD_IM2COL_FLOOR, WGRAD_START) is the im2col
    walk's: the stride-1 rectangles' cost is still the multiply-adds alone (their picks, the
    SD VAE cases at 1.2-1.8x cuDNN, unchanged)."""
    for cfg, splits in itertools.product(WGRAD_CONFIGS, (1, 3, 8)):
        cm = cfg.cluster_m
        tiles_mn = (-(-512 // (cfg.tile_m * cm)) * cm, -(-320 // cfg.tile_n) * 9)
        want = split_cost(
            (cfg.tile_m, cfg.tile_n), tiles_mn, (cm, 1), 400, splits, 132, _WGRAD_EFFICIENCY[cfg]
        )
        assert wgrad_cost(cfg, 512, 320, 9, 400, splits, 132, tiled=True) == want


def test_the_im2col_walk_pays_the_producer_floor_and_a_start():
    """On the im2col walk a k-tile costs at least WGRAD_IM2COL_FLOOR (the producer's) and each
    wave of CTAs WGRAD_START: a 64x64 tile's k-tile (a quarter of the multiply-adds) costs the
    floor, and one more k-tile a CTA adds the floor per wave."""
    one = wgrad_cost(WGRAD_SMALL, 64, 64, 1, 40, 1, 132)[0]
    two = wgrad_cost(WGRAD_SMALL, 64, 64, 1, 41, 1, 132)[0]
    assert two - one == pytest.approx(WGRAD_IM2COL_FLOOR)
    assert one > 40 * WGRAD_IM2COL_FLOOR + WGRAD_START - 1e-9


def test_the_strided_sd_unet_layers_leave_the_padded_cluster():
    """The SD UNet downsampling layers (3x3 stride 2, batch 8; 18:47: 0.26-0.43x cuDNN on
    128x128 c2x1): C = K = 320 padded K to 512 on the 2x1 cluster's two K tiles (52% of the
    multiply-adds useful, 108 CTAs of 128 k-tiles in one wave); the refit takes 128x128 without
    a cluster (K padded to 384), cut in 3 (243 CTAs of 43 k-tiles); C = K = 640 128x128 unsplit
    (225 CTAs of 32); C = K = 1280 (8 k-tiles a tile) 128x256 c2x1 (450 CTAs, 4 waves, not
    900 in 7)."""
    c320 = choose_wgrad(320, 320, 9, 8 * 32 * 32 // 64, 132)
    assert (c320.config, c320.parts, c320.per_split) == (WGRAD_SMALL_SQUARE, 3, 43)
    c640 = choose_wgrad(640, 640, 9, 8 * 16 * 16 // 64, 132)
    assert (c640.config, c640.parts) == (WGRAD_SMALL_SQUARE, 1)
    c1280 = choose_wgrad(1280, 1280, 9, 8 * 8 * 8 // 64, 132)
    assert (c1280.config, c1280.parts, c1280.tiles) == (WGRAD_LARGE, 1, 450)
    # the 18:47 pick, costed by the refit, is the dearer one in each case
    for (k, kt), new in zip(((320, 128), (640, 32), (1280, 8)), (c320, c640, c1280)):
        old = wgrad_cost(WGRAD_SQUARE, k, k, 9, kt, 2 if k == 640 else 1, 132)[0]
        assert wgrad_cost(new.config, k, k, 9, kt, new.parts, 132)[0] < old


def _probe():
    """scripts/conv_wgrad_probe.py as a module (its plans and its launch, no GPU needed)."""
    from script_modules import load_script

    return load_script("conv_wgrad_probe")


@pytest.mark.parametrize(
    "n, c, k, hw, f, stride, pad, im2col_preferred",
    [
        (2, 24, 40, 9, 3, 2, 1, False),  # the im2col walk (old / tile / parts rows)
        (2, 16, 24, 7, 3, 1, 1, False),  # stride 1: rectangles, and the im2col row forced
        (2, 16, 16, 8, 1, 1, 0, False),  # an unpadded 1x1: one plane 8 wide, and im2col forced
        (2, 16, 24, 7, 3, 1, 1, True),  # stride 1 preferring the im2col walk: the rect row
    ],
)
def test_every_probe_plan_computes_the_gradient(
    model_kernel, monkeypatch, n, c, k, hw, f, stride, pad, im2col_preferred
):
    """Each plan scripts/conv_wgrad_probe.py times, through its own launch (`_call`: the
    im2col walk forced at stride 1 by a patched `launch._wgrad_walk`, the rectangles by a
    patched `launch._wgrad_im2col`), gives autograd's dW on the CPU models, and each row ran
    its walk's key (rect 0 on the im2col walk)."""
    probe = _probe()
    if im2col_preferred:  # the chooser's comparison of the walks, forced both sides
        monkeypatch.setattr(probe.W, "wgrad_prefers_im2col", lambda *args: True)
        monkeypatch.setattr(launch, "wgrad_prefers_im2col", lambda *args: True)
        launch.clear_plans()
    g = _geometry((1, f, f), (0, pad, pad), (1, stride, stride))
    x, dy, want = _problem(n, c, k, (1, hw, hw), g)
    p = dict(n=n, c=c, k=k, spatial=(hw, hw), kernel=(f, f), stride=(stride, stride))
    p["padding"] = (pad, pad)
    rows = probe.variants(p)
    assert rows[0][0] == "pick" and any(im2col for _, im2col, _, _ in rows) == (stride == 1)
    for name, im2col, plan, _ in rows:
        dw = torch.full(want.shape, float("nan"), dtype=F64)
        probe._call(dy, x, dw, g, plan, im2col)
        assert _close(dw, want), (name, plan)
        rect = model_kernel[-1][0]["rect"]
        assert (rect == 0) == (im2col or stride > 1), (name, rect)
    assert (rows[0][1], any(name == "rect" for name, *_ in rows)) == (im2col_preferred,) * 2
    assert launch._wgrad_walk.__name__ == "_wgrad_walk"  # the patches undone
    assert launch._wgrad_im2col.__name__ == "_wgrad_im2col"
    launch.clear_plans()
