"""The DSA lightning indexer's training backward (issue 22), as cuDNN-frontend 1.32's
`indexer_backward_wrapper` defines it (docs/attention/DSA_INDEXER_NOTES.md, "Backward:
semantics, pinned"). fp32 by default; dtype=torch.float64 for the yardstick.

Forward being differentiated, per query row t and top-k slot i (valid: 0 <= idx[t, i] < S_kv):

    s[t, h, i] = sm_scale * q[t, h] . k[idx[t, i]]
    I[t, i]    = sum_h w[t, h] * relu(s[t, h, i])                     (the index logits)
    p[t, :]    = softmax of I[t, :] over the valid slots, 0 elsewhere  ("predict", index_score)
    L          = grad_scale * sum_t sum_i tc[t, i] (log tc[t, i] - max(log p[t, i], -100))
    tc         = max(target, e^-100)                                   (target: attn_score)

grad_scale = grad_loss * loss_coeff / (B * S_q) (the mean of the row KLs over the B x S_q query
rows, times the upstream gradient). The clip is cuDNN's (`kl_div(log_target=True)` with input
and target clipped to [-100, 0]): slots whose p < e^-100 (padding: p = 0) pass no gradient.

Closed form (cuDNN's kernel 1 then kernel 2):

    g[t, i]  = -grad_scale * tc[t, i] * [p[t, i] >= e^-100]
    G[t, i]  = g[t, i] - p[t, i] * sum_j g[t, j]                       (dL/dI, "grad_signal")
    dS       = G[t, i] * w[t, h] * [s[t, h, i] > 0]
    dw[t, h] = sum_i G[t, i] * relu(s[t, h, i])
    dq[t, h] = sm_scale * sum_i dS[t, h, i] * k[idx[t, i]]
    dk[j]    = sm_scale * sum_{(t, i): idx[t, i] = j} sum_h dS[t, h, i] * q[t, h]

With a target summing to 1 on the valid slots, G = grad_scale * (p - target) up to e^-100
terms. p is an input (cuDNN reads it, never recomputes it); `dsa_indexer_predict_ref` gives it
from the same q, k, w. Invalid slots (-1, >= S_kv) take no part: no K row is read, dk gets
nothing there.
"""

from __future__ import annotations

import math

import torch

from forgekernel.reference.dsa import _chunks, _gather_rows

CLIP_LOG_MIN = -100.0
CLIP_PROB_MIN = math.exp(CLIP_LOG_MIN)  # e^-100, an fp32 denormal; 0 on flush-to-zero

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _check(q, k, w, idx, *rows) -> None:
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2]:
        raise ValueError(f"q (S, H, D), k (S_kv, D): got {tuple(q.shape)}, {tuple(k.shape)}")
    if w.shape != q.shape[:2]:
        raise ValueError(f"weights: expected {tuple(q.shape[:2])}, got {tuple(w.shape)}")
    if idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"topk_indices: expected ({q.shape[0]}, topk), got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_indices: expected int32 (or int64), got {idx.dtype}")
    for name, t in rows:
        if t.shape != idx.shape:
            raise ValueError(f"{name}: expected {tuple(idx.shape)}, got {tuple(t.shape)}")


def valid_slots(idx: torch.Tensor, s_kv: int) -> torch.Tensor:
    """(S, topk) bool: slots that name a key (cuDNN: 0 <= id < S_kv; anything else is padding)."""
    return (idx >= 0) & (idx < s_kv)


def _scores(q, k, safe, sm_scale):
    """s (rows, H, topk) = sm_scale q . k[idx] for a chunk (safe: padding replaced by 0)."""
    return sm_scale * torch.einsum("rhd,rkd->rhk", q, _gather_rows(k, safe))


def dsa_indexer_logits_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """I (S, topk) in `dtype`: sum_h w relu(sm_scale q . k[idx]), -inf at invalid slots;
    differentiable in q, k, weights."""
    _check(q, k, weights, topk_indices)
    valid = valid_slots(topk_indices, k.shape[0])
    safe = torch.where(valid, topk_indices, 0).long()
    q, k, w = q.to(dtype), k.to(dtype), weights.to(dtype)
    parts = []
    for r0, r1 in _chunks(q.shape[0], topk_indices.shape[1] * (q.shape[1] + q.shape[2])):
        s = _scores(q[r0:r1], k, safe[r0:r1], sm_scale)
        parts.append(torch.einsum("rhk,rh->rk", s.relu(), w[r0:r1]))
    logits = torch.cat(parts) if parts else q.new_zeros(0, topk_indices.shape[1])
    return logits.masked_fill(~valid, float("-inf"))


def dsa_indexer_predict_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    sm_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """p (S, topk): softmax of the index logits over each row's valid slots, 0 at the others and
    on rows with none (cuDNN's `sparse_indexer_score_recompute_wrapper` "predict")."""
    logits = dsa_indexer_logits_ref(q, k, weights, topk_indices, sm_scale=sm_scale, dtype=dtype)
    return _softmax_valid(logits)


def _softmax_valid(logits: torch.Tensor) -> torch.Tensor:
    valid = torch.isfinite(logits)
    rows = valid.any(-1, keepdim=True)
    p = torch.softmax(torch.where(rows, logits, 0.0), dim=-1)
    return torch.where(valid, p, 0.0)


def dsa_indexer_kl_loss_ref(
    logits: torch.Tensor, target: torch.Tensor, grad_scale: float
) -> torch.Tensor:
    """L (module docstring) from the index logits I (S, topk) (-inf: invalid slot) and the
    target; differentiable in the logits. Rows with no valid slot add 0."""
    valid = torch.isfinite(logits)
    rows = valid.any(-1, keepdim=True)
    log_p = torch.log_softmax(torch.where(rows, logits, 0.0), dim=-1)
    log_p = torch.where(valid, log_p, float("-inf")).clamp(min=CLIP_LOG_MIN)
    tc = target.to(log_p.dtype).clamp(min=CLIP_PROB_MIN)
    terms = torch.where(rows, tc * (tc.log() - log_p), 0.0)
    return grad_scale * terms.sum()


def dsa_indexer_grad_signal_ref(
    target: torch.Tensor, predict: torch.Tensor, grad_scale: float
) -> torch.Tensor:
    """G = dL/dI (S, topk): cuDNN's kernel 1 (`grad_signal`, written over attn_score there)."""
    p = predict
    g = -grad_scale * target.to(p.dtype).clamp(min=CLIP_PROB_MIN) * (p >= CLIP_PROB_MIN)
    return g - p * g.sum(-1, keepdim=True)


def dsa_indexer_kl_backward_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    target: torch.Tensor,
    predict: torch.Tensor,
    *,
    grad_scale: float = 1.0,
    sm_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> Grads:
    """(dq (S, H, D), dw (S, H), dk (S_kv, D)) in `dtype` by the closed form (module
    docstring), from q (S, H, D), k (S_kv, D), weights (S, H), topk_indices int (S, topk),
    target and predict (S, topk) fp32. grad_scale = grad_loss * loss_coeff / (B * S_q)."""
    _check(q, k, weights, topk_indices, ("target", target), ("predict", predict))
    s_kv = k.shape[0]
    valid = valid_slots(topk_indices, s_kv)
    safe = torch.where(valid, topk_indices, 0).long()
    # dk's scatter: an invalid slot lands in a scratch row past the keys (row S_kv), dropped at
    # the end. A boolean mask over the slots instead sizes its result by their values: a host
    # read, which a CUDA-graph capture rejects (nothing here reads the device on the host).
    sink = torch.where(valid, topk_indices, s_kv).long()
    q, k, w = q.to(dtype), k.to(dtype), weights.to(dtype)
    grad = dsa_indexer_grad_signal_ref(target.to(dtype), predict.to(dtype), grad_scale)
    grad = torch.where(valid, grad, 0.0)
    dq, dw = torch.zeros_like(q), torch.zeros_like(w)
    dk = k.new_zeros(s_kv + 1, k.shape[1])
    for r0, r1 in _chunks(q.shape[0], topk_indices.shape[1] * (q.shape[1] + q.shape[2])):
        s = _scores(q[r0:r1], k, safe[r0:r1], sm_scale)
        g = grad[r0:r1, None, :]
        dw[r0:r1] = (g * s.relu()).sum(-1)
        ds = torch.where(s > 0, g * w[r0:r1, :, None], 0.0)  # (rows, H, topk)
        dq[r0:r1] = sm_scale * torch.einsum("rhk,rkd->rhd", ds, _gather_rows(k, safe[r0:r1]))
        rows_dk = sm_scale * torch.einsum("rhk,rhd->rkd", ds, q[r0:r1])
        dk.index_add_(0, sink[r0:r1].reshape(-1), rows_dk.reshape(-1, k.shape[1]))
    return dq, dw, dk[:s_kv]


def dsa_indexer_kl_backward_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    target: torch.Tensor,
    *,
    grad_scale: float = 1.0,
    sm_scale: float = 1.0,
    dtype: torch.dtype = torch.float64,
) -> Grads:
    """The same (dq, dw, dk) by autograd of L(I(q, k, w)) (predict = softmax(I) recomputed):
    the closed form's yardstick."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, weights)]
    with torch.enable_grad():
        logits = dsa_indexer_logits_ref(*leaves, topk_indices, sm_scale=sm_scale, dtype=dtype)
        loss = dsa_indexer_kl_loss_ref(logits, target, grad_scale)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    dq, dk, dw = (torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))
    return dq, dw, dk
