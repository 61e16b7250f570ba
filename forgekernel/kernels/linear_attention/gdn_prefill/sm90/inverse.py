"""T = (I + L)^-1 of a chunk's strictly lower-triangular L (64 x 64, fp32, in shared memory),
in place, by the aux warpgroup's four warps (the tensor cores' WGMMAs are the kernel's
bottleneck; the inverse is state-independent and runs a chunk ahead). Phase 0 here, on the CUDA
cores in fp32; phases 1, 2a, 2b on the tensor cores by mma.sync tf32 (`inverse_mma.py`).

L is split into 16 x 16 blocks L_IJ (I, J < 4).

    phase 0   warp w: T_ww = (I + L_ww)^-1 by forward substitution down the columns: lane c
              (both halves alike) solves (I + L_ww) x = e_c in registers, x_i = [i = c] -
              sum_{j < i} L_ij x_j in ascending j, reading the rows of L_ww by broadcast loads
              (every lane the same address) and never another lane's registers: 120 FFMAs on a
              chain of 15 (no shuffles; bitwise the row form it replaced, T_r -= L_rs T_s).
    phase 1   warps 0, 1 (b = 2 w): T_{b+1,b} = -T_{b+1,b+1} (L_{b+1,b} T_bb) (16 -> 32)
              warps 2, 3 (a = w): X_a1 = L_a1 T_11, X_a0 = L_a0 T_00 (kept)
    phase 2a  warps 2, 3: X_a0 += L_a1 T_10
    phase 2b  warp w, (I, J) = (2 + w // 2, w % 2): T_IJ = -(T_I2 X_2J + [I = 3] T_33 X_3J)
              (32 -> 64: T_[10] = -T_[11] L_[10] T_[00] on 32 x 32 blocks)

X_aJ lives in a 32 x 32 fp32 scratch. Barriers: the aux warpgroup's named barrier between
phases; the warp's own between a block read and its overwrite in place.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import BLOCK

VEC = 4  # fp32 words per 16-byte shared-memory read


@cute.jit
def block(t: cute.Tensor, i, j) -> cute.Tensor:
    """The (i, j) 16 x 16 block of a row-major fp32 matrix."""
    return cute.local_tile(t, (BLOCK, BLOCK), (i, j))


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
