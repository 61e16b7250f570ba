"""Compile the sm90 GEMM against fake tensors: M, N, K and leading strides are dynamic."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

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
    gemm = GemmSm90(GemmConfig.from_params(params), b_kn=params["b_kn"])
    return cute.compile(
        gemm,
        a,
        b,
        c,
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
