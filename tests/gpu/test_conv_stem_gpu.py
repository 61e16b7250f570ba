"""The stem fold (kernels/conv/sm90/stem.py: a stride-2 convolution of few channels as the
stride-1 R' x 1 convolution of 64 channels over an overlapping view of its space-to-depth image,
run by the standard forward and weight-gradient kernels) on the GPU against the fp64
references: the ResNet stem and two odd ones (C = 3, 7x7, stride 2, pad 3; H = W = 224 / 223 /
97, N = 32 / 8 / 1), the view itself and its compact copy, fp16 too, other channel counts and
filters, and a CUDA graph replay (what the bench times); the fold written by the fold kernel
(fold.py) against torch's. Criterion: our error <= 2 x the error
of the same op by PyTorch (cuDNN) in the input dtype + 1e-3, outputs NaN-poisoned first.

What a failure says (docs/conv/NOTES.md, "The stem as its own kernel"): `view` fails where
`copy` passes: the TMA descriptor of the overlapping view (W stride 16 elements, 64 channels)
misreads or is refused (the launch raises): the bench's `stem_copy` is then the path; both
fail: the fold (stem.py) or the folded filter."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import stem
from forgekernel.reference.conv import conv_ref, conv_wgrad_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.conv")

STEMS = [(32, 224), (8, 223), (1, 97)]


def rnd(*shape, dtype=torch.bfloat16, gen=None):
    t = torch.randn(*shape, device="cuda", generator=gen).to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def assert_good(ours, want, low):
    """The check's criterion (forgekernel.bench.check.compare)."""
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    err = float((ours.float() - want).abs().max())
    assert torch.isfinite(ours).all() and err <= bound, (err, bound)


def poisoned(shape, dtype):
    t = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    return t.contiguous(memory_format=torch.channels_last)


def _forward(n, hw, c, k, f, pad, dtype, overlap, bias=True, kernel=False):
    g = torch.Generator(device="cuda").manual_seed(n * 1000 + hw)
    x, w = rnd(n, c, hw, hw, dtype=dtype, gen=g), rnd(k, c, f, f, dtype=dtype, gen=g)
    b = rnd(k, dtype=dtype, gen=g) if bias else None
    low = F.conv2d(x, w, b, stride=2, padding=pad)
    y = poisoned(low.shape, dtype)
    geometry = op._geometry(2, (f, f), 2, pad, 1)
    assert stem.fits(op._as5d(x), op._as5d(w), geometry)
    stem.fprop(op._as5d(x), op._as5d(w), b, op._view5d(y), geometry, overlap, kernel=kernel)
    assert_good(y, conv_ref(x, w, b, stride=2, padding=pad), low)


def _weight_gradient(n, hw, c, k, f, pad, dtype, overlap, kernel=False):
    g = torch.Generator(device="cuda").manual_seed(n * 1000 + hw + 1)
    x = rnd(n, c, hw, hw, dtype=dtype, gen=g)
    p = (hw + 2 * pad - f) // 2 + 1
    dy = rnd(n, k, p, p, dtype=dtype, gen=g)
    w_shape = (k, c, f, f)
    kw = {"stride": 2, "padding": pad}
    # (grad_input, grad_weight, grad_bias): the weight's
    low = torch.ops.aten.convolution_backward(
        dy, x, torch.empty(w_shape, device="cuda", dtype=dtype), None, (2, 2), (pad, pad),
        (1, 1), False, (0, 0), 1, (False, True, False),
    )[1]  # fmt: skip
    dw = poisoned(w_shape, dtype)
    geometry = op._geometry(2, (f, f), 2, pad, 1)
    stem.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), geometry, overlap, kernel=kernel)
    assert_good(dw, conv_wgrad_ref(dy, x, w_shape, **kw), low)


# the view of torch's fold, its compact copy, the view of the fold kernel's fold
WAYS = [(True, False), (False, False), (True, True)]
WAY_IDS = ["view", "copy", "fold-kernel"]


@pytest.mark.parametrize("overlap, kernel", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("n, hw", STEMS)
def test_stem_forward(n, hw, overlap, kernel):
    _forward(n, hw, 3, 64, 7, 3, torch.bfloat16, overlap, kernel=kernel)


@pytest.mark.parametrize("overlap, kernel", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("n, hw", STEMS)
def test_stem_weight_gradient(n, hw, overlap, kernel):
    _weight_gradient(n, hw, 3, 64, 7, 3, torch.bfloat16, overlap, kernel=kernel)


@pytest.mark.parametrize("c, hw, pad", [(3, 224, 3), (3, 223, 3), (1, 97, 2), (8, 37, 1)])
def test_the_fold_kernel_writes_what_torch_writes(c, hw, pad):
    """fold.py's image bitwise equal to torch's fill and copy (the buffer NaN-poisoned first:
    every pixel written, the padding and the block rows' tails zero)."""
    g = torch.Generator(device="cuda").manual_seed(c)
    x = torch.randn(2, 1, hw, hw, c, device="cuda", generator=g).to(torch.bfloat16)
    geometry = op._geometry(2, (7, 7), 2, pad, 1)
    fold = stem.plan(c, (7, 7), geometry, geometry.output((1, hw, hw))[1:])
    # a NaN block of the folded image's size, freed: the caching allocator hands it to the
    # kernel path's new_empty
    size = 2 * fold.extents[0] * fold.extents[1] * fold.pixel
    torch.full((size,), float("nan"), device="cuda", dtype=torch.bfloat16)
    ours = stem.fold_input(x, fold, overlap=False, kernel=True)
    assert torch.equal(ours, stem.fold_input(x, fold, overlap=False))


@pytest.mark.parametrize(
    "c, k, f, pad",
    [(1, 40, 7, 3), (4, 64, 5, 2), (8, 136, 3, 1), (3, 24, 4, 0), (6, 64, 7, 3)],
)
def test_other_folds(c, k, f, pad):
    """Channels 1 to 8 (folded pixels of 16 and 32 channels: 32 or 64 channels a window, a
    part-filled k-tile), output channels off the tile, even and odd filters and shifts, fp16;
    torch's fold and the fold kernel's."""
    for dtype in (torch.bfloat16, torch.float16):
        for kernel in (False, True):
            _forward(2, 37, c, k, f, pad, dtype, True, kernel=kernel)
            _weight_gradient(2, 37, c, k, f, pad, dtype, True, kernel=kernel)


def test_stem_replays_in_a_cuda_graph():
    """The fold (its fill and copy) and both launches captured: a replay gives the eager
    result bitwise (no split whose order moves: the forward is unsplit, the weight gradient's
    parked split sums in part order)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x, w = rnd(8, 3, 224, 224, gen=g), rnd(64, 3, 7, 7, gen=g)
    dy = rnd(8, 64, 112, 112, gen=g)
    geometry = op._geometry(2, (7, 7), 2, 3, 1)

    def call():
        y = poisoned((8, 64, 112, 112), torch.bfloat16)
        dw = poisoned((64, 3, 7, 7), torch.bfloat16)
        stem.fprop(op._as5d(x), op._as5d(w), None, op._view5d(y), geometry)
        stem.wgrad(op._as5d(dy), op._as5d(x), op._view5d(dw), geometry)
        return y, dw

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
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))
