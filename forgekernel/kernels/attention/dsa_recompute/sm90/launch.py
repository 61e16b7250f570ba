"""Host launcher of the DSA score recompute: torch only (no DSL), the kernel through the compile
cache. Callers validate first (`forgekernel.ops.dsa_recompute`); nothing here reads device data
(CUDA-graph capturable)."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_recompute.sm90 import SPEC, config
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device


def dsa_score_recompute(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    out: torch.Tensor,
    softmax_scale: float,
    s_q: int,
    s_kv: int,
    indices_global: bool,
) -> None:
    """out (tokens, topk) fp32 (unit column stride) = the kernel's target (kernel.py): q
    (tokens, H, 576), kv (B s_kv, 576) in q's 16-bit dtype, lse (tokens, H) fp32 natural log,
    topk_indices int32 (tokens, topk), topk_length int32 (tokens,) or None; tokens = B s_q
    (token t is batch t // s_q). indices_global: entries are b s_kv + e, else e."""
    tokens, heads, _ = q.shape
    if tokens == 0 or topk_indices.shape[1] == 0:
        return
    params = config.params_for(dtype_name(q.dtype), heads, topk_length is not None)
    kernel = get_kernel(SPEC, params)
    idx = topk_indices if topk_indices.stride(-1) == 1 else topk_indices.contiguous()
    length = None if topk_length is None else topk_length.contiguous()
    with on_device(q.device):
        kernel(as_tma_ready(q), as_tma_ready(kv), lse, idx, length, out,
               softmax_scale * LOG2E, s_q, s_kv, int(indices_global))  # fmt: skip
