"""The forward kernel's stride-1 output rectangles (kernel.py, `rect` > 0), on the CPU: the walk
(geometry.rect_origin / rect_count with tile_m pixels) covers every output pixel once; the
kernel's model (emulate.run with `rect`: A a tiled box of x at the rectangle shifted by the tap,
zero outside x; rows stored to the rectangle's pixels inside Y) is torch's convolution for
every tile, both widths, padding (asymmetric, past the filter's reach), dilation, 3-D, splits
run in a random order; the chooser (rectangles where the im2col rate bound the tile) and the
launcher (which walk and compile key it asks for: a user's 1x1 filter the im2col walk, the
stem's im2col and a strided data gradient's 1x1 phases rectangles)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.kernels.conv.sm90.config import (
    BASE_CONFIGS,
    CANDIDATES,
    LARGE,
    SQUARE,
    STANDARD_CONFIGS,
    SplitPlan,
    choose_plan,
    split_tiles,
)
from forgekernel.kernels.conv.sm90.geometry import (
    RECT_WIDTHS,
    Geometry,
    rect_count,
    rect_origin,
    rect_width,
)

F64 = torch.float64


def _geometry(f, pad, dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), (1, 1, 1), tuple(dil))


def _torch_conv(x, w, bias, g: Geometry):
    pad = [v for d in (2, 1, 0) for v in (g.pad_lo[d], g.pad_hi[d])]
    return F.conv3d(F.pad(x, pad), w, bias, stride=g.stride, dilation=g.dilation)


def _cl5(t):
    return t.permute(0, 2, 3, 4, 1)


@pytest.mark.parametrize("pixels", [64, 128])
@pytest.mark.parametrize("rq", RECT_WIDTHS)
@pytest.mark.parametrize("n, z, p, q", [(2, 3, 7, 7), (1, 1, 56, 56), (3, 2, 17, 9), (1, 1, 1, 1)])
def test_the_rectangles_cover_every_output_pixel_once(pixels, rq, n, z, p, q):
    seen = torch.zeros(n, z, p, q, dtype=torch.int64)
    rp = pixels // rq
    for tile in range(rect_count(n, z, p, q, rq, pixels)):
        ni, zi, p0, q0 = rect_origin(tile, z, p, q, rq, pixels)
        assert p0 % rp == 0 and q0 % rq == 0 and p0 < p and q0 < q
        seen[ni, zi, p0 : p0 + rp, q0 : q0 + rq] += 1
    assert bool((seen == 1).all())


def test_the_forward_rectangle_widths():
    # 56 x 56 with 128 pixels: 8 x 16 or 16 x 8 both leave an eighth zero-filled, 8 first
    assert rect_width(56, 56, 128) == 8 and rect_count(1, 1, 56, 56, 8, 128) == 28
    assert rect_width(28, 28, 128) == 8 and rect_count(1, 1, 28, 28, 16, 128) == 8  # a tie
    assert rect_width(12, 40, 128) == 8  # 8 x 16: 5 tiles; 16 x 8: 6
    assert rect_count(1, 1, 64, 64, 16, 128) == 32  # no zero fill


CASES = [
    (2, 20, 24, (3, 9, 11), _geometry((3, 3, 3), (1, 1, 1))),
    (1, 72, 136, (1, 19, 21), _geometry((1, 3, 3), (0, 2, 1), (1, 2, 1))),
    (2, 8, 16, (1, 12, 13), _geometry((1, 2, 2), (0, 0, 1), pad_hi=(0, 1, 0))),
    (1, 16, 40, (2, 6, 5), _geometry((1, 3, 3), (0, 3, 4), pad_hi=(0, 1, 0))),  # past the reach
    (3, 24, 8, (1, 7, 7), _geometry((1, 1, 1), (0, 0, 0))),
]


@pytest.mark.parametrize("rect", RECT_WIDTHS)
@pytest.mark.parametrize("cfg", BASE_CONFIGS + CANDIDATES[1:2], ids=lambda c: c.tag())
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_rectangles_model_is_torchs_convolution(cfg, rect, case):
    n, c, k, size, g = CASES[case]
    torch.manual_seed(case)
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    bias = torch.randn(k, dtype=F64)
    want = _cl5(_torch_conv(x, w, bias, g))
    y = torch.full(want.shape, float("nan"), dtype=F64)
    emulate.run(_cl5(x).contiguous(), _cl5(w).contiguous(), y, bias, g, cfg, rect=rect)
    assert torch.allclose(y, want, atol=1e-10)


@pytest.mark.parametrize("per_split", [1, 2, 5])
@pytest.mark.parametrize("cfg", [replace(SQUARE, split=True), replace(LARGE, split=True)])
def test_split_rectangles_in_any_order(cfg, per_split):
    """Parts parked by tile index (rectangles, padded to whole clusters), summed by the last."""
    n, c, k, size, g = 3, 72, 40, (2, 9, 11), _geometry((3, 3, 3), (1, 1, 1))
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    want = _cl5(_torch_conv(x, w, None, g))
    fn = emulate.compiled(
        (("bias", False), ("rect", 8), *((f, getattr(cfg, f)) for f in cfg.__dataclass_fields__)),
        order_seed=per_split,
    )
    tiles = split_tiles(cfg, 0, k, tuple(want.shape[:4]), 8)
    parts = -(-(-(-c // 64) * 27) // per_split)
    work = torch.zeros(parts * tiles * cfg.tile_m * cfg.tile_n, dtype=torch.float32)
    flags = torch.zeros(tiles, dtype=torch.int32)
    y = torch.full(want.shape, float("nan"), dtype=F64)
    args = [*g.kernel_args(), per_split, 1]
    fn(_cl5(x).contiguous(), _cl5(w).contiguous(), y, None, work, flags, *args)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4) and not flags.any()


def test_the_chooser_takes_rectangles_where_the_im2col_rate_bound():
    """conv3d C = 128 -> K = 128 (0.51-0.57x cuDNN on the im2col walk): rectangles; the tiles
    are counted in rectangles; without pixels (strided, dgrad) the im2col walk only."""
    pixels = (1, 16, 64, 64)
    m = 16 * 64 * 64
    plan = choose_plan(m, 128, 128, 27, 132, pixels, forward=True)
    assert plan.rect in RECT_WIDTHS and plan.config in STANDARD_CONFIGS
    assert plan.tiles == split_tiles(plan.config, m, 128, pixels, plan.rect)
    assert choose_plan(m, 128, 128, 27, 132, forward=True).rect == 0
    for n, hw, c, k, taps in itertools.product((1, 32), (7, 14, 56), (64, 512), (64, 256), (1, 9)):
        px = (n, 1, hw, hw)
        plan = choose_plan(n * hw * hw, k, c, taps, 132, px, forward=True)
        assert plan.rect in (0, *RECT_WIDTHS)
        assert plan.tiles == split_tiles(plan.config, n * hw * hw, k, px, plan.rect)


@pytest.fixture
def model_kernel(monkeypatch):
    keys = []

    def get_kernel(spec, params):
        keys.append(dict(params))
        return emulate.stand_in(spec, params)

    launch._plans.clear()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    yield keys
    launch._plans.clear()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_launcher_forward_on_rectangles(model_kernel, case):
    """Each standard tile forced (stride 1: rectangles of `rect_width`, a 1x1 filter's the
    im2col walk), the output a channel slice of a wider buffer (written in place through its
    strides: the extra channels stay NaN) and compact; a plan of the chooser."""
    n, c, k, size, g = CASES[case]
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    bias = torch.randn(k, dtype=F64)
    want = _cl5(_torch_conv(x, w, bias, g))
    for cfg in (None, *STANDARD_CONFIGS):
        wide = torch.full((*want.shape[:4], k + 8), float("nan"), dtype=F64)
        launch.fprop(_cl5(x), _cl5(w), bias, wide[..., :k], g, cfg)
        assert torch.allclose(wide[..., :k], want, rtol=1e-6, atol=1e-5)
        assert bool(wide[..., k:].isnan().all())
        key = model_kernel[-1]
        if cfg is not None:
            p, q = want.shape[2:4]
            assert key["rect"] == (0 if g.filter == (1, 1, 1) else rect_width(p, q, cfg.tile_m))
    plan = SplitPlan(STANDARD_CONFIGS[0], 10**6, 1, 0, 0)  # a plan on the im2col walk
    y = torch.full(want.shape, float("nan"), dtype=F64)
    launch.fprop(_cl5(x), _cl5(w), bias, y, g, plan)
    assert model_kernel[-1]["rect"] == 0 and torch.allclose(y, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "size, f, pad, stride, dil",
    [
        ((3, 9, 11), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),  # stride 1: one launch
        ((1, 12, 13), (1, 3, 3), (0, 5, 2), (1, 1, 1), (1, 2, 1)),  # past the reach: a crop
        ((1, 14, 13), (1, 3, 3), (0, 1, 1), (1, 3, 3), (1, 1, 1)),  # stride 3: phases, strided dx
    ],
)
def test_the_data_gradient_mode_on_rectangles(model_kernel, size, f, pad, stride, dil):
    """The stride-1 data gradient (and each phase of a stride-3 one: a stride-1 forward of dy
    with the phase's taps) walks rectangles of dx's pixels where its plan says so (a SplitPlan
    of rectangles here: the chooser takes the im2col walk on problems this small, config.py
    RECT_START): dy a tiled box at the tap's offset, B's reversed taps unchanged; against
    autograd, the chosen plan too."""
    g = Geometry(f, pad, pad, stride, dil)
    x = torch.randn(2, 16, *size, dtype=F64, requires_grad=True)
    w = torch.randn(24, 16, *f, dtype=F64)
    want = _torch_conv(x, w, None, g)
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    for plan in (None, SplitPlan(SQUARE, 10**6, 1, 0, 8)):
        dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
        launch.dgrad(_cl5(dy), _cl5(w), dx, g, plan)
        assert torch.allclose(dx, _cl5(dx_want), rtol=1e-6, atol=1e-5)
    assert any(key["dgrad"] and key["rect"] for key in model_kernel)


def _calls(monkeypatch):
    """Every kernel call through the model: (compile key, y as the kernel sees it)."""
    calls = []

    def get_kernel(spec, params):
        model = emulate.stand_in(spec, params)

        def fn(*args):
            calls.append((dict(params), args[2]))
            return model(*args)

        return fn

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    return calls


@pytest.mark.parametrize("pad", [0, 1])
def test_a_users_1x1_at_stride_1_walks_im2col_rows(model_kernel, monkeypatch, pad):
    """A 1x1 filter at stride 1 (unpadded or padded), forward and data gradient, chosen or
    forced: the im2col walk (compile key rect 0, y written in place as (M, K) rows). H200
    (docs/conv/NOTES.md, "Measured: rectangles"): the 1x1 layers lost up to half their rate on
    one-plane rectangles against the im2col walk. A SplitPlan of rectangles asked for by name
    (scripts/conv_fwd_walks.py) still gets them, the unpadded 1x1 as one plane 8 pixels wide."""
    calls = _calls(monkeypatch)
    g = _geometry((1, 1, 1), (0, pad, pad))
    x = torch.randn(2, 16, 1, 8, 6, dtype=F64, requires_grad=True)
    w = torch.randn(24, 16, 1, 1, 1, dtype=F64)
    bias = torch.randn(24, dtype=F64)
    want = _torch_conv(x, w, bias, g)
    for cfg in (None, *STANDARD_CONFIGS):
        y = torch.full(_cl5(want).shape, float("nan"), dtype=F64)
        launch.fprop(_cl5(x), _cl5(w), bias, y, g, cfg)
        assert torch.allclose(y, _cl5(want), rtol=1e-6, atol=1e-5)
        key, y_seen = calls[-1]
        assert key["rect"] == 0 and y_seen.dim() == 2 and y_seen.data_ptr() == y.data_ptr()
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
    launch.dgrad(_cl5(dy), _cl5(w), dx, g)
    assert torch.allclose(dx, _cl5(dx_want), rtol=1e-6, atol=1e-5)
    key, dx_seen = calls[-1]
    assert key["dgrad"] and key["rect"] == 0 and dx_seen.dim() == 2
    plan = SplitPlan(STANDARD_CONFIGS[0], 10**6, 1, 0, 8)  # rectangles asked for by name
    y = torch.full(_cl5(want).shape, float("nan"), dtype=F64)
    launch.fprop(_cl5(x), _cl5(w), bias, y, g, plan)
    assert torch.allclose(y, _cl5(want), rtol=1e-6, atol=1e-5)
    key, y_seen = calls[-1]
    assert key["rect"] == 8 and y_seen.shape[:4] == ((1, 1, 12, 8) if not pad else y.shape[:4])


def test_the_stem_and_stride3_1x1_phases_keep_rectangles(model_kernel, monkeypatch):
    """The callers that may take rectangles on a 1x1: the few-channel stem (a 1x1 over its
    im2col, one plane 8 pixels wide: the chooser's walk, im2col rows on one this small
    (config.py RECT_START), rectangles when forced) and a strided data gradient's 1x1 phases
    (each written straight into its strided view of dx: rectangles only, chosen or forced)."""
    calls = _calls(monkeypatch)
    g = Geometry((1, 3, 3), (0, 1, 1), (0, 1, 1), (1, 1, 1))
    x = torch.randn(2, 3, 1, 8, 8, dtype=F64)
    w = torch.randn(16, 3, 1, 3, 3, dtype=F64)
    chosen = choose_plan(128, 16, 32, 1, 132, (1, 1, 16, 8), forward=True)  # the stem: C 27 -> 32
    assert chosen.rect == 0
    for cfg, rect, shape in ((None, 0, (128,)), (STANDARD_CONFIGS[0], 8, (1, 1, 16, 8))):
        y = torch.full((2, 1, 8, 8, 16), float("nan"), dtype=F64)
        launch.fprop(_cl5(x), _cl5(w), None, y, g, cfg)
        assert torch.allclose(y, _cl5(_torch_conv(x, w, None, g)), rtol=1e-6, atol=1e-5)
        key, y_seen = calls[-1]
        assert key["rect"] == rect and tuple(y_seen.shape[: len(shape)]) == shape
    calls.clear()
    g = Geometry((1, 3, 3), (0, 1, 1), (0, 1, 1), (1, 3, 3))  # nine 1x1 phases
    x = torch.randn(2, 16, 1, 14, 13, dtype=F64, requires_grad=True)
    w = torch.randn(24, 16, 1, 3, 3, dtype=F64)
    want = _torch_conv(x, w, None, g)
    dy = torch.randn_like(want)
    (dx_want,) = torch.autograd.grad(want, x, dy)
    for cfg in (None, STANDARD_CONFIGS[0]):
        dx = torch.full(_cl5(x).shape, float("nan"), dtype=F64)
        launch.dgrad(_cl5(dy), _cl5(w), dx, g, cfg)
        assert torch.allclose(dx, _cl5(dx_want), rtol=1e-6, atol=1e-5)
    assert len(calls) == 18
    for key, dx_seen in calls:
        assert key["dgrad"] and key["rect"] and dx_seen.dim() == 5
