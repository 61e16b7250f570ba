"""One step of a consumer warpgroup: a query block against the CTA's keys, transposed (keys
along the rows).

Key split (`_step`, tile_n 128, 64 keys per warpgroup): S^T = K Q^T and dP^T = V dO^T (SS
WGMMA, two commit groups); P^T = exp2(S^T scale log2e - LSE log2e), masked on edge /
diagonal blocks; dS^T = P^T (dP^T - Dsum); dV += P^T dO and dK += dS^T Q with the
accumulators as register A operands; dS^T to shared memory (stmatrix) for dQ = dS K (SS,
both operands MN-major views), dQ first and staged while dK runs. `_step_qh`: the same in two
32-query halves (D = 192). Column split (`_step_cs`, tile_n 64): S^T / dP^T split by query
columns, P^T and dS^T through shared memory, dV / dK / dQ split by head-dim columns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from forgekernel.kernels.common.sm90.layout import acc_as_operand_a, acc_to_operand_a, rows_cols
from forgekernel.kernels.common.sm90.mma import gemm


class MmaStep:
    """The consumer step bodies (mixed into AttentionBwdSm90)."""

    @cute.jit
    def _step(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k,
        masked: cutlass.Constexpr[bool], stage: cutlass.Constexpr = None,
    ):  # fmt: skip
        """One query block m (ring stage st) against this CTA's keys. `stage`: st.index as a
        compile-time constant (the loop unrolled by the ring depth), so that the shared-memory
        operand descriptors are constant offsets from loop-invariant bases."""
        si = st.index if const_expr(stage is None) else stage
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        # A thread's S^T element (r, c) sits at (row0 + ro[r], col0 + co[c]), ro, co static.
        ro, co = self._static_offsets(mma_sdp)
        q_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, si], True, -1)
        if const_expr(self.stats_early):
            # LSE read while S^T is on the tensor cores (after the wait it stalls the exp2)
            row0, col0 = tScS[0, 0]
            lse = self._col_stats(sLSE, si, col0, co)
        do_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, si], True, -1)
        if const_expr(self.dsum_early):
            # Dsum read while both GEMMs run: later its loads queue behind the exp2s (both
            # go through MIO) and the dS math waits for them
            dsum = self._col_stats(sDsum, si, col0, co)

        # P^T = exp2(S^T scale log2e - LSE log2e); rows are keys, columns queries.
        warpgroup.wait_group(1)
        s = rows_cols(acc_S)
        if const_expr(not self.stats_early):
            row0, col0 = tScS[0, 0]
        # visible iff key < Sk and (causal) key <= query + Sk - Sq, i.e.
        # ro[r] < edge and ro[r] - co[c] <= diag
        edge = seqlen_k - n0 - row0
        diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + col0 - row0
        if const_expr(masked):
            self._mask(s, ro, co, edge, diag)
        if const_expr(not self.stats_early):
            lse = self._col_stats(sLSE, si, col0, co)
        self._exp2(s, lse, scale_log2)
        if const_expr(self.stats_early and not self.dsum_early):
            # Dsum read before the dP^T wait
            dsum = self._col_stats(sDsum, si, col0, co)
        if const_expr(self.p_early):
            # P^T to the dV GEMM's 16-bit A operand before the dP^T wait (inline-PTX packed
            # converts, which the assembler leaves here); dS below still reads the fp32 P
            acc_to_operand_a(acc_S, tVrP)

        dv_args = (mma_dv, acc_dV, acc_S, tVrP, tVrdOt, si)
        if const_expr(self.dv_before_ds):
            self._issue_dv(*dv_args)
            warpgroup.wait_group(1)  # dP^T (issued before dV)
        else:
            warpgroup.wait_group(0)
        # dS^T = P^T (dP^T - Dsum)
        dp = rows_cols(acc_dP)
        if const_expr(not self.stats_early):
            dsum = self._col_stats(sDsum, si, col0, co)
        self._ds(dp, s, dsum)

        # dS^T -> shared memory, then dQ = dS K. One buffer: the previous step's dQ GEMMs
        # (both warpgroups) finished before that step's dQ-empty barrier. dq_split: buffer
        # step % 2, whose last readers (step - 2's dQ GEMMs) finished before the other
        # warpgroup reached step - 1's consumer barrier.
        if const_expr(self.dq_split):
            ds = step % 2
            if const_expr(stage is not None and self.stages % 2 == 0):
                ds = stage % 2
            tQrdS = tQrdS[None, None, None, ds]
            tdSsdS = tdSsdS[None, None, None, ds]
        # dV += P^T dO, dK += dS^T Q (A operands from registers). ds_store_first: dS^T to
        # shared memory before dV is issued, so the stores have landed by the fence.
        if const_expr(not self.ds_store_first and not self.dv_before_ds):
            self._issue_dv(*dv_args)
        rdS = cute.make_rmem_tensor(s_shape, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        tKrdS.store(acc_as_operand_a(rdS).load())
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS)
        if const_expr(self.ds_store_first):
            self._issue_dv(*dv_args)
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        # dQ, then dK: the dQ tile is staged below while dK is still on the tensor cores
        # (groups retire in order: one left in flight = dK). dK is waited for at the end of
        # the step, so no WGMMA crosses the loop's back edge.
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, -1)
        gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, si], False, 1)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)
        warpgroup.wait_group(0)
        q_pipe.consumer_release(st)

    @cute.jit
    def _issue_dv(self, mma_dv, acc_dV, acc_S, tVrP, tVrdOt, si):
        """dV += P^T dO (ring stage si), P^T the 16-bit register A operand (p_early: converted
        already)."""
        if const_expr(not self.p_early):
            tVrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, si], False, -1)

    @cute.jit
    def _step_qh(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k,
        masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """q_halves step: for each 32-query half h, S^T_h and dP^T_h (64 keys x 32 queries per
        warpgroup), P^T_h / dS^T_h, dS^T_h to its half of the dS buffer, dV and dK += over the
        half's 32 queries (A operands from registers); then dQ = dS K over the whole tile.
        Each half's dV / dK GEMMs retire at the next wait (groups retire in order)."""
        si = st.index
        hq = self.tile_m // 2
        ro, co = self._static_offsets(mma_sdp)
        row0, col0 = tScS[0, 0]
        edge = seqlen_k - n0 - row0
        q_pipe.consumer_wait(st)
        do_pipe.consumer_wait(st)
        for h in cutlass.range_constexpr(2):
            acc_S = cute.make_rmem_tensor(s_shape, Float32)
            acc_dP = cute.make_rmem_tensor(s_shape, Float32)
            gemm(mma_sdp, acc_S, tSrK, tSrQ[h][None, None, None, si], True, -1)
            gemm(mma_sdp, acc_dP, tPrV, tPrdO[h][None, None, None, si], True, -1)
            c0 = col0 + h * hq  # this half's first query column within the tile
            # the half's LSE and Dsum read while its GEMMs run (dsum_early, as in _step)
            lse = self._col_stats(sLSE, si, c0, co)
            dsum = self._col_stats(sDsum, si, c0, co)
            warpgroup.wait_group(1)
            s = rows_cols(acc_S)
            diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + c0 - row0
            if const_expr(masked):
                self._mask(s, ro, co, edge, diag)
            self._exp2(s, lse, scale_log2)
            warpgroup.wait_group(0)
            dp = rows_cols(acc_dP)
            self._ds(dp, s, dsum)
            rdS = cute.make_rmem_tensor(s_shape, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS[h])
            tVrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            tKrdS.store(acc_as_operand_a(rdS).load())
            gemm(mma_dv, acc_dV, tVrP, tVrdOt[h][None, None, None, si], False, -1)
            gemm(mma_dk, acc_dK, tKrdS, tKrQt[h][None, None, None, si], False, 0)
        # both warpgroups' dS^T in shared memory (the previous step's dQ GEMMs finished before
        # that step's dQ-empty barrier), then dQ = dS K over the whole tile
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, 0)
        q_pipe.consumer_release(st)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)

    @cute.jit
    def _step_cs(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k, tPsP,
        masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """Column-split step (tile_n = 64): this warpgroup's query columns of S^T, dP^T; P^T and
        dS^T (both halves) through shared memory; its head-dim columns of dV, dK and dQ."""
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        row0, col0 = tScS[0, 0]
        ro, co = self._static_offsets(mma_sdp)
        q_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, st.index], True, -1)
        lse = self._col_stats(sLSE, st.index, col0, co)  # stats_early
        do_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, st.index], True, -1)

        warpgroup.wait_group(1)
        s = rows_cols(acc_S)
        edge = seqlen_k - n0 - row0
        diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + col0 - row0
        if const_expr(masked):
            self._mask(s, ro, co, edge, diag)
        self._exp2(s, lse, scale_log2)
        dsum = self._col_stats(sDsum, st.index, col0, co)
        warpgroup.wait_group(0)
        # dS^T = P^T (dP^T - Dsum), fp32 P
        dp = rows_cols(acc_dP)
        self._ds(dp, s, dsum)
        rP = cute.make_rmem_tensor(s_shape, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor(s_shape, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        # P^T, dS^T -> buffer pair step % 2 (dq_split): its last readers (step - 2's GEMMs,
        # each warpgroup waits for all of its groups) finished before the other warpgroup
        # reached step - 1's consumer barrier
        b = st.index * 2 if const_expr(self.stages == 2) else step % 2 * 2
        tdSsdS = tdSsdS[None, None, None, b]
        tPsP = tPsP[None, None, None, b + 1]
        tQrdS = tQrdS[None, None, None, b]
        tKrdS = tKrdS[None, None, None, b]
        tVrP = tVrP[None, None, None, b + 1]
        cute.copy(r2s_ds, thr_r2s_ds.retile(rP), tPsP)
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS)
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        # dV, dK, then dQ (this warpgroup's columns), all waited for before the dQ staging:
        # dQ issued first and staged under dV / dK measured 0.987
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, st.index], False, -1)
        gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, st.index], False, -1)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, 0)
        q_pipe.consumer_release(st)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)

    @cute.jit
    def _mask(self, s, ro, co, edge, diag):
        """-inf into the thread's S^T elements whose key is not visible: key < Sk and (causal)
        key <= query + Sk - Sq, i.e. ro[r] < edge and ro[r] - co[c] <= diag (element (r, c) at
        static offsets ro[r], co[c] from the thread's first key / query)."""
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                visible = edge > ro[r]
                if const_expr(self.causal):
                    visible = visible and diag >= ro[r] - co[c]
                if not visible:
                    s[r, c] = -Float32.inf

    @cute.jit
    def _exp2(self, s, lse, scale_log2):
        """P^T = exp2(S^T scale log2e - LSE log2e) in place, LSE per query column. exp_groups
        g > 0: the columns in g groups, each group's scale taken as scale + 0 x (the previous
        group's first exp2), so that the assembler cannot issue all the arguments' FFMAs
        before the first MUFU (it does in the unmasked step: the MUFU queue then starts late)."""
        ncols = cute.size(s, mode=[1])
        groups = self.exp_groups if const_expr(self.exp_groups) else 1
        if const_expr(ncols % groups):
            raise ValueError(f"exp_groups {groups} does not divide the {ncols} columns")
        per = ncols // groups
        sc = scale_log2
        for g in cutlass.range_constexpr(groups):
            for c in cutlass.range_constexpr(g * per, (g + 1) * per):
                for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                    s[r, c] = cute.math.exp2(s[r, c] * sc - lse[c], fastmath=True)
            if const_expr(g + 1 < groups):
                sc = scale_log2 + s[0, g * per] * Float32(0.0)

    @cute.jit
    def _ds(self, dp, p, dsum):
        """dS^T = P^T (dP^T - Dsum) in place of dP^T, Dsum per query column."""
        for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                dp[r, c] = Float32(p[r, c]) * (dp[r, c] - dsum[c])

    def _col_stats(self, stats, stage, col0, co):
        """The per-query statistic (LSE or Dsum) of each of the thread's columns, read from
        the ring stage's shared-memory row; adjacent column pairs with one 8-byte load. Plain
        Python (unrolled while the caller is traced)."""
        row = stats[None, stage].iterator
        vals = [None] * len(co)
        for c in range(len(co)):
            if vals[c] is None:
                if c + 1 < len(co) and co[c + 1] == co[c] + 1 and co[c] % 2 == 0:
                    ptr = cute.make_ptr(
                        Float32, (row + col0 + co[c]).toint(), cute.AddressSpace.smem,
                        assumed_align=8,
                    )  # fmt: skip
                    pair = cute.make_tensor(ptr, cute.make_layout(2)).load()
                    vals[c], vals[c + 1] = pair[0], pair[1]
                else:
                    vals[c] = stats[col0 + co[c], stage]
        return vals

    def _static_offsets(self, mma_sdp):
        """Python ints: each element row's and column's offset from the thread's first one
        (the MMA's coordinate is thread part + value part; read off thread 0's slice)."""
        tn, tm = self.tile_n, self.tile_m // 2 if self.q_halves else self.tile_m
        ref = rows_cols(mma_sdp.get_slice(0).partition_C(cute.make_identity_tensor((tn, tm))))
        ro = [ref[r, 0][0] for r in range(cute.size(ref, mode=[0]))]
        co = [ref[0, c][1] for c in range(cute.size(ref, mode=[1]))]
        for v in ro + co:
            if not isinstance(v, int):
                raise TypeError("expected static coordinates for thread 0")
        return ro, co
