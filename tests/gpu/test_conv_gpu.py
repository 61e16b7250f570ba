"""Convolution on the GPU against the fp64 references (issue 23): the forward kernel with every
standard and candidate tile (cluster multicast included) on ragged problems, conv2d / conv3d
with bias, padding "same", strides, dilation; the data gradient by output phase (strides 1, 2,
3, dilation); the weight gradient; autograd end to end; CUDA graph capture (what the
bench times); torch.compile; inputs in other layouts; the data-gradient mode and the
weight-gradient kernel with every tile (and split). Criterion: our error <= 2 x the error of
the same op by PyTorch (cuDNN) in the input dtype + 1e-3, outputs NaN-poisoned first. The
fused strided data gradient (every phase in one launch, rows stored into dX's strided views)
with every tile, unsplit and split, into a channel slice of a wider buffer. The weight
gradient's reduce split (the parts bulk-reduce-added into one slot a tile) on every tile and
on the suite's 1x1s, and captured in a CUDA graph."""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import launch
from forgekernel.kernels.conv.sm90.config import CANDIDATES, STANDARD_CONFIGS, TALL
from forgekernel.kernels.conv.sm90.dgrad_config import FUSED_BASE, FusedPlan
from forgekernel.kernels.conv.sm90.wgrad_config import WGRAD_CONFIGS, WGRAD_REDUCE_CONFIGS
from forgekernel.reference.conv import conv_dgrad_ref, conv_ref, conv_wgrad_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.conv")
DTYPES = [torch.bfloat16, torch.float16]
# the forward's tiles: the standard ones, the K = 128 conv3d layers' 256x128 (forward only: not in
# STANDARD_CONFIGS, which the data-gradient mode shares) and the candidates
FORWARD_TILES = STANDARD_CONFIGS + (TALL,) + CANDIDATES


def rnd(*shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def assert_good(ours, want, low):
    """The check's criterion (forgekernel.bench.check.compare)."""
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    err = float((ours.float() - want).abs().max())
    assert torch.isfinite(ours).all() and err <= bound, (err, bound)


@pytest.mark.parametrize("cfg", FORWARD_TILES, ids=lambda c: c.tag())
def test_every_tile_on_a_ragged_problem(cfg):
    """M = 2 x 13 x 11 pixels, K = 200 output channels, C = 72 (a part-filled channel block)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b = rnd(2, 72, 13, 11, gen=g), rnd(200, 72, 3, 3, gen=g), rnd(200, gen=g)
    y = torch.full((2, 200, 13, 11), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = y.contiguous(memory_format=torch.channels_last)
    geometry = op._geometry(2, (3, 3), 1, 1, 1)
    launch.fprop(op._as5d(x), op._as5d(w), b, op._view5d(y), geometry, cfg)
    assert_good(y, conv_ref(x, w, b, padding=1), F.conv2d(x, w, b, padding=1))


@pytest.mark.parametrize("cfg", FORWARD_TILES, ids=lambda c: c.tag())
@pytest.mark.parametrize(
    "x_shape, f, kw, rect",
    [
        ((2, 72, 29, 31), (3, 3), {"padding": 1}, 8),  # 8 x 16, ragged in P and Q
        ((1, 72, 30, 30), (3, 3), {"padding": 2, "dilation": 2}, 16),  # 16 x 8 over 30 x 30
        ((2, 72, 7, 9), (3, 3), {"padding": (2, 0)}, 8),  # padding past the filter's reach
        ((1, 72, 5, 9, 10), (3, 3, 3), {"padding": 1}, 16),  # 3-D, 16 x 8 over 9 x 10
        ((2, 72, 14, 8), (1, 1), {"padding": 0}, 8),  # 1x1: one plane of 8-pixel rows
    ],
    ids=["rect8", "rect16-dil2", "rect8-pad2", "rect16-3d", "flat1x1"],
)
def test_forward_rectangles_every_tile_and_split(cfg, x_shape, f, kw, rect):
    """The stride-1 forward on output rectangles (A a tiled box of x at the tap's offset, the
    TMA's zero fill the padding; y stored as rectangles, clipped at P and Q) with each tile,
    the split ones in 1 and 4 k-tiles a part: K = 200 (a ragged N tile), C = 72 (a part-filled
    channel block), bias, into a channel slice of a wider buffer (the 8 extra channels stay
    NaN)."""
    from forgekernel.kernels.conv.sm90.config import SplitPlan, split_tiles

    g = torch.Generator(device="cuda").manual_seed(5)
    dims = len(f)
    w_shape = (200, 72, *f)
    x, w, b = rnd(*x_shape, gen=g), rnd(*w_shape, gen=g), rnd(200, gen=g)
    want = conv_ref(x, w, b, **kw)
    low = (F.conv3d if dims == 3 else F.conv2d)(x, w, b, **kw)
    fmt = torch.channels_last_3d if dims == 3 else torch.channels_last
    wide = torch.full((want.shape[0], 208, *want.shape[2:]), float("nan"), device="cuda")
    wide = wide.to(torch.bfloat16).contiguous(memory_format=fmt)
    y = wide[:, :200]
    geometry = op._geometry(dims, f, 1, kw["padding"], kw.get("dilation", 1))
    y5 = op._view5d(y)
    m = want[:, 0].numel()
    pixels = tuple(y5.shape[:4]) if f[0] * f[-1] > 1 else (1, 1, m // 8, 8)
    k_tiles = 2 * math.prod(f)
    for per_split in (k_tiles, 4, 1) if cfg.split else (k_tiles,):
        tiles = split_tiles(cfg, m, 200, pixels, rect)
        plan = SplitPlan(cfg, per_split, math.ceil(k_tiles / per_split), tiles, rect)
        wide.fill_(float("nan"))
        launch.fprop(op._as5d(x), op._as5d(w), b, y5, geometry, plan)
        assert_good(y, want, low)
        assert bool(wide[:, 200:].isnan().all())


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("cfg", STANDARD_CONFIGS, ids=lambda c: c.tag())
def test_dgrad_mode_every_tile(cfg, stride):
    """The kernel's data-gradient mode (W read N-major through a strided view of the phase's
    taps, taps reversed) with each standard tile: C = 200 output channels (a ragged N tile),
    K = 72 (a part-filled channel block), 3x3 padding 1, 13 x 11 input (ragged phases)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x_shape = (2, 200, 13, 11)
    w = rnd(72, 200, 3, 3, gen=g)
    kw = {"stride": stride, "padding": 1}
    dy = rnd(*conv_ref(rnd(*x_shape, gen=g), w, **kw).shape, gen=g)
    dx = torch.full(x_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    dx = dx.contiguous(memory_format=torch.channels_last)
    geometry = op._geometry(2, (3, 3), stride, 1, 1)
    launch.dgrad(op._as5d(dy), op._as5d(w), op._view5d(dx), geometry, cfg)
    x = torch.empty(x_shape, device="cuda", dtype=torch.bfloat16)
    assert_good(dx, conv_dgrad_ref(dy, w, x_shape, **kw), _torch_grads(dy, x, w, kw, "dx"))


FUSED_SHAPES = [
    ((2, 200, 13, 11), (72, 200, 3, 3), {"stride": 2, "padding": 1}),  # phases of 4 / 2 / 1 taps
    ((2, 200, 15, 13), (72, 200, 1, 1), {"stride": 2}),  # three phases of no tap: zero stores
    ((1, 200, 5, 7, 6), (72, 200, 3, 3, 3), {"stride": 2, "padding": 1}),  # eight phases
    # the walk's upper corner +1 along H and W (its boxes run one pixel past dY: zero fill)
    ((2, 200, 13, 11), (72, 200, 2, 2), {"stride": 2}),
    # the walk's padding below -1: dY cropped (a view at an offset), phase 0 of no tap
    ((2, 200, 13, 11), (72, 200, 1, 1), {"stride": 2, "padding": 1}),
]


@pytest.mark.parametrize("per_split", [None, 1, 3])
@pytest.mark.parametrize("cfg", FUSED_BASE, ids=lambda c: c.tag())
@pytest.mark.parametrize("shape", range(len(FUSED_SHAPES)))
def test_fused_dgrad_every_tile_and_split(cfg, per_split, shape):
    """The fused data gradient with each tile, unsplit (None) and split (1 or 3 k-tiles a part:
    every phase in parts, parked and summed by the last): C = 200 output channels (a ragged N
    tile), K = 72 (a part-filled channel block), odd sizes (phases one row short); dx the first
    200 channels of a 208-channel buffer (rows addressed through its strides; the other 8
    channels must stay untouched); twice, bitwise equal."""
    _fused_twice(cfg, per_split, *FUSED_SHAPES[shape])


# Problems of more units than the grid has CTAs (every tile, 2x1 clusters included): each CTA
# runs several units of different phases (4 / 2 / 2 / 1 taps; 1x1: a phase of one tap and
# three of none, zero units between stored ones), so the epilogue ring's position carried
# across tiles (`tiles_done`), the AB ring's states across units of different lengths and a
# split part parked after a stored tile are exercised; the small shapes above give a CTA one
# unit (two at most: the 3-D one in parts of one k-tile on 128x64 tiles, all of them split).
PERSISTENT_SHAPES = [
    ((16, 200, 40, 36), (72, 200, 3, 3), {"stride": 2, "padding": 1}),
    ((16, 200, 40, 36), (72, 200, 1, 1), {"stride": 2}),
]


@pytest.mark.parametrize("per_split", [None, 1])
@pytest.mark.parametrize("cfg", FUSED_BASE, ids=lambda c: c.tag())
@pytest.mark.parametrize("shape", range(len(PERSISTENT_SHAPES)))
def test_fused_dgrad_several_units_a_cta(cfg, per_split, shape):
    """`test_fused_dgrad_every_tile_and_split`'s checks on PERSISTENT_SHAPES."""
    _fused_twice(cfg, per_split, *PERSISTENT_SHAPES[shape])


def _fused_twice(cfg, per_split, x_shape, w_shape, kw):
    """The fused data gradient with `cfg` (split in parts of `per_split` k-tiles unless None)
    into the first 200 of 208 channels, against the fp64 reference, twice, bitwise equal."""
    g = torch.Generator(device="cuda").manual_seed(3)
    d = len(x_shape) - 2
    w = rnd(*w_shape, gen=g)
    ref = conv_ref(rnd(*x_shape, gen=g), w, **kw)
    dy = rnd(*ref.shape, gen=g)
    want = conv_dgrad_ref(dy, w, x_shape, **kw)
    x = torch.empty(x_shape, device="cuda", dtype=torch.bfloat16)
    low = _torch_grads(dy, x, w, kw, "dx")
    plan = cfg if per_split is None else FusedPlan(replace(cfg, split=True), per_split, 0, 0, 0, 0)
    geometry = op._geometry(d, w_shape[2:], kw["stride"], kw.get("padding", 0), 1)
    runs = []
    for _ in range(2):
        wide = torch.full((x_shape[0], *x_shape[2:], 208), float("nan"), device="cuda",
                          dtype=torch.bfloat16)  # fmt: skip
        dx5 = wide[..., :200] if d == 3 else wide[..., :200].unsqueeze(1)
        launch.dgrad(op._as5d(dy), op._as5d(w), dx5, geometry, plan)
        dx = wide[..., :200].permute(0, d + 1, *range(1, d + 1))
        assert_good(dx, want, low)
        assert torch.isnan(wide[..., 200:]).all()
        runs.append(dx.clone())
    assert torch.equal(runs[0], runs[1])


def _wgrad_every_split(cfg, tiles, k_tiles, dy, x, w_shape, geometry, want, low):
    """The weight gradient unsplit, at 2 k-tiles a part and at 1, each twice into a NaN-filled
    dw: good against the reference, and bitwise equal run to run."""
    from forgekernel.kernels.conv.sm90.wgrad_config import WgradPlan

    for per_split in (k_tiles, 2, 1):
        plan = WgradPlan(cfg, per_split, math.ceil(k_tiles / per_split), tiles)
        runs = []
        for _ in range(2):
            dw = torch.full(w_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            dw = dw.contiguous(memory_format=torch.channels_last)
            launch.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), geometry, plan)
            assert_good(dw, want, low)
            runs.append(dw)
        assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("cfg", WGRAD_CONFIGS, ids=lambda c: f"{c.tile_m}x{c.tile_n}")
def test_wgrad_every_tile_and_split(cfg):
    """The weight-gradient kernel with each tile, unsplit and split (the parts parked and
    summed by the last): K = 136 (a ragged K tile), C = 200 (a ragged channel tile and, for
    tile_n 256, a box past C), 3x3 stride 2 over 2 x 29 x 31 (463 pixels: a ragged k-tile);
    twice, bitwise equal (the parts are summed in split order whatever order they finish)."""
    from forgekernel.kernels.conv.sm90.wgrad_config import wgrad_tiles

    g = torch.Generator(device="cuda").manual_seed(2)
    x_shape, w_shape, kw = (2, 200, 29, 31), (136, 200, 3, 3), {"stride": 2, "padding": 1}
    x = rnd(*x_shape, gen=g)
    dy = rnd(*conv_ref(x, rnd(*w_shape, gen=g), **kw).shape, gen=g)
    want = conv_wgrad_ref(dy, x, w_shape, **kw)
    low = _torch_grads(dy, x, torch.empty(w_shape, device="cuda", dtype=x.dtype), kw, "dw")
    tiles = wgrad_tiles(cfg, 136, 200, 9)
    k_tiles = math.ceil(dy.numel() // 136 / 64)
    geometry = op._geometry(2, (3, 3), 2, 1, 1)
    _wgrad_every_split(cfg, tiles, k_tiles, dy, x, w_shape, geometry, want, low)


@pytest.mark.parametrize("cfg", WGRAD_CONFIGS, ids=lambda c: f"{c.tile_m}x{c.tile_n}")
@pytest.mark.parametrize(
    "x_shape, f, kw, rect",
    [
        ((2, 200, 29, 31), 3, {"padding": 1}, 8),  # 8 x 8 rectangles, ragged in P and Q
        ((1, 200, 30, 30), 3, {"padding": 1, "dilation": 2}, 16),  # 16 x 4 over 28 x 28
        ((2, 200, 7, 9), 3, {"padding": (2, 0)}, 8),  # padding past the filter's reach
        ((2, 200, 14, 8), 1, {"padding": 0}, 8),  # 1x1: one plane of 8-pixel rows
    ],
    ids=["rect8", "rect16", "rect8-pad2", "flat1x1"],
)
def test_wgrad_rectangles_every_tile_and_split(cfg, x_shape, f, kw, rect):
    """The stride-1 weight gradient (rectangles of output pixels through tiled TMAs; the TMA's
    zero fill is the padding and the rectangles' part past P and Q) with each tile, unsplit
    and split: K = 136, C = 200, 3x3 (and an unpadded 1x1 over 224 pixels, dy and x seen as
    one plane 8 pixels wide); twice, bitwise equal."""
    from forgekernel.kernels.conv.sm90.wgrad_config import wgrad_tiles

    g = torch.Generator(device="cuda").manual_seed(3)
    w_shape = (136, 200, f, f)
    x = rnd(*x_shape, gen=g)
    dy = rnd(*conv_ref(x, rnd(*w_shape, gen=g), **kw).shape, gen=g)
    want = conv_wgrad_ref(dy, x, w_shape, **kw)
    low = _torch_grads(dy, x, torch.empty(w_shape, device="cuda", dtype=x.dtype), kw, "dw")
    tiles = wgrad_tiles(cfg, 136, 200, f * f)
    n, _, p, q = dy.shape
    plane = (1, 1, n * p * q // 8, 8) if f == 1 else (n, 1, p, q)
    walk = launch._wgrad_walk(True, *plane)
    assert walk[0] == rect
    k_tiles = walk[1]
    geometry = op._geometry(2, (f, f), 1, kw["padding"], kw.get("dilation", 1))
    _wgrad_every_split(cfg, tiles, k_tiles, dy, x, w_shape, geometry, want, low)


def _sums_left_zero(made: bool = True) -> bool:
    """Every reduce split's sum slots left zero (runtime/scratch.py's `conv_wgrad.sums`); at
    least one such buffer where `made`."""
    from forgekernel.runtime import scratch

    bufs = [v for key, v in scratch._FLAGS.items() if key[0] == "conv_wgrad.sums"]
    return (bool(bufs) or not made) and all(not b.any() for b in bufs)


@pytest.mark.parametrize("cfg", WGRAD_REDUCE_CONFIGS, ids=lambda c: c.tag())
@pytest.mark.parametrize(
    "x_shape, f, kw",
    [
        ((2, 200, 14, 8), 1, {"padding": 0}),  # 1x1: one plane of 8-pixel rows
        ((2, 200, 29, 31), 3, {"padding": 1}),  # 8 x 8 rectangles, ragged in P and Q
    ],
    ids=["flat1x1", "rect8"],
)
def test_wgrad_reduce_every_tile_and_split(cfg, x_shape, f, kw):
    """The reduce split (each part bulk-reduce-added into its tile's one fp32 slot, the last
    part taking and zeroing it) with each of its tiles on the 8-wide rectangles, unsplit and at
    2 and 1 k-tiles a part: K = 136, C = 200; three runs each, all good against the reference
    and equal up to the parts' fp32 order, the slots left zero for the next launch."""
    from forgekernel.kernels.conv.sm90.wgrad_config import WgradPlan, wgrad_tiles

    g = torch.Generator(device="cuda").manual_seed(5)
    w_shape = (136, 200, f, f)
    x = rnd(*x_shape, gen=g)
    dy = rnd(*conv_ref(x, rnd(*w_shape, gen=g), **kw).shape, gen=g)
    want = conv_wgrad_ref(dy, x, w_shape, **kw)
    low = _torch_grads(dy, x, torch.empty(w_shape, device="cuda", dtype=x.dtype), kw, "dw")
    n, _, p, q = dy.shape
    walk = launch._wgrad_walk(True, *((1, 1, n * p * q // 8, 8) if f == 1 else (n, 1, p, q)))
    assert walk[0] == 8
    geometry = op._geometry(2, (f, f), 1, kw["padding"], 1)
    tiles = wgrad_tiles(cfg, 136, 200, f * f)
    for per_split in (walk[1], 2, 1):
        plan = WgradPlan(cfg, per_split, math.ceil(walk[1] / per_split), tiles, reduce=True)
        runs = []
        for _ in range(3):
            dw = torch.full(w_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
            dw = dw.contiguous(memory_format=torch.channels_last)
            launch.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), geometry, plan)
            assert_good(dw, want, low)
            runs.append(dw.float())
        assert all(torch.allclose(r, runs[0], rtol=1e-2, atol=1e-2) for r in runs[1:])
        assert _sums_left_zero(made=plan.parts > 1)


@pytest.mark.parametrize(
    "n, c, k, hw",
    [
        (32, 64, 64, 56),
        (32, 256, 128, 56),
        (32, 64, 256, 56),
        (32, 256, 64, 56),
        (32, 512, 256, 28),
        (32, 128, 512, 28),
        (32, 512, 128, 28),
        (32, 1024, 512, 14),
        (3, 72, 136, 17),  # 867 pixels: its own planes, 8 x 8 rectangles ragged in P and Q
        (5, 200, 40, 13),  # 845 pixels: ragged K and C tiles
    ],
)
def test_wgrad_reduce_on_the_suite_1x1s(n, c, k, hw):
    """The reduce split's chosen plan (launch.wgrad's `reduce`, the bench's `reduce` variant)
    on the suite's 1x1s it is timed on and two odd sizes, twice: against the fp64 reference,
    the sum slots left zero."""
    g = torch.Generator(device="cuda").manual_seed(7)
    w_shape = (k, c, 1, 1)
    x, dy = rnd(n, c, hw, hw, gen=g), rnd(n, k, hw, hw, gen=g)
    x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    want = conv_wgrad_ref(dy, x, w_shape)
    low = _torch_grads(dy, x, torch.empty(w_shape, device="cuda", dtype=x.dtype), {}, "dw")
    for _ in range(2):
        dw = torch.full(w_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        dw = dw.contiguous(memory_format=torch.channels_last)
        launch.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), op._geometry(2, (1, 1), 1, 0, 1),
                     reduce=True)  # fmt: skip
        assert_good(dw, want, low)
    assert _sums_left_zero(made=False)  # the odd sizes may plan no split


def test_wgrad_reduce_replays_in_a_cuda_graph():
    """The reduce split captured (its sum slots the capture's own, zeroed once per replay by
    the graph, left zero by the launch): a replay gives the eager result up to the parts'
    order, twice."""
    x, dy = rnd(32, 64, 56, 56), rnd(32, 64, 56, 56)
    x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    geometry = op._geometry(2, (1, 1), 1, 0, 1)

    def call():
        dw = torch.empty(64, 64, 1, 1, device="cuda", dtype=torch.bfloat16)
        launch.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), geometry, reduce=True)
        return dw

    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(captured.float(), eager.float(), rtol=1e-2, atol=1e-2)


FORWARD = [
    ((1, 3, 17, 19), (5, 3, 3, 3), {"padding": 1}),
    ((2, 24, 13, 11), (40, 24, 5, 5), {"stride": 2, "padding": 2}),
    ((3, 72, 9, 7), (136, 72, 3, 3), {"dilation": 2, "padding": 2}),
    ((1, 16, 7, 7), (24, 16, 7, 7), {"padding": 3}),
    ((2, 8, 15, 15), (8, 8, 3, 3), {"stride": 3}),
    ((1, 8, 6, 7), (16, 8, 2, 4), {"padding": "same"}),
    ((8, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    ((1, 8, 5, 7, 6), (16, 8, 3, 3, 3), {"padding": 1}),
    ((2, 24, 4, 9, 8), (40, 24, 1, 3, 3), {"stride": (1, 2, 2), "padding": (0, 1, 1)}),
    ((1, 128, 4, 16, 16), (128, 128, 3, 3, 3), {"padding": 1}),
    ((2, 3, 1, 9, 8), (16, 3, 1, 3, 3), {"padding": 1}),  # one plane padded in depth: Z = 3
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, w_shape, kw", FORWARD)
def test_forward(x_shape, w_shape, kw, dtype):
    x, w, b = rnd(*x_shape, dtype=dtype), rnd(*w_shape, dtype=dtype), rnd(w_shape[0], dtype=dtype)
    conv, ours = (F.conv2d, op.conv2d) if len(x_shape) == 4 else (F.conv3d, op.conv3d)
    y = ours(x, w, b, **kw)
    assert_good(y, conv_ref(x, w, b, **kw), conv(x, w, b, **kw))


GRADIENTS = [
    ((2, 24, 13, 13), (40, 24, 3, 3), {"stride": 2, "padding": 1}),
    ((1, 8, 10, 9), (16, 8, 2, 2), {"stride": 2}),
    ((1, 8, 9, 8), (16, 8, 2, 2), {"stride": 2, "padding": 1}),  # phases with padding < 0
    ((2, 64, 15, 15), (72, 64, 1, 1), {"stride": 2}),
    ((1, 16, 11, 12), (8, 16, 5, 5), {"stride": 2, "padding": 2}),
    ((1, 8, 13, 13), (8, 8, 3, 3), {"stride": 3, "padding": 1}),
    ((1, 16, 14, 14), (16, 16, 3, 3), {"stride": 2, "padding": 2, "dilation": 2}),
    ((2, 40, 9, 11), (24, 40, 3, 3), {"padding": 1}),
    ((4, 128, 28, 28), (256, 128, 3, 3), {"stride": 2, "padding": 1}),
    ((1, 8, 5, 6, 7), (16, 8, 3, 3, 3), {"stride": (1, 2, 2), "padding": 1}),
    ((1, 16, 5, 7, 6), (24, 16, 3, 3, 3), {"stride": 2, "padding": 1}),  # eight phases fused
    ((1, 24, 5, 7, 6), (16, 24, 1, 1, 1), {"stride": 2}),  # seven phases of no tap
    ((2, 72, 17, 15), (136, 72, 4, 4), {"stride": 2, "padding": 1}),
    ((1, 16, 13, 11), (24, 16, 7, 7), {"stride": 2, "padding": 3}),
    ((1, 16, 9, 8), (8, 16, 3, 3), {"stride": (2, 1), "padding": 1}),
    ((2, 3, 30, 30), (64, 3, 7, 7), {"stride": 2, "padding": 3}),  # the stem: the im2col path
    ((2, 3, 1, 9, 8), (16, 3, 1, 3, 3), {"padding": 1}),  # not the stem's path: Z = 3 planes
]


def _torch_grads(dy, x, w, kw, which):
    """PyTorch's (cuDNN) gradient in the input dtype: the low-precision yardstick."""
    d = x.dim() - 2
    stride = kw.get("stride", 1)
    stride = [stride] * d if isinstance(stride, int) else list(stride)
    pad = kw.get("padding", 0)
    pad = [pad] * d if isinstance(pad, int) else list(pad)
    dil = [kw.get("dilation", 1)] * d
    mask = [which == "dx", which == "dw", False]
    g = torch.ops.aten.convolution_backward(dy, x, w, None, stride, pad, dil, False, [0] * d, 1,
                                            mask)  # fmt: skip
    return g[0] if which == "dx" else g[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, w_shape, kw", GRADIENTS)
def test_data_and_weight_gradients(x_shape, w_shape, kw, dtype):
    x, w = rnd(*x_shape, dtype=dtype), rnd(*w_shape, dtype=dtype)
    dy = rnd(*conv_ref(x, w, **kw).shape, dtype=dtype)
    d2 = len(x_shape) == 4
    dgrad = op.conv2d_dgrad if d2 else op.conv3d_dgrad
    wgrad = op.conv2d_wgrad if d2 else op.conv3d_wgrad
    assert_good(dgrad(dy, w, x_shape, **kw), conv_dgrad_ref(dy, w, x_shape, **kw),
                _torch_grads(dy, x, w, kw, "dx"))  # fmt: skip
    assert_good(wgrad(dy, x, w_shape, **kw), conv_wgrad_ref(dy, x, w_shape, **kw),
                _torch_grads(dy, x, w, kw, "dw"))  # fmt: skip


def test_autograd_end_to_end():
    x = rnd(4, 32, 20, 20).requires_grad_()
    w = rnd(64, 32, 3, 3).requires_grad_()
    b = rnd(64).requires_grad_()
    y = op.conv2d(x, w, b, stride=2, padding=1)
    dy = torch.randn_like(y)
    y.backward(dy)
    kw = {"stride": 2, "padding": 1}
    assert_good(x.grad, conv_dgrad_ref(dy, w, x.shape, **kw), _torch_grads(dy, x, w, kw, "dx"))
    assert_good(w.grad, conv_wgrad_ref(dy, x, w.shape, **kw), _torch_grads(dy, x, w, kw, "dw"))
    assert torch.allclose(b.grad.float(), dy.float().sum((0, 2, 3)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("what", ["fwd", "dgrad_s1", "dgrad_s2", "dgrad_1x1_s2", "wgrad"])
def test_cuda_graph_capture_replays_the_eager_result(what):
    x, w = rnd(2, 64, 28, 28), rnd(128, 64, 3, 3)
    dy, dy1 = rnd(2, 128, 14, 14), rnd(2, 128, 28, 28)
    w1 = rnd(128, 64, 1, 1)
    calls = {
        "fwd": lambda: op.conv2d(x, w, stride=2, padding=1),
        "dgrad_s1": lambda: op.conv2d_dgrad(dy1, w, x.shape, padding=1),
        "dgrad_s2": lambda: op.conv2d_dgrad(dy, w, x.shape, stride=2, padding=1),
        "dgrad_1x1_s2": lambda: op.conv2d_dgrad(dy, w1, x.shape, stride=2),
        "wgrad": lambda: op.conv2d_wgrad(dy, x, w.shape, stride=2, padding=1),
    }
    eager = calls[what]()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[what]()  # warm-up: compiles, plans, workspaces outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = calls[what]()
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_torch_compile():
    x, w = rnd(2, 16, 12, 12).requires_grad_(), rnd(32, 16, 3, 3).requires_grad_()

    @torch.compile(fullgraph=True)
    def f(x, w):
        return op.conv2d(x, w, padding=1).float().square().mean()

    loss = f(x, w)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_inputs_in_other_layouts():
    x = rnd(2, 24, 13, 26)[..., ::2]  # strided NCHW
    w = rnd(40, 24, 3, 3)  # NCHW-contiguous weight
    y = op.conv2d(x, w, padding=1)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_good(y, conv_ref(x, w, padding=1), F.conv2d(x, w, padding=1))
