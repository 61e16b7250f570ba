"""Host launcher of the DSA indexer backward kernel: torch only (no DSL), the kernel through the
compile cache. Callers validate first (`forgekernel.ops.dsa_indexer_bwd`); nothing here reads
device data (CUDA-graph capturable: grad_loss is read by the kernel)."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import SPEC, config
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

KERNEL_DTYPES = (torch.bfloat16,)  # config.DTYPES: fp16 goes to the interim path


def unsupported(q: torch.Tensor, k: torch.Tensor, topk_indices: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (None: it can): q (S, H, D) / (B, S, H, D), k
    (S_kv, D) / (B, S_kv, D), topk_indices (..., topk) int32."""
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype:
        return f"dtypes {q.dtype} / {k.dtype}: the kernel takes bf16 (fp16's dS underflows)"
    if q.shape[-2] != config.HEADS:
        return f"the kernel takes {config.HEADS} heads, got {q.shape[-2]}"
    if q.shape[-1] != config.DIM or k.shape[-1] != config.DIM:
        return f"rows must be {config.DIM} wide, got {q.shape[-1]} / {k.shape[-1]}"
    if topk_indices.dtype != torch.int32:
        return f"topk_indices must be int32, got {topk_indices.dtype}"
    if topk_indices.shape[-1] > config.TOPK_MAX:
        return f"topk {topk_indices.shape[-1]} > {config.TOPK_MAX} (the row's G in shared memory)"
    if not q.is_cuda:
        return "q is not on a CUDA device"
    return None


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """(..., width) as (rows, width) with a unit column stride (a view where one exists)."""
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def dsa_indexer_bwd(
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
    dq: torch.Tensor | None = None,
    dw: torch.Tensor | None = None,
    reduce: bool = True,
    staged: bool = False,
    pair: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq like q, dw like weights, dk fp32 like k): the op's layouts (3-D q (S, H, D), k
    (S_kv, D) or 4-D q (B, S, H, D), k (B, S_kv, D); weights (.., S, H); target, predict fp32
    and topk_indices int32 (.., S, topk), per batch or with indices_global b S_kv + e).
    grad_scale = grad_loss x loss_coeff / (B S) is formed on the device. dq / dw: contiguous
    buffers to write (tests poison them); reduce False: the timing probe's build (dk stays 0);
    staged True: the candidate reduction form (kernel.py `_reduce_staged`); pair True: the
    candidate plan of two CTAs an SM (config.PAIR).
    `unsupported` must be None for these inputs."""
    four = q.dim() == 4
    b, s_q = (q.shape[0], q.shape[1]) if four else (1, q.shape[0])
    s_kv = k.shape[-2]
    topk = topk_indices.shape[-1]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dw = torch.empty(weights.shape, dtype=weights.dtype, device=q.device) if dw is None else dw
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    rows = b * s_q
    if rows == 0:
        return dq, dw, dk
    if topk == 0 or s_kv == 0:
        return dq.zero_(), dw.zero_(), dk
    params = config.params_for(dtype_name(q.dtype), q.shape[-2], reduce, staged, pair)
    kernel = get_kernel(SPEC, params)
    heads, dim = config.HEADS, config.DIM
    gl = torch.ones(1, dtype=torch.float32, device=q.device) if grad_loss is None else grad_loss
    with on_device(q.device):
        kernel(as_tma_ready(q.reshape(rows, heads, dim)), _rows(weights, heads),
               as_tma_ready(k.reshape(-1, dim)), _rows(target, topk), _rows(predict, topk),
               _rows(topk_indices, topk), gl.reshape(1), dq.view(rows, heads, dim),
               dw.view(rows, heads), dk.view(-1, dim), float(sm_scale),
               float(loss_coeff) / rows, s_q, s_kv, int(indices_global))  # fmt: skip
    return dq, dw, dk
