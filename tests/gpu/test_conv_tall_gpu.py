"""The conv3d forward candidates of docs/conv/NOTES.md "256 x 128 for the K = 128 conv3d layers"
on the GPU against the fp64 reference: config.TALL (256x128 c2x1, two m64 atoms a consumer
warpgroup; bench variant `m256`; `m256e64` with 256 x 64 epilogue sub-tiles), 128x256 c2x1
with a 64-column epilogue (`epi64`) and 128x128 c2x1 with each tile's epilogue overlapped with
the next tile's mainloop (`ovl`: several tiles a CTA, both accumulators, the last one drained), on
awkward 3-D problems (odd T / H / W, padding, dilation, stride 2, C and K off the tile, bias),
into a channel slice of a NaN-poisoned wider buffer, on each walk the launcher gives them
(rectangles at stride 1, the im2col walk otherwise); then on a suite-like K = 128 layer at
reduced batch, where each must also equal the standard plan bit for bit (the same k-tile order
and the same HGMMA k-steps per output element: only the epilogue's placement differs).
Criterion: test_conv_gpu.py's (our error <= 2 x PyTorch's in bf16 + 1e-3)."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import launch
from forgekernel.kernels.conv.sm90.config import LARGE, SQUARE, TALL, SplitPlan
from forgekernel.kernels.conv.sm90.geometry import rect_width
from forgekernel.reference.conv import conv_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.conv")
EPI64 = replace(LARGE, epi_n=64, epi_stages=2)
CONFIGS = {
    "m256": TALL,
    "m256e64": replace(TALL, epi_n=64, epi_stages=1),
    "epi64": EPI64,
    "ovl": SQUARE,  # with the overlapped epilogue (a SplitPlan's `overlap`)
}


def _plan(name, rect):
    """The candidate as the launcher takes it: a config (its rectangles chosen), or for `ovl`
    SQUARE's SplitPlan with the overlap on the walk `rect`."""
    if name == "ovl":
        return SplitPlan(SQUARE, 1, 0, 0, rect, overlap=True)
    return CONFIGS[name]


def rnd(*shape, gen=None):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)


def assert_good(ours, want, low):
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    err = float((ours.float() - want).abs().max())
    assert torch.isfinite(ours).all() and err <= bound, (err, bound)


SHAPES = [
    # x (N, C, D, H, W), K, filter, conv kwargs
    ((2, 72, 5, 9, 11), 136, (3, 3, 3), {"padding": 1}),  # one 16 x 16 rectangle a plane
    ((1, 24, 3, 19, 21), 40, (1, 3, 3), {"padding": (0, 2, 1)}),  # 8 x 32, ragged P and Q
    ((1, 16, 4, 7, 33), 200, (3, 3, 3), {"padding": 2, "dilation": 2}),
    ((2, 72, 7, 13, 11), 40, (3, 3, 3), {"padding": 1, "stride": 2}),  # the im2col walk
    # the im2col walk with several tiles a CTA on 6 SMs (14 M x 2 N tiles of 128x128 over 3
    # clusters: 4-5 a CTA, `ovl`'s overlapped sub-tiles on this walk; the one above has 1), K
    # ragged
    ((2, 72, 7, 29, 27), 136, (3, 3, 3), {"padding": 1, "stride": 2}),
    ((3, 136, 3, 17, 15), 264, (3, 3, 3), {"padding": 1}),  # C, K off every tile
    ((1, 8, 1, 1, 1), 8, (1, 1, 1), {}),  # one pixel
]


@pytest.fixture(params=[None, 6], ids=["all-sms", "6-sms"])
def sms(request, monkeypatch):
    """The launcher's SM count: the device's, or 6 (3 clusters: every CTA walks several tiles,
    so that `ovl` stores tiles from both accumulators and drains either; the persistent loop
    of the others too)."""
    launch.clear_plans()
    if request.param is not None:
        monkeypatch.setattr(launch, "num_sms", lambda *_: request.param)
    yield request.param
    launch.clear_plans()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_candidate_on_awkward_3d_problems(name, shape, sms):
    x_shape, k, f, kw = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(shape)
    x, w, b = rnd(*x_shape, gen=g), rnd(k, x_shape[1], *f, gen=g), rnd(k, gen=g)
    want = conv_ref(x, w, b, **kw)
    low = F.conv3d(x, w, b, **kw)
    stride, pad, dil = kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1)
    geometry = op._geometry(3, f, stride, pad, dil)
    rect = rect_width(*want.shape[3:5], 128) if stride == 1 and f != (1, 1, 1) else 0
    # the im2col walk writes y in place only when it is compact (a channel slice would go
    # through the launcher's scratch buffer, not NaN-poisoned: a reused block may still hold
    # an earlier run's correct output), so the slice only on the rectangles
    extra = 8 if rect else 0
    wide = torch.full((want.shape[0], k + extra, *want.shape[2:]), float("nan"), device="cuda")
    wide = wide.to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    y = wide[:, :k]
    plan = _plan(name, rect)
    if name == "ovl" and f == (1, 1, 1):  # one k-tile a tile: the overlap is refused
        with pytest.raises(ValueError, match="overlap"):
            launch.fprop(op._as5d(x), op._as5d(w), b, op._view5d(y), geometry, plan)
        return
    launch.fprop(op._as5d(x), op._as5d(w), b, op._view5d(y), geometry, plan)
    assert_good(y, want, low)
    assert bool(wide[:, k:].isnan().all())


@pytest.mark.parametrize(
    "name, c, k, f",
    [
        ("m256", 128, 128, (3, 3, 3)),
        ("m256", 128, 128, (1, 3, 3)),
        ("m256e64", 128, 128, (3, 3, 3)),
        ("ovl", 128, 128, (3, 3, 3)),
        ("ovl", 128, 128, (1, 3, 3)),
        ("epi64", 128, 256, (3, 3, 3)),
    ],
)
def test_candidate_equals_the_standard_plan_on_a_suite_layer(name, c, k, f, sms):
    """n1 x 4 x 64 x 64 (the suite's planes, 4 output planes): the launcher's own plan and the
    candidate's as the bench passes it (unsplit, rectangles 8 wide)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x, w = rnd(1, c, 4, 64, 64, gen=g), rnd(k, c, *f, gen=g)
    pad = tuple(v // 2 for v in f)
    want = conv_ref(x, w, None, padding=pad)
    low = F.conv3d(x, w, None, padding=pad)
    geometry = op._geometry(3, f, 1, pad, 1)
    outs = []
    given = SplitPlan(CONFIGS[name], 1, 0, 0, 8, overlap=name == "ovl")
    for plan in (None, given):
        y = torch.full_like(low, float("nan")).contiguous(memory_format=torch.channels_last_3d)
        launch.fprop(op._as5d(x), op._as5d(w), None, op._view5d(y), geometry, plan)
        assert_good(y, want, low)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
