"""DSA sparse backward preprocess (sm_90a): one pass over out and dO giving what the sparse
backward kernel reads (kernels/attention/dsa_sparse_bwd/sm90/launch.py `preprocess` is the
torch statement of the same math), fp32 throughout:

    delta    = rowsum(dO * O)                                  (fp32 products, fp32 sums)
    lse_all  = logaddexp(lse, sink[h])  (lse without a sink; torch's logaddexp, its equal
               infinities included), +inf where it is -inf (nothing in the denominator: P = 0)
    lse2     = log2(e) lse_all
    Delta'   = delta - dlse exp(lse_all - lse)  (the term 0 unless both LSEs are finite)
    term     = -P_sink delta, P_sink = exp(sink - lse_all) (1 for a +inf sink): d_sink's
               (token, head) term, summed over tokens by the launcher

Grid (tokens, ceil(H / WARPS)), WARPS warps a CTA, warp w the row (token, head = y WARPS + w):
lane l loads the 16-byte vectors l and l + 32 of O and of dO (each warp load one contiguous
512-byte run), fp32 products summed in the lane, then a shuffle sum over the warp; lane 0
writes the row's outputs. No shared memory, no barrier."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.config import (
    D_V,
    LANES,
    LOADS,
    THREADS,
    VEC,
    WARPS,
)
from forgekernel.kernels.common.sm90.constants import LOG2E


class DsaSparseBwdPreSm90:
    def __init__(self, sink: bool, dlse: bool):
        self.sink = sink
        self.dlse = dlse

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLse: cute.Tensor,
        mdLse: cute.Tensor | None,
        mSink: cute.Tensor | None,
        mLse2: cute.Tensor,
        mDelta: cute.Tensor,
        mTerm: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mO, mdO (tokens, H, 512) 16-bit, rows 16-byte aligned; mLse, mdLse (tokens, H) fp32
        any strides (mdLse None without dLSE); mSink (H,) fp32 or None; mLse2, mDelta, mTerm
        (tokens, H) fp32 written (mTerm None without a sink)."""
        if const_expr(mO.element_type != mdO.element_type):
            raise TypeError("out and dout must share one dtype")
        if const_expr(mO.shape[2] != D_V):
            raise ValueError(f"out rows must be {D_V} wide")
        if const_expr(self.sink != (mSink is not None) or self.sink != (mTerm is not None)):
            raise TypeError("the sink and its terms come together, as the compile key says")
        if const_expr(self.dlse != (mdLse is not None)):
            raise TypeError("dlse as the compile key says")
        grid = (mO.shape[0], cute.ceil_div(mO.shape[1], WARPS), 1)
        self.kernel(mO, mdO, mLse, mdLse, mSink, mLse2, mDelta, mTerm).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLse: cute.Tensor,
        mdLse: cute.Tensor | None,
        mSink: cute.Tensor | None,
        mLse2: cute.Tensor,
        mDelta: cute.Tensor,
        mTerm: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, hblock, _ = cute.arch.block_idx()
        lane = tidx % LANES
        head = hblock * WARPS + tidx // LANES
        if head < mO.shape[1]:
            dtype = mO.element_type
            rO = cute.make_rmem_tensor((VEC, LOADS), dtype)
            rdO = cute.make_rmem_tensor((VEC, LOADS), dtype)
            src_o = cute.zipped_divide(mO[token, head, None], (VEC,))
            src_do = cute.zipped_divide(mdO[token, head, None], (VEC,))
            for k in cutlass.range_constexpr(LOADS):
                cute.autovec_copy(src_o[None, k * LANES + lane], rO[None, k])
                cute.autovec_copy(src_do[None, k * LANES + lane], rdO[None, k])
            lse = mLse[token, head]
            prod = rO.load().to(Float32) * rdO.load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            delta = cute.arch.warp_reduction_sum(acc, threads_in_group=LANES)
            if lane == 0:
                self._row(mLse2, mDelta, mTerm, mdLse, mSink, token, head, lse, delta)

    @cute.jit
    def _row(self, mLse2, mDelta, mTerm, mdLse, mSink, token, head, lse, delta):
        """Lane 0's scalar tail: lse2, Delta' and the sink term of one row."""
        lse_all = lse
        if const_expr(self.sink):
            sink = mSink[head]
            gap = lse - sink
            # torch.logaddexp: equal infinities (gap NaN) give themselves
            if gap == gap:
                top = cutlass.max(lse, sink)
                lse_all = top + cute.math.log1p(cute.math.exp(-cute.math.abs(gap)))
        if lse_all == -Float32.inf:
            lse_all = Float32.inf
        mLse2[token, head] = lse_all * LOG2E
        if const_expr(self.sink):
            p_sink = Float32(1.0)
            if sink != Float32.inf:
                p_sink = cute.math.exp(sink - lse_all)
            mTerm[token, head] = -(p_sink * delta)
        delta_k = delta
        if const_expr(self.dlse):
            ratio = lse_all - lse
            # both LSEs finite (torch.isfinite & isfinite) exactly when their gap is: x - x is
            # NaN for an infinite or NaN x, else 0 (an ordered compare)
            if ratio - ratio == Float32(0.0):
                delta_k = delta - mdLse[token, head] * cute.math.exp(ratio)
        mDelta[token, head] = delta_k
