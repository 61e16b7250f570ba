"""PTX instructions the DSL does not wrap, as inline assembly: a packed 16-bit convert, 1-D
bulk copy / bulk reduce-add, acquire / release on a global int, a generic-to-async proxy
fence for global memory, and a threadIdx read the compiler may not hoist."""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one packed 16-bit pair (lo in the low half), as inline PTX:
    the assembler leaves it where it is written (the DSL's vector conversion can be moved
    past later barriers; the forward and backward use it for P)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{'bf16x2' if bf16 else 'f16x2'}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def bulk_g2s(dst_smem, src_gmem, nbytes: int, mbar, *, loc=None, ip=None) -> None:
    """cp.async.bulk global -> shared of `nbytes` (multiple of 16), completing on `mbar`."""
    llvm.inline_asm(
        None,
        [
            dst_smem.toint(loc=loc, ip=ip).ir_value(),
            src_gmem.llvm_ptr,
            Int32(nbytes).ir_value(loc=loc, ip=ip),
            mbar.toint(loc=loc, ip=ip).ir_value(),
        ],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(dst_gmem, src_smem, nbytes: int, *, loc=None, ip=None) -> None:
    """dst[i] += src[i] for `nbytes` / 4 floats, shared -> global, async (bulk group)."""
    llvm.inline_asm(
        None,
        [
            dst_gmem.llvm_ptr,
            src_smem.toint(loc=loc, ip=ip).ir_value(),
            Int32(nbytes).ir_value(loc=loc, ip=ip),
        ],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def ld_acquire_gpu(ptr, *, loc=None, ip=None) -> Int32:
    v = llvm.inline_asm(
        T.i32(),
        [ptr.llvm_ptr],
        "ld.global.acquire.gpu.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)


@dsl_user_op
def red_release_gpu_add(ptr, val, *, loc=None, ip=None) -> None:
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr, Int32(val).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def opaque_tid_x(*, loc=None, ip=None) -> Int32:
    """threadIdx.x read where it is used (volatile: not hoisted or merged with other reads)."""
    v = llvm.inline_asm(
        T.i32(),
        [],
        "mov.u32 $0, %tid.x;",
        "=r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None) -> None:
    """Order this thread's generic-proxy global accesses with its async-proxy ones."""
    llvm.inline_asm(
        None,
        [],
        "fence.proxy.async.global;",
        "",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
