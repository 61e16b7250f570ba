"""Kimi Delta Attention backward kernel 2, `wg2`: the chunk's products on two math warpgroups
split by key channels (docs/linear_attention/NOTES.md "KDA kernel 2 on two math warpgroups,
built"). Math warpgroup kh (warpgroups 1, 2 -> kh = 0, 1) owns key channels [64 kh, 64 kh + 64)
of dw, dqe, dq, dke, dk and dG: every product is `KdaBwdChunkSm90`'s with N = 64 (B the rows
[64 kh, +64) of h / dh, the columns [64 kh, +64) of (k er) / (q el): whole 8 KB SW128 atoms
columns, 1,024-byte aligned), and the per-channel SIMT (tables, block operands, te, the dG
rows and their reverse cumsum) is done on its own 64 channels, 2 threads a channel where it is
per channel. S = dO U^T (C x C, reduced over V) is computed by both (8 m64n64k16 each, no
exchange); warpgroup 1 alone writes dP^T and dP's diagonal. Every output element is formed by
the same operations in the same order as the 256-thread kernel (bit for bit).

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: 144 registers a thread, under the
launch's 168): warpgroup 0 as before (the TMA warp, the <h, dh> warps); warpgroups 1, 2 the math
halves.

Named barriers: BAR_HDH (320: both math warpgroups and the <h, dh> warps; every dq block of
both retired before dG's rows overwrite (k er)'s and h's bytes), BAR_BOTH (256: both math
warpgroups' dO / dU products retired and dP^T / dP_ii stored before (k er) / (q el) overwrite
dU / dO), BAR_WG + kh (128: warpgroup-local: G's rows, the tables, the block operands, dG's rows
and te's partials)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import (
    BAR_HDH,
    HDH_THREADS,
    KdaBwdChunkSm90,
    _GroupWaits,
)
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.config import (
    CHUNK,
    LOAD_GROUPS,
    NS,
    SUB,
    WG2_THREADS,
)

BAR_BOTH = BAR_HDH + 1  # both math warpgroups (256)
BAR_WG = BAR_HDH + 2  # + kh: one math warpgroup (128)
MATH_THREADS = 2 * THREADS_PER_WG


class KdaBwdChunkWg2Sm90(KdaBwdChunkSm90):
    """`KdaBwdChunkSm90` on two math warpgroups split by key channels (module docstring)."""

    threads = WG2_THREADS
    math_threads = MATH_THREADS

    def __init__(self, k: int, v: int):
        super().__init__(k, v)
        self.half = k // 2  # a math warpgroup's key channels

    def _setup(self):
        super()._setup()
        dt, bf = self.dtype, BFloat16
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        n = (CHUNK, self.half)
        self.mma_w = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32,
                                                       (1, 1, 1), n)  # fmt: skip
        self.mma_q = sm90_utils.make_trivial_tiled_mma(bf, bf, k_major, mn_major, Float32,
                                                       (1, 1, 1), n, a_source=rmem)  # fmt: skip
        self.mma_k = sm90_utils.make_trivial_tiled_mma(bf, bf, k_major, mn_major, Float32,
                                                       (1, 1, 1), n)  # fmt: skip

    @staticmethod
    def _kh():
        """This math warpgroup's key-channel half (warpgroups 1, 2 -> 0, 1), from the opaque
        thread index (its helpers' coordinates are re-derived per phase, as `_coords`')."""
        return opaque_tid_x() // THREADS_PER_WG - 1

    @cute.jit
    def _coords(self, mma):
        """`KdaBwdChunkSm90._coords` on this warpgroup's (C, 64) accumulator, columns moved to
        its key channels."""
        t0, row_w, col_w = softmax.acc_coords(mma, opaque_tid_x() % THREADS_PER_WG,
                                              (CHUNK, self.half))  # fmt: skip
        return t0, row_w, col_w + self.half * self._kh()

    @cute.jit
    def _store_rows(self, acc, mma, mOut, tid, b, hv, c, seqlen, scale=None):
        """Gated DeltaNet's `_store_rows` for this warpgroup's (C, 64) columns of out."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.half))
        tile = cute.local_tile(mOut[b, None, hv, None], (CHUNK, self.half), (c, self._kh()))
        g = rows_cols(mma.get_slice(tid).partition_C(tile))
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if c * CHUNK + row_base + t0[r, 0][0] < seqlen:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    if const_expr(mOut.element_type != Float32):
                        g[r, j] = a[r, j].to(mOut.element_type)
                    else:
                        g[r, j] = a[r, j]

    @cute.jit
    def _tables2(self, mG, sG, sTab, first, seqlen, b, hv, kh):
        """`_tables` with 2 threads a channel: thread t, channel 64 kh + t % 64, loads G's rows
        [32 (t // 64), +32); after a warpgroup barrier the first of the pair writes r_I, e^(r_I),
        e^(G_C - r_J), the second the six E_(I, J) (the same exps, 8 / 6)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        col = tid % self.half + self.half * kh
        part = tid // self.half
        rows = CHUNK // 2
        for n in cutlass.range(rows, unroll=8):
            i = n + rows * part
            g_t = Float32(0.0)
            if first + i < seqlen:
                g_t = mG[b, first + i, hv, col]
            sG[self._gi(i, col)] = g_t
        named_barrier(BAR_WG + kh, THREADS_PER_WG).arrive_and_wait()
        last = cutlass.min(first + CHUNK, seqlen) - 1 - first
        r = [Float32(0.0)] * NS
        for j in cutlass.range_constexpr(NS):
            r[j] = sG[self._gi(cutlass.min(j * SUB + SUB // 2, last), col)]
        if part == 0:
            g_last = sG[self._gi(last, col)]
            for j in cutlass.range_constexpr(NS):
                sTab[(self.t_r + j) * self.k + col] = r[j]
                sTab[(self.t_er + j) * self.k + col] = cute.math.exp(r[j], fastmath=True)
                sTab[(self.t_gr + j) * self.k + col] = cute.math.exp(g_last - r[j], fastmath=True)
        else:
            for i in cutlass.range_constexpr(1, NS):
                for j in cutlass.range_constexpr(i):
                    pair = i * (i - 1) // 2 + j
                    e = cute.math.exp(r[i] - r[j], fastmath=True)
                    sTab[(self.t_e + pair) * self.k + col] = e

    @cute.jit
    def _block_operands2(self, sQ, sK, sKr, sQl, sG, sTab, first, seqlen, kh, scale=None):
        """`_block_operands` with 2 threads a channel (rows [32 (t // 64), +32) each)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        col = tid % self.half + self.half * kh
        rows = CHUNK // 2
        base = rows * (tid // self.half)
        qq, kk = sQ[None, None, 0], sK[None, None, 0]
        kr, ql = sKr[None, None, 0], sQl[None, None, 0]
        for n in cutlass.range(rows, unroll=4):
            i = n + base
            a = sG[self._gi(i, col)] - sTab[(self.t_r + i // SUB) * self.k + col]
            el, er = Float32(0.0), Float32(0.0)
            if first + i < seqlen:
                el = cute.math.exp(a, fastmath=True)
                er = cute.math.exp(-a, fastmath=True)
                if const_expr(scale is not None):
                    el = el * scale
            kr[i, col] = BFloat16(Float32(kk[i, col]) * er)
            ql[i, col] = BFloat16(Float32(qq[i, col]) * el)

    @cute.jit
    def _math(
        self, mma_w, mma_s, mma_q, mma_k, sDO, sU, sDU, sQ, sK, sH, sDH, sP, sKr, sQl, sG, sRows,
        sTab, mG, mDQ, mDK, mDW, mDG, bars, c, hv, b, seqlen, scale, kh,
    ):  # fmt: skip
        """`KdaBwdChunkSm90._math` on key channels [64 kh, +64); kh warp-uniform."""
        qs = scale if const_expr(mDQ.element_type != Float32) else None
        hk = self.half
        wg_w = mma_w.get_slice(0)
        wg_s = mma_s.get_slice(0)
        wg_q = mma_q.get_slice(0)
        wg_k = mma_k.get_slice(0)
        # this warpgroup's B operands: h's / dh's rows, (k er)'s / (q el)'s columns [64 kh, +64)
        sHh = cute.local_tile(sH[None, None, 0], (hk, self.v), (kh, 0))
        sDHh = cute.local_tile(sDH[None, None, 0], (hk, self.v), (kh, 0))
        sKrT = cute.local_tile(transposed(sKr)[None, None, 0], (hk, CHUNK), (kh, 0))
        sQlT = cute.local_tile(transposed(sQl)[None, None, 0], (hk, CHUNK), (kh, 0))
        tArDO = wg_w.make_fragment_A(wg_w.partition_A(sDO))
        tArU = wg_w.make_fragment_A(wg_w.partition_A(sU))
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sHh))
        tBrDH = wg_w.make_fragment_B(wg_w.partition_B(sDHh))
        tSrDO = wg_s.make_fragment_A(wg_s.partition_A(sDO))
        tSrU = wg_s.make_fragment_B(wg_s.partition_B(sU))
        tQrP = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
        tQrKr = wg_q.make_fragment_B(wg_q.partition_B(sKrT))
        tKrP = wg_k.make_fragment_A(wg_k.partition_A(sP))
        tKrQl = wg_k.make_fragment_B(wg_k.partition_B(sQlT))
        mine = named_barrier(BAR_WG + kh, THREADS_PER_WG)
        both = named_barrier(BAR_BOTH, MATH_THREADS)
        first = c * CHUNK
        tid = opaque_tid_x() % THREADS_PER_WG
        w = tid // WARP_SIZE  # the warp's sub-chunk
        self._tables2(mG, sG, sTab, first, seqlen, b, hv, kh)
        mine.arrive_and_wait()

        wait = _GroupWaits(bars, LOAD_GROUPS)
        # dw = -dU h^T, out at once
        acc = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, hk)), Float32)
        wait("du", "h")
        gemm(mma_w, acc, tArDU[None, None, None, 0], tBrH, True, 0)
        acc.store(-acc.load())
        self._store_rows(acc, mma_w, mDW, tid, b, hv, c, seqlen)
        # dqe = dO h^T, S = dO U^T (S whole in both warpgroups)
        wait("do")
        gemm(mma_w, acc, tArDO[None, None, None, 0], tBrH, True, -1)
        acc_s = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        wait("u")
        gemm(mma_s, acc_s, tSrDO[None, None, None, 0], tSrU[None, None, None, 0], True, 0)
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        t0, row_w, col_w = softmax.acc_coords(mma_w, tid, (CHUNK, hk))
        col_w = col_w + hk * kh
        diag = self.table - CHUNK
        s = rows_cols(acc_s)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                if col == i and kh == 0:
                    sTab[diag + i] = s[r, j]
                if col >= i or first + i >= seqlen:
                    s[r, j] = Float32(0.0)
        if kh == 0:
            self._store_bf16(acc_s, mma_s, sP, True)  # dP^T for both warpgroups' dk blocks
        acc_to_operand_a(acc_s, tQrP)
        both.arrive_and_wait()  # both warpgroups' dO / dU products retired, dP^T stored
        wait("q", "k")
        self._block_operands2(sQ, sK, sKr, sQl, sG, sTab, first, seqlen, kh, qs)
        cute.arch.fence_view_async_shared()
        mine.arrive_and_wait()

        # dq = el o (e^(r_w) o dqe + sum_(J <= w) E_(w,J) o blocks) + dP_ii k_i
        qa = rows_cols(acc)
        self._scale_cols(qa, sTab, self.t_er + w, t0, col_w)
        acc_b = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, hk)), Float32)
        ba = rows_cols(acc_b)
        for j in cutlass.range_constexpr(NS):
            self._gemm_block(mma_q, acc_b, tQrP[None, None, j], tQrKr[None, None, j])
            if w == j:
                qa.store(qa.load() + ba.load())
            elif w > j:
                self._add_scaled_cols(qa, ba, sTab, w, j, t0, col_w)
        self._scale_rows_g(qa, mma_w, sG, sTab, w, first, seqlen, True)
        # both warpgroups' dq blocks retired and the <h, dh> warps done: (k er)'s and h's bytes
        # free for dG's rows
        named_barrier(BAR_HDH, MATH_THREADS + HDH_THREADS).arrive_and_wait()
        self._rows_out(qa, mma_w, sQ, sK, sRows, sTab, diag, True, qs)
        self._store_rows(acc, mma_w, mDQ, tid, b, hv, c, seqlen)

        # dk = er o (e^(G_C - r_w) o dke + sum_(I >= w) E_(I,w) o blocks) + dP_jj q_j
        wait("dh")
        gemm(mma_w, acc, tArU[None, None, None, 0], tBrDH, True, 0)
        self._te(qa, mma_w, sK, sG, sTab, w, first, seqlen)
        self._scale_cols(qa, sTab, self.t_gr + w, t0, col_w)
        for i in cutlass.range_constexpr(NS):
            self._gemm_block(mma_k, acc_b, tKrP[None, None, i, 0], tKrQl[None, None, i])
            if w == i:
                qa.store(qa.load() + ba.load())
            elif w < i:
                self._add_scaled_cols(qa, ba, sTab, i, w, t0, col_w)
        self._scale_rows_g(qa, mma_w, sG, sTab, w, first, seqlen, False)
        self._rows_out(qa, mma_w, sK, sQ, sRows, sTab, diag, False, qs)
        self._store_rows(acc, mma_w, mDK, tid, b, hv, c, seqlen)
        mine.arrive_and_wait()  # this warpgroup's dG rows and te's partials in shared memory
        if tid < hk:  # one channel a thread, the 256-thread kernel's chain (bit for bit)
            self._finish_dg(sG, sRows, sTab, mDG, first, seqlen, b, hv, tid + hk * kh)
