"""The dQ hand-over and reduction: consumers stage each step's fp32 dQ tile in shared memory,
the dQ-writer warp (warp 1 of warpgroup 0) adds it to the global workspace.

Staging (`_stage_dq`, consumer threads): wait on the buffer's EMPTY barrier, 16-byte stores
in the workspace order (`utils.dq_frag_offset`), `fence.proxy.async.shared::cta`, arrive on
FULL. Writer (`_write_dq_tile`): wait on FULL, one `cp.reduce.async.bulk .add.f32` of the
part (tile_m x D floats; dq_split: each warpgroup's half on its own barriers), wait until the
bulk op has read shared memory, arrive on EMPTY. The buffer starts empty (one arrival per
part before the first step). Deterministic: before its reduction the writer spins
(`ld.acquire.gpu`) on the (query block, head, batch) counter until the key blocks before its
own in the fixed order (`_dq_turn`) have added theirs, and bumps it (`red.release.gpu`) once
its own addition has completed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.attention.bwd.sm90.config import NUM_MMA_WG
from forgekernel.kernels.attention.bwd.sm90.roles import Bar
from forgekernel.kernels.attention.bwd.sm90.utils import DQ_VEC
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.ptx import (
    bulk_reduce_add_f32,
    fence_proxy_async_global,
    ld_acquire_gpu,
    red_release_gpu_add,
)
from forgekernel.kernels.common.sm90.scheduler import atomic


class DqReduction:
    """Both sides of the dQ hand-over (mixed into AttentionBwdSm90)."""

    def _dq_bar(self, full: bool, part):
        """(barrier id, threads) of the staging buffer's full or empty barrier for `part`:
        joint hand-over, both consumer warpgroups and the writer warp (part 0); dq_split,
        warpgroup `part` and the writer warp."""
        if const_expr(self.dq_split):
            base = Bar.DQ_FULL if full else Bar.DQ_EMPTY_SPLIT
            return base + part, THREADS_PER_WG + 32
        return Bar.DQ_FULL if full else Bar.DQ_EMPTY, self.num_mma_threads + 32

    @cute.jit
    def _stage_dq(self, acc_dQ, sdQ, tidx, wg):
        """This thread's dQ fragment -> the staging buffer, in the workspace order
        (`utils.dq_frag_offset`, DQ_VEC elements per 16-byte store), between the buffer's
        empty and full barriers (`_dq_bar`; with dq_split warpgroup wg's own, warp-uniform)."""
        tile = self.tile_m * self.head_dim
        n = cute.size(acc_dQ)
        part = wg if const_expr(self.dq_split) else 0
        bar, threads = self._dq_bar(False, part)
        cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
        off = sdQ.iterator + tidx * DQ_VEC
        stride = DQ_VEC * self.num_mma_threads
        if const_expr(self.dq_split):
            # warpgroup halves: wg * tile / 2 + (tidx % 128) * DQ_VEC (warpgroup term uniform)
            off = off + wg * (tile // 2 - THREADS_PER_WG * DQ_VEC)
            stride = DQ_VEC * THREADS_PER_WG
        base = cute.make_ptr(Float32, off.toint(), cute.AddressSpace.smem, assumed_align=4 * DQ_VEC)
        dst = cute.make_tensor(base, cute.make_layout((DQ_VEC, n // DQ_VEC), stride=(1, stride)))
        src = cute.make_tensor(acc_dQ.iterator, cute.make_layout((DQ_VEC, n // DQ_VEC)))
        dst.store(src.load())
        cute.arch.fence_view_async_shared()
        bar, threads = self._dq_bar(True, part)
        cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _write_dq(
        self, sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
        seqlen_q, seqlen_k,
    ):  # fmt: skip
        """Warp 1: drain the dQ staging buffer into the fp32 workspace (bulk reduce-add), one
        part per handing-over group (dq_split: each warpgroup's half, waited for, reduced and
        released on its own barriers; half 0 released while half 1 may still be read)."""
        self._dq_first_arrivals(num_steps)
        self._write_dq_tile(
            sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
            seqlen_q, seqlen_k,
        )  # fmt: skip
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _write_dq_persistent(
        self, sdQ, mdQacc, mSem, mK, tiles, group, num_tiles, ws, seqlen_q, seqlen_k
    ):  # fmt: skip
        """Warp 1 of a persistent CTA: every tile's dQ tiles, the staging buffer and its
        barriers going round over all of the CTA's steps."""
        lane = cute.arch.lane_idx()
        tstate = tiles.consumer_state()
        self._dq_first_arrivals(None)
        tile, tstate = atomic.take(tiles, tstate, lane)
        while tile < num_tiles:
            n_block, head_kv, batch, m_begin, m_end, _, num_steps = self._tile_work(
                tile, mK, group, seqlen_q, seqlen_k
            )
            self._write_dq_tile(
                sdQ, mdQacc, mSem, n_block, head_kv, batch, head_kv * group, m_begin, m_end,
                num_steps, ws, seqlen_q, seqlen_k,
            )  # fmt: skip
            tile, tstate = atomic.take(tiles, tstate, lane)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _dq_first_arrivals(self, num_steps):
        """The staging buffer starts empty: one arrival per part, matched by the consumers'
        first waits (persistent: always; the consumers match the last one at the end)."""
        parts = NUM_MMA_WG if const_expr(self.dq_split) else 1
        for p in cutlass.range_constexpr(parts):
            bar, threads = self._dq_bar(False, p)
            if const_expr(self.persistent):
                cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)
            else:
                if num_steps > 0:
                    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _write_dq_tile(
        self, sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
        seqlen_q, seqlen_k,
    ):  # fmt: skip
        """One tile's steps of the dQ writer."""
        tile = self.tile_m * self.head_dim
        parts = NUM_MMA_WG if const_expr(self.dq_split) else 1
        part = tile // parts
        lane = cute.arch.lane_idx()
        num_m = m_end - m_begin
        for step in cutlass.range(num_steps, unroll=1):
            head, m = self._step_coords(step, hq0, m_begin, num_m)
            gdq = mdQacc[batch, head, None].iterator + (ws * self.head_dim + m * tile)
            if const_expr(self.deterministic):
                sem = mSem[batch, head, None].iterator + (ws + m)
            for p in cutlass.range_constexpr(parts):
                bar, threads = self._dq_bar(True, p)
                cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
                if lane == 0:
                    if const_expr(self.deterministic and p == 0):
                        # this key block's turn in query block m's fixed order (_dq_turn)
                        turn = self._dq_turn(n_block, m, seqlen_q, seqlen_k)
                        seen = ld_acquire_gpu(sem)
                        while seen != turn:
                            seen = ld_acquire_gpu(sem)
                        fence_proxy_async_global()
                    bulk_reduce_add_f32(gdq + p * part, sdQ.iterator + p * part, part * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    fence_proxy_async_global()
                    red_release_gpu_add(sem, 1)
            for p in cutlass.range_constexpr(parts):
                if const_expr(not self.deterministic):
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(parts - 1 - p, read=True)
                cute.arch.sync_warp()
                bar, threads = self._dq_bar(False, p)
                if const_expr(self.persistent):
                    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)
                else:
                    if step + 1 < num_steps:
                        cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _dq_turn(self, n_block, m, seqlen_q, seqlen_k):
        """How many key blocks add to query block m's dQ before key block n_block (the
        deterministic order). Non-causal: ascending key blocks (every one sees every query
        block). Causal: descending, from the highest key block query block m sees,
        n_max(m) - 1 with n_max(m) = ceil(((m + 1) tile_m + Sk - Sq) / tile_n) clipped to the
        key blocks (the inequality of _query_blocks: key block n reaches m iff
        max(n tile_n - (Sk - Sq), 0) < (m + 1) tile_m). Key block n's first query blocks then
        have it first in line, and it trails key block n + 1 by as many steps as it starts
        after it: no waiting in the steady state (FA3's order for deterministic causal)."""
        turn = n_block
        if const_expr(self.causal):
            tm, tn = self.tile_m, self.tile_n
            n_max = ((m + 1) * tm + seqlen_k - seqlen_q + tn - 1) // tn
            n_max = cutlass.min(n_max, (seqlen_k + tn - 1) // tn)
            turn = n_max - 1 - n_block
        return turn
