"""`forgekernel.ops.dsa_recompute.dsa_score_recompute`: DeepSeek sparse attention's score
recompute (DSA, DeepSeek-V3.2, issue 22), the indexer's training target; cuDNN-frontend 1.32's
`sparse_attn_score_recompute_wrapper` (same tensors, same result; kernel:
kernels/attention/dsa_recompute/sm90).

Math (reference/dsa.py `dsa_score_target_ref`; DeepSeek-V3.2 paper eq. (3): "sum the main
attention scores across all heads, then L1-normalize along the sequence dimension", over the
selected keys only): for query token t and list position j,

    S[t, j]      = sum_h exp(softmax_scale q[t, h] . kv[idx[t, j]] - lse[t, h])
    target[t, j] = S[t, j] / (sum_j' S[t, j'] + 1e-10)                       fp32

lse is the sparse forward's (`dsa_sparse_attention(..., return_lse=True)`): natural log, over
the same keys, without a sink (FlashMLA's and cuDNN's "KV-only" LSE). Entries that are padding
(negative), at or past topk_length[t], or outside their batch's keys give 0 and join no sum; a
head whose lse is -inf (its forward saw no key) adds 0; a row with no valid entry is all 0.

Layouts (cuDNN's): q (S, H, 576) / (B, S, H, 576) bf16 or fp16; kv (S_kv, 576) / (B, S_kv,
576) in q's dtype (one latent head: 512 + 64 RoPE columns); lse (S, H) / (B, S, H) fp32;
topk_indices int32 (S, topk) / (B, S, topk), per batch (e in [0, S_kv)) or, with
indices_global, b * S_kv + e (cuDNN's topk_indices_global); topk_length int32 (S,) / (B, S) or
None; returns fp32 (S, topk) / (B, S, topk). H one of 16, 32, 64, 128 (DeepSeek-V3.2 per GPU:
TP8 16, TP1 128). Nothing is read on the host (CUDA-graph capturable): an entry past S_kv is
not an error here (it counts as padding; reference.dsa raises on it, cuDNN would count a zero
row). softmax_scale has no default (DeepSeek-V3.2's: 1 / sqrt(192) x its YaRN mscale^2).
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_recompute.sm90 import launch
from forgekernel.kernels.attention.dsa_recompute.sm90.config import HEADS, WIDTH
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    check_bool,
    check_cuda,
    check_same_device,
    check_shaped,
    check_tensor,
)
from forgekernel.ops.mla import check_softmax_scale

INDEX = (torch.int32,)
FP32 = (torch.float32,)
MAX_ROWS = 2**31  # kv rows are int32 in the kernel, query tokens its grid x


def _validate(q, kv, lse, topk_indices, topk_length, out) -> bool:
    """The checks, each naming its argument; True for the batched (4-D q) form."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be (S, H, {WIDTH}) or (B, S, H, {WIDTH}), got {shape}")
    batched = q.dim() == 4
    lead = tuple(q.shape[:-2])  # (S,) or (B, S)
    check_tensor("q", q, ndim=q.dim(), cuda=False)
    heads = q.shape[-2]
    if q.shape[-1] != WIDTH:
        raise ValueError(f"q's last dim must be {WIDTH} (512 latent + 64 RoPE), got {q.shape[-1]}")
    if heads not in HEADS:
        raise NotImplementedError(f"H must be one of {HEADS} (compiled), got {heads}")
    check_tensor("kv", kv, ndim=3 if batched else 2, dtypes=(q.dtype,), cuda=False)
    if kv.shape[-1] != WIDTH or (batched and kv.shape[0] != q.shape[0]):
        want = f"({q.shape[0]}, S_kv, {WIDTH})" if batched else f"(S_kv, {WIDTH})"
        raise ValueError(f"kv must be {want}, got {tuple(kv.shape)}")
    check_shaped("lse", lse, (*lead, heads), FP32)
    check_tensor("topk_indices", topk_indices, ndim=len(lead) + 1, dtypes=INDEX, cuda=False)
    if tuple(topk_indices.shape[:-1]) != lead:
        raise ValueError(f"topk_indices must be {(*lead, 'topk')}, got {tuple(topk_indices.shape)}")
    if topk_length is not None:
        check_shaped("topk_length", topk_length, lead, INDEX)
    if out is not None:
        check_shaped("out", out, topk_indices.shape, FP32)
    check_cuda("q", q)
    extra = {"topk_length": topk_length} if topk_length is not None else {}
    if out is not None:
        extra["out"] = out
    check_same_device(q=q, kv=kv, lse=lse, topk_indices=topk_indices, **extra)
    return batched


@torch.library.custom_op("forgekernel::dsa_score_recompute", mutates_args=())
def _recompute_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    softmax_scale: float,
    s_q: int,
    s_kv: int,
    indices_global: bool,
) -> torch.Tensor:
    """The traced call (torch.compile, fake tensors): the flat (tokens, ...) operands; the
    eager call launches directly (no dispatcher)."""
    out = torch.empty(topk_indices.shape, dtype=torch.float32, device=q.device)
    launch.dsa_score_recompute(q, kv, lse, topk_indices, topk_length, out, softmax_scale, s_q,
                               s_kv, indices_global)  # fmt: skip
    return out


@_recompute_op.register_fake
def _(q, kv, lse, topk_indices, topk_length, softmax_scale, s_q, s_kv, indices_global):
    return topk_indices.new_empty(topk_indices.shape, dtype=torch.float32)


def dsa_score_recompute(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    indices_global: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer's target (module docstring): fp32 (S, topk), or (B, S, topk) for batched
    inputs, the head-summed attention probabilities at the selected keys, L1-normalized per
    token. out: written in place when given (its shape)."""
    scale = check_softmax_scale(softmax_scale)
    check_bool("indices_global", indices_global)
    batched = _validate(q, kv, lse, topk_indices, topk_length, out)
    s_q, heads = q.shape[-3], q.shape[-2]
    s_kv = kv.shape[-2]
    tokens = q.shape[0] * s_q if batched else s_q
    topk = topk_indices.shape[-1]
    if kv.numel() // WIDTH >= MAX_ROWS or tokens >= MAX_ROWS:
        raise ValueError("kv rows and query tokens must be below 2^31 (int32 rows, grid x)")
    q2 = q.reshape(tokens, heads, WIDTH)
    kv2 = kv.reshape(-1, WIDTH)
    lse2 = lse.reshape(tokens, heads)
    idx2 = topk_indices.reshape(tokens, topk)
    len2 = None if topk_length is None else topk_length.reshape(tokens)
    if _traced(q, kv, lse, topk_indices, topk_length, out):  # the 2026-12-05 audit: no op
        fresh = torch.ops.forgekernel.dsa_score_recompute(
            q2, kv2, lse2, idx2, len2, scale, s_q, s_kv, indices_global
        ).view(topk_indices.shape)
        return fresh if out is None else out.copy_(fresh)
    target = out
    if target is None:
        target = torch.empty(topk_indices.shape, dtype=torch.float32, device=q.device)
    flat = target.view(tokens, topk) if target.is_contiguous() else None
    dst = flat if flat is not None else torch.empty(tokens, topk, dtype=torch.float32,
                                                    device=q.device)  # fmt: skip
    launch.dsa_score_recompute(q2, kv2, lse2, idx2, len2, dst, scale, s_q, s_kv, indices_global)
    if flat is None:
        target.copy_(dst.view(target.shape))
    return target
