"""Attention backward preprocess (sm_90a): Dsum = rowsum(dO * O) in fp32, and the LSE in log2
units with +inf for rows that saw no key (LSE -inf) and for padding rows, so that the main
kernel's P = exp2(S scale log2e - LSE log2e) is 0 there.

Grid (Sq_pad / 128, Hq, B), 128 threads: Dv / 8 threads per row, each loading 16 bytes of O
and of dO, a shuffle sum across the row's threads.

Varlen (static flag): o, do (Tq, Hq, Dv), lse (Hq, Tq), lse2 / dsum (Hq, rows) with sequence b's
padded region from row `config.varlen_ws_row(cu_seqlens_q[b], b)`; grid
(ceil(max_seqlen_q / 128), Hq, B); blocks past the sequence's padded length do nothing."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.attention.bwd.sm90.config import ROW_PAD, varlen_ws_row
from forgekernel.kernels.common.sm90.constants import LOG2E

THREADS = 128


class AttentionBwdPreSm90:
    def __init__(self, head_dim_v: int, varlen: bool = False):
        self.varlen = varlen
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
        mCuQ: cute.Tensor | None,
        mDqAcc: cute.Tensor | None,
        max_seqlen_q: Int32,
        stream: cuda.CUstream,
    ):
        """mO, mdO (B, Sq, Hq, Dv); mLSE (B, Hq, Sq) fp32; mLSE2, mDsum (B, Hq, Sq_pad) fp32,
        Sq_pad a multiple of 128; mCuQ None; mDqAcc (B, Hq, Sq_pad * D) fp32, the main kernel's
        dQ accumulator, zeroed here (each block its 128 rows); max_seqlen_q unused. Varlen:
        mO, mdO (Tq, Hq, Dv), mLSE (Hq, Tq), mLSE2, mDsum (Hq, rows), mCuQ int32 (B + 1,),
        mDqAcc None (the launcher zeroes the padded workspace)."""
        if const_expr(mO.element_type != mdO.element_type):
            raise TypeError("o and do must share one dtype")
        if const_expr(self.varlen):
            grid = (
                cute.ceil_div(max_seqlen_q, ROW_PAD),
                mO.shape[1],
                mCuQ.shape[0] - 1,
            )
        else:
            grid = (cute.ceil_div(mLSE2.shape[2], ROW_PAD), mO.shape[2], mO.shape[0])
        self.kernel(mO, mdO, mLSE, mLSE2, mDsum, mCuQ, mDqAcc).launch(
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
        mCuQ: cute.Tensor | None,
        mDqAcc: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.varlen):
            q_off = mCuQ[batch]
            seqlen_q = mCuQ[batch + 1] - q_off
            ws = varlen_ws_row(q_off, batch)
            if m_block * ROW_PAD < seqlen_q:
                self._rows(mO, mdO, mLSE, mLSE2, mDsum, tidx, m_block, head, batch, seqlen_q,
                           q_off, ws)  # fmt: skip
        else:
            self._rows(mO, mdO, mLSE, mLSE2, mDsum, tidx, m_block, head, batch, mO.shape[1], 0, 0)
            if const_expr(mDqAcc is not None):
                self._zero_dq(mDqAcc, tidx, m_block, head, batch, mLSE2.shape[2])

    @cute.jit
    def _zero_dq(self, mDqAcc, tidx, m_block, head, batch, sq_pad):
        """Zero this block's 128 rows of the dQ accumulator, 16 bytes per store, coalesced
        (the accumulator is tile-major, so 128 rows are one contiguous run of 128 * D)."""
        row = mDqAcc[batch, head, None]
        quads = mDqAcc.shape[2] // sq_pad // 4  # D / 4: one pass of 128 threads per row
        base = m_block * ROW_PAD * quads * 4
        zero = cute.make_rmem_tensor(4, Float32)
        zero.fill(0.0)
        for i in cutlass.range(quads * (ROW_PAD // THREADS), unroll=4):
            ptr = cute.make_ptr(
                Float32, (row.iterator + base + (i * THREADS + tidx) * 4).toint(),
                cute.AddressSpace.gmem, assumed_align=16,
            )  # fmt: skip
            cute.make_tensor(ptr, cute.make_layout(4)).store(zero.load())

    @cute.jit
    def _rows(self, mO, mdO, mLSE, mLSE2, mDsum, tidx, m_block, head, batch, seqlen_q, q_off, ws):
        """Rows m_block * 128 + [0, 128) of (batch, head): fixed length indexes the batch mode;
        varlen the packed token q_off + row and the workspace row ws + row."""
        tpr = self.threads_per_row
        rows_per_pass = THREADS // tpr
        chunk = tidx % tpr
        sub = tidx // tpr
        dtype = mO.element_type
        for p in cutlass.range_constexpr(ROW_PAD // rows_per_pass):
            row = m_block * ROW_PAD + p * rows_per_pass + sub
            acc = Float32(0.0)
            if row < seqlen_q:
                if const_expr(self.varlen):
                    src_o = mO[q_off + row, head, None]
                    src_do = mdO[q_off + row, head, None]
                else:
                    src_o = mO[batch, row, head, None]
                    src_do = mdO[batch, row, head, None]
                gO = cute.local_tile(src_o, (self.vec,), (chunk,))
                gdO = cute.local_tile(src_do, (self.vec,), (chunk,))
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
                lse2 = Float32.inf
                if const_expr(self.varlen):
                    mDsum[head, ws + row] = acc
                    if row < seqlen_q:
                        lse = mLSE[head, q_off + row]
                        if lse != -Float32.inf:
                            lse2 = lse * LOG2E
                    mLSE2[head, ws + row] = lse2
                else:
                    mDsum[batch, head, row] = acc
                    if row < seqlen_q:
                        lse = mLSE[batch, head, row]
                        if lse != -Float32.inf:
                            lse2 = lse * LOG2E
                    mLSE2[batch, head, row] = lse2
