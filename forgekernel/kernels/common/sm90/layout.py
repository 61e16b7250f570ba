"""Views of tensors and WGMMA register fragments: each one a new layout over the same
registers or bytes, no data moves."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from forgekernel.kernels.common.sm90.ptx import cvt_pair


def select(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """t with its modes reordered (or a subset of them)."""
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
    return select(t, [1, 0] + list(range(2, cute.rank(t.layout))))


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
    register orders coincide."""
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


@cute.jit
def acc_to_operand_a(acc: cute.Tensor, dst: cute.Tensor):
    """An fp32 accumulator to the 16-bit register A operand `dst` of a following WGMMA (K along
    the accumulator's columns), one `cvt_pair` per pair of values."""
    src = acc_as_operand_a(acc)
    packed = cute.recast_tensor(dst, Int32)
    bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = cvt_pair(src[2 * i], src[2 * i + 1], bf16)
