"""Masking and online softmax on WGMMA accumulators, in base 2.

Every function takes the accumulator partitions of one thread (S or O, seen as (rows, cols)
through `layout.rows_cols`) and per-row register tensors: the running row max (of the raw
scores), the thread's partial row sum, and the O rescale factor of the last step. A row of a
64-row warpgroup tile is spread over the 4 threads of a quad, so maxima are reduced across
the quad at once, sums only at the end (`finalize`).

The scores are scaled inside the exponent: P = exp2(S * scale_log2 - max * scale_log2), with
scale_log2 = softmax_scale * log2(e), so S is never rescaled on its own.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.common.sm90.constants import LN2
from forgekernel.kernels.common.sm90.layout import rows_cols

# Independent max / sum chains per row: a 64- or 128-long dependency chain otherwise.
CHAINS = 4
QUAD = 4  # threads that share one accumulator row


def acc_coords(tiled_mma: cute.TiledMma, tidx: Int32, tile_shape) -> tuple:
    """The score coordinates of thread `tidx` as (t0, row_base, col_base): thread 0's
    (rows, cols) coordinates, all static, plus this thread's offset from them, so a mask
    compares registers with constants instead of holding a coordinate per element."""
    ident = cute.make_identity_tensor(tile_shape)
    t0 = rows_cols(tiled_mma.get_slice(0).partition_C(ident))
    base = tiled_mma.get_slice(tidx).partition_C(ident)[0]
    return t0, base[0], base[1]


@cute.jit
def mask_scores(
    acc_S: cute.Tensor,
    coords: tuple,
    m0: Int32,
    n0: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    qgroup: Int32,
    causal: cutlass.Constexpr[bool],
):
    """-inf where the key is past seqlen_k or, with `causal` (bottom-right aligned), past the
    row's diagonal. The tile starts at row m0 and key n0; row i is query i // qgroup
    (pack-GQA: qgroup query heads packed as consecutive rows; else 1), which sees keys up to
    query + seqlen_k - seqlen_q // qgroup. coords: `acc_coords` of this thread."""
    t0, row_base, col_base = coords
    s = rows_cols(acc_S)
    col0 = n0 + col_base
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        limit = seqlen_k - col0  # first masked column, relative to the thread's first
        if const_expr(causal):
            query = (m0 + row_base + t0[r, 0][0]) // qgroup
            limit = cutlass.min(limit, query + seqlen_k - seqlen_q // qgroup + 1 - col0)
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            if t0[r, c][1] >= limit:
                s[r, c] = -Float32.inf


@cute.jit
def quad_row_max(s: cute.Tensor, r: cutlass.Constexpr[int], init: Float32) -> Float32:
    """max(init, row r of the (rows, cols) view s) over the quad holding the row."""
    part = [init] * CHAINS
    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
        part[c % CHAINS] = cute.arch.fmax(part[c % CHAINS], s[r, c])
    cur = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
    return cute.arch.warp_reduction_max(cur, threads_in_group=QUAD)


@cute.jit
def scaled_max(row_max: Float32, scale_log2: Float32) -> Float32:
    """row_max * scale_log2, the value the row's exponents subtract; 0 for a row with no
    visible key yet (max -inf), so that exp2(-inf - 0) = 0 rather than exp2(-inf + inf) =
    NaN."""
    scaled = row_max * scale_log2
    if row_max == -Float32.inf:
        scaled = Float32(0.0)
    return scaled


@cute.jit
def exp2_row(
    s: cute.Tensor, r: cutlass.Constexpr[int], scale_log2: Float32, max_scaled: Float32
) -> Float32:
    """Row r of s replaced by exp2(s * scale_log2 - max_scaled) (the MUFU, fastmath); returns
    this thread's part of the row sum."""
    part = [Float32(0.0)] * CHAINS
    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
        p = cute.math.exp2(s[r, c] * scale_log2 - max_scaled, fastmath=True)
        s[r, c] = p
        part[c % CHAINS] = part[c % CHAINS] + p
    return (part[0] + part[1]) + (part[2] + part[3])


@cute.jit
def online_softmax(
    acc_S: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    rescale: cute.Tensor,
    scale_log2: Float32,
):
    """S -> P in place, one step of the online softmax: the running max takes S's row maxima,
    `rescale` gets each row's exp2((old max - new max) scale_log2) for O (applied by the
    caller once the P V in flight is done), the row sums are rescaled and P's added."""
    s = rows_cols(acc_S)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        prev = row_max[r]
        cur = quad_row_max(s, r, prev)
        row_max[r] = cur
        cur_scaled = scaled_max(cur, scale_log2)
        rescale[r] = cute.math.exp2(prev * scale_log2 - cur_scaled, fastmath=True)
        total = exp2_row(s, r, scale_log2, cur_scaled)
        row_sum[r] = row_sum[r] * rescale[r] + total


@cute.jit
def rescale_o(acc_O: cute.Tensor, rescale: cute.Tensor):
    """O's rows multiplied by their rescale factors."""
    o = rows_cols(acc_O)
    for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * rescale[r]


@cute.jit
def finalize(
    acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32
) -> cute.Tensor:
    """O /= row sum (reduced over the quad here); returns the rows' natural-log LSE,
    (max scale_log2 + log2(sum)) ln 2. Rows that saw no key get O = 0 and LSE = -inf."""
    o = rows_cols(acc_O)
    row_lse = cute.make_rmem_tensor(cute.size(row_sum), Float32)
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=QUAD)
        inv = Float32(1.0)
        lse = -Float32.inf
        if total > 0.0:
            inv = cute.arch.rcp_approx(total)
            lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
        row_lse[r] = lse
        for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
            o[r, c] = o[r, c] * inv
    return row_lse
