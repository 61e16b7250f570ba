"""Compile the score recompute against fake tensors: tokens, heads' strides, kv rows, topk and
every outer stride dynamic (q and kv rows 16-byte aligned; lse any strides; the index and
output rows unit column stride); heads and dtype baked in; topk_length present or not."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.dsa_recompute.sm90.config import WIDTH
from forgekernel.kernels.attention.dsa_recompute.sm90.kernel import DsaRecomputeSm90
from forgekernel.kernels.common.sm90 import fake


def _rows(dtype, rows, cols, align: int) -> cute.Tensor:
    """(rows, cols) with unit column stride, any row stride."""
    return make_fake_tensor(dtype, (rows, cols), stride=(cute.sym_int64(), 1), assumed_align=align)


def compile_recompute(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    heads = params["heads"]
    tokens, topk = cute.sym_int32(), cute.sym_int32()
    any_strides = (cute.sym_int64(), cute.sym_int64())
    lse = make_fake_tensor(cutlass.Float32, (tokens, heads), stride=any_strides, assumed_align=4)
    length = None
    if params.get("length", False):
        length = make_fake_tensor(cutlass.Int32, (tokens,), stride=(1,), assumed_align=4)
    return cute.compile(
        DsaRecomputeSm90(heads),
        fake.rowmajor(dtype, (tokens, heads, WIDTH)),
        fake.rowmajor(dtype, (cute.sym_int32(), WIDTH)),
        lse,
        _rows(cutlass.Int32, tokens, topk, 4),
        length,
        _rows(cutlass.Float32, tokens, topk, 4),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
