"""Gated DeltaNet backward, the q / k epilogue (sm_90a): kernel 2 leaves dq, dk per VALUE head
in fp32 (B, T, HV, K), the gradients of q / k after l2norm and scale, repeated to the value
heads; this kernel forms the gradient of the op's q (or k) input (B, T, H, K) in one pass:

    d   = sum over the HV / H value heads j of head h: dxs[b, t, h (HV / H) + j, :]
    n2  = x . x + eps
    dx  = scale / sqrt(n2) (d - x (x . d) / n2)     (l2norm; without it dx = scale d)

x the op's 16-bit input (not normalized: the norm is recomputed, nothing saved from the
forward). SIMT: grid (ceil(T / 64), H, B), 128 threads; K / 8 = 16 threads a row, each 8
columns (16-byte x loads, two 16-byte loads of each value head's fp32 row, one of a 16-bit row:
the `d16` key, the chunk kernel's dqk16, summed in fp32), 8 rows a pass, the
row dots reduced over the row's 16 threads (shuffles), dx written once in 16 bits. Replaces the
torch group sum, l2norm backward and cast (0.75 KB + 0.5 KB a token-head written, and x's fp32
copy kept from the forward, 0.5 KB). Deterministic: a fixed summation order, no atomics.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.config import (
    L2NORM_EPS,
    ROWS,
    THREADS,
    VEC,
)


class GdnBwdNormSm90:
    """One CTA per (64 tokens, q / k head, sequence); see the module docstring."""

    def __init__(self, k: int, *, l2norm: bool):
        if k % VEC or k // VEC > 32:
            raise ValueError(f"K must be a multiple of {VEC} up to {32 * VEC}, got {k}")
        self.k = k
        self.l2norm = l2norm
        self.tpr = k // VEC  # threads a row
        self.rows_per_pass = THREADS // self.tpr

    @cute.jit
    def __call__(
        self,
        mD: cute.Tensor,
        mX: cute.Tensor,
        mOut: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mD fp32 or x's 16-bit dtype (B, T, HV, K); mX, mOut (B, T, H, K) 16-bit, H dividing
        HV."""
        if const_expr(mX.element_type != mOut.element_type):
            raise TypeError("x and the gradient out must share one dtype")
        if const_expr(mD.element_type not in (Float32, mX.element_type)):
            raise TypeError("the value heads' gradients must be fp32 or x's dtype")
        grid = (cute.ceil_div(mX.shape[1], ROWS), mX.shape[2], mX.shape[0])
        self.kernel(mD, mX, mOut, scale).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mD: cute.Tensor, mX: cute.Tensor, mOut: cute.Tensor, scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        blk, h, b = cute.arch.block_idx()
        seqlen = mX.shape[1]
        group = mD.shape[2] // mX.shape[2]
        lane = tidx % self.tpr
        sub = tidx // self.tpr
        dtype = mX.element_type
        for p in cutlass.range_constexpr(ROWS // self.rows_per_pass):
            t = blk * ROWS + p * self.rows_per_pass + sub
            d = cute.make_rmem_tensor(VEC, Float32)
            d.fill(0.0)
            rX = cute.make_rmem_tensor(VEC, dtype)
            rX.fill(0.0)
            if t < seqlen:
                for j in cutlass.range(group, unroll=1):
                    gD = cute.local_tile(mD[b, t, h * group + j, None], (VEC,), (lane,))
                    rD = cute.make_rmem_tensor(VEC, mD.element_type)
                    cute.autovec_copy(gD, rD)
                    d.store(d.load() + rD.load().to(Float32))  # the sum in fp32
                cute.autovec_copy(cute.local_tile(mX[b, t, h, None], (VEC,), (lane,)), rX)
            x = rX.load().to(Float32)
            dv = d.load()
            out = dv * scale
            if const_expr(self.l2norm):
                # every thread reduces (rows past T with zeros): the shuffles see whole groups
                xx = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                xd = (x * dv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                xx = cute.arch.warp_reduction_sum(xx, threads_in_group=self.tpr) + L2NORM_EPS
                xd = cute.arch.warp_reduction_sum(xd, threads_in_group=self.tpr)
                c = xd / xx
                out = (dv - x * c) * (scale * cute.math.rsqrt(xx))
            if t < seqlen:
                rO = cute.make_rmem_tensor(VEC, dtype)
                rO.store(out.to(dtype))
                cute.autovec_copy(rO, cute.local_tile(mOut[b, t, h, None], (VEC,), (lane,)))
