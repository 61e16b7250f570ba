"""Paged GQA attention decode (sm_90a), split-KV: one query token per sequence against a KV
cache in pages; H query heads of one KV head (H = `heads`, compiled; it divides the group
Hq / Hkv, a run-time value: any GQA ratio) read against one stream of its keys.

Partial pass, grid (splits, Hq / H, B), 128 threads: split s of sequence b covers tokens
[s * per_split, min((s + 1) * per_split, seqlen)); its 4 warps take contiguous quarters. A warp
walks its tokens UNROLL at a time: each lane loads its D / 32 elements of every token's K and
V row (page page_table[b, t // page_size], slot t % page_size; 8 bytes per lane at D = 128, a
256-byte row per warp), dots them with the H query rows held in registers (pre-scaled
by softmax_scale * log2 e), sums across the warp and keeps an online softmax (running max,
sum, O of its D / 32 columns per head). The 4 warps are merged through shared memory and the
split writes O normalized (fp32) and its LSE in log2 units, -inf where it saw no key.

Speculative decoding / MTP (`qtokens` = Q > 1, compiled): sequence b brings
sq = cu_seqlens_q[b + 1] - cu_seqlens_q[b] <= Q query tokens (q packed (total_q, Hq, D)); a
CTA's rows are the Q x H (query token, head) pairs, token i seeing keys j <= sk - sq + i when
causal (bottom-right), all keys otherwise; rows past sq are neither computed into nor stored.
Partial outputs are per query row: (splits, total_q, Hq, D).

Combine pass, grid (Hq, rows), 128 threads: O = sum_s 2^(lse_s - lse) O_s, lse = log2 sum_s
2^lse_s; O 0 and LSE -inf where no split saw a key; LSE returned natural (x ln 2).

FP8 (e4m3) caches: K and V rows are widened to fp32 as loaded; a per-KV-head scale of K
(per-tensor scales come as (Hkv,) tensors) is folded into the query rows and V's into the
output, so dequantization costs nothing per element.

Math on CUDA cores (no MMA): memory-bound at the group sizes of GQA decode (H <= 8: 2 x 128
x H FMAs per 512 bytes of K and V at D = 128). The query rows and O stay in registers:
H x D / 32 <= 64 (D = 256 takes H <= 8; at H = 16, D = 256 the compiler spilled 1.6 KB)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.attention.paged.sm90.config import THREADS, WARPS
from forgekernel.kernels.common.sm90.constants import LN2

UNROLL = 4  # tokens whose K and V rows a warp loads before it computes on any of them


class PagedDecodeSm90:
    """The partial pass; see the module docstring."""

    def __init__(self, head_dim: int, heads: int, qtokens: int = 1):
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
        if qtokens not in (1, 2, 4):
            raise ValueError(f"query tokens per sequence must be 1, 2 or 4, got {qtokens}")
        if heads not in (1, 2, 4, 8, 16) or heads * qtokens * head_dim > 64 * 32:
            raise ValueError(
                f"heads x query tokens x D must be <= 2048, got {heads} x {qtokens} x {head_dim}"
            )
        self.d = head_dim
        self.h = heads
        self.qt = qtokens
        self.g = heads * qtokens  # query rows per CTA: (token, head) pairs
        self.e = head_dim // 32  # elements of a row per lane

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        group: Int32,
        mKScale: cute.Tensor | None,
        mVScale: cute.Tensor | None,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        stream: cuda.CUstream,
    ):
        """mQ (B, Hq, D); mK, mV (num_pages, page_size, Hkv, D); mPT int32 (B, max_pages);
        mSeq int32 (B,); mOp fp32 (splits, B, Hq, D); mLp fp32 (splits, B, Hq), log2 units;
        group = Hq / Hkv, a multiple of the compiled heads per CTA; mKScale, mVScale fp32
        (Hkv,) dequantization scales of an FP8 cache, else None; mCuQ int32 (B + 1,) with
        mQ (total_q, Hq, D) and mOp / mLp per query row when qtokens > 1, else None (mQ
        (B, Hq, D)); causal 0 / 1 (query tokens among themselves, bottom-right)."""
        if const_expr(mK.element_type != mV.element_type):
            raise TypeError("k_cache and v_cache must share one dtype")
        if const_expr(mK.element_type != mQ.element_type and mK.element_type.width != 8):
            raise TypeError("a 16-bit cache must have q's dtype")

        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")

        @cute.struct
        class Shared:
            m: cute.struct.MemRange[Float32, WARPS * self.g]
            lsum: cute.struct.MemRange[Float32, WARPS * self.g]
            o: cute.struct.MemRange[Float32, WARPS * self.g * self.d]

        self.shared = Shared
        self.kernel(
            mQ,
            mK,
            mV,
            mPT,
            mSeq,
            mOp,
            mLp,
            scale_log2,
            per_split,
            page_size,
            group,
            mKScale,
            mVScale,
            mCuQ,
            causal,
        ).launch(
            grid=(mOp.shape[0], mQ.shape[1] // self.h, mSeq.shape[0]),
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        group: Int32,
        mKScale: cute.Tensor | None,
        mVScale: cute.Tensor | None,
        mCuQ: cute.Tensor | None,
        causal: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, head_block, b = cute.arch.block_idx()
        head0 = head_block * self.h
        kvh = head0 // group
        q_off, sq = b, Int32(1)
        if const_expr(mCuQ is not None):
            q_off = mCuQ[b]
            sq = mCuQ[b + 1] - q_off
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        G, E = self.g, self.e

        sk = mSeq[b]
        t0 = split * per_split
        t1 = cutlass.min(t0 + per_split, sk)
        share = cute.ceil_div(cutlass.max(t1 - t0, 0), WARPS)
        w0 = t0 + warp * share
        w1 = cutlass.min(w0 + share, t1)

        q_scale = scale_log2
        if const_expr(mKScale is not None):
            q_scale = scale_log2 * mKScale[kvh]
        q = self._load_query(mQ, q_off, sq, head0, lane, q_scale)
        m = cute.make_rmem_tensor(G, Float32)
        lsum = cute.make_rmem_tensor(G, Float32)
        o = cute.make_rmem_tensor((E, G), Float32)
        m.fill(-Float32.inf)
        lsum.fill(0.0)
        o.fill(0.0)
        kr = cute.make_rmem_tensor((E, UNROLL), mK.element_type)
        vr = cute.make_rmem_tensor((E, UNROLL), mV.element_type)
        kf = cute.make_rmem_tensor(E, Float32)
        vf = cute.make_rmem_tensor(E, Float32)
        t = w0
        while t < w1:
            for u in cutlass.range_constexpr(UNROLL):
                tu = cutlass.min(t + u, w1 - 1)
                page = mPT[b, tu // page_size]
                slot = tu % page_size
                cute.autovec_copy(
                    cute.local_tile(mK[page, slot, kvh, None], (E,), (lane,)), kr[None, u]
                )
                cute.autovec_copy(
                    cute.local_tile(mV[page, slot, kvh, None], (E,), (lane,)), vr[None, u]
                )
            for u in cutlass.range_constexpr(UNROLL):
                if t + u < w1:
                    kf.store(kr[None, u].load().to(Float32))
                    vf.store(vr[None, u].load().to(Float32))
                    for g in cutlass.range_constexpr(G):
                        s = Float32(0.0)
                        for e in cutlass.range_constexpr(E):
                            s += q[e, g] * kf[e]
                        s = cute.arch.warp_reduction_sum(s)
                        if const_expr(self.qt > 1):
                            # row (token i, head) sees keys <= sk - sq + i when causal, none
                            # past sq
                            i = g // self.h
                            limit = Int32(cutlass.select_(causal != 0, sk - sq + i, sk - 1))
                            limit = Int32(cutlass.select_(i < sq, limit, -1))
                            if t + u <= limit:
                                self._online_softmax(g, s, m, lsum, o, vf)
                        else:
                            self._online_softmax(g, s, m, lsum, o, vf)
            t += UNROLL
        if const_expr(mVScale is not None):
            v_scale = mVScale[kvh]
            for i in cutlass.range_constexpr(E * G):
                o[i] = o[i] * v_scale
        self._merge_warps(m, lsum, o, mOp, mLp, split, (q_off, sq), head0, tidx, lane, warp)

    @cute.jit
    def _online_softmax(self, g, s, m, lsum, o, vf):
        """Row g takes a key of score s (log2 units) and value row vf."""
        m_new = cute.arch.fmax(m[g], s)
        corr = cute.math.exp2(m[g] - m_new, fastmath=True)
        p = cute.math.exp2(s - m_new, fastmath=True)
        lsum[g] = lsum[g] * corr + p
        for e in cutlass.range_constexpr(self.e):
            o[e, g] = o[e, g] * corr + p * vf[e]
        m[g] = m_new

    @cute.jit
    def _load_query(self, mQ, q_off, sq, head0, lane, scale_log2):
        """The CTA's query rows (token i < Q, head head0 + h; tokens past sq read token
        sq - 1, never used), this lane's D / 32 columns, fp32, times scale * log2 e."""
        G, E = self.g, self.e
        q = cute.make_rmem_tensor((E, G), Float32)
        raw = cute.make_rmem_tensor(E, mQ.element_type)
        f = cute.make_rmem_tensor(E, Float32)
        for g in cutlass.range_constexpr(G):
            # clamped into q: a sequence with no query tokens (sq = 0) still reads a row
            token = q_off + cutlass.max(cutlass.min(Int32(g // self.h), sq - 1), 0)
            token = cutlass.min(token, mQ.shape[0] - 1)
            row = mQ[token, head0 + g % self.h, None]
            cute.autovec_copy(cute.local_tile(row, (E,), (lane,)), raw)
            f.store(raw.load().to(Float32))
            for e in cutlass.range_constexpr(E):
                q[e, g] = f[e] * scale_log2
        return q

    @cute.jit
    def _merge_warps(self, m, lsum, o, mOp, mLp, split, rows, head0, tidx, lane, warp):
        """The 4 warps' (max, sum, O) through shared memory into this split's normalized O and
        log2 LSE (`write_split`)."""
        G, E, D = self.g, self.e, self.d
        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sm = storage.m.get_tensor(cute.make_layout((WARPS, G)))
        sl = storage.lsum.get_tensor(cute.make_layout((WARPS, G)))
        so = storage.o.get_tensor(cute.make_layout((WARPS, G, D)))
        for g in cutlass.range_constexpr(G):
            if lane == 0:
                sm[warp, g] = m[g]
                sl[warp, g] = lsum[g]
            for e in cutlass.range_constexpr(E):
                so[warp, g, lane * E + e] = o[e, g]
        cute.arch.sync_threads()
        write_split((sm, sl, so), mOp, mLp, split, rows, head0, self.h, G, D, tidx)


@cute.jit
def write_split(
    merge, mOp, mLp, split, rows, head0, heads: cutlass.Constexpr[int],
    g_rows: cutlass.Constexpr[int], d_: cutlass.Constexpr[int], tidx,
):  # fmt: skip
    """The warps' (max in log2 units, sum, unnormalized O) of the CTA's rows, in shared memory
    as `merge` = (m (WARPS, >= G), lsum (WARPS, >= G), O (WARPS, >= G, D)), combined into this
    split's normalized O and log2 LSE: -inf and 0 where no warp saw a key. Row g is query
    token g // heads of the sequence (rows = (its first row, its tokens sq)), head
    head0 + g % heads; rows of tokens past sq are not written."""
    sm, sl, so = merge
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
