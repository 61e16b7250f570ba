"""Compile the indexer backward against fake tensors: rows, key rows, topk and every outer stride
dynamic (q and k rows 16-byte aligned; weights / dw rows any stride, unit head stride; target,
predict and ids unit column stride; the fp32 dK accumulator rows 16-byte aligned); the 16-bit
dtype baked in (64 heads x 128)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.config import DIM, HEADS
from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.kernel import DsaIndexerBwdSm90
from forgekernel.kernels.common.sm90 import fake


def _rows(dtype, rows, cols, align: int) -> cute.Tensor:
    """(rows, cols) with unit column stride, any row stride."""
    return make_fake_tensor(dtype, (rows, cols), stride=(cute.sym_int64(), 1), assumed_align=align)


def kernel_for(params: dict) -> DsaIndexerBwdSm90:
    return DsaIndexerBwdSm90(
        not params.get("noreduce", False), params.get("staged", False), params.get("pair", False)
    )


def compile_indexer_bwd(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    """kernel: the instance to compile (tests read its `shared` struct after), else a new one."""
    dtype = fake.dtype_of(params["dtype"])
    rows, slots, topk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    return cute.compile(
        kernel_for(params) if kernel is None else kernel,
        fake.rowmajor(dtype, (rows, HEADS, DIM)),
        _rows(dtype, rows, HEADS, 2),
        fake.rowmajor(dtype, (slots, DIM)),
        _rows(cutlass.Float32, rows, topk, 4),
        _rows(cutlass.Float32, rows, topk, 4),
        _rows(cutlass.Int32, rows, topk, 4),
        make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4),
        fake.rowmajor(dtype, (rows, HEADS, DIM)),
        _rows(dtype, rows, HEADS, 2),
        fake.rowmajor(cutlass.Float32, (slots, DIM), divisibility=4),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
