"""The consumer warpgroups (warpgroups 1 and 2): operand fragments, the tile loop and the step
loop; the step itself is in `mma_step.py`, the dK / dV stores in `epilogue.py`.

Per tile: zero dK / dV, wait for K / V, run the steps (the unrolled loop with a
compile-time ring stage, or the rolled one; each step's masked body only on blocks crossing
the key edge or the causal diagonal), then dK / dV out (persistent: K / V released to the
producer after the stores). Persistent: tiles taken from the tile ring; the ring stage, the dS
buffer parity and the dQ hand-over continue across tiles.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.attention.bwd.sm90.roles import Bar
from forgekernel.kernels.common.sm90 import pipeline as pipes
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols, transposed
from forgekernel.kernels.common.sm90.scheduler import atomic


class Consumer:
    """The consumer warpgroups' loops (mixed into AttentionBwdSm90)."""

    @cute.jit
    def _consume(
        self, tidx, wg, warp_idx, mma_sdp, mma_dv, mma_dk, mma_dq,
        sQ, sdO, sK, sV, sdS, sLSE, sDsum, sdQ,
        q_pipe, do_pipe, kv_pipe, tma_dk, mdK, tma_dv, mdV,
        scale, scale_log2, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
        m_begin, m_end, m_unmasked, num_steps, mdK_gmem, mdV_gmem, k_off, persist=None,
    ):  # fmt: skip
        """Consumer warpgroup `wg` (keys 64 wg .. 64 wg + 63 of the block); tidx in [0, 256).
        persist: (tile ring, tile count, mK) of a persistent CTA, whose tiles come from the
        ring (n_block .. num_steps unused then)."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        wg_sdp = mma_sdp.get_slice(wg * THREADS_PER_WG)
        wg_dv = mma_dv.get_slice(wg * THREADS_PER_WG)
        wg_dk = mma_dk.get_slice(wg * THREADS_PER_WG)
        wg_dq = mma_dq.get_slice(wg * THREADS_PER_WG)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sdO)))
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transposed(sQ)))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        if const_expr(not self.dq_split):
            tQrdS = tQrdS[None, None, None, 0]
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))[None, None, None, 0]
        if const_expr(self.col_split):
            # P^T (stages 1, 3) and dS^T (stages 0, 2) A operands from shared memory, K-major
            # views, indexed in the step
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_A(transposed(sdS)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(transposed(sdS)))
        else:
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((tn, tm)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((tn, tm)))
        s_cols = tm // 2 if const_expr(self.q_halves) else tm
        if const_expr(self.q_halves):
            # per 32-row half of the Q / dO stages: the B operands of S^T, dP^T, dK, dV
            hq = tm // 2
            sQh = [cute.local_tile(sQ, (hq, d, self.stages), (h, 0, 0)) for h in range(2)]
            sdOh = [cute.local_tile(sdO, (hq, dv, self.stages), (h, 0, 0)) for h in range(2)]
            tSrQ = [wg_sdp.make_fragment_B(wg_sdp.partition_B(t)) for t in sQh]
            tPrdO = [wg_sdp.make_fragment_B(wg_sdp.partition_B(t)) for t in sdOh]
            tVrdOt = [wg_dv.make_fragment_B(wg_dv.partition_B(transposed(t))) for t in sdOh]
            tKrQt = [wg_dk.make_fragment_B(wg_dk.partition_B(transposed(t))) for t in sQh]
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((tn, hq)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((tn, hq)))
        s_shape = wg_sdp.partition_shape_C((tn, s_cols))
        dq_shape = wg_dq.partition_shape_C((tm, d))
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((tn, dv)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dk.partition_shape_C((tn, d)), Float32)
        # (key, query) coordinates of this thread's S^T elements, within the tile
        tScS = rows_cols(
            mma_sdp.get_slice(tidx).partition_C(cute.make_identity_tensor((tn, s_cols)))
        )
        r2s_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_sdp
        )
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        if const_expr(self.dq_split):
            # both dS buffers (column split: the two dS / P pairs)
            tdSsdS = thr_r2s_ds.partition_D(transposed(sdS))
        elif const_expr(self.q_halves):
            tdSsdS = [
                thr_r2s_ds.partition_D(
                    cute.local_tile(transposed(sdS)[None, None, 0], (tn, tm // 2), (0, h))
                )
                for h in range(2)
            ]
        else:
            tdSsdS = thr_r2s_ds.partition_D(transposed(sdS)[None, None, 0])

        consumer_bar = named_barrier(Bar.CONSUMERS, self.num_mma_threads)
        kv_state = pipes.consumer_state(1)
        st = pipes.consumer_state(self.stages)
        frags = (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS,
        )  # fmt: skip
        tile_args = (
            warp_idx, sK, sV, sdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, kv_pipe, tma_dk, mdK,
            tma_dv, mdV, scale, scale_log2, seqlen_q, seqlen_k, mdK_gmem, mdV_gmem, k_off,
            consumer_bar,
        )  # fmt: skip
        if const_expr(self.persistent):
            tiles, num_tiles, mK = persist
            lane = cute.arch.lane_idx()
            tstate = tiles.consumer_state()
            gstep = Int32(0)
            tile, tstate = atomic.take(tiles, tstate, lane)
            while tile < num_tiles:
                n_block, head_kv, batch, m_begin, m_end, m_unmasked, num_steps = self._tile_work(
                    tile, mK, group, seqlen_q, seqlen_k
                )
                kv_state, st = self._consume_tile(
                    frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
                    m_unmasked, num_steps, gstep,
                )  # fmt: skip
                gstep += num_steps
                tile, tstate = atomic.take(tiles, tstate, lane)
            # the dQ writer's last arrival is matched here
            bar, threads = self._dq_bar(False, wg if const_expr(self.dq_split) else 0)
            cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
        else:
            self._consume_tile(
                frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
                m_unmasked, num_steps, 0,
            )  # fmt: skip

    @cute.jit
    def _consume_tile(
        self, frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
        m_unmasked, num_steps, gstep,
    ):  # fmt: skip
        """One key block's steps and its dK / dV (persistent: K / V released once the dK / dV
        stores have read them). gstep: the CTA's steps before this tile (persistent), so that
        the dS buffer parity follows all of them (the ring stage is carried in `st`)."""
        (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS,
        ) = frags  # fmt: skip
        (
            warp_idx, sK, sV, sdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, kv_pipe, tma_dk, mdK,
            tma_dv, mdV, scale, scale_log2, seqlen_q, seqlen_k, mdK_gmem, mdV_gmem, k_off,
            consumer_bar,
        ) = tile_args  # fmt: skip
        tn = self.tile_n
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        n0 = n_block * tn
        key_edge = n0 + tn > seqlen_k
        kv_pipe.consumer_wait(kv_state)
        step_args = (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
            scale_log2, n0, seqlen_q, seqlen_k,
        )  # fmt: skip
        # The steps; their query block m (_step_coords) carried instead of divided every step.
        step_fn, extra = self._step, ()
        if const_expr(self.col_split):
            step_fn, extra = self._step_cs, (tdSsdS,)  # P^T: the odd buffers of the four
        elif const_expr(self.q_halves):
            step_fn = self._step_qh
        m = self._first_m(m_begin, m_end)
        if const_expr(self.static_stage):
            # Unrolled by the ring depth: step0 + j sits in ring stage j (the ring starts at
            # stage 0 and advances once per step; not persistent, so one tile per CTA).
            for step0 in cutlass.range(0, num_steps, self.stages, unroll=1):
                for j in cutlass.range_constexpr(self.stages):
                    step = step0 + j
                    if step < num_steps:
                        self._run_step(step_fn, st, step, m, step_args, extra, key_edge,
                                       m_unmasked, j)  # fmt: skip
                        st.advance()
                        m = self._next_m(m, m_begin, m_end)
        else:
            for step in cutlass.range(num_steps, unroll=1):
                self._run_step(step_fn, st, gstep + step, m, step_args, extra, key_edge,
                               m_unmasked)  # fmt: skip
                st.advance()
                m = self._next_m(m, m_begin, m_end)

        if const_expr(self.head_split):
            self._reduce_dkv(
                tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK_gmem, mdV_gmem, scale, n_block,
                head_kv, batch, seqlen_k,
            )  # fmt: skip
        elif const_expr(self.persistent):
            # dK / dV through the K / V buffers; each warp releases them once past the
            # stores (the storing warp after the TMA has read them)
            self._store_dkv(
                tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
                scale, n_block, head_kv, batch, consumer_bar, 0,
            )  # fmt: skip
            kv_pipe.consumer_release(kv_state)
            kv_state.advance()
        elif const_expr(self.varlen):
            if key_edge:
                self._store_dkv_rows(
                    tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK_gmem, mdV_gmem, scale,
                    n_block, head_kv, seqlen_k, k_off,
                )  # fmt: skip
            else:
                self._store_dkv(
                    tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK,
                    tma_dv, mdV, scale, n_block, head_kv, batch, consumer_bar, k_off,
                )  # fmt: skip
        else:
            self._store_dkv(
                tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
                scale, n_block, head_kv, batch, consumer_bar, 0,
            )  # fmt: skip
        return kv_state, st

    @cute.jit
    def _run_step(
        self, step_fn, st, step, m, step_args, extra, key_edge, m_unmasked,
        stage: cutlass.Constexpr = None,
    ):  # fmt: skip
        """One step through `step_fn`, its masked body when the block crosses the key edge or
        (causal) the diagonal, else the unmasked one."""
        masked = key_edge
        if const_expr(self.causal):
            masked = masked or m < m_unmasked
        stage_arg = () if const_expr(stage is None) else (stage,)
        if masked:
            step_fn(st, step, m, *step_args, *extra, True, *stage_arg)
        else:
            step_fn(st, step, m, *step_args, *extra, False, *stage_arg)
