"""Convolution references (torch only), computed in fp64 and returned as fp32: the forward
conv2d / conv3d, and its data and weight gradients as autograd of that forward.

Torch's conventions: x (N, C, *spatial), w (K, C, *filter), y (N, K, *out), groups = 1.
`padding` is an int, one int per spatial dim (symmetric), one (below, above) pair per dim, or
"valid" / "same" (torch's rule: dilation x (F - 1) split with the odd one above; stride 1).
Asymmetric padding is an explicit zero pad of x followed by an unpadded convolution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_dim(value, dims: int, name: str) -> tuple:
    if isinstance(value, int):
        return (value,) * dims
    value = tuple(value)
    if len(value) != dims:
        raise ValueError(f"{name} needs {dims} values, got {value}")
    return value


def explicit_padding(padding, filter_size, dilation, dims: int) -> tuple[tuple[int, int], ...]:
    """((below, above) per spatial dim) of a torch-style `padding`."""
    dilation = _per_dim(dilation, dims, "dilation")
    if padding == "valid":
        return ((0, 0),) * dims
    if padding == "same":
        total = [d * (f - 1) for d, f in zip(dilation, filter_size)]
        return tuple((t // 2, t - t // 2) for t in total)
    pads = _per_dim(padding, dims, "padding")
    return tuple(p if isinstance(p, tuple) else (p, p) for p in pads)


def _conv64(x, w, bias, stride, padding, dilation):
    dims = x.dim() - 2
    pads = explicit_padding(padding, w.shape[2:], dilation, dims)
    # F.pad lists the last dim first
    flat = [v for lo_hi in reversed(pads) for v in lo_hi]
    conv = F.conv2d if dims == 2 else F.conv3d
    return conv(
        F.pad(x, flat),
        w,
        bias,
        stride=_per_dim(stride, dims, "stride"),
        dilation=_per_dim(dilation, dims, "dilation"),
    )


def _disable_tf32():
    """fp64 convolutions never use TF32; the flag is cleared anyway so that nothing a caller
    set can leak into the reference."""
    return torch.backends.cudnn.flags(enabled=True, allow_tf32=False)


def conv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride=1,
    padding=0,
    dilation=1,
) -> torch.Tensor:
    """y = conv(x, w) + bias in fp64, returned as fp32."""
    with _disable_tf32():
        b = None if bias is None else bias.double()
        return _conv64(x.double(), w.double(), b, stride, padding, dilation).float()


def conv_dgrad_ref(
    dy: torch.Tensor, w: torch.Tensor, x_shape, stride=1, padding=0, dilation=1
) -> torch.Tensor:
    """dx = (d conv(x, w) / dx)^T dy for an x of `x_shape`, fp64, returned as fp32."""
    with _disable_tf32():
        x = torch.zeros(tuple(x_shape), dtype=torch.float64, device=dy.device, requires_grad=True)
        y = _conv64(x, w.double(), None, stride, padding, dilation)
        (dx,) = torch.autograd.grad(y, x, dy.double())
        return dx.float()


def conv_wgrad_ref(
    dy: torch.Tensor, x: torch.Tensor, w_shape, stride=1, padding=0, dilation=1
) -> torch.Tensor:
    """dw = (d conv(x, w) / dw)^T dy for a w of `w_shape`, fp64, returned as fp32."""
    with _disable_tf32():
        w = torch.zeros(tuple(w_shape), dtype=torch.float64, device=dy.device, requires_grad=True)
        y = _conv64(x.double(), w, None, stride, padding, dilation)
        (dw,) = torch.autograd.grad(y, w, dy.double())
        return dw.float()
