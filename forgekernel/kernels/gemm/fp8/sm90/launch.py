"""Host launcher of the block-scaled FP8 GEMM: torch only (no DSL), the kernel through the
compile cache. Callers validate first (`forgekernel.ops.gemm_fp8`). Stream-K configurations
take the dense launcher's per-stream workspace (`stream_k_workspace`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig, stream_plan
from forgekernel.kernels.gemm.dense.sm90.launch import stream_k_workspace
from forgekernel.kernels.gemm.dense.sm90.plan import grid_ctas
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    STREAM_MIN_K,
    choose_config,
    params_for,
)
from forgekernel.runtime import pdl
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device, tma_target
from forgekernel.runtime.plans import PlanCache
from forgekernel.runtime.scratch import scratch

_plans = PlanCache()
# `scale_mn_major`: A's scales are read in vectors of 4 fp32 rows (kernel.py `_fetch_mn_major`)
SCALE_VECTOR = 4


def clear_plans() -> None:
    """Every plan (they hold the functions they looked up)."""
    _plans.clear()


def _choose(out_dtype, m, n, k, device_index, config) -> tuple[tuple, int, tuple | None, str]:
    """(compile params, max clusters, stream K: (k-tiles per CTA, tiles, workspace floats) or
    None, the PDL form of its grid: `pdl.form`) for an (M, N, K) problem whose C has N columns
    (a multiple of 8)."""
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
    ctas = grid_ctas(cfg, m, n, k, sms, split[0] if split else 0)
    # One CTA per SM (the pipeline takes nearly all shared memory).
    max_clusters = sms // (cfg.cluster_m * cfg.cluster_n)
    return params_for(dtype_name(out_dtype), cfg), max_clusters, split, pdl.form(ctas, sms)


def _plan(out_dtype, m, n, k, device_index, config, _pdl_forced=None) -> tuple:
    """`_choose`'s plan with its kernel looked up, once per problem (a compile-cache lookup
    per call before), and whether it reads A's scales M-major. The kernel: its PDL build
    unless runtime/pdl.py says otherwise when the plan is built (`pdl.forced()` in the key; the
    trigger late inside `pdl.late()`; the partial-wave rule's form for its grid otherwise)."""
    params, max_clusters, split, form = _choose(out_dtype, m, n, k, device_index, config)
    mn_major = dict(params).get("scale_mn_major", False)
    fn = get_kernel(SPEC, pdl.key_for(params, form))
    return fn, max_clusters, split, mn_major


def takes_mn_major(scale_a: torch.Tensor) -> bool:
    """Whether A's scales (M, K/128) fp32 are what a `scale_mn_major` kernel reads as they are:
    unit stride along M, the K/128 stride a multiple of 4 and at least M rounded up to 4, the
    base 16-byte aligned and M rounded up to 4 floats in storage in every column (the kernel
    reads whole 4-row vectors). DeepGEMM's TMA-aligned layout is that: an (M, K/128) view of a
    (K/128, M') buffer, M' = M rounded up to 4 (`get_mn_major_tma_aligned_tensor`)."""
    m, kb = scale_a.shape
    m4 = -(-m // SCALE_VECTOR) * SCALE_VECTOR
    ld = scale_a.stride(1)
    if scale_a.stride(0) != 1 or ld % SCALE_VECTOR or (kb > 1 and ld < m4):
        return False
    if scale_a.data_ptr() % (4 * SCALE_VECTOR):
        return False
    end = scale_a.storage_offset() + (kb - 1) * ld + m4  # floats the kernel may read
    return scale_a.untyped_storage().nbytes() >= 4 * end


def mn_major_copy(scale_a: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """A's scales (M, K/128) copied M-major: the (M, K/128) view of `buf`, a (K/128, M rounded
    up to 4) fp32 buffer (a new one when None), whose padding rows are left as they are (read,
    never stored). What a caller may make once and pass to every call (`takes_mn_major`)."""
    m, kb = scale_a.shape
    m4 = -(-m // SCALE_VECTOR) * SCALE_VECTOR
    if buf is None:
        buf = torch.empty(kb, m4, dtype=torch.float32, device=scale_a.device)
    buf[:, :m].copy_(scale_a.t())
    return buf.t()[:m]


def mn_major_scales(scale_a: torch.Tensor) -> torch.Tensor:
    """A's scales as a `scale_mn_major` kernel reads them (`takes_mn_major`): the caller's
    tensor where it already is, else `mn_major_copy` into a scratch (runtime/scratch.py: reused
    per stream, a capture's own): one small copy kernel (K/128 x M x 8 bytes of traffic). Call
    it with the device current."""
    if takes_mn_major(scale_a):
        return scale_a
    m, kb = scale_a.shape
    m4 = -(-m // SCALE_VECTOR) * SCALE_VECTOR
    buf = scratch("gemm_fp8.scale_a_mn", (kb, m4), torch.float32, scale_a.device)
    return mn_major_copy(scale_a, buf)


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
    configuration (tuning scripts), else `choose_config`'s. A configuration that reads A's
    scales M-major (`scale_mn_major`) takes DeepGEMM's TMA-aligned scale_a as it is and copies
    any other once (`mn_major_scales`)."""
    m, k = a.shape
    n = b.shape[0]
    if m == 0 or n == 0:
        return
    n8 = -(-n // 8) * 8
    fn, max_clusters, split, mn_major = _plans.get_or_build(
        (out.dtype, m, n8, k, a.device.index, config, pdl.forced()), _plan
    )
    c = out.new_empty(m, n8) if n % 8 else tma_target(out)
    work = flags = None
    per = 0
    if split is not None:
        per, tiles, floats = split
        work, flags = stream_k_workspace(a.device, tiles, floats)
    with on_device(a.device):
        if mn_major:
            scale_a = mn_major_scales(scale_a)
        fn(as_tma_ready(a), as_tma_ready(b), c, work, flags, per, scale_a, scale_b, None,
           max_clusters)  # fmt: skip
    if c is not out:
        out.copy_(c if c.shape[1] == n else c[:, :n])


def _grouped_plan(_, out_dtype, device_index, config, _pdl_forced=None) -> tuple:
    """(the grouped kernel, max clusters, whether it reads A's scales M-major): one config
    (GROUPED, or the one forced), looked up once per output dtype and device (params_for, the
    compile-cache lookup and the SM count cost ~6 us a call on the CPU)."""
    cfg = config or GROUPED
    params = params_for(dtype_name(out_dtype), cfg, grouped=True)
    fn = get_kernel(SPEC, pdl.key(params, pdl.enabled()))
    return fn, num_sms(device_index) // (cfg.cluster_m * cfg.cluster_n), cfg.scale_mn_major


def gemm_fp8_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    groups: torch.Tensor,
    out: torch.Tensor,
    config: GemmConfig | None = None,
) -> None:
    """The grouped (MoE, contiguous) layout: out = (a x scale_a) @ (b[e] x scale_b[e])^T per
    row, e = groups[row]: a (M, K) float8_e4m3fn with every expert's rows contiguous and padded
    to multiples of 128 (padding rows' groups[row] = -1: their output rows are computed with
    expert 0, not the caller's), b (E, N, K) float8_e4m3fn, scale_a (M, K/128), scale_b
    (E, N/128, K/128) fp32, groups int32 (M,), out (M, N) 16-bit; N a multiple of 128.
    `config`: force a configuration of the grouped kind (128 rows, no B multicast, not stream
    K; tuning scripts, a suite's variants: another walk), else GROUPED."""
    m, k = a.shape
    e, n, _ = b.shape
    if m == 0 or n == 0:
        return
    fn, clusters, mn_major = _plans.get_or_build(
        ("grouped", out.dtype, a.device.index, config, pdl.forced()), _grouped_plan
    )
    flat_b = b.reshape(e * n, k)
    flat_sb = scale_b.reshape(e * scale_b.shape[1], scale_b.shape[2])
    with on_device(a.device):
        if mn_major:
            scale_a = mn_major_scales(scale_a)
        fn(as_tma_ready(a), as_tma_ready(flat_b), out, None, None, 0, scale_a, flat_sb, groups,
           clusters)  # fmt: skip
