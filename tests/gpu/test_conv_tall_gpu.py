"""The forward's 256x128 tile (config.TALL: 256x128 c2x1, two m64 atoms a consumer warpgroup;
docs/conv/NOTES.md "256 x 128 adopted") on the GPU against the fp64 reference: on awkward 3-D
problems (odd T / H / W, padding, dilation, stride 2, C and K off the tile, bias), into a channel
slice of a NaN-poisoned wider buffer, on each walk the launcher gives it (rectangles at stride 1,
the im2col walk otherwise), on all SMs and on 6 (every CTA several tiles); then as the launcher
takes it by itself (`config.takes_tall`) on the moved suite layers and one unmeasured member of
the class (C = 64), where it must equal `was` (the plan before: 128x128 c2x1 on rectangles 8
wide) bit for bit (the same k-tile order and HGMMA k-steps per output element: only the tile's
shape differs), in bf16 and fp16, the compile key the launcher fetched recorded (tile_m 256);
and next to the class's edges, where the launcher keeps 128x128. Criterion: test_conv_gpu.py's
(our error <= 2 x PyTorch's in the input dtype + 1e-3)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import launch
from forgekernel.kernels.conv.sm90.config import SQUARE, TALL, SplitPlan, choose_plan
from forgekernel.kernels.conv.sm90.geometry import rect_width
from forgekernel.reference.conv import conv_ref
from forgekernel.runtime.device import dtype_name

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.conv")
WAS = SplitPlan(SQUARE, 1, 0, 0, 8)  # the bench's `was` (the launcher recounts the rest)


def rnd(*shape, gen=None, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


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
    # the im2col walk with several tiles a CTA on 6 SMs, K ragged
    ((2, 72, 7, 29, 27), 136, (3, 3, 3), {"padding": 1, "stride": 2}),
    ((3, 136, 3, 17, 15), 264, (3, 3, 3), {"padding": 1}),  # C, K off every tile
    ((1, 8, 1, 1, 1), 8, (1, 1, 1), {}),  # one pixel
]


@pytest.fixture(params=[None, 6], ids=["all-sms", "6-sms"])
def sms(request, monkeypatch):
    """The launcher's SM count: the device's, or 6 (3 clusters: every CTA walks several tiles
    of the persistent loop)."""
    launch.clear_plans()
    if request.param is not None:
        monkeypatch.setattr(launch, "num_sms", lambda *_: request.param)
    yield request.param
    launch.clear_plans()


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_tall_on_awkward_3d_problems(shape, sms):
    x_shape, k, f, kw = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(shape)
    x, w, b = rnd(*x_shape, gen=g), rnd(k, x_shape[1], *f, gen=g), rnd(k, gen=g)
    want = conv_ref(x, w, b, **kw)
    low = F.conv3d(x, w, b, **kw)
    stride, pad, dil = kw.get("stride", 1), kw.get("padding", 0), kw.get("dilation", 1)
    geometry = op._geometry(3, f, stride, pad, dil)
    rect = rect_width(*want.shape[3:5], 256) if stride == 1 and f != (1, 1, 1) else 0
    # the im2col walk writes y in place only when it is compact (a channel slice would go
    # through the launcher's scratch buffer, not NaN-poisoned: a reused block may still hold
    # an earlier run's correct output), so the slice only on the rectangles
    extra = 8 if rect else 0
    wide = torch.full((want.shape[0], k + extra, *want.shape[2:]), float("nan"), device="cuda")
    wide = wide.to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    y = wide[:, :k]
    launch.fprop(op._as5d(x), op._as5d(w), b, op._view5d(y), geometry, TALL)
    assert_good(y, want, low)
    assert bool(wide[:, k:].isnan().all())


@pytest.fixture
def fetched(monkeypatch):
    """The forward compile keys the launcher fetches (`launch.get_kernel` wrapped), as dicts;
    the plans forgotten first (each holds the function it fetched)."""
    keys = []
    get_kernel = launch.get_kernel

    def recording(spec, params):
        if spec is launch.SPEC:
            keys.append(dict(params))
        return get_kernel(spec, params)

    launch.clear_plans()
    monkeypatch.setattr(launch, "get_kernel", recording)
    yield keys
    launch.clear_plans()


def _ours_and_was(n, c, k, size, f, fetched, dtype=torch.bfloat16):
    """The launcher's own plan (None) and `was` on x (n, c, *size), w (k, c, *f), padding "same",
    no bias: both outputs checked, returned, with the compile key the launcher fetched for its
    own plan."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x, w = rnd(n, c, *size, gen=g, dtype=dtype), rnd(k, c, *f, gen=g, dtype=dtype)
    pad = tuple(v // 2 for v in f)
    want = conv_ref(x, w, None, padding=pad)
    low = F.conv3d(x, w, None, padding=pad)
    geometry = op._geometry(3, f, 1, pad, 1)
    outs = []
    for plan in (None, WAS):
        y = torch.full_like(low, float("nan")).contiguous(memory_format=torch.channels_last_3d)
        fetched.clear()
        launch.fprop(op._as5d(x), op._as5d(w), None, op._view5d(y), geometry, plan)
        assert_good(y, want, low)
        outs.append(y)
        if plan is None:
            assert len(fetched) == 1, fetched  # one kernel, looked up once for the problem
            key = fetched[0]
    return (*outs, key)


def _takes_tall(n, c, k, size, f, sms):
    m = n * size[0] * size[1] * size[2]
    taps = f[0] * f[1] * f[2]
    num_sms = sms or torch.cuda.get_device_properties(0).multi_processor_count
    return choose_plan(m, k, c, taps, num_sms, (n, *size), forward=True).config == TALL


@pytest.mark.parametrize(
    "n, c, k, size, f",
    [
        (4, 128, 128, (16, 64, 64), (3, 3, 3)),  # the suite's three K = 128 layers
        (1, 128, 128, (16, 128, 128), (3, 3, 3)),
        (1, 128, 128, (16, 128, 128), (1, 3, 3)),
        (1, 64, 128, (16, 128, 128), (3, 3, 3)),  # in the class, unmeasured: 27 k-tiles
    ],
    ids=["n4-c128-3x3x3", "n1-c128-3x3x3", "n1-c128-1x3x3", "n1-c64-3x3x3"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_launchers_tall_equals_was_on_the_class(n, c, k, size, f, dtype, fetched):
    """The device's own SM count (the rule's rounds are the device's); the key the launcher
    fetched is TALL's (256x128 on rectangles 8 wide, forward, the input dtype), not only the
    chooser's pick."""
    assert _takes_tall(n, c, k, size, f, None)
    ours, was, key = _ours_and_was(n, c, k, size, f, fetched, dtype)
    assert (key["tile_m"], key["tile_n"], key["rect"], key["dgrad"]) == (256, 128, 8, False)
    assert key["dtype"] == dtype_name(dtype)
    assert torch.equal(ours, was)


@pytest.mark.parametrize(
    "n, c, k, size, f",
    [
        (1, 128, 128, (16, 128, 96), (1, 3, 3)),  # M below 2^18
        (1, 128, 136, (16, 128, 128), (1, 3, 3)),  # K 136
        (1, 128, 128, (16, 100, 128), (1, 3, 3)),  # P % 32: the 8 x 32 rectangles zero-filled
        (1, 64, 128, (16, 128, 128), (1, 3, 3)),  # 9 k-tiles
    ],
    ids=["m-below", "k136", "zero-fill", "9-k-tiles"],
)
def test_the_launcher_keeps_128x128_next_to_the_class(n, c, k, size, f, fetched):
    """Outside the class by one bound each: the launcher's own plan (not TALL: the key it
    fetched is not 256 rows) and `was`, both checked."""
    assert not _takes_tall(n, c, k, size, f, None)
    key = _ours_and_was(n, c, k, size, f, fetched)[2]
    assert key["tile_m"] != 256
