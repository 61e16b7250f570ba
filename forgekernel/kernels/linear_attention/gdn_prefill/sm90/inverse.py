"""T = (I + L)^-1 of a chunk's strictly lower-triangular L (64 x 64, fp32, in shared memory),
in place, by the aux warpgroup's four warps on the CUDA cores in fp32 (the tensor cores are the
kernel's bottleneck; the inverse is state-independent and runs a chunk ahead).

L is split into 16 x 16 blocks L_IJ (I, J < 4). In phases 1 and 2 a warp's lane (r, h) =
(lane % 16, lane // 16) owns row r, columns 8 h .. 8 h + 7 of the 16 x 16 block it computes.

    phase 0   warp w: T_ww = (I + L_ww)^-1 by forward substitution down the columns: lane c
              (both halves alike) solves (I + L_ww) x = e_c in registers, x_i = [i = c] -
              sum_{j < i} L_ij x_j in ascending j, reading the rows of L_ww by broadcast loads
              (every lane the same address) and never another lane's registers: 120 FFMAs on a
              chain of 15 (no shuffles). Each x_i is the same FFMA sequence as the row form's
              (T_r -= L_rs T_s, s ascending, whose terms with s >= r are exact no-ops: L_rs = 0),
              so T_ww is bitwise the row form's.
    phase 1   warps 0, 1 (b = 2 w): T_{b+1,b} = -T_{b+1,b+1} (L_{b+1,b} T_bb) (16 -> 32)
              warps 2, 3 (a = w): X_a1 = L_a1 T_11, X_a0 = L_a0 T_00 (kept)
    phase 2a  warps 2, 3: X_a0 += L_a1 T_10
    phase 2b  warp w, (I, J) = (2 + w // 2, w % 2): T_IJ = -(T_I2 X_2J + [I = 3] T_33 X_3J)
              (32 -> 64: T_[10] = -T_[11] L_[10] T_[00] on 32 x 32 blocks)

X_aJ lives in a 32 x 32 fp32 scratch; every block product reads its left factor's row r (16
words) and, per k, 8 words of the right factor's row k (the 16 lanes of a half broadcast).
Barriers: the aux warpgroup's named barrier between phases; the warp's own between a block
read and its overwrite in place.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import BLOCK

HALF = BLOCK // 2  # columns per lane (block products)
VEC = 4  # fp32 words per 16-byte shared-memory read


@cute.jit
def block(t: cute.Tensor, i, j) -> cute.Tensor:
    """The (i, j) 16 x 16 block of a row-major fp32 matrix."""
    return cute.local_tile(t, (BLOCK, BLOCK), (i, j))


@cute.jit
def block_product(
    acc: cute.Tensor, x: cute.Tensor, y: cute.Tensor, r: Int32, h: Int32,
    first: cutlass.Constexpr[bool],
):  # fmt: skip
    """acc[c] (+)= sum_k x[r, k] y[k, 8 h + c], c < 8: this lane's half row of x y."""
    xrow = cute.make_rmem_tensor(BLOCK, Float32)
    cute.autovec_copy(x[r, None], xrow)
    yh = cute.local_tile(y, (BLOCK, HALF), (0, h))
    for k in cutlass.range_constexpr(BLOCK):
        yk = cute.make_rmem_tensor(HALF, Float32)
        cute.autovec_copy(yh[k, None], yk)
        for c in cutlass.range_constexpr(HALF):
            if const_expr(first and k == 0):
                acc[c] = xrow[k] * yk[c]
            else:
                acc[c] = acc[c] + xrow[k] * yk[c]


@cute.jit
def store_half_row(
    acc: cute.Tensor, dst: cute.Tensor, r: Int32, h: Int32, negate: cutlass.Constexpr[bool]
):
    """This lane's 8 values into row r, columns 8 h .. 8 h + 7 of a 16 x 16 block."""
    out = cute.make_rmem_tensor(HALF, Float32)
    for c in cutlass.range_constexpr(HALF):
        out[c] = -acc[c] if const_expr(negate) else acc[c]
    cute.autovec_copy(out, cute.local_tile(dst, (BLOCK, HALF), (0, h))[r, None])


@cute.jit
def diagonal_inverse(sW: cute.Tensor, w: Int32, lane: Int32):
    """Phase 0: block (w, w) of sW, L_ww -> T_ww in place (one warp; column lane % 16 in each
    half, the first half stores it). Right-looking by panels of 4 columns of L: once x_j is
    final (j in the panel) every row below takes its term, each row's panel one 16-byte read;
    per x_i the terms still come in ascending j. Live: the 16 x_i and one panel row (the
    left-looking order, row i's dot product at a time, held the rows too: spills at 104)."""
    c = lane % BLOCK
    diag = block(sW, w, w)
    x = [cutlass.select_(c == i, Float32(1.0), Float32(0.0)) for i in range(BLOCK)]
    for p in cutlass.range_constexpr(BLOCK // VEC):
        for i in cutlass.range_constexpr(VEC * p + 1, BLOCK):
            panel = cute.make_rmem_tensor(VEC, Float32)
            cute.autovec_copy(cute.local_tile(diag[i, None], (VEC,), (p,)), panel)
            for j in cutlass.range_constexpr(VEC * p, min(VEC * p + VEC, i)):
                x[i] = x[i] - panel[j - VEC * p] * x[j]
    cute.arch.sync_warp()  # every lane's reads of L_ww before any overwrite
    if lane < BLOCK:
        for i in cutlass.range_constexpr(BLOCK):
            diag[i, c] = x[i]


@cute.jit
def invert_diagonal(sW: cute.Tensor, atid: Int32):
    """Phase 0 (each warp its own diagonal block, the rows it wrote itself: the caller syncs
    the warp after writing its rows of L)."""
    w = cute.arch.make_warp_uniform(atid // 32)
    diagonal_inverse(sW, w, atid % 32)


@cute.jit
def invert_merge(sW: cute.Tensor, sX: cute.Tensor, atid: Int32, bar):
    """Phases 1, 2a, 2b after `invert_diagonal`: sW -> T = (I + L)^-1 in place (zero above
    stays zero). atid: the aux warpgroup's thread index; bar: its named barrier."""
    w = cute.arch.make_warp_uniform(atid // 32)
    lane = atid % 32
    r = lane % BLOCK
    h = lane // BLOCK
    bar.arrive_and_wait()

    kept = cute.make_rmem_tensor(HALF, Float32)  # warps 2, 3: X_w0 between phases 1 and 2a
    acc = cute.make_rmem_tensor(HALF, Float32)
    if w >= 2:
        block_product(acc, block(sW, w, 1), block(sW, 1, 1), r, h, True)
        store_half_row(acc, block(sX, w - 2, 1), r, h, False)
        block_product(kept, block(sW, w, 0), block(sW, 0, 0), r, h, True)
    else:
        b = 2 * w
        z = block(sW, b + 1, b)  # L_{b+1,b}, then L T_bb, then T_{b+1,b}
        block_product(acc, z, block(sW, b, b), r, h, True)
        cute.arch.sync_warp()
        store_half_row(acc, z, r, h, False)
        cute.arch.sync_warp()
        block_product(acc, block(sW, b + 1, b + 1), z, r, h, True)
        cute.arch.sync_warp()
        store_half_row(acc, z, r, h, True)
    bar.arrive_and_wait()

    if w >= 2:
        block_product(kept, block(sW, w, 1), block(sW, 1, 0), r, h, False)
        store_half_row(kept, block(sX, w - 2, 0), r, h, False)
    bar.arrive_and_wait()

    i = 2 + w // 2
    j = w % 2
    block_product(acc, block(sW, i, 2), block(sX, 0, j), r, h, True)
    if w >= 2:
        block_product(acc, block(sW, 3, 3), block(sX, 1, j), r, h, False)
    store_half_row(acc, block(sW, i, j), r, h, True)
    bar.arrive_and_wait()


@cute.jit
def invert(sW: cute.Tensor, sX: cute.Tensor, atid: Int32, bar):
    """All phases at once (KDA's intra kernel; GDN's aux issues Q K^T between them)."""
    invert_diagonal(sW, atid)
    invert_merge(sW, sX, atid, bar)
