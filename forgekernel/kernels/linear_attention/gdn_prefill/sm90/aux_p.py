"""The aux warpgroup of the chunked kernel's `t_pre` form (mixed into GdnChunkedFwdSm90): T
diag(beta) comes from the precompute (`t_pre.py`) through the T ring (producer warp -> state
warpgroups), so per chunk only what needs q: Q K^T, its mask and decays, the row norms
(l2norm) and the state warpgroups' per-token tables (`AuxWy`'s, called as they are). With the
`no_o` key the tables only (no Q K^T, no P; with l2norm k's row norms alone: no q)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import warpgroup

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import consumer_state, producer_state
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    QK_STAGES,
    STAGES,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import (
    Bar,
    aux_barrier_id,
    gate_warp_witnesses_qk,
)


class AuxP:
    """Q K^T, P and the tables (the `t_pre` form's warpgroup 1; AuxWy supplies the masks)."""

    @cute.jit
    def _aux_p(
        self, mma_aux, sQ, sK, sP, sG, sBeta, sTab, sNorm, qk_pipe, gate_pipe, aux_pipe, scale,
        nchunks, a,
    ):  # fmt: skip
        """Chunks a, a + aux_wgs, ... (`AuxWy._aux`'s ring states and hand-offs, less L, the
        inverse and T)."""
        wg_thr = mma_aux.get_slice(0)
        tSrQ = wg_thr.make_fragment_A(wg_thr.partition_A(sQ))
        tSrKb = wg_thr.make_fragment_B(wg_thr.partition_B(sK))
        acc_shape = wg_thr.partition_shape_C((CHUNK, CHUNK))
        bar = named_barrier(Bar.AUX, THREADS_PER_WG)
        ld = consumer_state(QK_STAGES)
        gt = consumer_state(STAGES)
        ax = producer_state(STAGES)
        first = 0
        witness = gate_warp_witnesses_qk(self.aux_wgs)
        if const_expr(self.aux_wgs > 1):
            bar = named_barrier(aux_barrier_id(a), THREADS_PER_WG)
            ld.advance(a)
            gt.advance(a)
            ax.advance(a)
            first = a
        for _ in cutlass.range(first, nchunks, self.aux_wgs, unroll=1):
            atid = opaque_tid_x() - THREADS_PER_WG * (1 + a)
            if const_expr(witness):
                gate_pipe.consumer_wait(gt)
            qk_pipe.consumer_wait(ld)
            acc_p = cute.make_rmem_tensor(acc_shape, Float32)
            if const_expr(not self.no_o):
                gemm(mma_aux, acc_p, tSrQ[None, None, None, ld.index],
                     tSrKb[None, None, None, ld.index], True, -1)  # fmt: skip
            if const_expr(not witness):
                gate_pipe.consumer_wait(gt)
            if const_expr(self.l2norm):
                self._row_norm(atid, sQ, sK, sG, sNorm, ld.index, gt.index)
                bar.arrive_and_wait()  # every row's norms before the mask reads them
            if const_expr(not self.no_o):
                coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
                warpgroup.wait_group(0)
            qk_pipe.consumer_release(ld)
            if const_expr(not self.no_o):
                self._decay_mask(acc_p, coords, sG, sBeta, sNorm, gt.index, scale, False)
            aux_pipe.producer_acquire(ax)
            if atid < CHUNK:
                self._tables(atid, sG, sNorm, sTab, gt.index, ax.index, scale)
            if const_expr(not self.no_o):  # P, read by the state's O^T += U^T P^T
                self._store_p(mma_aux, acc_p, sP, ax.index, atid, acc_shape)
            gate_pipe.consumer_release(gt)
            aux_pipe.producer_commit(ax)
            ld.advance(self.aux_wgs)
            gt.advance(self.aux_wgs)
            ax.advance(self.aux_wgs)

    @cute.jit
    def _store_p(self, mma_aux, acc_p, sP, s, atid, acc_shape):
        """P (the masked Q K^T) -> 16 bits -> stmatrix into the aux ring's stage s, fenced for
        the state's WGMMA (async proxy)."""
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_aux
        )
        thr_r2s = r2s.get_slice(atid)
        r_p = cute.make_rmem_tensor(acc_shape, self.dtype)
        r_p.store(acc_p.load().to(self.dtype))
        cute.copy(r2s, thr_r2s.retile(r_p), thr_r2s.partition_D(sP[None, None, s]))
        cute.arch.fence_view_async_shared()  # stmatrix (generic) -> WGMMA (async proxy)
