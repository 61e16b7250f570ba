"""Gated DeltaNet backward, kernel 0 (the chunk factors), `wg2`: the chunk's products on two
math warpgroups split by independent products (docs/linear_attention/NOTES.md "GDN backward
factors kernel on two math warpgroups"). The one-math-warpgroup kernel (factors.py) runs the
whole chain on one warp a scheduler; here the inverse's chain and the products that do not
need T run side by side:

    warpgroup 1: the gates (its warp 0), K K^T -> A -> T (the inverse), T^T, u = [T diag(beta)] V
    warpgroup 2: Q K^T -> P^T, Ke, Qe (under Q K^T), then W = [T diag(beta e^G)] K from T

T reaches warpgroup 2 through the inverse's fp32 scratch (sW, final after the merges' last
barrier; nothing writes it after): warpgroup 1 arrives at BAR_T, warpgroup 2 waits there and
reads T from sW as warpgroup 1 does. Every product, mask, scaling and conversion is
`GdnBwdFactorsSm90`'s, on the same operands in the same order, on a warpgroup's own thread
index (the accumulator partitions are the warpgroup's): the same outputs bit for bit.

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: under the launch's 168 registers a
thread): warpgroup 0 as before (the TMA warp); warpgroups 1, 2 as above, each issuing its own
TMA stores (bulk groups are the issuing thread's: warpgroup 1's first thread T^T, then u;
warpgroup 2's P^T, Ke, Qe, then W) and waiting its own groups' shared-memory reads before
the exit.

Named barriers: BAR_GATES (256: the gates in shared memory, every math warp waits at one
instruction, warpgroup 1's warp 0 after writing them: so warpgroup 1's four warps reach the
inverse's barriers having waited equally often, which racecheck needs), BAR_T (256: warpgroup 1
arrives, warpgroup 2 waits), BAR_INVERSE (warpgroup 1's merges, as before), BAR_MATH /
BAR_MATH2 (128, each warpgroup's own: its tiles written before its stores). Every phase is
waited at one instruction (no unaligned-barrier case)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.config import CHUNK, WG2_THREADS
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.factors import (
    BAR_INVERSE,
    BAR_MATH,
    GdnBwdFactorsSm90,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma

BAR_T = BAR_INVERSE + 1  # T final in sW: warpgroup 1 arrives, warpgroup 2 waits (256)
BAR_GATES = BAR_INVERSE + 2  # the gates in shared memory: warps 4..11 wait, 4 after writing
BAR_MATH2 = BAR_INVERSE + 3  # warpgroup 2's own (128): its tiles written before its stores
MATH_PAIR = 2 * THREADS_PER_WG
LEADER = (THREADS_PER_WG, 2 * THREADS_PER_WG)  # each math warpgroup's storing thread


class GdnBwdFactorsWg2Sm90(GdnBwdFactorsSm90):
    """`GdnBwdFactorsSm90` on two math warpgroups by independent products (module
    docstring)."""

    threads = WG2_THREADS

    @cute.jit
    def _math_roles(self, mma_aux, mma_rs, sQ, sK, sV, outs, sPt, sTt, gates, sW, sX, mG,
                    mBeta, mElast, mBigG, bars, tiles, c, hv, b):  # fmt: skip
        if opaque_tid_x() < THREADS_PER_WG + WARP_SIZE:
            self._gates(gates, mG, mBeta, mElast, mBigG, c, hv, b)
        # every math warp waits, the gates' warp too: racecheck orders two threads' accesses by
        # the bar.syncs each has waited at (an arrive counts for nothing), and warpgroup 1's
        # warps hand blocks to each other at BAR_INVERSE (NOTES "next/fac-race")
        named_barrier(BAR_GATES, MATH_PAIR).arrive_and_wait()
        wg = cute.arch.make_warp_uniform(opaque_tid_x() // THREADS_PER_WG)
        if wg == 1:
            self._t_and_u(mma_aux, mma_rs, sK, sV, outs[1], sTt, gates, sW, sX, bars, tiles,
                          c, hv, b)  # fmt: skip
        else:
            self._p_and_w(mma_aux, mma_rs, sQ, sK, outs, sPt, gates, sW, bars, tiles, c, hv, b)

    @cute.jit
    def _t_and_u(self, mma_aux, mma_rs, sK, sV, s_u, sTt, gates, sW, sX, bars, tiles, c, hv,
                 b):  # fmt: skip
        """Warpgroup 1: A = beta_i d_ij (K K^T) -> T in sW (BAR_T after the merges), T^T out,
        u = [T diag(beta)] V out."""
        sG2, sBeta, _ = gates
        cute.arch.mbarrier_wait(bars + 0, 0)  # k
        wg_a = mma_aux.get_slice(0)
        tSrKa = wg_a.make_fragment_A(wg_a.partition_A(sK))
        tSrKb = wg_a.make_fragment_B(wg_a.partition_B(sK))
        acc_shape = wg_a.partition_shape_C((CHUNK, CHUNK))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        gemm(mma_aux, acc, tSrKa[None, None, None, 0], tSrKb[None, None, None, 0], True, 0)
        atid = opaque_tid_x() - THREADS_PER_WG
        coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
        self._decay_mask(acc, coords, sG2, sBeta, sG2, 0, Float32(1.0), True)
        tWsW = mma_aux.get_slice(atid).partition_C(sW)
        tWsW.store(acc.load())
        cute.arch.sync_warp()
        invert_diagonal(sW, atid)
        invert_merge_mma(sW, sX, atid, named_barrier(BAR_INVERSE, THREADS_PER_WG))
        named_barrier(BAR_T, MATH_PAIR).arrive()  # T final in sW (the merges' last barrier)
        acc.store(tWsW.load())
        self._store_tile(acc, mma_aux, sTt, True)  # T^T
        self._store_group((tiles["tt"],), c, hv, b, BAR_MATH, LEADER[0])
        wg_r = mma_rs.get_slice(0)
        self._scale_by_beta(acc, coords, sBeta, 0)
        tUrA = wg_r.make_fragment_A(wg_r.partition_shape_A((CHUNK, CHUNK)))
        acc_to_operand_a(acc, tUrA)
        acc_u = cute.make_rmem_tensor(wg_r.partition_shape_C((CHUNK, self.v)), Float32)
        tBrV = wg_r.make_fragment_B(wg_r.partition_B(transposed(sV)))
        cute.arch.mbarrier_wait(bars + 2, 0)  # v
        gemm(mma_rs, acc_u, tUrA, tBrV[None, None, None, 0], True, 0)
        self._store_tile(acc_u, mma_rs, s_u, False)
        self._store_group((tiles["u"],), c, hv, b, BAR_MATH, LEADER[0])
        if opaque_tid_x() == LEADER[0]:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _p_and_w(self, mma_aux, mma_rs, sQ, sK, outs, sPt, gates, sW, bars, tiles, c, hv, b):
        """Warpgroup 2: P = d_ij (Q K^T) with Ke, Qe under its WGMMAs, P^T, Ke, Qe out; after
        BAR_T, W = [T diag(beta e^G)] K (T from sW) out."""
        sG2, sBeta, sBetaEg = gates
        s_w, _, s_ke, s_qe = outs
        cute.arch.mbarrier_wait(bars + 0, 0)  # k
        cute.arch.mbarrier_wait(bars + 1, 0)  # q
        wg_a = mma_aux.get_slice(0)
        tSrQ = wg_a.make_fragment_A(wg_a.partition_A(sQ))
        tSrKb = wg_a.make_fragment_B(wg_a.partition_B(sK))
        acc_shape = wg_a.partition_shape_C((CHUNK, CHUNK))
        acc_p = cute.make_rmem_tensor(acc_shape, Float32)
        gemm(mma_aux, acc_p, tSrQ[None, None, None, 0], tSrKb[None, None, None, 0], True, -1)
        atid = opaque_tid_x() - 2 * THREADS_PER_WG
        # Ke, Qe: the loaded rows times their decays
        out_shape = mma_rs.get_slice(0).partition_shape_C((CHUNK, self.k))
        t0, row_base, _ = softmax.acc_coords(mma_rs, atid, (CHUNK, self.k))
        g_last = sG2[CHUNK - 1, 0]
        e_end, e_g = [], []
        for r in cutlass.range_constexpr(2):
            g_i = sG2[row_base + t0[r, 0][0], 0]
            e_end.append(cute.math.exp2(g_last - g_i, fastmath=True))
            e_g.append(cute.math.exp2(g_i, fastmath=True))
        self._scaled_rows(mma_rs, atid, sK, s_ke, e_end, out_shape)
        self._scaled_rows(mma_rs, atid, sQ, s_qe, e_g, out_shape)
        cute.arch.fence_view_async_shared()
        warpgroup.wait_group(0)
        coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
        self._decay_mask(acc_p, coords, sG2, sBeta, sG2, 0, Float32(1.0), False)
        self._store_tile(acc_p, mma_aux, sPt, True)  # P^T
        self._store_group((tiles["pt"], tiles["ke"], tiles["qe"]), c, hv, b, BAR_MATH2,
                          LEADER[1])  # fmt: skip
        named_barrier(BAR_T, MATH_PAIR).arrive_and_wait()  # T final in sW
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        acc.store(mma_aux.get_slice(atid).partition_C(sW).load())
        self._scale_by_beta(acc, coords, sBetaEg, 0)
        wg_r = mma_rs.get_slice(0)
        tWrA = wg_r.make_fragment_A(wg_r.partition_shape_A((CHUNK, CHUNK)))
        acc_to_operand_a(acc, tWrA)
        acc_w = cute.make_rmem_tensor(out_shape, Float32)
        tBrK = wg_r.make_fragment_B(wg_r.partition_B(transposed(sK)))
        gemm(mma_rs, acc_w, tWrA, tBrK[None, None, None, 0], True, 0)
        self._store_tile(acc_w, mma_rs, s_w, False)
        self._store_group((tiles["w"],), c, hv, b, BAR_MATH2, LEADER[1])
        if opaque_tid_x() == LEADER[1]:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
