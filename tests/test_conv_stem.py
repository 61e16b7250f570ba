"""The stem fold (kernels/conv/sm90/stem.py; docs/conv/NOTES.md, "The stem as its own
kernel"): a stride-2 convolution of few channels as the stride-1 R' x 1 convolution of an
overlapping view of its space-to-depth image, run by the standard kernels. On the CPU through
the kernels' models (emulate.py: fp64 accumulation, the TMA boxes' zero fill) against fp64
references on odd sizes, every channel count and shift it takes; the launches it makes (no copy
of the view, standard compile keys); the bench variants."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script  # tests/ is on the path

from forgekernel.kernels.conv.sm90 import SPEC, WGRAD_SPEC, emulate, launch, stem
from forgekernel.kernels.conv.sm90.geometry import Geometry

op = importlib.import_module("forgekernel.ops.conv")


@pytest.fixture
def models(monkeypatch):
    """The kernels' CPU models in place of the compiled functions; the plans forgotten."""
    launch.clear_plans()
    monkeypatch.setattr(launch, "get_kernel", emulate.stand_in)
    yield
    launch.clear_plans()


def _rnd(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _assert_rounded(ours: torch.Tensor, want: torch.Tensor) -> None:
    """ours within twice the input dtype's rounding of the fp64 result (+ 1e-3): the models
    accumulate in fp64, so only the output's rounding may differ."""
    bound = 2 * float((want.to(ours.dtype).double() - want).abs().max()) + 1e-3
    err = float((ours.double() - want).abs().max())
    assert err <= bound, (err, bound)


def _geometry(f, pad_lo, pad_hi) -> Geometry:
    return Geometry((1, *f), (0, *pad_lo), (0, *pad_hi), (1, 2, 2))


# (n, c, (H, W), k, (R, S), pad_lo, pad_hi): the ResNet stem's shape at small sizes, odd and
# even maps, each shift (pad_lo even / odd per dim), channels 1 to 8 (cs 4 and 8), even and odd
# filters, padding above smaller and larger than below, windows that leave x's last rows unread
CASES = [
    (1, 3, (23, 21), 8, (7, 7), (3, 3), (3, 3)),
    (2, 3, (16, 18), 16, (7, 7), (3, 3), (3, 3)),
    (1, 3, (17, 19), 5, (3, 3), (1, 1), (1, 1)),
    (1, 1, (13, 12), 8, (5, 5), (2, 0), (2, 1)),
    (2, 4, (12, 12), 24, (4, 4), (0, 1), (1, 0)),
    (1, 5, (11, 16), 8, (6, 6), (3, 2), (3, 2)),
    (1, 8, (15, 9), 136, (7, 5), (3, 2), (0, 4)),
    (1, 3, (14, 15), 8, (7, 7), (0, 0), (0, 0)),
]


# the fold read through its view, through the view's compact copy, and written by the fold
# kernel (its model) instead of torch's fill and copy
WAYS = [(True, False), (False, False), (True, True)]
WAY_IDS = ["view", "copy", "fold-kernel"]


def _problem(n, c, hw, k, f, lo, hi, gen):
    x = _cl(_rnd(n, c, *hw, gen=gen))
    w = _cl(_rnd(k, c, *f, gen=gen))
    pads = [v for pair in zip(reversed(lo), reversed(hi)) for v in pair]  # F.pad: W first
    xp = F.pad(x.double(), pads)
    return x, w, xp


@pytest.mark.parametrize("overlap, kernel", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("n, c, hw, k, f, lo, hi", CASES)
def test_the_fold_is_the_stem_forward(models, n, c, hw, k, f, lo, hi, overlap, kernel):
    gen = torch.Generator().manual_seed(c * 100 + k)
    x, w, xp = _problem(n, c, hw, k, f, lo, hi, gen)
    bias = _rnd(k, gen=gen)
    want = F.conv2d(xp, w.double(), bias.double(), stride=2)
    g = _geometry(f, lo, hi)
    assert stem.fits(op._as5d(x), op._as5d(w), g)
    y = _cl(torch.full(want.shape, float("nan"), dtype=torch.bfloat16))
    stem.fprop(op._as5d(x), op._as5d(w), bias, op._view5d(y), g, overlap, kernel=kernel)
    _assert_rounded(y, want)


@pytest.mark.parametrize("overlap, kernel", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("n, c, hw, k, f, lo, hi", CASES)
def test_the_fold_is_the_stem_weight_gradient(models, n, c, hw, k, f, lo, hi, overlap, kernel):
    gen = torch.Generator().manual_seed(c * 100 + k + 1)
    x, w, xp = _problem(n, c, hw, k, f, lo, hi, gen)
    wd = w.double().requires_grad_()
    y = F.conv2d(xp, wd, stride=2)
    dy = _cl(_rnd(*y.shape, gen=gen))
    y.backward(dy.double())
    dw = _cl(torch.full(w.shape, float("nan"), dtype=torch.bfloat16))
    g = _geometry(f, lo, hi)
    stem.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), g, overlap, kernel=kernel)
    _assert_rounded(dw, wd.grad)


def test_the_folded_filter_puts_each_tap_once():
    """fold_filter then unfold_filter_grad is the identity (every tap, channel and shift), and
    the folded filter holds no other non-zero."""
    gen = torch.Generator().manual_seed(3)
    for c, f, lo in ((3, (7, 7), (3, 3)), (8, (5, 6), (2, 1)), (1, (4, 3), (0, 0))):
        w = _rnd(7, 1, *f, c, gen=gen)
        fold = stem.plan(c, f, _geometry(f, lo, lo), (9, 9))
        folded = stem.fold_filter(w, fold)
        assert folded.shape == (7, 1, fold.taps[0], 1, fold.channels)
        assert int((folded != 0).sum()) == int((w != 0).sum())
        back = torch.empty_like(w)
        stem.unfold_filter_grad(folded, fold, back)
        assert torch.equal(back, w)


def test_the_resnet_stem_fold():
    """n32-c3-224x224-k64-7x7-s2 pad 3: a 4 x 1 convolution of 64 channels over a 115 x 115
    image of 16-channel pixels (13.5 MB), its view's pixels 16 elements (32 bytes) apart, each
    window 4 folded pixels = the 64 channels of one k-tile."""
    g = _geometry((7, 7), (3, 3), (3, 3))
    fold = stem.plan(3, (7, 7), g, (112, 112))
    assert fold.taps == (4, 4) and fold.extents == (115, 115) and fold.shift == (1, 1)
    assert fold.pixel == 16 and fold.channels == 64 and fold.origin == (2, 2)
    x = torch.zeros(2, 1, 224, 224, 3, dtype=torch.bfloat16)
    view = stem.fold_input(x, fold)
    assert view.shape == (2, 1, 115, 112, 64)
    assert view.stride() == (115 * 115 * 16, 115 * 115 * 16, 115 * 16, 16, 1)
    assert view.untyped_storage().nbytes() == 2 * 115 * 115 * 16 * 2
    assert stem.fold_input(x, fold, overlap=False).is_contiguous()


def test_the_fold_places_x_at_its_padded_pixels():
    """Folded pixel (i, j) channel a x 8 + b x C + c is padded x's (2i + a, 2j + b, c) (pad lo
    + shift), zero past x and past 2C in each block row: element by element, even and odd."""
    gen = torch.Generator().manual_seed(5)
    for hw in ((224, 224), (13, 11)):
        x = _rnd(1, 1, *hw, 3, gen=gen)
        g = _geometry((7, 7), (3, 3), (3, 3))
        out = g.output((1, *hw))[1:]
        fold = stem.plan(3, (7, 7), g, out)
        folded = stem.fold_input(x, fold, overlap=False)[0, 0, :, :, :16]  # pixel j's own
        hs, q = folded.shape[:2]
        padded = torch.zeros(2 * hs, 2 * q, 3, dtype=x.dtype)
        h, w_ = min(hw[0], 2 * hs - 4), min(hw[1], 2 * q - 4)
        padded[4 : 4 + h, 4 : 4 + w_] = x[0, 0, :h, :w_]
        blocks = padded.view(hs, 2, q, 2, 3).permute(0, 2, 1, 3, 4)  # (i, j, a, b, c)
        want = torch.zeros(hs, q, 2, 8, dtype=x.dtype)
        want[..., :6] = blocks.reshape(hs, q, 2, 6)
        assert torch.equal(folded, want.reshape(hs, q, 16))


@pytest.mark.parametrize(
    "c, f, stride, dilation, fits",
    [
        (3, (7, 7), 2, 1, True),
        (8, (3, 3), 2, 1, True),
        (9, (7, 7), 2, 1, False),  # past MAX_CHANNELS (and launch's few channels)
        (3, (7, 7), 1, 1, False),  # stride 1: nothing to fold
        (3, (7, 7), 3, 1, False),
        (3, (7, 7), 2, 2, False),  # dilated
        (3, (1, 3), 2, 1, False),  # under launch.FEW_CHANNELS_TAPS taps
    ],
)
def test_what_folds(c, f, stride, dilation, fits):
    x = torch.empty(2, 1, 20, 20, c, device="meta")
    w = torch.empty(8, 1, *f, c, device="meta")
    g = op._geometry(2, f, stride, 1, dilation)
    assert stem.fits(x, w, g) is fits


def test_the_stem_launches_the_standard_kernels_on_the_view(monkeypatch):
    """The ResNet stem at batch 2: one forward and one weight-gradient launch, each given the
    overlapping view itself (the launchers copy nothing: the fold's 13.5 MB per image pair is
    the only buffer), the folded filter (64, 1, 4, 1, 64), and compile keys among the standard
    ones (`forgekernel build --only conv_fprop_sm90 --only conv_wgrad_sm90` builds them)."""
    calls = []

    def get_kernel(spec, params):
        def fn(*args):
            calls.append((spec.name, dict(params), args))

        return fn

    launch.clear_plans()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    g = op._geometry(2, (7, 7), 2, 3, 1)
    x = torch.zeros(2, 1, 224, 224, 3, dtype=torch.bfloat16)
    w = torch.zeros(64, 1, 7, 7, 3, dtype=torch.bfloat16)
    y = torch.empty(2, 1, 112, 112, 64, dtype=torch.bfloat16)
    stem.fprop(x, w, None, y, g)
    stem.wgrad(y, x, torch.empty_like(w), g)
    launch.clear_plans()
    (fwd, fwd_key, fwd_args), (bwd, bwd_key, bwd_args) = calls
    assert (fwd, bwd) == (SPEC.name, WGRAD_SPEC.name)
    views = fwd_args[0], bwd_args[1]
    for view in views:
        assert view.shape == (2, 1, 115, 112, 64) and view.stride()[-2:] == (16, 1)
        assert view.untyped_storage().nbytes() == 2 * 115 * 115 * 16 * 2
    assert fwd_args[1].shape == (64, 1, 4, 1, 64) and bwd_args[2].shape == (64, 1, 4, 1, 64)
    standard = {tuple(sorted(dict(p).items())) for p in SPEC.standard_params()}
    standard |= {tuple(sorted(dict(p).items())) for p in WGRAD_SPEC.standard_params()}
    assert tuple(sorted(fwd_key.items())) in standard
    assert tuple(sorted(bwd_key.items())) in standard
    # stride 1, no padding: the folded geometry's (the descriptor sees no stem geometry)
    assert fwd_args[6:18] == (0,) * 6 + (1,) * 6


def test_the_suites_time_the_fold_on_the_stem(models):
    """conv_fwd and conv_wgrad offer `stem_copy` / `im2col` on the ResNet
    stem and on no case the fold does not take; the variants compute the case (a small stem,
    on the models)."""
    from forgekernel.bench.suites import conv_fwd, conv_layers, conv_wgrad

    for suite in (conv_fwd.suite(), conv_wgrad.suite()):
        stems = [c.name for c in suite.bench_cases if suite.variants_for(c).get("im2col")]
        assert stems == ["n32-c3-224x224-k64-7x7-s2"]
    for kind in ("fwd", "wgrad"):
        case = conv_layers.conv_case(kind, 2, 3, 8, (15, 14), 7, 2, bias=kind == "fwd")
        variants = conv_layers.stem_variants(case)
        assert sorted(variants) == ["im2col", "stem_copy"]
        inputs = conv_layers.make_inputs(case, torch.bfloat16, torch.device("cpu"), None)
        want = conv_layers.reference(inputs).double()
        for run in variants.values():
            _assert_rounded(run(inputs, None), want)


def test_the_probe_times_the_fold_and_the_kernel_apart(models):
    """scripts/conv_stem_fold_probe.py's parts of `stem_direct`: the fold alone, and the
    standard kernel's launch on a ready fold, which computes the case (y, or dW folded); its
    first case is the suites' stem."""
    from forgekernel.bench.suites import conv_layers

    probe = load_script("conv_stem_fold_probe")
    assert probe.CASES[0] == (32, 224)
    for kind in ("fwd", "wgrad"):
        case = conv_layers.conv_case(kind, 2, 3, 8, (13, 12), 7, 2)
        inputs = conv_layers.make_inputs(case, torch.bfloat16, torch.device("cpu"), None)
        want = conv_layers.reference(inputs).double()
        fold, kernel = probe._parts(case, inputs)
        assert fold().shape == (2, 1, 10, 6, 64)  # P, Q = 7, 6: Hs = 7 + 3
        kernel()
        if kind == "fwd":
            _assert_rounded(kernel.args[3][:, 0].permute(0, 3, 1, 2), want)
        else:
            dw = torch.empty(8, 1, 7, 7, 3, dtype=torch.bfloat16)
            g = op._geometry(2, (7, 7), 2, 3, 1)
            stem.unfold_filter_grad(kernel.args[2], stem.plan(3, (7, 7), g, (7, 6)), dw)
            _assert_rounded(dw[:, 0].permute(0, 3, 1, 2), want)


@pytest.mark.parametrize("n, c, hw, k, f, lo, hi", CASES)
def test_the_fold_kernel_writes_what_torch_writes(models, n, c, hw, k, f, lo, hi):
    """fold.py (its model: every pixel, zero fill included) and torch's fill and copy give the
    same folded image bitwise; the compile key is the channels' (half 8 for
    C <= 4, else 16)."""
    gen = torch.Generator().manual_seed(c)
    x = _rnd(n, 1, *hw, c, gen=gen)
    g = _geometry(f, lo, hi)
    fold = stem.plan(c, f, g, g.output((1, *hw))[1:])
    keys = []

    def get_kernel(spec, params):
        keys.append((spec.name, dict(params)))
        return emulate.stand_in(spec, params)

    real = launch.get_kernel
    launch.get_kernel = get_kernel
    try:
        with_kernel = stem.fold_input(x, fold, overlap=False, kernel=True)
    finally:
        launch.get_kernel = real
    assert keys == [
        ("conv_stem_fold_sm90", {"channels": c, "dtype": "bfloat16", "half": fold.pixel // 2})
    ]
    assert torch.equal(with_kernel, stem.fold_input(x, fold, overlap=False))


def test_the_launcher_runs_the_stem_by_its_fold(monkeypatch):
    """launch.fprop / launch.wgrad on a stem (C = 3, 7x7, stride 2, odd map): the fold kernel,
    then the standard kernel on the folded view, the results the fp64 references'; given a
    config, or at stride 1, the im2col path (no fold)."""
    calls = []

    def get_kernel(spec, params):
        model = emulate.stand_in(spec, params)

        def fn(*args):
            calls.append(spec.name)
            return model(*args)

        return fn

    launch.clear_plans()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    gen = torch.Generator().manual_seed(11)
    x, w = _cl(_rnd(2, 3, 23, 21, gen=gen)), _rnd(16, 3, 7, 7, gen=gen)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = F.conv2d(x64, w64, stride=2, padding=3)
    g = op._geometry(2, (7, 7), 2, 3, 1)
    y = torch.empty(2, 1, *want.shape[2:], 16, dtype=torch.bfloat16)
    launch.fprop(op._as5d(x), op._as5d(w), None, y, g)
    _assert_rounded(y[:, 0].permute(0, 3, 1, 2), want.detach())
    dy = _rnd(*y.shape, gen=gen)
    want.backward(dy[:, 0].permute(0, 3, 1, 2).double())
    dw = torch.empty(16, 1, 7, 7, 3, dtype=torch.bfloat16)
    launch.wgrad(dy, op._as5d(x), dw, g)
    _assert_rounded(dw[:, 0].permute(0, 3, 1, 2), w64.grad)
    fold = "conv_stem_fold_sm90"
    assert calls == [fold, SPEC.name, fold, WGRAD_SPEC.name]
    calls.clear()
    g1 = op._geometry(2, (7, 7), 1, 3, 1)
    y1 = torch.empty(2, 1, 23, 21, 16, dtype=torch.bfloat16)
    launch.fprop(op._as5d(x), op._as5d(w), None, y1, g1)
    assert calls == [SPEC.name]
    launch.clear_plans()
