"""Compile the sm90 GEMM against fake tensors: M, N, K and leading strides are dynamic."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def _row_major(dtype, rows, cols):
    # Inner dim contiguous, leading stride any multiple of 8 elements (16 B, TMA).
    return make_fake_tensor(
        dtype, (rows, cols), stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16
    )


def compile_gemm(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = _DTYPES[params["dtype"]]
    m = cute.sym_int32()
    n = cute.sym_int32(divisibility=8)
    k = cute.sym_int32(divisibility=8)
    a = _row_major(dtype, m, k)
    b = _row_major(dtype, k, n) if params["b_kn"] else _row_major(dtype, n, k)
    cfg = GemmConfig.from_params(params)
    if cfg.split_k > 1:
        # fp32 workspace (S, M, N), compact.
        c = make_fake_tensor(
            cutlass.Float32,
            (cfg.split_k, m, n),
            stride=(cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1),
            assumed_align=16,
        )
    else:
        c = _row_major(dtype, m, n)
    gemm = GemmSm90(cfg, b_kn=params["b_kn"])
    return cute.compile(
        gemm,
        a,
        b,
        c,
        cutlass.Int32(1),
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi --gpu-arch {arch} {extra_options}".strip(),
    )
