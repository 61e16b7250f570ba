"""Paged attention decode (sm_90a), split-KV: the plan's bookkeeping and the combine pass.

The partial pass (decode.py) runs on grid (splits, Hq / H, B): split s of sequence b covers
keys [s * per_split, min((s + 1) * per_split, seqlen)) and writes, per query row, O normalized
(fp32) and its LSE in log2 units, -inf where it saw no key (`write_split`, from its warps'
running max, sum and O in shared memory). Speculative decoding / MTP: sequence b brings
sq = cu_seqlens_q[b + 1] - cu_seqlens_q[b] query tokens (q packed (total_q, Hq, D)), token i
seeing keys j <= sk - sq + i when causal (bottom-right); partial outputs are per query row,
(splits, total_q, Hq, D).

Combine pass, grid (Hq, rows), 128 threads: O = sum_s 2^(lse_s - lse) O_s, lse = log2 sum_s
2^lse_s; O 0 and LSE -inf where no split saw a key; LSE returned natural (x ln 2). A plan of
one split skips it: the partial pass writes the final O and LSE itself (`write_split`)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from forgekernel.kernels.attention.paged.sm90.config import THREADS, WARPS
from forgekernel.kernels.common.sm90.constants import LN2


@cute.jit
def write_split(
    merge, outs, split, rows, head0, heads: cutlass.Constexpr[int],
    g_rows: cutlass.Constexpr[int], d_: cutlass.Constexpr[int], tidx,
):  # fmt: skip
    """The warps' (max in log2 units, sum, unnormalized O) of the CTA's rows, in shared memory
    as `merge` = (m (WARPS, >= G), lsum (WARPS, >= G), O (WARPS, >= G, D)), combined into this
    split's normalized O and log2 LSE: -inf and 0 where no warp saw a key. Row g is query
    token g // heads of the sequence (rows = (its first row, its tokens sq)), head
    head0 + g % heads; rows of tokens past sq are not written. outs = (mOp, mLp, mO, mLSE,
    direct): direct != 0 (a plan of one split) writes the final O in its dtype and the natural
    LSE into mO, mLSE, with no combine pass after; else the partials into mOp, mLp."""
    sm, sl, so = merge
    mOp, mLp, mO, mLSE, direct = outs
    q_off, sq = rows
    for i in cutlass.range(tidx, g_rows * d_, THREADS):
        g = i // d_
        d = i - g * d_
        top = sm[0, g]
        for w in cutlass.range_constexpr(1, WARPS):
            top = cute.arch.fmax(top, sm[w, g])
        total = Float32(0.0)
        acc = Float32(0.0)
        if top != -Float32.inf:
            for w in cutlass.range_constexpr(WARPS):
                c = cute.math.exp2(sm[w, g] - top, fastmath=True)
                total += sl[w, g] * c
                acc += so[w, g, d] * c
        token = q_off + g // heads
        head = head0 + g % heads
        out = Float32(0.0)
        lse = -Float32.inf
        if total > 0.0:
            out = acc / total
            lse = top + cute.math.log2(total, fastmath=True)
        if g // heads < sq:
            if direct != 0:
                mO[token, head, d] = out.to(mO.element_type)
                if d == 0:
                    mLSE[token, head] = lse * LN2
            else:
                mOp[split, token, head, d] = out
                if d == 0:
                    mLp[split, token, head] = lse


class PagedCombineSm90:
    """The combine pass; see the module docstring."""

    def __init__(self, head_dim: int):
        self.d = head_dim

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mOp fp32 (splits, rows, Hq, D), mLp fp32 (splits, rows, Hq) log2; mO (rows, Hq, D)
        16-bit; mLSE fp32 (rows, Hq) (any strides: (Hq, rows) storage seen transposed),
        natural log. rows: B, or total_q with query tokens."""
        self.kernel(mOp, mLp, mO, mLSE).launch(
            grid=(mO.shape[1], mO.shape[0], 1), block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        head, b, _ = cute.arch.block_idx()
        splits = mLp.shape[0]
        top = -Float32.inf
        for s in cutlass.range(splits):
            top = cute.arch.fmax(top, mLp[s, b, head])
        total = Float32(0.0)
        if top != -Float32.inf:
            for s in cutlass.range(splits):
                total += cute.math.exp2(mLp[s, b, head] - top, fastmath=True)
        for d in cutlass.range(tidx, self.d, THREADS):
            acc = Float32(0.0)
            if total > 0.0:
                # unrolled: the splits' loads in flight together (a latency chain otherwise)
                for s in cutlass.range(splits, unroll=4):
                    w = cute.math.exp2(mLp[s, b, head] - top, fastmath=True)
                    acc += w * mOp[s, b, head, d]
                acc = acc / total
            mO[b, head, d] = acc.to(mO.element_type)
        if tidx == 0:
            lse = -Float32.inf
            if total > 0.0:
                lse = (top + cute.math.log2(total, fastmath=True)) * LN2
            mLSE[b, head] = lse
