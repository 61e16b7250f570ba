"""The aux warpgroup of the chunked prefill kernel (mixed into GdnChunkedFwdSm90): per chunk,
everything that does not depend on the state, a chunk ahead of the state warpgroups.

1. K K^T (SS WGMMA, 64 x 64 over K); with l2norm, while it runs, thread t sums the squares of
   row t % 64 of q (t < 64) or k (t >= 64): rq, rk.
2. The per-token tables of the state warpgroups (threads < 64, token j = thread):
   fK = rk 2^G2, fQ = scale rq 2^G2, fU = rk 2^(G2_C - G2), and 2^G2_C.
3. In the accumulator, d_ij = 2^(G2_i - G2_j) for j < i (0 elsewhere: selected, never an
   overflowing product): L = beta_i rk_i rk_j d (K K^T) -> the fp32 scratch (zero above the
   diagonal, rewritten whole each chunk).
4. T = (I + L)^-1 in the scratch: the diagonal blocks (`inverse.invert_diagonal`), Q K^T
   issued, the merges on the tensor cores (`inverse_mma.invert_merge_mma`) under it; then
   P = scale rq_i rk_j d (Q K^T) for j <= i -> 16 bits -> stmatrix into the aux ring's P tile;
   T read back in the accumulator layout, T diag(beta) -> 16 bits -> its T tile.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import consumer_state, producer_state
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    L2NORM_EPS,
    QK_STAGES,
    STAGES,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import (
    Bar,
    aux_barrier_id,
    gate_warp_witnesses_qk,
)

VEC = 8  # 16-bit elements per 16-byte shared-memory read
WARP_ROWS = 16  # accumulator rows a warp holds (WGMMA M = 64 over 4 warps)


class AuxWy:
    """Scores, masks and the WY inverse (warpgroup 1)."""

    @cute.jit
    def _aux(
        self, mma_aux, sQ, sK, sP, sT, sG, sBeta, sTab, sNorm, sW, sX, qk_pipe, gate_pipe,
        aux_pipe, scale, nchunks, a,
    ):  # fmt: skip
        """Chunks a, a + aux_wgs, ... (a: this aux warpgroup, 0 unless the CTA has two, which
        alternate: each ring state starts at a and steps by aux_wgs; sW, sX its own scratch)."""
        # Thread-dependent views (stmatrix and scratch addresses, coordinates, the inverse's
        # identity rows) are rebuilt each chunk from a threadIdx the compiler may not hoist:
        # hoisted out of the loop they are ~20 live registers, which spilled at 104.
        wg_thr = mma_aux.get_slice(0)
        tSrQ = wg_thr.make_fragment_A(wg_thr.partition_A(sQ))
        tSrKa = wg_thr.make_fragment_A(wg_thr.partition_A(sK))
        tSrKb = wg_thr.make_fragment_B(wg_thr.partition_B(sK))
        acc_shape = wg_thr.partition_shape_C((CHUNK, CHUNK))
        bar = named_barrier(Bar.AUX, THREADS_PER_WG)
        ld = consumer_state(QK_STAGES)
        gt = consumer_state(STAGES)
        ax = producer_state(STAGES)
        first = 0
        witness = gate_warp_witnesses_qk(self.aux_wgs)  # gate stage first (roles.py says why)
        if const_expr(self.aux_wgs > 1):
            bar = named_barrier(aux_barrier_id(a), THREADS_PER_WG)
            ld.advance(a)
            gt.advance(a)
            ax.advance(a)
            first = a
        for _ in cutlass.range(first, nchunks, self.aux_wgs, unroll=1):
            atid = opaque_tid_x() - THREADS_PER_WG * (1 + a)
            if const_expr(witness):  # the gate warp saw this chunk's q / k land: no stale parity
                gate_pipe.consumer_wait(gt)
            qk_pipe.consumer_wait(ld)
            kb = tSrKb[None, None, None, ld.index]
            acc = cute.make_rmem_tensor(acc_shape, Float32)
            gemm(mma_aux, acc, tSrKa[None, None, None, ld.index], kb, True, -1)
            if const_expr(not witness):
                gate_pipe.consumer_wait(gt)
            if const_expr(self.l2norm):
                self._row_norm(atid, sQ, sK, sG, sNorm, ld.index, gt.index)
            # the norms are visible; every thread is past the previous chunk's scratch reads
            bar.arrive_and_wait()
            coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
            warpgroup.wait_group(0)
            self._decay_mask(acc, coords, sG, sBeta, sNorm, gt.index, scale, True)
            tWsW = mma_aux.get_slice(atid).partition_C(sW)
            tWsW.store(acc.load())
            cute.arch.sync_warp()
            invert_diagonal(sW, atid)
            # Q K^T on the tensor cores under the inverse's merges (one accumulator in flight
            # at a time: both at once were 64 registers beside the masks' operands, which
            # spilled; in flight during phase 0, its 32 beside the 16 columns, 8 B spilled)
            acc_p = cute.make_rmem_tensor(acc_shape, Float32)
            gemm(mma_aux, acc_p, tSrQ[None, None, None, ld.index], kb, True, -1)
            invert_merge_mma(sW, sX, atid, bar)
            warpgroup.wait_group(0)
            qk_pipe.consumer_release(ld)
            self._decay_mask(acc_p, coords, sG, sBeta, sNorm, gt.index, scale, False)
            # the ring's stage is taken only now: everything above runs while the state
            # warpgroups still read it (two chunks back)
            aux_pipe.producer_acquire(ax)
            if atid < CHUNK:
                self._tables(atid, sG, sNorm, sTab, gt.index, ax.index, scale)
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype),
                mma_aux,
            )
            thr_r2s = r2s.get_slice(atid)
            r_p = cute.make_rmem_tensor(acc_shape, self.dtype)
            r_p.store(acc_p.load().to(self.dtype))
            cute.copy(r2s, thr_r2s.retile(r_p), thr_r2s.partition_D(sP[None, None, ax.index]))
            acc.store(tWsW.load())
            self._scale_by_beta(acc, coords, sBeta, gt.index)
            r_t = cute.make_rmem_tensor(acc_shape, self.dtype)
            r_t.store(acc.load().to(self.dtype))
            cute.copy(r2s, thr_r2s.retile(r_t), thr_r2s.partition_D(sT[None, None, ax.index]))
            # stmatrix writes are generic-proxy, the state warpgroups' WGMMAs read async-proxy
            cute.arch.fence_view_async_shared()
            gate_pipe.consumer_release(gt)
            aux_pipe.producer_commit(ax)
            ld.advance(self.aux_wgs)
            gt.advance(self.aux_wgs)
            ax.advance(self.aux_wgs)

    @cute.jit
    def _row_norm(self, atid, sQ, sK, sG, sNorm, stage, gs):
        """Row t = atid % 64 of gate stage gs: sNorm[t, 0] = 1 / |q_t| (atid < 64), sNorm[t, 1]
        = 1 / |k_t| and sNorm[t, 2] = G2_t - log2(sNorm[t, 1]) (atid >= 64; fla's eps): the
        masks' column factor rk_j 2^-G2_j as one exponent (|log2 rk| <= 10 for eps 1e-6: no
        overflow). Staged: a thread may reach the next chunk's norms while others still read
        these in the P mask (after the inverse's last barrier)."""
        row = atid % CHUNK
        if atid < CHUNK:
            if const_expr(self.q_load):  # the no_o key loads no q (rq, O's factor, unread)
                ss = self._sum_squares(sQ[None, None, stage], row)
                sNorm[row, 0, gs] = cute.math.rsqrt(ss + L2NORM_EPS, fastmath=True)
        else:
            self._k_norm(sK[None, None, stage], row, sG, sNorm, gs)

    @cute.jit
    def _k_norm(self, tile, row, sG, sNorm, gs):
        """sNorm[row, 1, gs] = rk = 1 / |k_row| and sNorm[row, 2, gs] = G2_row - log2 rk
        (`_row_norm`; the T precompute's too)."""
        ss = self._sum_squares(tile, row)
        rk = cute.math.rsqrt(ss + L2NORM_EPS, fastmath=True)
        sNorm[row, 1, gs] = rk
        sNorm[row, 2, gs] = sG[row, gs] - cute.math.log2(rk, fastmath=True)

    @cute.jit
    def _sum_squares(self, tile, row) -> Float32:
        """Sum of squares of a 16-bit row; a rolled loop (two 16-byte reads in flight): the
        unrolled one's 16 reads are 64 registers beside the two accumulators in flight."""
        parts = cute.make_rmem_tensor(VEC, Float32)
        parts.fill(0.0)
        line = tile[row, None]
        for m in cutlass.range(self.k // VEC, unroll=2):
            x = cute.local_tile(line, (VEC,), (m,)).load().to(Float32)
            parts.store(parts.load() + x * x)
        p = parts.load()
        return ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))

    @cute.jit
    def _tables(self, j, sG, sNorm, sTab, gs, s, scale):
        """Token j's factors for the state warpgroups (see the module docstring)."""
        gj = sG[j, gs]
        gc = sG[CHUNK - 1, gs]
        ej = cute.math.exp2(gj, fastmath=True)
        ecj = cute.math.exp2(gc - gj, fastmath=True)
        rq = Float32(1.0)
        rk = Float32(1.0)
        if const_expr(self.l2norm):
            if const_expr(self.q_load):  # no_o: no q norm (column 1 unread)
                rq = sNorm[j, 0, gs]
            rk = sNorm[j, 1, gs]
        sTab[j, 0, s] = rk * ej
        sTab[j, 1, s] = scale * rq * ej
        sTab[j, 2, s] = rk * ecj
        if j == 0:
            sTab[0, 3, s] = cute.math.exp2(gc, fastmath=True)

    @cute.jit
    def _decay_mask(
        self, acc, coords, sG, sBeta, sNorm, gs, scale, strict: cutlass.Constexpr[bool]
    ):
        """In place: strict, K K^T -> L = beta_i rk_i rk_j 2^(G2_i - G2_j) (.) for j < i;
        else Q K^T -> P = scale rq_i rk_j 2^(G2_i - G2_j) (.) for j <= i; 0 elsewhere.

        Warp w holds rows i0 = 16 w + t and i1 = i0 + 8 (t < 8) and, per 8-column group n,
        two columns; by group (n against the warp-uniform w: no lane divergence):
          n < 2 w      both rows below the diagonal: d_i0j = 2^(G2_i0 - h_j) and d_i1j =
                       2^(G2_i1 - G2_i0) d_i0j (the first factor <= 1, the second <= rk_j)
          n = 2 w      row i0 crosses its diagonal (selected), row i1 below it: both direct
          n = 2 w + 1  row i0 above it (0), row i1 crosses it: direct, selected
          n > 2 w + 1  above both rows: 0, no power formed
        so warp w forms 7 + 4 w powers instead of 32 (warp 3, the last to finish, 19). Above
        the diagonal a power may be inf: it is selected away, never multiplied, and the
        factored form is used only below it.

        The band is chosen once per warp (`_band_mask` compiled for each w, one uniform branch
        here): chosen per column group, each group's load -> ex2 -> multiply chain sat alone
        between branches and the 16 column chains ran one after another."""
        t0, row_base, _ = coords
        w = cute.arch.make_warp_uniform(row_base // WARP_ROWS)
        gi, fi = [], []
        for r in cutlass.range_constexpr(2):
            i = row_base + t0[r, 0][0]
            gi.append(sG[i, gs])
            if const_expr(strict):
                f = sBeta[i, gs]
                if const_expr(self.l2norm):
                    f = f * sNorm[i, 1, gs]
            else:
                f = scale
                if const_expr(self.l2norm):
                    f = f * sNorm[i, 0, gs]
            fi.append(f)
        ratio = cute.math.exp2(gi[1] - gi[0], fastmath=True)
        for band in cutlass.range_constexpr(CHUNK // WARP_ROWS):
            if w == band:
                self._band_mask(acc, coords, sG, sNorm, gs, gi, fi, ratio, strict, band)

    @cute.jit
    def _band_mask(
        self, acc, coords, sG, sNorm, gs, gi, fi, ratio, strict: cutlass.Constexpr[bool],
        band: cutlass.Constexpr[int],
    ):  # fmt: skip
        """`_decay_mask` for the warp holding rows 16 band .. 16 band + 15: straight-line."""
        t0, row_base, col_base = coords
        a = rows_cols(acc)
        # element (r, c) sits at (row_base + t0r, col_base + t0c): j <= i iff
        # col_base - row_base <= t0r - t0c
        diff = col_base - row_base
        for n in cutlass.range_constexpr(cute.size(a, mode=[1]) // 2):
            for c in cutlass.range_constexpr(2 * n, 2 * n + 2):
                j = col_base + t0[0, c][1]
                off = [t0[r, 0][0] - t0[r, c][1] for r in range(2)]
                seen = [diff < o if const_expr(strict) else diff <= o for o in off]
                if const_expr(n < 2 * band):
                    d = cute.math.exp2(gi[0] - self._col_exponent(sG, sNorm, j, gs), fastmath=True)
                    a[0, c] = a[0, c] * (d * fi[0])
                    a[1, c] = a[1, c] * ((ratio * d) * fi[1])
                elif const_expr(n == 2 * band):
                    hj = self._col_exponent(sG, sNorm, j, gs)
                    d0 = cute.math.exp2(gi[0] - hj, fastmath=True)
                    d1 = cute.math.exp2(gi[1] - hj, fastmath=True)
                    a[0, c] = cutlass.select_(seen[0], a[0, c] * (d0 * fi[0]), Float32(0.0))
                    a[1, c] = a[1, c] * (d1 * fi[1])
                elif const_expr(n == 2 * band + 1):
                    d1 = cute.math.exp2(gi[1] - self._col_exponent(sG, sNorm, j, gs), fastmath=True)
                    a[0, c] = Float32(0.0)
                    a[1, c] = cutlass.select_(seen[1], a[1, c] * (d1 * fi[1]), Float32(0.0))
                else:
                    a[0, c] = Float32(0.0)
                    a[1, c] = Float32(0.0)

    @cute.jit
    def _col_exponent(self, sG, sNorm, j, gs):
        """h_j: G2_j, with l2norm G2_j - log2 rk_j (rk_j folded into the column's exponent)."""
        return sNorm[j, 2, gs] if const_expr(self.l2norm) else sG[j, gs]

    @cute.jit
    def _scale_by_beta(self, acc, coords, sBeta, gs):
        """acc (T in the accumulator layout) -> T diag(beta)."""
        t0, _, col_base = coords
        a = rows_cols(acc)
        for c in cutlass.range_constexpr(cute.size(a, mode=[1])):
            b = sBeta[col_base + t0[0, c][1], gs]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, c] = a[r, c] * b
