"""The CPU model of the Gated DeltaNet backward's q / k epilogue (kernels/linear_attention/
gdn_bwd_norm/sm90): the gradient of the op's q (or k) input from the gradient of its
normalized, scaled form repeated to the value heads, as the kernel forms it: the group sum over
each head's HV / H value heads, then l2norm's backward with the norm recomputed from x,

    dx = scale / sqrt(n2) (d - x (x . d) / n2),   n2 = x . x + eps,

(reference/delta_rule_bwd.py's `_l2norm_backward` after `_l2norm`: the same function), or
scale d without l2norm."""

from __future__ import annotations

import torch

from forgekernel.reference.delta_rule import L2NORM_EPS


def qk_grad_model(dxs: torch.Tensor, x: torch.Tensor, scale: float, l2norm: bool,
                  dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """dxs (B, T, HV, K), x (B, T, H, K), H dividing HV -> dx (B, T, H, K) in `dtype` (x's by
    default), computed in dxs's float dtype (fp32 at least: fp64 for the checks)."""
    h, hv = x.shape[2], dxs.shape[2]
    f = torch.promote_types(dxs.dtype, torch.float32)
    d = dxs.to(f).unflatten(2, (h, hv // h)).sum(3)
    if not l2norm:
        return (d * scale).to(dtype or x.dtype)
    xf = x.to(f)
    n2 = (xf * xf).sum(-1, keepdim=True) + L2NORM_EPS
    out = (d - xf * (xf * d).sum(-1, keepdim=True) / n2) * (scale * n2.rsqrt())
    return out.to(dtype or x.dtype)
