"""Attention backward preprocess (sm_90a): Dsum = rowsum(dO * O) in fp32, and the LSE in log2
units with +inf for rows that saw no key (LSE -inf) and for padding rows, so that the main
kernel's P = exp2(S scale log2e - LSE log2e) is 0 there.

Grid (Sq_pad / 128, Hq, B), 128 threads: Dv / 8 threads per row, each loading 16 bytes of O
and of dO, a shuffle sum across the row's threads."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.attention.bwd.sm90.config import ROW_PAD

LOG2E = math.log2(math.e)
THREADS = 128


class AttentionBwdPreSm90:
    def __init__(self, head_dim_v: int):
        if head_dim_v % 8 or not 8 <= head_dim_v <= 256:
            raise ValueError(f"head_dim_v must be a multiple of 8 in [8, 256], got {head_dim_v}")
        self.head_dim_v = head_dim_v
        self.vec = 8
        self.threads_per_row = head_dim_v // self.vec
        if self.threads_per_row > 32:
            raise ValueError("head_dim_v > 256 unsupported")

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mO, mdO (B, Sq, Hq, Dv); mLSE (B, Hq, Sq) fp32; mLSE2, mDsum (B, Hq, Sq_pad) fp32,
        Sq_pad a multiple of 128."""
        if const_expr(mO.element_type != mdO.element_type):
            raise TypeError("o and do must share one dtype")
        grid = (cute.ceil_div(mLSE2.shape[2], ROW_PAD), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSE2, mDsum).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mO.shape[1]
        tpr = self.threads_per_row
        rows_per_pass = THREADS // tpr
        chunk = tidx % tpr
        sub = tidx // tpr
        dtype = mO.element_type
        for p in cutlass.range_constexpr(ROW_PAD // rows_per_pass):
            row = m_block * ROW_PAD + p * rows_per_pass + sub
            acc = Float32(0.0)
            if row < seqlen_q:
                gO = cute.local_tile(mO[batch, row, head, None], (self.vec,), (chunk,))
                gdO = cute.local_tile(mdO[batch, row, head, None], (self.vec,), (chunk,))
                rO = cute.make_rmem_tensor(self.vec, dtype)
                rdO = cute.make_rmem_tensor(self.vec, dtype)
                cute.autovec_copy(gO, rO)
                cute.autovec_copy(gdO, rdO)
                fO = rO.load().to(Float32)
                fdO = rdO.load().to(Float32)
                prod = fO * fdO
                acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            acc = cute.arch.warp_reduction_sum(acc, threads_in_group=tpr)
            if chunk == 0:
                mDsum[batch, head, row] = acc
                lse2 = Float32.inf
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2E
                mLSE2[batch, head, row] = lse2
