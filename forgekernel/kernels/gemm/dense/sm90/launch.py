"""Host launcher of the sm90 dense GEMM: torch only (no DSL), the kernel through the compile
cache. Callers validate first (`forgekernel.gemm`); the launcher makes the operands TMA-ready,
picks the configuration (a recorded tuning winner, else the analytical default) and launches
fn(a, b, c, max_clusters)."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.dense.sm90 import SPEC
from forgekernel.kernels.gemm.dense.sm90.config import (
    NUM_SMS_H100_H200,
    GemmConfig,
    choose_config,
    params_for,
)
from forgekernel.runtime import tuning
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, copy_back, dtype_name, num_sms, tma_target


def tuning_key(dtype: torch.dtype, b_kn: bool, m: int, n: int, k: int) -> str:
    """The problem's key in the tuning table (`forgekernel.tune_gemm` records under it)."""
    return f"{dtype_name(dtype)},{'kn' if b_kn else 'nk'},{m},{n},{k}"


def config_for(
    dtype: torch.dtype, b_kn: bool, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200
) -> GemmConfig:
    """A recorded tuning winner for exactly this problem, else the analytical default for a
    chip with `num_sms` multiprocessors (132 on H100 SXM and H200, 114 on H100 PCIe)."""
    tuned = tuning.load(SPEC.name).get(tuning_key(dtype, b_kn, m, n, k))
    cfg = GemmConfig.from_record(tuned["config"]) if tuned else None
    return cfg or choose_config(m, n, k, num_sms)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    b_kn: bool,
    config: GemmConfig | None = None,
) -> None:
    """out = a @ b^T with b (N, K), or a @ b with b_kn and b (K, N), written into out (any
    (M, N) view). a, b and out are 16-bit alike on one device, K and N multiples of 8."""
    m, k = a.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    sms = num_sms(a.device.index)
    cfg = config or config_for(a.dtype, b_kn, m, n, k, sms)
    fn = get_kernel(SPEC, params_for(dtype_name(a.dtype), b_kn, cfg))
    # One CTA per SM (the pipeline takes nearly all shared memory).
    max_clusters = sms // (cfg.cluster_m * cfg.cluster_n)
    a, b = as_tma_ready(a), as_tma_ready(b)
    c = tma_target(out)
    with torch.cuda.device(a.device):
        fn(a, b, c, max_clusters)
    copy_back((out,), (c,))
