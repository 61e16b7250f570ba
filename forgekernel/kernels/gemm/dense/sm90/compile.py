"""Compile the sm90 GEMM against fake tensors: M, N, K and leading strides are dynamic."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90


def compile_gemm(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The GEMM of `params` (a compile key: dtype, b_kn and the GemmConfig fields) for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    m = cute.sym_int32()
    n = cute.sym_int32(divisibility=8)
    k = cute.sym_int32(divisibility=8)
    a = fake.rowmajor(dtype, (m, k))
    b = fake.rowmajor(dtype, (k, n) if params["b_kn"] else (n, k))
    c = fake.rowmajor(dtype, (m, n))
    cfg = GemmConfig.from_params(params)
    gemm = GemmSm90(cfg, b_kn=params["b_kn"])
    if cfg.stream_k:
        work = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=16)
        flags = fake.offsets()
    else:
        work = flags = None
    return cute.compile(
        gemm,
        a,
        b,
        c,
        work,
        flags,
        cutlass.Int32(0),
        None,
        None,
        None,
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
