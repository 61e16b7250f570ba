"""The block-scaled FP8 GEMM kernel: the dense GEMM's (`kernels/gemm/dense/sm90/kernel.py`,
whose docstring describes the FP8 path) with the rows of each thread's accumulator taken per
thread for the A scales.

The dense kernel hands `_mainloop_scaled` the rows of its warpgroup's first thread (it slices
the MMA by the warpgroup, as the shared-memory operands need): every thread then scaled its
rows by rows 0 and 8's scales (H200 2026-12-01: wrong on every M > 1, right on M = 1). This
override recomputes them from the thread's own slice; it moves into the dense kernel the next
time that one is re-verified on a GPU (an edit there retires the GEMM's GPU record)."""

from __future__ import annotations

import cutlass.cute as cute

from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90


class GemmFp8Sm90(GemmSm90):
    @cute.jit
    def _mainloop_scaled(self, k_tiles, mma, where, ab_pipe, read, release):
        tiled_mma, tCrA, tCrB, acc, (tmp, _, _, mSFA, mSFB) = mma
        tidx, _, _ = cute.arch.thread_idx()
        rows = tiled_mma.get_slice(tidx - THREADS_PER_WG).partition_C(
            cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n))
        )
        mma = (tiled_mma, tCrA, tCrB, acc, (tmp, rows[0][0], rows[2][0], mSFA, mSFB))
        return GemmSm90._mainloop_scaled(self, k_tiles, mma, where, ab_pipe, read, release)
