"""Compile the sm90 GEMM against fake tensors: M, N, K and leading strides are dynamic (and
the masked grouped FP8 GEMM's: experts and every stride too)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig
from forgekernel.runtime.pdl import built_on, trigger_of


def compile_gemm(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The GEMM of `params` (a compile key: dtype, b_kn and the GemmConfig fields) for `arch`."""
    dtype = fake.dtype_of(params["dtype"])
    cfg = GemmConfig.from_params(params)
    k = cute.sym_int32(divisibility=8)
    if cfg.swap:
        # C^T = B A^T (launch.py): A the weight (N, K), B the tokens (M, K), C the (N, M)
        # view of the (M, N) row-major output: unit stride along the kernel's M.
        if params["b_kn"]:
            raise ValueError("the swap takes B 'nk' (a 'kn' weight would be an M-major A)")
        weight, tokens = cute.sym_int32(divisibility=8), cute.sym_int32()
        a = fake.rowmajor(dtype, (weight, k))
        b = fake.rowmajor(dtype, (tokens, k))
        c = make_fake_tensor(
            dtype,
            (weight, tokens),
            stride=(1, cute.sym_int64(divisibility=8)),
            assumed_align=16,
        )
    else:
        m = cute.sym_int32()
        n = cute.sym_int32(divisibility=8)
        a = fake.rowmajor(dtype, (m, k))
        b = fake.rowmajor(dtype, (k, n) if params["b_kn"] else (n, k))
        c = fake.rowmajor(dtype, (m, n))
    gemm = GemmSm90(cfg, b_kn=params["b_kn"], pdl=built_on(params), trigger=trigger_of(params))
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


def compile_gemm_fp8_masked(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The masked grouped FP8 GEMM of `params` (out dtype and the GemmConfig fields): operands
    (rows, cols, experts) with the cols contiguous, as torch's (E, rows, cols) permuted."""
    fp8 = cutlass.Float8E4M3FN
    m = cute.sym_int32()  # max_m
    n = cute.sym_int32(divisibility=128)
    k = cute.sym_int32(divisibility=128)
    experts = cute.sym_int32()

    def batched(dtype, rows, cols, divisibility):
        row, expert = (cute.sym_int64(divisibility=divisibility) for _ in range(2))
        stride = (row, 1, expert)
        return make_fake_tensor(dtype, (rows, cols, experts), stride=stride, assumed_align=16)

    def scales():
        shape = (cute.sym_int32(), cute.sym_int32(), experts)
        stride = (cute.sym_int64(), cute.sym_int64(), cute.sym_int64())
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=4)

    cfg = GemmConfig.from_params({k_: v for k_, v in params.items() if k_ not in ("out", "pdl")})
    return cute.compile(
        GemmSm90(cfg, masked=True, pdl=built_on(params)),
        batched(fp8, m, k, 16),
        batched(fp8, n, k, 16),
        batched(fake.dtype_of(params["out"]), m, n, 8),
        None,
        None,
        cutlass.Int32(0),
        scales(),
        scales(),
        make_fake_tensor(cutlass.Int32, (experts,), stride=(1,)),
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
