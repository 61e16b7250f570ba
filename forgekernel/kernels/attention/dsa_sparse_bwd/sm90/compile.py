"""Compile the sparse backward against fake tensors: tokens, H, slots, topk and every outer
stride dynamic (q, kv, dO rows 16-byte aligned; lse2 / delta any strides; the index rows unit
column stride; dq (tokens, H, 576) row-major; the fp32 dkv accumulator rows 16-byte aligned);
the heads of one CTA and the dtype baked in."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import D_V, WIDTH
from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.kernel import DsaSparseBwdSm90
from forgekernel.kernels.common.sm90 import fake


def compile_sparse_bwd(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    any_strides = (cute.sym_int64(), cute.sym_int64())
    per_head = [
        make_fake_tensor(cutlass.Float32, (tokens, heads), stride=any_strides, assumed_align=4)
        for _ in range(2)
    ]
    idx = make_fake_tensor(
        cutlass.Int32, (tokens, cute.sym_int32()), stride=(cute.sym_int64(), 1), assumed_align=4
    )
    return cute.compile(
        DsaSparseBwdSm90(
            params["block"],
            not params.get("noreduce", False),
            params.get("xchg", False),
            params.get("red4s", False),
        ),
        fake.rowmajor(dtype, (tokens, heads, WIDTH)),
        fake.rowmajor(dtype, (slots, WIDTH)),
        fake.rowmajor(dtype, (tokens, heads, D_V)),
        *per_head,
        idx,
        fake.rowmajor(dtype, (tokens, heads, WIDTH), divisibility=1, align=4),
        fake.rowmajor(cutlass.Float32, (slots, WIDTH), divisibility=4),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )


def compile_h64(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The h64 kernels (kernel_h64.py): part `kv` takes kernel.py's operands with the
    dS workspace (tokens, rows, H) in place of dq; part `dq` kv, the index rows, the workspace
    and dq. The workspace's rows 16-byte aligned (H a multiple of 64). Part `fused`
    (kernel_h64f.py) takes kernel.py's operands, dq's rows 16-byte aligned."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.kernel_h64 import (
        DsaSparseBwdDqSm90,
        DsaSparseBwdKvSm90,
    )

    dtype = fake.dtype_of(params["dtype"])
    tokens, heads, slots = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
    idx = make_fake_tensor(
        cutlass.Int32, (tokens, cute.sym_int32()), stride=(cute.sym_int64(), 1), assumed_align=4
    )
    ws = fake.rowmajor(dtype, (tokens, cute.sym_int32(), heads))
    kv = fake.rowmajor(dtype, (slots, WIDTH))
    if params["h64"] == "fused":
        from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.kernel_h64f import (
            DsaSparseBwdFusedSm90,
        )

        any_strides = (cute.sym_int64(), cute.sym_int64())
        per_head = [
            make_fake_tensor(cutlass.Float32, (tokens, heads), stride=any_strides, assumed_align=4)
            for _ in range(2)
        ]
        return cute.compile(
            DsaSparseBwdFusedSm90(not params.get("noreduce", False)),
            fake.rowmajor(dtype, (tokens, heads, WIDTH)),
            kv,
            fake.rowmajor(dtype, (tokens, heads, D_V)),
            *per_head,
            idx,
            fake.rowmajor(dtype, (tokens, heads, WIDTH)),  # dq: 16-byte rows (its 128-bit stores)
            fake.rowmajor(cutlass.Float32, (slots, WIDTH), divisibility=4),
            cutlass.Float32(1.0),
            cutlass.Float32(1.0),
            fake.stream(),
            options=fake.options(arch, extra_options),
        )
    if params["h64"] == "dq":
        return cute.compile(
            DsaSparseBwdDqSm90(params.get("dq_heads", 64)),
            kv,
            idx,
            ws,
            fake.rowmajor(dtype, (tokens, heads, WIDTH), divisibility=1, align=4),
            fake.stream(),
            options=fake.options(arch, extra_options),
        )
    any_strides = (cute.sym_int64(), cute.sym_int64())
    per_head = [
        make_fake_tensor(cutlass.Float32, (tokens, heads), stride=any_strides, assumed_align=4)
        for _ in range(2)
    ]
    return cute.compile(
        DsaSparseBwdKvSm90(not params.get("noreduce", False), not params.get("v2", False)),
        fake.rowmajor(dtype, (tokens, heads, WIDTH)),
        kv,
        fake.rowmajor(dtype, (tokens, heads, D_V)),
        *per_head,
        idx,
        ws,
        fake.rowmajor(cutlass.Float32, (slots, WIDTH), divisibility=4),
        cutlass.Float32(1.0),
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
