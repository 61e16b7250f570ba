"""`forgekernel.ops.conv`: conv2d / conv3d on Hopper and their data and weight gradients,
fp16/bf16 in and out, fp32 accumulation.

Torch's conventions: x (N, C, H, W) / (N, C, D, H, W), w (K, C, R, S) / (K, C, T, R, S),
y (N, K, P, Q) / (N, K, Z, P, Q); `stride`, `padding`, `dilation` an int or one per spatial
dim, `padding` also "valid" or "same" (stride 1; dilation x (F - 1) split with the odd one
above, as torch does), groups = 1. The kernels read channels-last memory
(`torch.channels_last` / `channels_last_3d`): inputs in another layout are copied into it, and
every output (y, dx, dw) is allocated channels-last, which is what torch's cuDNN path returns
for channels-last inputs.

This module validates; eager calls then go straight to the leaf's host launcher
(`kernels/conv/sm90/launch.py`: forward kernel, data gradient by output phase, weight gradient).
A plain eager call whose key (the tensors' shapes and dtypes, the geometry arguments with their
exact types) passed the named checks before takes their result from one dict lookup, its
device checks made as they make them (issue 17: host time per call; tests/test_host_overhead.py
proves on mutations that a key never stands for a call the named checks reject);
under `torch.compile`, or when autograd records the call, the same work runs through the custom
ops `forgekernel::conv_fwd` / `conv_dgrad` / `conv_wgrad`, whose fake implementations give the
compiler shapes and strides. `conv_fwd`'s autograd formula computes dx with `conv_dgrad`, dw
with `conv_wgrad` and the bias gradient as dy summed over batch and space (fp32, rounded once).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from forgekernel.kernels.conv.sm90 import INT32_MAX, Geometry, dgrad_geometry_problem
from forgekernel.kernels.conv.sm90 import launch as conv_sm90
from forgekernel.ops._dispatch import plain, tracing, wants_grad
from forgekernel.ops._validate import (
    PassedChecks,
    arg_key,
    check_cuda,
    check_same_device,
    check_same_dtype,
    check_shaped,
    check_tensor,
    on_one_device,
    tensor_key,
)

IntArg = int | Sequence[int]
Padding = int | Sequence[int] | str


# ---------------------------------------------------------------- argument checks
def _per_dim(name: str, value: object, dims: int, minimum: int) -> tuple[int, ...]:
    """An int or `dims` ints, each >= minimum, as a tuple."""
    values = (value,) * dims if isinstance(value, int) else value
    if (
        isinstance(value, bool)
        or not isinstance(values, (tuple, list))
        or len(values) != dims
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        raise TypeError(f"{name} must be an int or {dims} ints, got {value!r}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return tuple(values)


def _padding(
    padding: object, filter_size: Sequence[int], dilation: tuple[int, ...], stride, dims: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(below, above) per spatial dim of torch's `padding`."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * dims, (0,) * dims
        if padding != "same":
            raise ValueError(f"padding must be 'valid', 'same' or ints, got {padding!r}")
        if any(s != 1 for s in stride):
            raise ValueError(f"padding='same' needs stride 1, got stride {stride}")
        total = [d * (f - 1) for d, f in zip(dilation, filter_size)]
        return tuple(t // 2 for t in total), tuple(t - t // 2 for t in total)
    pads = _per_dim("padding", padding, dims, 0)
    return pads, pads


def _check_groups(groups: object, padding_mode: object) -> None:
    if groups != 1:
        raise ValueError(
            f"groups must be 1 (grouped and depthwise convolutions are not supported), "
            f"got {groups!r}"
        )
    if padding_mode != "zeros":
        raise ValueError(
            f"padding_mode must be 'zeros' (the only one supported), got {padding_mode!r}"
        )


def _geometry(dims: int, filter_size, stride, padding, dilation) -> Geometry:
    """The 3-D kernel geometry of a `dims`-D convolution (2-D: D = T = 1)."""
    stride = _per_dim("stride", stride, dims, 1)
    dilation = _per_dim("dilation", dilation, dims, 1)
    lo, hi = _padding(padding, filter_size, dilation, stride, dims)
    lift = (1,) * (3 - dims)
    zero = (0,) * (3 - dims)
    return Geometry(
        filter=lift + tuple(filter_size),
        pad_lo=zero + lo,
        pad_hi=zero + hi,
        stride=lift + stride,
        dilation=lift + dilation,
    )


def _spatial3(shape: Sequence[int], dims: int) -> tuple[int, int, int]:
    return (1,) * (3 - dims) + tuple(shape[2:])


def _cached(check):
    """`check` (a pure function of hashable geometry arguments) cached for eager calls, which
    ask the same on every call; called plainly where torch.compile traces (it would warn about
    the cache wrapper)."""
    cached = functools.lru_cache(maxsize=1024)(check)

    def call(*args):
        return check(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


_descriptor_problem = _cached(Geometry.descriptor_problem)
_dgrad_problem = _cached(dgrad_geometry_problem)


def _check_geometry(geometry: Geometry, in_shape, dims: int, what: str) -> tuple[int, ...]:
    """The output's spatial extents (`dims` of them); errors for a window that never fits and
    for what the im2col TMA cannot encode."""
    out = geometry.output(_spatial3(in_shape, dims))
    if any(o <= 0 for o in out):
        raise ValueError(
            f"{what} {tuple(in_shape)} is smaller than the dilated kernel "
            f"{geometry.filter[3 - dims :]} (dilation {geometry.dilation[3 - dims :]}) even with "
            f"padding: the output would be empty"
        )
    problem = _descriptor_problem(geometry)
    if problem:
        raise ValueError(f"unsupported convolution geometry: {problem}")
    if in_shape[0] * math.prod(out) > INT32_MAX:
        raise ValueError("N x output pixels must be < 2^31 (the kernel's row index is 32-bit)")
    return out[3 - dims :]


def _check_operands(x, w, bias, dims: int, x_name: str = "x") -> None:
    check_tensor(x_name, x, ndim=dims + 2, cuda=False)
    check_tensor("w", w, ndim=dims + 2, cuda=False)
    check_same_dtype(**{x_name: x, "w": w})
    if x.shape[1] != w.shape[1]:
        hint = ""
        if w.shape[1] and x.shape[1] % w.shape[1] == 0 and x.shape[1] != w.shape[1]:
            hint = " (a grouped convolution's weight: groups are not supported)"
        raise ValueError(
            f"{x_name} has {x.shape[1]} channels (dim 1) but w takes {w.shape[1]} "
            f"(w is (K, C, *kernel)){hint}"
        )
    if any(f < 1 for f in w.shape[2:]):
        raise ValueError(f"w's kernel size must be >= 1 in every dim, got {tuple(w.shape[2:])}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, cuda=False)
        check_same_dtype(**{x_name: x, "bias": bias})
        if bias.shape[0] != w.shape[0]:
            raise ValueError(f"bias must have shape ({w.shape[0]},), got {tuple(bias.shape)}")


def _validate_fwd(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims):
    _check_groups(groups, padding_mode)
    _check_operands(x, w, bias, dims)
    geometry = _geometry(dims, w.shape[2:], stride, padding, dilation)
    out_spatial = _check_geometry(geometry, x.shape, dims, "x")
    _check_out(out, (x.shape[0], w.shape[0], *out_spatial), x)
    # Device checks come last so that every shape error is reported the same on any device.
    check_cuda("x", x)
    check_same_device(x=x, w=w, **_present(bias=bias, out=out))
    return geometry


def _shape(name: str, value: object, dims: int) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) != dims + 2:
        raise TypeError(f"{name} must be a shape of {dims + 2} ints, got {value!r}")
    if not all(isinstance(v, int) and v >= 0 for v in value):
        raise ValueError(f"{name} must hold ints >= 0, got {tuple(value)}")
    return tuple(value)


def _validate_dgrad(dy, w, x_shape, stride, padding, dilation, groups, out, dims):
    _check_groups(groups, "zeros")
    x_shape = _shape("x_shape", x_shape, dims)
    check_tensor("dy", dy, ndim=dims + 2, cuda=False)
    check_tensor("w", w, ndim=dims + 2, cuda=False)
    check_same_dtype(dy=dy, w=w)
    if x_shape[1] != w.shape[1]:
        raise ValueError(f"x_shape has {x_shape[1]} channels but w takes {w.shape[1]}")
    geometry = _geometry(dims, w.shape[2:], stride, padding, dilation)
    out_spatial = _check_geometry(geometry, x_shape, dims, "x_shape")
    _check_grad_out(dy, (x_shape[0], w.shape[0], *out_spatial))
    problem = _dgrad_problem(geometry, _spatial3(x_shape, dims), _spatial3(dy.shape, dims))
    if problem:
        raise ValueError(f"unsupported convolution geometry: {problem}")
    _check_out(out, x_shape, dy)
    check_cuda("dy", dy)
    check_same_device(dy=dy, w=w, **_present(out=out))
    return geometry, x_shape


def _validate_wgrad(dy, x, w_shape, stride, padding, dilation, groups, out, dims):
    _check_groups(groups, "zeros")
    w_shape = _shape("w_shape", w_shape, dims)
    check_tensor("dy", dy, ndim=dims + 2, cuda=False)
    check_tensor("x", x, ndim=dims + 2, cuda=False)
    check_same_dtype(dy=dy, x=x)
    if x.shape[1] != w_shape[1]:
        raise ValueError(f"x has {x.shape[1]} channels but w_shape takes {w_shape[1]}")
    if any(f < 1 for f in w_shape[2:]):
        raise ValueError(f"w_shape's kernel size must be >= 1, got {w_shape[2:]}")
    geometry = _geometry(dims, w_shape[2:], stride, padding, dilation)
    out_spatial = _check_geometry(geometry, x.shape, dims, "x")
    _check_grad_out(dy, (x.shape[0], w_shape[0], *out_spatial))
    _check_out(out, w_shape, dy)
    check_cuda("dy", dy)
    check_same_device(dy=dy, x=x, **_present(out=out))
    return geometry, w_shape


def _check_out(out, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if out is not None:
        check_shaped("out", out, shape, (like.dtype,))


def _present(**tensors) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if t is not None}


def _check_grad_out(dy: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(dy.shape) != shape:
        raise ValueError(
            f"dy must have the convolution's output shape {shape}, got {tuple(dy.shape)}"
        )


# ---------------------------------------------------------------- the common eager call
# Every named check above but the device ones (and groups / padding_mode, compared as they
# compare them) is a function of the arguments' types, shapes, dtypes and geometry values: a
# plain eager call whose key equals one that passed them passes them. One key and one dict
# lookup per call where the named checks cost ~25 us on the CPU (issue 17).
_PASSED = PassedChecks()


_arg_key, _meta = arg_key, tensor_key


def _fwd_key(x, w, bias, stride, padding, dilation, out, dims) -> tuple:
    args = (_arg_key(stride), _arg_key(padding), _arg_key(dilation))
    return ("fwd", dims, x.shape, x.dtype, w.shape, w.dtype, _meta(bias), _meta(out), args)


def _grad_key(op, dims, dy, other, shape, stride, padding, dilation, out) -> tuple:
    """dgrad (other = w, shape = x_shape) or wgrad (other = x, shape = w_shape)."""
    args = (_arg_key(shape), _arg_key(stride), _arg_key(padding), _arg_key(dilation))
    return (op, dims, dy.shape, dy.dtype, other.shape, other.dtype, _meta(out), args)


def _remember(key: tuple, passed: tuple) -> None:
    """What the named checks returned for a plain eager call of `key` (arguments that make no
    key, None in its last entry, are left to the named checks)."""
    for arg in key[-1]:
        if arg is None:
            return
    _PASSED.remember(key, passed)


def _seen(key: tuple, groups: object, padding_mode: object, first, *others) -> tuple | None:
    """The named checks' result for a call of `key` that passed them before, the device checks
    made as they make them (last: check_cuda of the first tensor, then one device); None sends
    the call through the named checks."""
    passed = _PASSED.get(key)
    if passed is None or groups != 1 or padding_mode != "zeros":
        return None
    check_cuda(_FIRST[key[0]], first)
    return passed if on_one_device(first, *others) else None


_FIRST = {"fwd": "x", "dgrad": "dy", "wgrad": "dy"}


def _fwd_seen(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims):
    """(key, passed) of a forward call: key None when it is traced or its tensors are not plain
    (the named checks and the custom op), passed None when the named checks must decide."""
    if tracing() or not plain(x, w, optional=(bias, out)):
        return None, None
    key = _fwd_key(x, w, bias, stride, padding, dilation, out, dims)
    return key, _seen(key, groups, padding_mode, x, w, bias, out)


def _grad_seen(op, dy, other, shape, stride, padding, dilation, groups, out, dims):
    """`_fwd_seen` of a data (other = w, shape = x_shape) or weight (other = x, shape =
    w_shape) gradient call."""
    if tracing() or not plain(dy, other, optional=(out,)):
        return None, None
    key = _grad_key(op, dims, dy, other, shape, stride, padding, dilation, out)
    return key, _seen(key, groups, "zeros", dy, other, out)


# ---------------------------------------------------------------- layouts
def _memory_format(dims: int) -> torch.memory_format:
    return torch.channels_last if dims == 2 else torch.channels_last_3d


def _view5d(t: torch.Tensor) -> torch.Tensor:
    """(N, C, *spatial) as the kernels' (N, D, H, W, C) view (2-D: D = 1), no copy: contiguous
    when t is in channels-last memory (what the launchers write in place). One as_strided
    (1.0 us on the CPU; permute and unsqueeze 1.8)."""
    shape, stride = t.shape, t.stride()
    if len(shape) == 4:
        n, c, h, w = shape
        sn, sc, sh, sw = stride
        return t.as_strided((n, 1, h, w, c), (sn, h * sh, sh, sw, sc))
    n, c, d, h, w = shape
    sn, sc, sd, sh, sw = stride
    return t.as_strided((n, d, h, w, c), (sn, sd, sh, sw, sc))


def _as5d(t: torch.Tensor) -> torch.Tensor:
    """An input in channels-last memory (copied into it when it is not), as `_view5d`."""
    return _view5d(t.contiguous(memory_format=_memory_format(t.dim() - 2)))


def _empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    dims = len(shape) - 2
    return torch.empty(
        tuple(shape), dtype=like.dtype, device=like.device, memory_format=_memory_format(dims)
    )


def _geometry_of(stride, pad_lo, pad_hi, dilation, filter_size) -> Geometry:
    """The Geometry of a custom op's int lists (one entry per spatial dim)."""
    lift = 3 - len(stride)
    return Geometry(
        filter=(1,) * lift + tuple(filter_size),
        pad_lo=(0,) * lift + tuple(pad_lo),
        pad_hi=(0,) * lift + tuple(pad_hi),
        stride=(1,) * lift + tuple(stride),
        dilation=(1,) * lift + tuple(dilation),
    )


def _lists(g: Geometry, dims: int) -> tuple[list[int], ...]:
    """The custom ops' int lists of a geometry (its last `dims` entries)."""
    cut = 3 - dims
    return (
        list(g.stride[cut:]),
        list(g.pad_lo[cut:]),
        list(g.pad_hi[cut:]),
        list(g.dilation[cut:]),
    )


def _out_shape(x_shape, w_shape, g: Geometry) -> tuple[int, ...]:
    dims = len(x_shape) - 2
    out = g.output(_spatial3(x_shape, dims))[3 - dims :]
    return (x_shape[0], w_shape[0], *out)


# ---------------------------------------------------------------- eager work
# Each writes into `out` (any view of the result's shape: in place when it is in channels-last
# memory, else through a scratch buffer) or a fresh channels-last tensor.
def _fwd(x, w, bias, g: Geometry, out=None, y_shape=None) -> torch.Tensor:
    if out is None:
        y_shape = _out_shape(x.shape, w.shape, g) if y_shape is None else y_shape
    y = _empty(y_shape, x) if out is None else out
    conv_sm90.fprop(_as5d(x), _as5d(w), bias, _view5d(y), g)
    return y


def _dgrad(dy, w, x_shape, g: Geometry, out=None) -> torch.Tensor:
    dx = _empty(x_shape, dy) if out is None else out
    conv_sm90.dgrad(_as5d(dy), _as5d(w), _view5d(dx), g)
    return dx


def _wgrad(dy, x, w_shape, g: Geometry, out=None) -> torch.Tensor:
    dw = _empty(w_shape, dy) if out is None else out
    conv_sm90.wgrad(_as5d(dy), _as5d(x), _view5d(dw), g)
    return dw


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("forgekernel::conv_fwd", mutates_args=())
def _conv_fwd_op(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    pad_lo: list[int],
    pad_hi: list[int],
    dilation: list[int],
) -> torch.Tensor:
    return _fwd(x, w, bias, _geometry_of(stride, pad_lo, pad_hi, dilation, w.shape[2:]))


@_conv_fwd_op.register_fake
def _(x, w, bias, stride, pad_lo, pad_hi, dilation):
    g = _geometry_of(stride, pad_lo, pad_hi, dilation, w.shape[2:])
    return _empty(_out_shape(x.shape, w.shape, g), x)


@torch.library.custom_op("forgekernel::conv_dgrad", mutates_args=())
def _conv_dgrad_op(
    dy: torch.Tensor,
    w: torch.Tensor,
    x_shape: list[int],
    stride: list[int],
    pad_lo: list[int],
    pad_hi: list[int],
    dilation: list[int],
) -> torch.Tensor:
    return _dgrad(dy, w, x_shape, _geometry_of(stride, pad_lo, pad_hi, dilation, w.shape[2:]))


@_conv_dgrad_op.register_fake
def _(dy, w, x_shape, stride, pad_lo, pad_hi, dilation):
    return _empty(x_shape, dy)


@torch.library.custom_op("forgekernel::conv_wgrad", mutates_args=())
def _conv_wgrad_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_shape: list[int],
    stride: list[int],
    pad_lo: list[int],
    pad_hi: list[int],
    dilation: list[int],
) -> torch.Tensor:
    return _wgrad(dy, x, w_shape, _geometry_of(stride, pad_lo, pad_hi, dilation, w_shape[2:]))


@_conv_wgrad_op.register_fake
def _(dy, x, w_shape, stride, pad_lo, pad_hi, dilation):
    return _empty(w_shape, dy)


def _setup_fwd(ctx, inputs, output) -> None:
    x, w, bias, stride, pad_lo, pad_hi, dilation = inputs
    ctx.geometry = (stride, pad_lo, pad_hi, dilation)
    ctx.shapes = (list(x.shape), list(w.shape))
    ctx.has_bias = bias is not None
    # each gradient needs the other operand only
    ctx.save_for_backward(
        w if ctx.needs_input_grad[0] else None, x if ctx.needs_input_grad[1] else None
    )


def _grad_fwd(ctx, dy):
    w, x = ctx.saved_tensors
    x_shape, w_shape = ctx.shapes
    dx = dw = db = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.forgekernel.conv_dgrad(dy, w, x_shape, *ctx.geometry)
    if ctx.needs_input_grad[1]:
        dw = torch.ops.forgekernel.conv_wgrad(dy, x, w_shape, *ctx.geometry)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        dims = list(range(dy.dim()))
        db = dy.sum(dim=[0, *dims[2:]], dtype=torch.float32).to(dy.dtype)
    return dx, dw, db, None, None, None, None


_conv_fwd_op.register_autograd(_grad_fwd, setup_context=_setup_fwd)


# ---------------------------------------------------------------- public API
def _finish(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A custom op's result, copied into `out` when one was given (autograd records the
    copy)."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _conv(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims):
    key, passed = _fwd_seen(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims)
    if passed is None:
        g = _validate_fwd(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims)
        passed = g, None
        if key is not None:  # plain tensors and no mode: not traced
            passed = g, _out_shape(x.shape, w.shape, g)
            _remember(key, passed)
    g, y_shape = passed
    if key is None or wants_grad(x, w, bias):
        return _finish(torch.ops.forgekernel.conv_fwd(x, w, bias, *_lists(g, dims)), out)
    return _fwd(x, w, bias, g, out, y_shape)


def conv2d(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = conv2d(x, w) + bias for x (N, C, H, W), w (K, C, R, S), bias (K,) or None, as
    `torch.nn.functional.conv2d` computes it (groups = 1, zero padding). fp16 or bf16 alike,
    fp32 accumulation; y (N, K, P, Q) in channels-last memory, or written into `out` (any view
    of that shape; in place when it is channels-last). Differentiable in x, w, bias."""
    return _conv(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims=2)


def conv3d(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = conv3d(x, w) + bias for x (N, C, D, H, W), w (K, C, T, R, S): `conv2d` in 3-D;
    y (N, K, Z, P, Q) in channels-last-3d memory."""
    return _conv(x, w, bias, stride, padding, dilation, groups, padding_mode, out, dims=3)


def _dgrad_api(dy, w, x_shape, stride, padding, dilation, groups, out, dims) -> torch.Tensor:
    key, passed = _grad_seen("dgrad", dy, w, x_shape, stride, padding, dilation, groups, out, dims)
    if passed is None:
        passed = _validate_dgrad(dy, w, x_shape, stride, padding, dilation, groups, out, dims)
        if key is not None:  # plain tensors and no mode: not traced
            _remember(key, passed)
    g, x_shape = passed
    if key is None or wants_grad(dy, w):
        dx = torch.ops.forgekernel.conv_dgrad(dy, w, list(x_shape), *_lists(g, dims))
        return _finish(dx, out)
    return _dgrad(dy, w, x_shape, g, out)


def _wgrad_api(dy, x, w_shape, stride, padding, dilation, groups, out, dims) -> torch.Tensor:
    key, passed = _grad_seen("wgrad", dy, x, w_shape, stride, padding, dilation, groups, out, dims)
    if passed is None:
        passed = _validate_wgrad(dy, x, w_shape, stride, padding, dilation, groups, out, dims)
        if key is not None:
            _remember(key, passed)
    g, w_shape = passed
    if key is None or wants_grad(dy, x):
        dw = torch.ops.forgekernel.conv_wgrad(dy, x, list(w_shape), *_lists(g, dims))
        return _finish(dw, out)
    return _wgrad(dy, x, w_shape, g, out)


def conv2d_dgrad(
    dy: torch.Tensor,
    w: torch.Tensor,
    x_shape: Sequence[int],
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dx (x_shape, channels-last, or written into `out`) = the data gradient of conv2d(x, w)
    at dy (N, K, P, Q): what `torch.nn.grad.conv2d_input` computes. A strided convolution's runs
    as one stride-1 convolution per output phase (no multiply-add on inserted zeros)."""
    return _dgrad_api(dy, w, x_shape, stride, padding, dilation, groups, out, dims=2)


def conv3d_dgrad(
    dy: torch.Tensor,
    w: torch.Tensor,
    x_shape: Sequence[int],
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`conv2d_dgrad` in 3-D: dy (N, K, Z, P, Q), w (K, C, T, R, S)."""
    return _dgrad_api(dy, w, x_shape, stride, padding, dilation, groups, out, dims=3)


def conv2d_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_shape: Sequence[int],
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """dw (w_shape, channels-last, or written into `out`) = the weight gradient of
    conv2d(x, w) at dy (N, K, P, Q): what `torch.nn.grad.conv2d_weight` computes. An
    implicit GEMM over the N x P x Q output pixels, split over CTAs and summed in a fixed
    order (bitwise repeatable; kernels/conv/sm90/wgrad.py)."""
    return _wgrad_api(dy, x, w_shape, stride, padding, dilation, groups, out, dims=2)


def conv3d_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    w_shape: Sequence[int],
    stride: IntArg = 1,
    padding: Padding = 0,
    dilation: IntArg = 1,
    groups: int = 1,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`conv2d_wgrad` in 3-D: dy (N, K, Z, P, Q), x (N, C, D, H, W)."""
    return _wgrad_api(dy, x, w_shape, stride, padding, dilation, groups, out, dims=3)
