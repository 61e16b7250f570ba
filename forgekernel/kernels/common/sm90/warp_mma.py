"""Pieces of the warp-level-MMA (mma.sync m16n8k16) kernels that gather their operands row by
row (paged and sparse caches): cp.async row copies into swizzled shared-memory tiles, the
accumulator seen in WGMMA shape so that `layout` and `softmax` apply, and the query rows' key
limits of decode with a few query tokens per sequence."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

COPY_BITS = 128  # one cp.async: 16 bytes


def swizzled_rows(rows: int, width: int, stages: int | None = None):
    """(rows, width[, stages]) 16-bit, rows contiguous, 16-byte chunks XOR-swizzled by the row
    (mod 8): conflict-free ldmatrix and cp.async. width a power of two >= 64."""
    bits = width.bit_length() - 1
    rows8 = cute.make_layout((8, width), stride=(width, 1))
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, bits - 3), 0, rows8)
    shape = (rows, width) if stages is None else (rows, width, stages)
    return cute.tile_to_shape(atom, shape, (0, 1) if stages is None else (0, 1, 2))


def tiled_row_copy(dtype, width: int, threads: int) -> cute.TiledCopy:
    """cp.async of 16 bytes per thread and copy over (rows, width) tiles, a row spread over at
    most a warp, the rest of the threads on the next rows."""
    chunk = COPY_BITS // dtype.width
    per_row = min(width // chunk, 32)
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
        num_bits_per_copy=COPY_BITS,
    )  # fmt: skip
    return cute.make_tiled_copy_tv(
        atom,
        cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, chunk)),
    )


@cute.jit
def copy_row_async(gcopy, row: cute.Tensor, width: cutlass.Constexpr[int], dst, crd):
    """cp.async of this thread's chunks of one `width`-long gmem row (16-byte aligned) into
    `dst` (a `tiled_row_copy` partition of the row's tile row, (atom, chunks)); crd: the
    same partition of the tile's identity (the chunks' columns)."""
    chunk = COPY_BITS // row.element_type.width
    ptr = cute.make_ptr(
        row.element_type, row.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16
    )
    chunks = cute.tiled_divide(cute.make_tensor(ptr, cute.make_layout(width)), (chunk,))
    for k in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        src = chunks[None, crd[0, k][1] // chunk]
        cute.copy(gcopy, cute.make_tensor(src.iterator, dst[None, k].layout), dst[None, k])


def as_wide_acc(acc: cute.Tensor) -> cute.Tensor:
    """An mma.sync accumulator ((2, 2), M, N) seen as a WGMMA-shaped one ((2, 2, N), M, 1), so
    that `layout.rows_cols`, `softmax` and `layout.acc_to_operand_a` apply: the N atoms of 8
    columns become the V pairs of columns 8 apart."""
    lay = acc.layout
    shape, stride = lay.shape, lay.stride
    wide = cute.make_layout(
        ((shape[0][0], shape[0][1], shape[2]), shape[1], 1),
        stride=((stride[0][0], stride[0][1], stride[2]), stride[1], 0),
    )
    return cute.make_tensor(acc.iterator, wide)


@cute.jit
def query_row_limits(
    coords, heads: cutlass.Constexpr[int], qtokens: cutlass.Constexpr[int], sq, sk, t1, causal
):
    """Per score row of this thread ((rows, cols) coordinates `coords`; row r = query token
    r // heads): the first key it may not see: t1 (the split's end) and, with query tokens,
    causal bottom-right (key <= sk - sq + token); rows of tokens past sq see none."""
    limits = cute.make_rmem_tensor(cute.size(coords, mode=[0]), Int32)
    for r in cutlass.range_constexpr(cute.size(coords, mode=[0])):
        lim = t1
        if const_expr(qtokens > 1):
            token = coords[r, 0][0] // heads
            lim = Int32(cutlass.select_(causal != 0, cutlass.min(t1, sk - sq + token + 1), t1))
            lim = Int32(cutlass.select_(token < sq, lim, 0))
        limits[r] = lim
    return limits
