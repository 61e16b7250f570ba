"""Host launcher of the block-scaled FP8 GEMM: torch only (no DSL), the kernel through the
compile cache. Callers validate first (`forgekernel.ops.gemm_fp8`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    GROUPED_WIDE,
    choose_config,
    params_for,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device, tma_target
from forgekernel.runtime.plans import PlanCache

_plans = PlanCache()


def _choose(out_dtype, m, n, k, device_index) -> tuple[tuple, int]:
    cfg = choose_config(m, n, k)
    # One CTA per SM (the pipeline takes nearly all shared memory).
    return params_for(dtype_name(out_dtype), cfg), num_sms(device_index) // (
        cfg.cluster_m * cfg.cluster_n
    )


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out = (a x scale_a) @ (b x scale_b)^T: a (M, K), b (N, K) float8_e4m3fn, scale_a
    (M, K/128) and scale_b (ceil(N/128), K/128) fp32 (any strides), out (M, N) 16-bit (any
    view; N not a multiple of 8 goes through an (M, N rounded up) scratch)."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return
    params, max_clusters = _plans.get_or_build((out.dtype, m, n, k, a.device.index), _choose)
    fn = get_kernel(SPEC, params)
    if n % 8:
        c = out.new_empty(m, -(-n // 8) * 8)
    else:
        c = tma_target(out)
    with on_device(a.device):
        fn(as_tma_ready(a), as_tma_ready(b), c, None, None, 0, scale_a, scale_b, None, max_clusters)
    if c is not out:
        out.copy_(c if c.shape[1] == n else c[:, :n])


def gemm_fp8_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    groups: torch.Tensor,
    out: torch.Tensor,
    wide: bool = False,
) -> None:
    """The grouped (MoE, contiguous) layout: out = (a x scale_a) @ (b[e] x scale_b[e])^T per
    row, e = groups[row]: a (M, K) float8_e4m3fn with every expert's rows contiguous and padded
    to multiples of 128 (padding rows' groups[row] = -1: their output rows are computed with
    expert 0, not the caller's), b (E, N, K) float8_e4m3fn, scale_a (M, K/128), scale_b
    (E, N/128, K/128) fp32, groups int32 (M,), out (M, N) 16-bit; N a multiple of 128. `wide`:
    the 128x192 tile instead of 128x128 (until the GPU picks)."""
    m, k = a.shape
    e, n, _ = b.shape
    if m == 0 or n == 0:
        return
    cfg = GROUPED_WIDE if wide else GROUPED
    fn = get_kernel(SPEC, params_for(dtype_name(out.dtype), cfg, grouped=True))
    clusters = num_sms(a.device.index) // (cfg.cluster_m * cfg.cluster_n)
    flat_b = b.reshape(e * n, k)
    flat_sb = scale_b.reshape(e * scale_b.shape[1], scale_b.shape[2])
    with on_device(a.device):
        fn(as_tma_ready(a), as_tma_ready(flat_b), out, None, None, 0, scale_a, flat_sb, groups,
           clusters)  # fmt: skip
