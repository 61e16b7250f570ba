"""Compile the FP4-weight masked grouped GEMM against fake tensors: every size and stride
dynamic but the contiguous modes; operands (rows, cols, experts) as torch's (E, rows, cols)
permuted, the exponent words (N, K/128, E) with N contiguous."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.gemm.fp4.sm90.convert import GemmFp4ConvertSm90
from forgekernel.kernels.gemm.fp4.sm90.kernel import GemmFp4GroupedSm90


def compile_gemm_fp4_grouped(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The kernel of `params` (a compile key: out dtype, tokens per tile, layout). The
    contiguous layout's A, C and sa have one batch (E = 1), its counts are m_indices (M,)."""
    contiguous = bool(params.get("contiguous"))
    m = cute.sym_int32()  # max_m
    n = cute.sym_int32(divisibility=128)
    k = cute.sym_int32(divisibility=128)
    half_k = cute.sym_int32(divisibility=64)
    blocks = cute.sym_int32()  # K / 128
    experts = cute.sym_int32()
    batches = 1 if contiguous else experts

    def batched(dtype, rows, cols, divisibility, batch=None):
        row, expert = (cute.sym_int64(divisibility=divisibility) for _ in range(2))
        return make_fake_tensor(
            dtype, (rows, cols, batch or experts), stride=(row, 1, expert), assumed_align=16
        )

    exps = make_fake_tensor(
        cutlass.Int32,
        (n, blocks, experts),
        stride=(1, cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4)),
        assumed_align=16,
    )
    sfa = make_fake_tensor(
        cutlass.Float32,
        (m, blocks, batches),
        stride=(cute.sym_int64(), cute.sym_int64(), cute.sym_int64()),
        assumed_align=4,
    )
    if params.get("converter"):
        converters = params.get("converters", 1)
        kernel = GemmFp4ConvertSm90(params["tokens"], contiguous=contiguous, converters=converters)
    else:
        staged = bool(params.get("staged_sa"))
        kernel = GemmFp4GroupedSm90(params["tokens"], contiguous=contiguous, staged_sa=staged)
    return cute.compile(
        kernel,
        batched(cutlass.Float8E4M3FN, m, k, 16, batches),
        batched(cutlass.Uint8, n, half_k, 16),
        exps,
        batched(fake.dtype_of(params["out"]), m, n, 8, batches),
        sfa,
        make_fake_tensor(cutlass.Int32, (m if contiguous else experts,), stride=(1,)),
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
