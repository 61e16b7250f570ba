"""GEMM reference: C = A @ B^T in fp32 (B given as (N, K) or, with b_layout="kn", (K, N))."""

from __future__ import annotations

import torch


def gemm_ref(a: torch.Tensor, b: torch.Tensor, b_layout: str = "nk") -> torch.Tensor:
    b_nk = b if b_layout == "nk" else b.t()
    return a.float() @ b_nk.float().t()


def gemm_fp8_ref(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """Block-scaled FP8 GEMM in fp64, returned as fp32: a (M, K) times scale_a (M, K/128) per
    1x128 group, b (N, K) times scale_b (ceil(N/128), K/128) per 128x128 block, C = A B^T."""
    n = b.shape[0]
    sa = scale_a.double().repeat_interleave(128, dim=1)
    sb = scale_b.double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)
    return ((a.double() * sa) @ (b.double() * sb).t()).float()
