"""GEMM reference: C = A @ B^T in fp32 (B given as (N, K) or, with b_layout="kn", (K, N))."""

from __future__ import annotations

import torch


def gemm_ref(a: torch.Tensor, b: torch.Tensor, b_layout: str = "nk") -> torch.Tensor:
    b_nk = b if b_layout == "nk" else b.t()
    return a.float() @ b_nk.float().t()
