"""DSL helpers shared by the backward kernels: layout views of WGMMA accumulators, the dQ
tiled MMA (whose accumulator order is the dQ workspace's order), and a few PTX instructions
the DSL does not wrap (1-D bulk copy / bulk reduce-add, acquire / release on a global int)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cutlass_dsl import T, dsl_user_op

THREADS_PER_WG = 128


def select(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def packed_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """A packed varlen tensor (T, H, D) as (T, D, H, 1): the fixed-length (S, D, H, B) view
    with one batch (sequences are row offsets into it)."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[0], lay.shape[2], lay.shape[1], 1),
            stride=(lay.stride[0], lay.stride[2], lay.stride[1], 0),
        ),
    )


def transposed(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (staged) shared-memory tensor; the swizzle rides on the
    iterator, so the view addresses the same bytes."""
    modes = [1, 0] + list(range(2, cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def rows_cols(t: cute.Tensor) -> cute.Tensor:
    """A WGMMA accumulator partition ((2, 2, V), M, N) seen as (rows, cols) =
    ((2, M), (2, V, N)): a thread holds rows r and r + 8 of its warp's 16-row band and, in each
    row, V pairs of adjacent columns 8 apart."""
    shape = t.layout.shape
    s = cute.make_layout(shape).stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def acc_as_operand_a(t: cute.Tensor) -> cute.Tensor:
    """An accumulator ((2, 2, V), M, N) as the register A operand of a following WGMMA whose K
    runs along the accumulator's columns: ((2, 2, 2), M, (V / 2, N)). For 16-bit A the
    register orders coincide, no data moves."""
    lay = cute.logical_divide(t.layout, ((None, None, 2), None, None))
    shape, stride = lay.shape, lay.stride
    a = cute.make_layout(
        ((shape[0][0], shape[0][1], shape[0][2][0]), shape[1], (shape[0][2][1], shape[2])),
        stride=(
            (stride[0][0], stride[0][1], stride[0][2][0]),
            stride[1],
            (stride[0][2][1], stride[2]),
        ),
    )
    return cute.make_tensor(t.iterator, a)


def make_dq_mma(dtype, tile_m: int, head_dim: int) -> cute.TiledMma:
    """dQ (tile_m, D) = dS (tile_m, tile_n) K (tile_n, D), both operands MN-major in shared
    memory, over two warpgroups: split along rows for tile_m = 128, along D for tile_m = 64.
    The postprocess kernel rebuilds it to read the workspace in the same order."""
    mn = OperandMajorMode.MN
    if tile_m == 128:
        atoms, inst_n = (2, 1, 1), head_dim
    elif tile_m == 64:
        atoms, inst_n = (1, 2, 1), head_dim // 2
    else:
        raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn, mn, Float32, atoms, (64, inst_n))


DQ_VEC = 4  # fp32 dQ elements a thread stages with one (16-byte) shared-memory store


DQ_WG_THREADS = 128  # threads of one consumer warpgroup


def dq_frag_offset(thread: Int32, i: int, per_thread: int, halves: bool) -> Int32:
    """Word offset inside one (tile_m, D) fp32 dQ tile of element i of consumer thread
    `thread`'s accumulator (per_thread elements each, 256 threads): runs of DQ_VEC consecutive
    elements of all threads, so that 16-byte shared-memory stores are conflict-free and the
    postprocess reads coalesced. `halves` (the dq_split main kernels): each warpgroup's
    elements fill one contiguous half of the tile instead (reduced into global memory on
    its own), inside it runs of DQ_VEC elements of the warpgroup's threads."""
    if not halves:
        return ((i // DQ_VEC) * 2 * DQ_WG_THREADS + thread) * DQ_VEC + (i % DQ_VEC)
    wg, lane = thread // DQ_WG_THREADS, thread % DQ_WG_THREADS
    return (
        wg * (DQ_WG_THREADS * per_thread)
        + ((i // DQ_VEC) * DQ_WG_THREADS + lane) * DQ_VEC
        + (i % DQ_VEC)
    )


@dsl_user_op
def cvt_pair(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one packed 16-bit pair (lo in the low half), as inline PTX:
    the assembler leaves it where it is written (the DSL's vector conversion can be moved
    past later barriers; the forward uses the same convert)."""
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


@cute.jit
def acc_to_operand_a(acc: cute.Tensor, dst: cute.Tensor):
    """An fp32 accumulator to the 16-bit register A operand `dst` of a following WGMMA (K along
    the accumulator's columns), one `cvt_pair` per pair of values."""
    src = acc_as_operand_a(acc)
    packed = cute.recast_tensor(dst, Int32)
    bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = cvt_pair(src[2 * i], src[2 * i + 1], bf16)


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


__all__ = [
    "THREADS_PER_WG",
    "select",
    "packed_as_sdhb",
    "transposed",
    "rows_cols",
    "acc_as_operand_a",
    "make_dq_mma",
    "DQ_VEC",
    "dq_frag_offset",
    "bulk_g2s",
    "cvt_pair",
    "acc_to_operand_a",
    "bulk_reduce_add_f32",
    "ld_acquire_gpu",
    "red_release_gpu_add",
    "opaque_tid_x",
    "fence_proxy_async_global",
    "cutlass",
]
