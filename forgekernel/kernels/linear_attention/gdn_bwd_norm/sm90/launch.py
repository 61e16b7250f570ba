"""Host launcher of the Gated DeltaNet backward's q / k epilogue: torch only (no DSL)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.config import params_for
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments


def check_inputs(dxs: torch.Tensor, x: torch.Tensor) -> None:
    """ValueError / TypeError saying what is off: dxs fp32 or x's dtype (B, T, HV, K), x 16-bit
    (B, T, H, K), H dividing HV."""
    if x.dim() != 4:
        raise ValueError(f"x must be (B, T, H, K), got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    b, t, h, k = x.shape
    heads_ok = h > 0 and dxs.dim() == 4 and dxs.shape[2] % h == 0
    if (not heads_ok or dxs.dtype not in (torch.float32, x.dtype)
            or tuple(dxs.shape) != (b, t, dxs.shape[2], k)):  # fmt: skip
        raise ValueError(f"dxs must be float32 or {x.dtype} (B, T, HV, K) = ({b}, {t}, a "
                         f"multiple of {h}, {k}), got {dxs.dtype} {tuple(dxs.shape)}")  # fmt: skip
    _params(dtype_name(x.dtype), k)  # K supported


def gdn_bwd_norm(
    dxs: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    l2norm: bool,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gradient of the op's q (or k) input x (B, T, H, K) 16-bit from dxs (B, T, HV, K) fp32
    (or x's dtype: the `d16` key, summed in fp32),
    the gradient of x's normalized, scaled form repeated to the HV value heads (value head hv
    reads head hv // (HV / H)): summed over each head's HV / H value heads, through l2norm's
    backward (`l2norm`: x / sqrt(x.x + eps)) and the scale; in x's dtype, into `out`
    (contiguous, x's shape and dtype) when given."""
    check_inputs(dxs, x)
    res = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if res.shape != x.shape or res.dtype != x.dtype or not res.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} {tuple(x.shape)}")
    if x.numel() == 0:
        return res
    d16 = dxs.dtype != torch.float32
    fn = get_kernel(SPEC, _params(dtype_name(x.dtype), x.shape[-1], l2norm=l2norm, d16=d16))
    with on_device(x.device):
        fn(as_tma_ready(dxs), as_tma_ready(x), res, float(scale))
    return res
