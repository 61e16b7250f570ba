"""The convolution torch layer on the CPU: every bad input raises a clear error naming the
argument before any kernel runs; with the CPU models of the compiled kernels standing in
(kernels/conv/sm90/emulate.py, fp64 accumulation), the eager path, `out=`, layouts, autograd
(dx, dw, bias) and the dgrad / wgrad functions match the fp64 references to the output's
rounding; custom ops with fake implementations trace under make_fx and run under
torch.compile."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.reference.conv import conv_dgrad_ref, conv_ref, conv_wgrad_ref

op = importlib.import_module("forgekernel.ops.conv")
BF16, FP16 = torch.bfloat16, torch.float16
UNIT_ROUNDOFF = {BF16: 2.0**-8, FP16: 2.0**-11}


@pytest.fixture
def cpu_kernel(monkeypatch):
    """Device checks off, the compiled functions the kernel models; returns the list of
    launcher entry points called."""
    calls = []
    launch.clear_plans()  # plans hold the function they looked up
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(launch, "get_kernel", emulate.stand_in)
    for name in ("fprop", "dgrad", "wgrad"):
        real = getattr(launch, name)

        def traced(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(launch, name, traced)
    yield calls
    launch.clear_plans()


def rnd(*shape, dtype=BF16, generator=None):
    return torch.randn(*shape, generator=generator).to(dtype)


def close(got, want, dtype=BF16):
    """got (16-bit) is want (fp32 from fp64) rounded once."""
    u = UNIT_ROUNDOFF[dtype]
    torch.testing.assert_close(got.float(), want, rtol=u, atol=1e-6 + u * 1e-3)


X, W, B = rnd(2, 8, 9, 9), rnd(16, 8, 3, 3), rnd(16)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((X.float(), W), {}, TypeError, "x must have dtype in (float16, bfloat16)"),
        ((X, W.half()), {}, TypeError, "w has dtype torch.float16 but x has"),
        ((X[0], W), {}, ValueError, "x must be 4-D, got 3-D"),
        ((X.tolist(), W), {}, TypeError, "x must be a torch.Tensor"),
        ((X, rnd(16, 4, 3, 3)), {}, ValueError, "groups are not supported"),
        ((X, rnd(16, 6, 3, 3)), {}, ValueError, "x has 8 channels (dim 1) but w takes 6"),
        ((X, W), {"groups": 2}, ValueError, "groups must be 1"),
        ((X, W), {"padding_mode": "reflect"}, ValueError, "padding_mode must be 'zeros'"),
        ((X, W), {"padding": "full"}, ValueError, "padding must be 'valid', 'same' or ints"),
        ((X, W), {"padding": "same", "stride": 2}, ValueError, "padding='same' needs stride 1"),
        ((X, W), {"stride": 0}, ValueError, "stride must be >= 1"),
        ((X, W), {"stride": (1, 2, 3)}, TypeError, "stride must be an int or 2 ints"),
        ((X, W), {"padding": -1}, ValueError, "padding must be >= 0"),
        ((X, W), {"dilation": 1.5}, TypeError, "dilation must be an int or 2 ints"),
        ((X, W), {"stride": True}, TypeError, "stride must be an int or 2 ints"),
        ((X, W, rnd(8)), {}, ValueError, "bias must have shape (16,)"),
        ((X, W, B.half()), {}, TypeError, "bias has dtype torch.float16 but x has"),
        ((X, rnd(16, 8, 11, 3)), {}, ValueError, "is smaller than the dilated kernel"),
        ((X, W), {"padding": 17}, ValueError, "padding 17 along H is past the im2col TMA"),
        ((X, W), {"stride": 9}, ValueError, "stride 9 along H is outside 1..8"),
        ((rnd(1, 8, 40, 40), rnd(4, 8, 3, 17)), {"dilation": (1, 2), "padding": (1, 16)},
         ValueError, "(kernel size 17 - 1) x dilation 2 = 32 along W"),
        ((X, W), {"out": rnd(2, 16, 9, 9)}, ValueError, "out must have shape (2, 16, 7, 7)"),
        ((X, W), {}, ValueError, "x must be a CUDA tensor"),
    ],
)  # fmt: skip
def test_bad_inputs_raise(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        op.conv2d(*args, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: op.conv2d_dgrad(rnd(2, 16, 7, 7), W, (2, 8, 9)), "x_shape must be a shape of 4"),
        (lambda: op.conv2d_dgrad(rnd(2, 16, 8, 7), W, (2, 8, 9, 9)), "dy must have the conv"),
        (lambda: op.conv2d_dgrad(rnd(2, 16, 7, 7), W, (2, 4, 9, 9)), "x_shape has 4 channels"),
        (lambda: op.conv2d_dgrad(rnd(2, 16, 7, 7), W, (2, 8, 9, 9), groups=4), "groups must"),
        (lambda: op.conv2d_wgrad(rnd(2, 16, 7, 7), X, (16, 4, 3, 3)), "x has 8 channels but"),
        (lambda: op.conv2d_wgrad(rnd(2, 16, 7, 7), X, (16, 8, 3, -1)), "ints >= 0"),
        (lambda: op.conv3d_wgrad(rnd(2, 16, 7, 7), X, (16, 8, 1, 3, 3)), "dy must be 5-D"),
        (lambda: op.conv2d_wgrad(rnd(2, 16, 7, 7), X, (16, 8, 3, 3)), "dy must be a CUDA"),
    ],
)
def test_bad_gradient_inputs_raise(call, words):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert words in str(info.value)


SEED = 0  # test_forward_matches_the_reference's inputs


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(
    "x_shape, w_shape, kwargs",
    [
        ((2, 3, 17, 19), (5, 3, 3, 3), {"padding": 1}),
        ((2, 24, 13, 11), (40, 24, 5, 5), {"stride": 2, "padding": 2}),
        ((1, 72, 9, 7), (136, 72, 3, 3), {"dilation": 2, "padding": "same"}),
        ((1, 8, 6, 7), (16, 8, 2, 4), {"padding": "same"}),
        ((1, 8, 5, 7, 6), (16, 8, 3, 3, 3), {"padding": 1}),
        ((2, 16, 4, 9, 8), (24, 16, 1, 3, 3), {"stride": (1, 2, 2), "padding": (0, 1, 1)}),
    ],
)
def test_forward_matches_the_reference(cpu_kernel, x_shape, w_shape, kwargs, dtype):
    # seeded here: drawn from the global generator, the inputs were whatever the tests before
    # this one in the worker left it at (an order-dependent fp16 miss near zero, ~1.4 ulps)
    g = torch.Generator().manual_seed(SEED)
    x, w = rnd(*x_shape, dtype=dtype, generator=g), rnd(*w_shape, dtype=dtype, generator=g)
    b = rnd(w_shape[0], dtype=dtype, generator=g)
    fn = op.conv2d if len(x_shape) == 4 else op.conv3d
    y = fn(x, w, b, **kwargs)
    close(y, conv_ref(x, w, b, **kwargs), dtype)
    fmt = torch.channels_last if len(x_shape) == 4 else torch.channels_last_3d
    assert y.is_contiguous(memory_format=fmt)
    assert cpu_kernel == ["fprop"]


def test_out_is_written_in_place_or_through_a_copy(cpu_kernel):
    want = conv_ref(X, W, B, stride=2, padding=1)
    out = torch.full((2, 16, 5, 5), float("nan"), dtype=BF16).contiguous(
        memory_format=torch.channels_last
    )
    assert op.conv2d(X, W, B, stride=2, padding=1, out=out) is out
    close(out, want)
    plain = torch.full((2, 16, 5, 5), float("nan"), dtype=BF16)  # NCHW: not the kernel's layout
    assert op.conv2d(X, W, B, stride=2, padding=1, out=plain) is plain
    close(plain, want)


def test_inputs_in_any_layout_are_read_right(cpu_kernel):
    x = rnd(2, 9, 9, 8).permute(0, 3, 1, 2)  # channels-last already
    w = rnd(16, 8, 6, 3)[:, :, ::2]  # strided
    assert x.is_contiguous(memory_format=torch.channels_last)
    close(op.conv2d(x, w), conv_ref(x, w))
    close(op.conv2d(x.contiguous(), w.contiguous()), conv_ref(x, w))


@pytest.mark.parametrize(
    "x_shape, w_shape, kwargs",
    [
        ((2, 12, 9, 11), (20, 12, 3, 3), {"stride": 2, "padding": 1}),
        ((1, 8, 10, 9), (16, 8, 2, 2), {"stride": 2}),
        ((1, 8, 5, 6, 7), (8, 8, 3, 3, 3), {"stride": (1, 2, 2), "padding": 1}),
    ],
)
def test_autograd_gives_every_gradient(cpu_kernel, x_shape, w_shape, kwargs):
    x = rnd(*x_shape).requires_grad_()
    w = rnd(*w_shape).requires_grad_()
    b = rnd(w_shape[0]).requires_grad_()
    fn = op.conv2d if len(x_shape) == 4 else op.conv3d
    y = fn(x, w, b, **kwargs)
    dy = rnd(*y.shape)
    y.backward(dy)
    close(x.grad, conv_dgrad_ref(dy, w, x_shape, **kwargs))
    close(w.grad, conv_wgrad_ref(dy, x, w_shape, **kwargs))
    close(b.grad, dy.double().sum([0, *range(2, dy.dim())]).float())
    assert {"dgrad", "wgrad"} <= set(cpu_kernel)


def test_only_the_gradients_asked_for_run(cpu_kernel):
    x, w = rnd(1, 8, 9, 9).requires_grad_(), rnd(8, 8, 3, 3)
    op.conv2d(x, w, padding=1).sum().backward()
    assert cpu_kernel == ["fprop", "dgrad"]  # the phases launch the kernel themselves
    cpu_kernel.clear()
    x, w = rnd(1, 8, 9, 9), rnd(8, 8, 3, 3).requires_grad_()
    op.conv2d(x, w, padding=1).sum().backward()
    assert cpu_kernel == ["fprop", "wgrad"]


@pytest.mark.parametrize("dims", [2, 3])
def test_gradient_functions_match_the_references(cpu_kernel, dims):
    spatial, kernel = ((11, 10), (3, 3)) if dims == 2 else ((5, 7, 6), (3, 1, 3))
    x_shape, w_shape = (2, 8, *spatial), (24, 8, *kernel)
    kw = {"stride": 2, "padding": 1, "dilation": 1}
    x, w = rnd(*x_shape), rnd(*w_shape)
    dy = rnd(*conv_ref(x, w, **kw).shape)
    dgrad = op.conv2d_dgrad if dims == 2 else op.conv3d_dgrad
    wgrad = op.conv2d_wgrad if dims == 2 else op.conv3d_wgrad
    close(dgrad(dy, w, x_shape, **kw), conv_dgrad_ref(dy, w, x_shape, **kw))
    close(wgrad(dy, x, w_shape, **kw), conv_wgrad_ref(dy, x, w_shape, **kw))
    out = torch.full(w_shape, float("nan"), dtype=BF16)
    assert wgrad(dy, x, w_shape, **kw, out=out) is out
    close(out, conv_wgrad_ref(dy, x, w_shape, **kw))


def test_eager_calls_without_grad_skip_the_dispatcher(cpu_kernel, monkeypatch):
    def no_dispatcher(*args):
        raise AssertionError("an eager call without grad went through the custom op")

    monkeypatch.setattr(torch.ops.forgekernel, "conv_fwd", no_dispatcher)
    op.conv2d(X, W)
    with torch.no_grad():
        op.conv2d(X, W.clone().requires_grad_())


def _cuda_fakes():
    x = torch.empty(2, 8, 9, 9, dtype=BF16, device="cuda")
    w = torch.empty(16, 8, 3, 3, dtype=BF16, device="cuda")
    return x, w, torch.empty(16, dtype=BF16, device="cuda")


def test_make_fx_records_the_ops_with_channels_last_results():
    with FakeTensorMode():
        x, w, b = _cuda_fakes()
        y = op.conv2d(x, w, b, stride=2, padding=1)
        assert y.shape == (2, 16, 5, 5) and y.is_contiguous(memory_format=torch.channels_last)
        dx = op.conv2d_dgrad(y, w, x.shape, stride=2, padding=1)
        dw = op.conv2d_wgrad(y, x, w.shape, stride=2, padding=1)
        assert dx.shape == x.shape and dw.shape == w.shape
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = str(make_fx(lambda *t: op.conv2d(*t, padding=1) * 2, tracing_mode="fake")(
            *_cuda_fakes()).graph)  # fmt: skip
    assert "forgekernel.conv_fwd" in graph


def test_torch_compile_runs_forward_and_backward(cpu_kernel):
    x, w = rnd(1, 8, 7, 7).requires_grad_(), rnd(8, 8, 3, 3).requires_grad_()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x, w):
        return op.conv2d(x, w, stride=2, padding=1).float().square().sum()

    f(x, w).backward()
    y = op.conv2d(x.detach(), w.detach(), stride=2, padding=1)
    dy = (2 * y.float()).to(BF16)
    close(x.grad, conv_dgrad_ref(dy, w, x.shape, stride=2, padding=1))
    close(w.grad, conv_wgrad_ref(dy, x, w.shape, stride=2, padding=1))
