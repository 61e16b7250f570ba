"""The CPU model of Kimi Delta Attention's fused backward kernel (kernels/linear_attention/
kda_bwd_fused/sm90): kernel 2's model (`reference.kda_bwd_chunk.chunk_grads_model`), then the WY
kernel's (`reference.kda_bwd_wy.wy_grads_model`) on its dw rounded to the tiles' dtype (the
fused kernel's on-chip dw: kernel 2's dw16 rounding), the WY half's dk and dG added onto kernel
2's. The kernel is the two kernels' products in the two kernels' order, so its outputs are the
two launches' and this model is their two models joined, nothing new."""

from __future__ import annotations

import torch

from forgekernel.reference.kda_bwd_chunk import chunk_grads_model
from forgekernel.reference.kda_bwd_wy import wy_grads_model


def fused_grads_model(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, operands=None):
    """(dq, dk, dv, dg, dbeta) from kernel 2's inputs (`chunk_grad_tiles`' layouts) and the WY
    kernel's others (`wy_tiles`' tt, w, u (here uw), v, beta), every chunk at once, in the
    inputs' float dtype (fp64 for the checks). `operands`: the tiles' 16-bit dtype whose
    on-chip roundings to emulate (both models': the block operands in bf16, dw, dvb, dkb in
    the tiles' dtype), or None: nothing rounded (dw kept in the inputs' float dtype)."""
    rounding = None if operands is None else (lambda x: x.to(torch.bfloat16).to(x.dtype))
    dq, dk, dw, dg = chunk_grads_model(do, u, du, q, k, h, dh, big_g, rounding)
    if operands is not None:
        dw = dw.to(operands).to(dw.dtype)
    dk_wy, dv, dg_wy, dbeta = wy_grads_model(dw, du, tt, w, k, uw, v, beta, big_g, operands)
    return dq, dk + dk_wy, dv, dg + dg_wy, dbeta
