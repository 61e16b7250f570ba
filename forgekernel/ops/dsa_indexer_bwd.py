"""`dsa_indexer_backward`: the DSA lightning indexer's training backward (issue 22), cuDNN-
frontend 1.32's `indexer_backward_wrapper` (same tensors, same argument order, same result);
exported as `forgekernel.ops.dsa_indexer.dsa_indexer_backward`.

Math (reference/dsa_indexer_bwd.py; docs/attention/DSA_INDEXER_NOTES.md "Backward"): the
gradients in q, weights and k of

    L = grad_loss * loss_coeff / (B * S_q) * sum_t KL_clip(target[t] || predict[t])

where predict = softmax over the selected slots of I[t, i] = sum_h w[t, h] relu(sm_scale q[t, h]
. k[idx[t, i]]) is given (cuDNN's `index_score`, from its indexer score recompute), and the KL
clips log p and log target at -100. dL/dI = G = g - p sum(g), g = -scale max(target, e^-100)
[p >= e^-100]; then dw = sum_i G relu(s), dq = sm_scale sum_i G w [s > 0] k, dk scattered.

Layouts (cuDNN's): q (S, H, D) / (B, S, H, D), weights (S, H) / (B, S, H), k (S_kv, D) /
(B, S_kv, D), all one dtype (cuDNN: bf16; here also fp16 / fp32); target (cuDNN's attn_score,
the score recompute's output) and predict (S, topk) / (B, S, topk) fp32; topk_indices int32
of the same shape, per batch (0 <= id < S_kv) or, with indices_global, b * S_kv + id; any other
id is padding (no K row read, no gradient). grad_loss: a one-element fp32 tensor on q's device
(read on the device: CUDA-graph safe) or None (1). Returns (d_q, d_weights, d_k) in the input
dtypes (cuDNN's d_index_q, d_weights, d_index_k); d_k rows no slot names are 0. Unlike cuDNN,
target is not overwritten.

THE KERNEL (kernels/attention/dsa_indexer_bwd/sm90; docs/attention/DSA_INDEXER_NOTES.md
"Backward kernel, built"): dq, dw and an fp32 dK accumulator in one launch (G from target /
predict in its prologue), then dK cast to k's dtype in torch. It takes bf16 inputs (cuDNN's
contract) with 64 heads x 128, top-k <= 2048, both index forms, 3-D or 4-D. Everything else, or
FORGEKERNEL_DSA_INDEXER_BWD_KERNEL=0, takes the INTERIM PATH: the closed form in fp32 torch
(`reference.dsa_indexer_bwd.dsa_indexer_kl_backward_ref`, chunked rows), correct, not fast:
fp16 (its dS, rounded to fp16 for the GEMMs, underflows at the usual grad_loss 1 / (B S_q):
kernels/.../config.py DTYPES), fp32 inputs, other head counts or widths, top-k > 2048.
"""

from __future__ import annotations

import math
import os

import torch

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import launch as kernel_launch
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    check_bool,
    check_cuda,
    check_same_device,
    check_shaped,
    check_tensor,
)
from forgekernel.reference.dsa_indexer_bwd import dsa_indexer_kl_backward_ref

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
F32 = (torch.float32,)
INDEX = (torch.int32,)
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# "0": the interim path everywhere; unset or "1": the kernel where it takes the inputs.
KERNEL_ENV = "FORGEKERNEL_DSA_INDEXER_BWD_KERNEL"


def kernel_selected() -> bool:
    env = os.environ.get(KERNEL_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{KERNEL_ENV} must be '0' or '1', got {env!r}")
    return env != "0"


def _validate(q, weights, k, target, predict, idx, grad_loss) -> bool:
    """The checks, each naming its argument; True for the batched (4-D q) form."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be (S, H, D) or (B, S, H, D), got {got}")
    batched = q.dim() == 4
    check_tensor("q", q, ndim=q.dim(), dtypes=FLOATS, cuda=False)
    lead = tuple(q.shape[:-2])  # (S,) or (B, S)
    check_shaped("weights", weights, q.shape[:-1], (q.dtype,))
    check_tensor("k", k, ndim=3 if batched else 2, dtypes=(q.dtype,), cuda=False)
    if k.shape[-1] != q.shape[-1] or (batched and k.shape[0] != q.shape[0]):
        want = f"({q.shape[0]}, S_kv, {q.shape[-1]})" if batched else f"(S_kv, {q.shape[-1]})"
        raise ValueError(f"k must be {want}, got {tuple(k.shape)}")
    check_tensor("topk_indices", idx, ndim=len(lead) + 1, dtypes=INDEX, cuda=False)
    if tuple(idx.shape[:-1]) != lead:
        raise ValueError(f"topk_indices must be {(*lead, 'topk')}, got {tuple(idx.shape)}")
    check_shaped("target", target, idx.shape, F32)
    check_shaped("predict", predict, idx.shape, F32)
    if grad_loss is not None:
        check_tensor("grad_loss", grad_loss, ndim=grad_loss.dim(), dtypes=F32, cuda=False)
        if grad_loss.numel() != 1:
            raise ValueError(f"grad_loss must hold one element, got {tuple(grad_loss.shape)}")
    extra = {} if grad_loss is None else {"grad_loss": grad_loss}
    check_same_device(q=q, weights=weights, k=k, target=target, predict=predict,
                      topk_indices=idx, **extra)  # fmt: skip
    return batched


def flat_indices(idx: torch.Tensor, s_kv: int, indices_global: bool) -> torch.Tensor:
    """(B, S, topk) ids, per batch or global, as rows of the flat (B x S_kv) k: -1 where the id
    is padding (outside its batch's [0, S_kv), cuDNN's rule)."""
    base = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64)[:, None, None]
    local = idx.long() - base * s_kv if indices_global else idx.long()
    valid = (local >= 0) & (local < s_kv)
    return torch.where(valid, local + base * s_kv, -1)


def _backward_interim(q, weights, k, target, predict, idx, grad_loss, sm_scale, loss_coeff,
                      indices_global) -> Grads:  # fmt: skip
    """INTERIM: fp32 torch on the device (the kernel's stand-in); any layout of the op."""
    four = q.dim() == 4
    q4, w3, k3, t3, p3, i3 = (x if four else x[None] for x in (q, weights, k, target, predict,
                                                                idx))  # fmt: skip
    b, s, h, d = q4.shape
    s_kv = k3.shape[1]
    rows = flat_indices(i3, s_kv, indices_global).reshape(b * s, -1)
    scale = loss_coeff / (b * s)
    if grad_loss is not None:
        scale = grad_loss.reshape(()).float() * scale
    dq, dw, dk = dsa_indexer_kl_backward_ref(
        q4.reshape(b * s, h, d), k3.reshape(b * s_kv, d), w3.reshape(b * s, h), rows,
        t3.reshape(b * s, -1), p3.reshape(b * s, -1), grad_scale=scale, sm_scale=sm_scale,
    )  # fmt: skip
    return (dq.to(q.dtype).view(q.shape), dw.to(weights.dtype).view(weights.shape),
            dk.to(k.dtype).view(k.shape))  # fmt: skip


def _backward_kernel(q, weights, k, target, predict, idx, grad_loss, sm_scale, loss_coeff,
                     indices_global) -> Grads | None:  # fmt: skip
    """The kernel (module docstring), None where `launch.unsupported` declines the inputs or
    FORGEKERNEL_DSA_INDEXER_BWD_KERNEL=0; dK cast to k's dtype in torch."""
    if not kernel_selected() or kernel_launch.unsupported(q, k, idx) is not None:
        return None
    dq, dw, dk = kernel_launch.dsa_indexer_bwd(q, weights, k, target, predict, idx, grad_loss,
                                               sm_scale, loss_coeff, indices_global)  # fmt: skip
    return dq, dw, dk.to(k.dtype)


def _backward(*args) -> Grads:
    """The kernel where it takes the inputs, else the interim path."""
    grads = _backward_kernel(*args)
    return _backward_interim(*args) if grads is None else grads


@torch.library.custom_op("forgekernel::dsa_indexer_backward", mutates_args=())
def _backward_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    target: torch.Tensor,
    predict: torch.Tensor,
    topk_indices: torch.Tensor,
    grad_loss: torch.Tensor | None,
    sm_scale: float,
    loss_coeff: float,
    indices_global: bool,
) -> Grads:
    return _backward(q, weights, k, target, predict, topk_indices, grad_loss, sm_scale,
                     loss_coeff, indices_global)  # fmt: skip


@_backward_op.register_fake
def _(q, weights, k, target, predict, topk_indices, grad_loss, sm_scale, loss_coeff,
      indices_global):  # fmt: skip
    return q.new_empty(q.shape), weights.new_empty(weights.shape), k.new_empty(k.shape)


def _check_scalar(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def dsa_indexer_backward(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    target: torch.Tensor,
    predict: torch.Tensor,
    topk_indices: torch.Tensor,
    grad_loss: torch.Tensor | None = None,
    *,
    sm_scale: float = 1.0,
    loss_coeff: float = 1.0,
    indices_global: bool = False,
) -> Grads:
    """(d_q, d_weights, d_k) of the indexer's KL loss (module docstring), cuDNN's
    `indexer_backward_wrapper(index_q, weights, index_k, attn_score, index_score,
    topk_indices, grad_loss, sm_scale, loss_coeff, topk_indices_global=...)`."""
    sm_scale = _check_scalar("sm_scale", sm_scale)
    loss_coeff = _check_scalar("loss_coeff", loss_coeff)
    check_bool("indices_global", indices_global)
    _validate(q, weights, k, target, predict, topk_indices, grad_loss)
    check_cuda("q", q)
    args = (q, weights, k, target, predict, topk_indices, grad_loss, sm_scale, loss_coeff,
            indices_global)  # fmt: skip
    if _traced(q, weights, k, target, predict, topk_indices, grad_loss):
        return torch.ops.forgekernel.dsa_indexer_backward(*args)
    return _backward(*args)
