"""Kimi Delta Attention backward, the WY kernel, `wg2`: the chunk's products on two math
warpgroups split by value / key channels (docs/linear_attention/NOTES.md "KDA backward WY kernel
on two math warpgroups"). Math warpgroup kh (warpgroups 1, 2 -> kh = 0, 1) owns channels
[64 kh, 64 kh + 64) of dvb, dv, dkb, dk, dx, dy and dG: every product but dA is
`KdaBwdWySm90`'s with N = 64 (B the columns [64 kh, +64) of du / dw / (k er) / (k el) through
their transposed views: whole 8 KB SW128 atom columns, 1,024-byte aligned), and the per-channel
SIMT (tables, block operands, the dG rows and their reverse cumsum) is done on its own 64
channels, 2 threads a channel where kernel 2's `wg2` does so.

dA = dvb u^T + dkb w^T (C x C) is reduced over all 128 value and key channels: each warpgroup
stores its dvb / dkb halves in the tiles' dtype over the du / dw columns its own products have
read (the same rounding as the 256-thread kernel's register A operand), and both then compute
the whole dA from shared memory (16 m64n64k16 each, the same k-block order). The three row dots
of dbeta (over V or K) keep the 256-thread kernel's summation order: warpgroup 1 sums its 16
columns a row first and hands the partials over (shared memory, a named barrier it only arrives
at), warpgroup 2 continues from them and stores dbeta. Every output element is formed by the
same operations in the same order as the 256-thread kernel (bit for bit).

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: under the launch's 168 registers a
thread): warpgroup 0 as before (the TMA warp); warpgroups 1, 2 the math halves.

Named barriers: BAR_BOTH (256, twice: both halves of dvb and dkb stored before dA's products;
both dA's retired and (beta dA)^T stored before (k er) / (k el) overwrite dw / du's bytes),
BAR_DOTS + slot (256, once each: warpgroup 1 arrives, warpgroup 2 waits), BAR_WG + kh (128:
warpgroup-local: G's rows, the tables, each half's products retired before its bytes are
overwritten, the block operands, dG's rows)."""

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
from forgekernel.kernels.common.sm90.ptx import bulk_reduce_add_f32, opaque_tid_x
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import QUAD
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads_wg2 import (
    BAR_BOTH,
    BAR_WG,
    MATH_THREADS,
    KdaBwdChunkWg2Sm90,
)
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import CHUNK, NS, WG2_THREADS
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.wy_grads import KdaBwdWySm90

BAR_DOTS = BAR_WG + 2  # + slot: warpgroup 1's row-dot partials to warpgroup 2 (256)
DOTS = 3  # rowsum(dvb o v), rowsum(z), rowsum(k o dx): dbeta's three terms


class KdaBwdWyWg2Sm90(KdaBwdWySm90, KdaBwdChunkWg2Sm90):
    """`KdaBwdWySm90` on two math warpgroups split by channels (module docstring); kernel 2's
    `wg2` brings the half coordinates, tables, block operands and dv's half-row store."""

    threads = WG2_THREADS

    def __init__(self, k: int, v: int):
        super().__init__(k, v)
        # warpgroup 1's row-dot partials (a slot each: 2 rows x 128 threads) after the tables
        self.t_dots = self.table
        self.table += DOTS * 2 * THREADS_PER_WG

    def _setup(self):
        super()._setup()
        dt, bf = self.dtype, BFloat16
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        n = (CHUNK, self.half)
        # dvb, dkb's halves = T^T [du dw]'s: B the half's transposed (MN-major) view
        self.mma_t = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                       (1, 1, 1), n)  # fmt: skip
        # dA = dvb u^T + dkb w^T, A (dvb, dkb over du's, dw's bytes) and B K-major in shared
        # memory
        self.mma_da = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32,
                                                        (1, 1, 1), (CHUNK, CHUNK))  # fmt: skip
        self.mma_x = sm90_utils.make_trivial_tiled_mma(bf, bf, k_major, mn_major, Float32,
                                                       (1, 1, 1), n, a_source=rmem)  # fmt: skip
        self.mma_y = sm90_utils.make_trivial_tiled_mma(bf, bf, k_major, mn_major, Float32,
                                                       (1, 1, 1), n)  # fmt: skip

    def _half(self, s_tile, kh):
        """Columns [64 kh, +64) of a staged (C, 128) shared tile, staged: (C, 64, 1)."""
        return cute.local_tile(s_tile, (CHUNK, self.half, 1), (0, kh, 0))

    def _half_t(self, s_tile, kh):
        """The transposed view's rows [64 kh, +64) of a staged (C, 128) shared tile: a B
        operand's half (MN-major), unstaged."""
        return cute.local_tile(transposed(s_tile)[None, None, 0], (self.half, CHUNK), (kh, 0))

    @cute.jit
    def _math(
        self, mma_t, mma_da, mma_x, mma_y, sDW, sDU, sW, sK, sU, sV, sTt, sP, sKr, sKl, sG,
        sRows, sTab, mBeta, mG, mDK, mDV, mDG, mDB, mDKo, bars, c, hv, b, seqlen, kh,
    ):  # fmt: skip
        """`KdaBwdWySm90._math` on channels [64 kh, +64); kh warp-uniform."""
        hk = self.half
        wg_t = mma_t.get_slice(0)
        wg_da = mma_da.get_slice(0)
        wg_x = mma_x.get_slice(0)
        wg_y = mma_y.get_slice(0)
        tArT = wg_t.make_fragment_A(wg_t.partition_A(sTt))
        tBrDU = wg_t.make_fragment_B(wg_t.partition_B(self._half_t(sDU, kh)))
        tBrDW = wg_t.make_fragment_B(wg_t.partition_B(self._half_t(sDW, kh)))
        tDArV = wg_da.make_fragment_A(wg_da.partition_A(sDU))  # dvb, both halves
        tDArB = wg_da.make_fragment_A(wg_da.partition_A(sDW))  # dkb, both halves
        tDBrU = wg_da.make_fragment_B(wg_da.partition_B(sU))
        tDBrW = wg_da.make_fragment_B(wg_da.partition_B(sW))
        tXrA = wg_x.make_fragment_A(wg_x.partition_shape_A((CHUNK, CHUNK)))
        tXrKr = wg_x.make_fragment_B(wg_x.partition_B(self._half_t(sKr, kh)))
        tYrP = wg_y.make_fragment_A(wg_y.partition_A(sP))
        tYrKl = wg_y.make_fragment_B(wg_y.partition_B(self._half_t(sKl, kh)))
        mine = named_barrier(BAR_WG + kh, THREADS_PER_WG)
        both = named_barrier(BAR_BOTH, MATH_THREADS)
        first = c * CHUNK
        tid = opaque_tid_x() % THREADS_PER_WG
        w = tid // WARP_SIZE  # the warp's sub-chunk
        self._tables2(mG, sG, sTab, first, seqlen, b, hv, kh)
        t0, row_w, col_w = softmax.acc_coords(mma_t, tid, (CHUNK, hk))
        col_w = col_w + hk * kh
        beta = [Float32(0.0), Float32(0.0)]  # zero past T: every row product there is zero
        for r in cutlass.range_constexpr(2):
            i = first + row_w + t0[r, 0][0]
            if i < seqlen:
                beta[r] = mBeta[b, i, hv]
        mine.arrive_and_wait()

        # dvb's half = T^T du's: over du's half (this warpgroup's reads of it retired), dv out
        acc = cute.make_rmem_tensor(wg_t.partition_shape_C((CHUNK, hk)), Float32)
        cute.arch.mbarrier_wait(bars + 0, 0)  # T^T, du
        if kh == 0:
            self._prefetch_rows(mDK, tid, b, hv, first, seqlen)
        gemm(mma_t, acc, tArT[None, None, None, 0], tBrDU, True, 0)
        mine.arrive_and_wait()
        self._store_tile(acc, mma_t, self._half(sDU, kh), False)
        cute.arch.mbarrier_wait(bars + 2, 0)  # v
        dv_dot = self._dots_start(sTab, 0, kh, tid)
        dv_dot = self._dots_end(self._dots_from(acc, mma_t, self._half(sV, kh), tid, dv_dot),
                                sTab, 0, kh, tid)  # fmt: skip
        self._scale_rows(acc, beta)
        self._store_rows(acc, mma_t, mDV, tid, b, hv, c, seqlen)
        # dkb's half = T^T dw's: over dw's half
        cute.arch.mbarrier_wait(bars + 3, 0)  # dw
        gemm(mma_t, acc, tArT[None, None, None, 0], tBrDW, True, 0)
        mine.arrive_and_wait()
        self._store_tile(acc, mma_t, self._half(sDW, kh), False)
        cute.arch.mbarrier_wait(bars + 1, 0)  # u
        cute.arch.mbarrier_wait(bars + 4, 0)  # w
        both.arrive_and_wait()  # both halves of dvb and dkb in shared memory
        # dA = dvb u^T + dkb w^T, whole in each warpgroup, in flight over z and dk's first term
        acc_a = cute.make_rmem_tensor(wg_da.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(mma_da, acc_a, tDArV[None, None, None, 0], tDBrU[None, None, None, 0], True, -1)
        gemm(mma_da, acc_a, tDArB[None, None, None, 0], tDBrW[None, None, None, 0], False, -1)
        cute.arch.mbarrier_wait(bars + 5, 0)  # k
        z = self._dots_start(sTab, 1, kh, tid)
        z = self._dots_end(self._kb_rows(acc, mma_t, sK, sG, sRows, beta, z), sTab, 1, kh, tid)
        self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen)  # onto kernel 2's dk
        warpgroup.wait_group(0)
        t0s, row_s, col_s = softmax.acc_coords(mma_da, tid, (CHUNK, CHUNK))
        s = rows_cols(acc_a)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                s[r, j] = -s[r, j]
                if col >= i or first + i >= seqlen:
                    s[r, j] = Float32(0.0)
        acc_to_operand_a(acc_a, tXrA)
        if kh == 0:
            self._scale_rows(acc_a, beta)
            self._store_bf16(acc_a, mma_da, sP, True)  # (beta dA)^T for both warpgroups' dy
        both.arrive_and_wait()  # both dA's retired (dvb's, dkb's bytes free), (beta dA)^T stored
        self._block_operands2(sK, sK, sKr, sKl, sG, sTab, first, seqlen, kh)
        cute.arch.fence_view_async_shared()
        mine.arrive_and_wait()

        # dx = el o sum_(J <= w) E_(w,J) o blocks: rowsum(k o dx) into dbeta, then beta dx
        acc.fill(0.0)
        xa = rows_cols(acc)
        acc_b = cute.make_rmem_tensor(wg_t.partition_shape_C((CHUNK, hk)), Float32)
        ba = rows_cols(acc_b)
        for j in cutlass.range_constexpr(NS):
            self._gemm_block(mma_x, acc_b, tXrA[None, None, j], tXrKr[None, None, j])
            if w == j:
                xa.store(xa.load() + ba.load())
            elif w > j:
                self._add_scaled_cols(xa, ba, sTab, w, j, t0, col_w)
        self._scale_rows_g(xa, mma_t, sG, sTab, w, first, seqlen, True)
        kx = self._dots_start(sTab, 2, kh, tid)
        kx = self._dots_end(self._dots_from(acc, mma_t, self._half(sK, kh), tid, kx), sTab, 2,
                            kh, tid)  # fmt: skip
        dbeta = [dv_dot[r] + z[r] + kx[r] for r in range(2)]  # warpgroup 2's: the row sums
        if kh == 1:
            self._store_vec(dbeta, t0, row_w, tid, mDB, b, hv, first, seqlen)
        self._scale_rows(acc, beta)
        self._rows_add(xa, mma_t, sK, sRows, True)
        self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen)

        # dy = er o sum_(I >= w) E_(I,w) o blocks
        acc.fill(0.0)
        for i in cutlass.range_constexpr(NS):
            self._gemm_block(mma_y, acc_b, tYrP[None, None, i, 0], tYrKl[None, None, i])
            if w == i:
                xa.store(xa.load() + ba.load())
            elif w < i:
                self._add_scaled_cols(xa, ba, sTab, i, w, t0, col_w)
        self._scale_rows_g(xa, mma_t, sG, sTab, w, first, seqlen, False)
        self._rows_add(xa, mma_t, sK, sRows, False)
        if const_expr(mDKo.element_type != Float32):  # dk16: the final dk, rounded once
            self._add_rows_to(acc, mma_t, mDK, mDKo, tid, b, hv, c, seqlen)
        else:
            self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen)
        mine.arrive_and_wait()  # this warpgroup's dG rows in shared memory
        self._finish_half(sRows, mDG, first, seqlen, b, hv, tid, kh, mine)

    @cute.jit
    def _dots_from(self, acc, mma, s_tile, tid, start):
        """This thread's row dots of the (C, 64) accumulator with the 16-bit half tile `s_tile`
        (GDN's `_row_dots` order, its columns), from `start`, not quad reduced."""
        x = cute.make_rmem_tensor(acc.shape, Float32)
        x.store(mma.get_slice(tid).partition_C(s_tile[None, None, 0]).load().to(Float32))
        a, xv = rows_cols(acc), rows_cols(x)
        out = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            part = start[r]
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                part = part + a[r, j] * xv[r, j]
            out[r] = part
        return out

    @cute.jit
    def _dots_start(self, sTab, slot, kh, tid):
        """Where row dot `slot`'s sum starts: zero in warpgroup 1 (its 64 channels come first
        in the 256-thread kernel's order); warpgroup 1's partials in warpgroup 2, once handed
        over (`_dots_end`)."""
        s0, s1 = Float32(0.0), Float32(0.0)
        if kh == 1:
            named_barrier(BAR_DOTS + slot, MATH_THREADS).arrive_and_wait()
            n = self.t_dots + slot * 2 * THREADS_PER_WG + tid
            s0 = sTab[n]
            s1 = sTab[n + THREADS_PER_WG]
        return [s0, s1]

    @cute.jit
    def _dots_end(self, parts, sTab, slot, kh, tid):
        """Warpgroup 1: its partials to warpgroup 2 (stored; the barrier only arrived at: it
        never waits here), zeros returned; warpgroup 2: the row sums (quad reduced)."""
        o0, o1 = Float32(0.0), Float32(0.0)
        if kh == 0:
            n = self.t_dots + slot * 2 * THREADS_PER_WG + tid
            sTab[n] = parts[0]
            sTab[n + THREADS_PER_WG] = parts[1]
            named_barrier(BAR_DOTS + slot, MATH_THREADS).arrive()
        else:
            o0 = cute.arch.warp_reduction_sum(parts[0], threads_in_group=QUAD)
            o1 = cute.arch.warp_reduction_sum(parts[1], threads_in_group=QUAD)
        return [o0, o1]

    @cute.jit
    def _add_rows(self, acc, mma, mOut, tid, b, hv, c, seqlen):
        """GDN's `_add_rows` on this warpgroup's (C, 64) columns of out."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.half))
        tile = cute.local_tile(mOut[b, None, hv, None], (CHUNK, self.half), (c, self._kh()))
        g = rows_cols(mma.get_slice(tid).partition_C(tile))
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if c * CHUNK + row_base + t0[r, 0][0] < seqlen:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    g[r, j] = g[r, j] + a[r, j]

    @cute.jit
    def _add_rows_to(self, acc, mma, mIn, mOut, tid, b, hv, c, seqlen):
        """`KdaBwdWySm90._add_rows_to` on this warpgroup's (C, 64) columns (a row's 8 pairs
        loaded before its first store)."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.half))
        kh = self._kh()
        src = cute.local_tile(mIn[b, None, hv, None], (CHUNK, self.half), (c, kh))
        dst = cute.local_tile(mOut[b, None, hv, None], (CHUNK, self.half), (c, kh))
        gi = rows_cols(mma.get_slice(tid).partition_C(src))
        go = rows_cols(mma.get_slice(tid).partition_C(dst))
        a = rows_cols(acc)
        n = cute.size(a, mode=[1])
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if c * CHUNK + row_base + t0[r, 0][0] < seqlen:
                x = [gi[r, j] for j in range(n)]
                for j in cutlass.range_constexpr(n):
                    go[r, j] = (x[j] + a[r, j]).to(mOut.element_type)

    @cute.jit
    def _finish_half(self, sRows, mDG, first, seqlen, b, hv, tid, kh, mine):
        """`_finish_rows` on channels [64 kh, +64): thread t < 64 = channel 64 kh + t (the
        same chain), then thread i < C adds row i's half (256 B) onto mDG by one bulk
        reduce-add."""
        col = tid + self.half * kh
        if tid < self.half:
            acc = Float32(0.0)
            for n in cutlass.range(CHUNK, unroll=8):
                i = CHUNK - 1 - n
                acc = acc + sRows[self._gi(i, col)]
                sRows[self._gi(i, col)] = acc
        cute.arch.fence_view_async_shared()  # the sums seen by the bulk reduce (async proxy)
        mine.arrive_and_wait()
        if tid < CHUNK:
            if first + tid < seqlen:
                bulk_reduce_add_f32(mDG[b, first + tid, hv, None].iterator + self.half * kh,
                                    sRows.iterator + self._gi(tid, self.half * kh),
                                    self.half * 4)  # fmt: skip
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sRows read before the exit
