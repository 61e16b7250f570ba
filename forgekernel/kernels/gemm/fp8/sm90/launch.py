"""Host launcher of the block-scaled FP8 GEMM: torch only (no DSL), the kernel through the
compile cache. Callers validate first (`forgekernel.ops.gemm_fp8`). Stream-K configurations
take the dense launcher's per-stream workspace (`stream_k_workspace`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig, stream_plan
from forgekernel.kernels.gemm.dense.sm90.launch import stream_k_workspace
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    STREAM_MIN_K,
    choose_config,
    params_for,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device, tma_target
from forgekernel.runtime.plans import PlanCache

_plans = PlanCache()


def clear_plans() -> None:
    """Every plan (they hold the functions they looked up)."""
    _plans.clear()


def _choose(out_dtype, m, n, k, device_index, config) -> tuple[tuple, int, tuple | None]:
    """(compile params, max clusters, stream K: (k-tiles per CTA, tiles, workspace floats) or
    None) for an (M, N, K) problem whose C has N columns (a multiple of 8)."""
    sms = num_sms(device_index)
    cfg = config or choose_config(m, n, k, sms)
    if not cfg.fits(m):
        raise ValueError(
            f"FP8 GEMM config {cfg.tag()} loads {cfg.a_rows} rows of A: M = {m} is more"
        )
    split = None
    if cfg.stream_k:
        per, ctas, tiles = stream_plan(cfg, m, n, k, sms, STREAM_MIN_K)
        split = (per, tiles, 2 * ctas * cfg.tile_m * cfg.tile_n)
    # One CTA per SM (the pipeline takes nearly all shared memory).
    return params_for(dtype_name(out_dtype), cfg), sms // (cfg.cluster_m * cfg.cluster_n), split


def _plan(out_dtype, m, n, k, device_index, config) -> tuple:
    """`_choose`'s plan with its kernel looked up, once per problem (a compile-cache lookup
    per call before)."""
    params, max_clusters, split = _choose(out_dtype, m, n, k, device_index, config)
    return get_kernel(SPEC, params), max_clusters, split


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig | None = None,
) -> None:
    """out = (a x scale_a) @ (b x scale_b)^T: a (M, K), b (N, K) float8_e4m3fn, scale_a
    (M, K/128) and scale_b (ceil(N/128), K/128) fp32 (any strides), out (M, N) 16-bit (any
    view; N not a multiple of 8 goes through an (M, N rounded up) scratch). `config`: force a
    configuration (tuning scripts), else `choose_config`'s."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return
    n8 = -(-n // 8) * 8
    fn, max_clusters, split = _plans.get_or_build(
        (out.dtype, m, n8, k, a.device.index, config), _plan
    )
    c = out.new_empty(m, n8) if n % 8 else tma_target(out)
    work = flags = None
    per = 0
    if split is not None:
        per, tiles, floats = split
        work, flags = stream_k_workspace(a.device, tiles, floats)
    with on_device(a.device):
        fn(as_tma_ready(a), as_tma_ready(b), c, work, flags, per, scale_a, scale_b, None,
           max_clusters)  # fmt: skip
    if c is not out:
        out.copy_(c if c.shape[1] == n else c[:, :n])


def _grouped_plan(_, out_dtype, device_index) -> tuple:
    """(the grouped kernel, max clusters): one config (GROUPED), looked up once per output
    dtype and device (params_for, the compile-cache lookup and the SM count cost ~6 us a call
    on the CPU)."""
    cfg = GROUPED
    fn = get_kernel(SPEC, params_for(dtype_name(out_dtype), cfg, grouped=True))
    return fn, num_sms(device_index) // (cfg.cluster_m * cfg.cluster_n)


def gemm_fp8_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    groups: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The grouped (MoE, contiguous) layout: out = (a x scale_a) @ (b[e] x scale_b[e])^T per
    row, e = groups[row]: a (M, K) float8_e4m3fn with every expert's rows contiguous and padded
    to multiples of 128 (padding rows' groups[row] = -1: their output rows are computed with
    expert 0, not the caller's), b (E, N, K) float8_e4m3fn, scale_a (M, K/128), scale_b
    (E, N/128, K/128) fp32, groups int32 (M,), out (M, N) 16-bit; N a multiple of 128."""
    m, k = a.shape
    e, n, _ = b.shape
    if m == 0 or n == 0:
        return
    fn, clusters = _plans.get_or_build(("grouped", out.dtype, a.device.index), _grouped_plan)
    flat_b = b.reshape(e * n, k)
    flat_sb = scale_b.reshape(e * scale_b.shape[1], scale_b.shape[2])
    with on_device(a.device):
        fn(as_tma_ready(a), as_tma_ready(flat_b), out, None, None, 0, scale_a, flat_sb, groups,
           clusters)  # fmt: skip
