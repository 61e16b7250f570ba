"""The producer warp (warp 0 of warpgroup 0): TMA loads.

Per tile: K and V once (one-stage `kv_pipe`, released by the consumers after the tile's dK /
dV), then per step the Q tile with its LSE row slice (`q_pipe`) and the dO tile with its Dsum
slice (`do_pipe`): TMA for Q / dO, a 1-D bulk copy for the fp32 statistics, completing on the
same stage's mbarrier. Persistent: the tiles come from the global counter
(`scheduler.atomic`), each published on the tile ring before its loads; a tile's first Q / dO
stage is issued before its K / V (that stage frees first).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from forgekernel.kernels.common.sm90 import pipeline as pipes
from forgekernel.kernels.common.sm90.ptx import bulk_g2s
from forgekernel.kernels.common.sm90.scheduler import atomic


class Producer:
    """Warp 0's loads (mixed into AttentionBwdSm90)."""

    @cute.jit
    def _produce(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe,
        n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
    ):  # fmt: skip
        """Warp 0: K and V once, then per step Q + LSE and dO + Dsum."""
        kv_state = pipes.producer_state(1)
        st = pipes.producer_state(self.stages)
        self._produce_tile(
            tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
            sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
            n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
        )  # fmt: skip

    @cute.jit
    def _produce_persistent(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum, mSem,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, tiles,
        group, num_tiles, seqlen_q, seqlen_k, offs,
    ):  # fmt: skip
        """Warp 0 of a persistent CTA: takes the tiles (mSem[0, 0, 0] is the counter),
        publishes each on the tile ring and issues its loads."""
        lane = cute.arch.lane_idx()
        n_ctas = cute.arch.grid_dim()[0]
        ctr = mSem[0, 0, None].iterator
        kv_state = pipes.producer_state(1)
        st = pipes.producer_state(self.stages)
        tstate = tiles.producer_state()
        tile = atomic.first_tile()
        while tile < num_tiles:
            tstate = atomic.publish(tiles, tstate, tile, lane)
            n_block, head_kv, batch, m_begin, m_end, _, num_steps = self._tile_work(
                tile, mK, group, seqlen_q, seqlen_k
            )
            kv_state, st = self._produce_tile(
                tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
                sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
                n_block, head_kv, batch, head_kv * group, m_begin, m_end, num_steps, offs,
            )  # fmt: skip
            # the next tile, taken once this one's loads are all issued (about the ring
            # depth before its consumers finish)
            tile = atomic.next_tile(ctr, lane, n_ctas)
        tstate = atomic.publish(tiles, tstate, num_tiles, lane)

    @cute.jit
    def _load_kv(
        self, tma_k, tma_v, mK, mV, sK, sV, kv_pipe, kv_state, n_block, head_kv, batch, k_off
    ):  # fmt: skip
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        one = cute.make_layout(1)
        gK = cute.local_tile(self._seq(mK[None, None, head_kv, batch], k_off), (tn, d), (None, 0))
        gV = cute.local_tile(self._seq(mV[None, None, head_kv, batch], k_off), (tn, dv), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        kv_pipe.producer_acquire(kv_state)
        bar = kv_pipe.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK[(None, n_block)], tKsK[(None, 0)], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV[(None, n_block)], tVsV[(None, 0)], tma_bar_ptr=bar)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _produce_tile(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
        n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
    ):  # fmt: skip
        """One tile's loads: K and V, then per step Q + LSE and dO + Dsum (persistent: K and V
        after the first step's Q and dO, whose ring stage frees first)."""
        tm, d, dv = self.tile_m, self.head_dim, self.head_dim_v
        q_off, k_off, ws = offs
        one = cute.make_layout(1)
        kv_args = (tma_k, tma_v, mK, mV, sK, sV, kv_pipe)
        kv_coords = (n_block, head_kv, batch, k_off)
        if const_expr(not self.persistent):
            kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)

        num_m = m_end - m_begin
        for step in cutlass.range(num_steps, unroll=1):
            head, m = self._step_coords(step, hq0, m_begin, num_m)
            gQ = cute.local_tile(self._seq(mQ[None, None, head, batch], q_off), (tm, d), (None, 0))
            gdO = cute.local_tile(
                self._seq(mdO[None, None, head, batch], q_off), (tm, dv), (None, 0)
            )
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
            )
            q_pipe.producer_acquire(st)
            bar_q = q_pipe.producer_get_barrier(st)
            cute.copy(tma_q, tQgQ[(None, m)], tQsQ[(None, st.index)], tma_bar_ptr=bar_q)
            with cute.arch.elect_one():
                bulk_g2s(
                    sLSE[None, st.index].iterator,
                    mLSE2[batch, head, None].iterator + (ws + m * tm),
                    tm * 4,
                    bar_q,
                )
            do_pipe.producer_acquire(st)
            bar_do = do_pipe.producer_get_barrier(st)
            cute.copy(tma_do, tdOgdO[(None, m)], tdOsdO[(None, st.index)], tma_bar_ptr=bar_do)
            with cute.arch.elect_one():
                bulk_g2s(
                    sDsum[None, st.index].iterator,
                    mDsum[batch, head, None].iterator + (ws + m * tm),
                    tm * 4,
                    bar_do,
                )
            st.advance()
            if const_expr(self.persistent):
                if step == 0:
                    kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)
        if const_expr(self.persistent):
            if num_steps == 0:
                kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)
        return kv_state, st
