"""Fake tensors and options for ahead-of-time compiles: every size and stride the kernel does
not bake in is a symbolic integer, so one compiled kernel serves all problem sizes."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def dtype_of(name: str):
    """The DSL dtype of a compile key's dtype name."""
    return DTYPES[name]


def rowmajor(dtype, shape, divisibility: int = 8, align: int | None = 16) -> cute.Tensor:
    """A tensor of `shape` (ints static, `cute.sym_int*` dynamic) whose last mode is contiguous
    and whose other strides are dynamic multiples of `divisibility` elements (8 x 16 bits =
    16 bytes: TMA-ready), base `align`-byte aligned."""
    strides = tuple(cute.sym_int64(divisibility=divisibility) for _ in shape[:-1])
    if align is None:
        return make_fake_tensor(dtype, tuple(shape), stride=(*strides, 1))
    return make_fake_tensor(dtype, tuple(shape), stride=(*strides, 1), assumed_align=align)


def offsets() -> cute.Tensor:
    """int32 (B + 1,) cumulative sequence offsets (cu_seqlens)."""
    return make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), stride=(1,))


def stream():
    """The TVM-FFI environment stream (torch's current stream at call time)."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def options(arch: str, extra: str = "") -> str:
    """`cute.compile` options for an exported (TVM-FFI) kernel on `arch`."""
    return f"--enable-tvm-ffi --gpu-arch {arch} {extra}".strip()
