"""The state warpgroups of the chunked prefill kernel (mixed into GdnChunkedFwdSm90).

State warpgroup w of the CTA holds value rows [64 b, 64 b + 64) of S^T (V, K) as an fp32 WGMMA
accumulator for the whole sequence, b = `config.value_row_block(part, w, state warpgroups)`
(part: the CTA's share of a V split; its v tile holds only its own value columns). Per chunk
(A operands from registers, B from shared memory; the factor tables from the aux warpgroup):

    X^T, O^T = S^T K^T, S^T Q^T                 one commit group, S^T as a 16-bit A operand
    X^T     <- V^T - X^T diag(fK)               V^T read from the v tile (transposed view)
    O^T     <- O^T diag(fQ)
    U^T      = X^T (T diag(beta))^T             waited for at once (the next two read it)
    O^T     += U^T P^T
    S^T     <- 2^G2_C S^T + [U^T diag(fU)] K     K as an MN-major B (the k tile transposed)

then O^T -> 16 bits -> transposed stmatrix into this warpgroup's O tile (token-major, two
alternating) -> the rows inside the sequence to global memory, 16 bytes a thread and copy.
The `t_pre` form (`o_warp`: its key without state_lds; the standard form's `o_warp` key
likewise) reads V^T by transposed ldmatrix and hands the O tile to warpgroup 0's O warp through
an mbarrier pair a tile (`_hand_o`, `_drain_o`: a TMA store a whole chunk), its
thread-dependent views hoisted out of the loop. Both t_pre forms (the T ring's) and the `o_warp`
standard form release the v stage after U^T, once every V^T load has been read, not after the
corrections (NOTES, "t_pre failed on the H100"). The `no_o` key (t_pre form, the segmented
path's pass B) forms no O: X^T, U^T and the update only.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import consumer_state
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    QK_STAGES,
    ROWS_PER_STATE_WG,
    STAGES,
    V_STAGES,
    value_row_block,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import Bar

ROWS = ROWS_PER_STATE_WG
VEC = 8  # 16-bit elements per 16-byte copy of the O epilogue


class StateWg:
    """The state recurrence and the outputs (warpgroups 2 and 3)."""

    @cute.jit
    def _state(
        self, w, stid, mma_ks, mma_st, sQ, sK, sV, sP, sT, sTab, sO, mInit, mFinal, mO,
        qk_pipe, v_pipe, aux_pipe, hv, part, n, bos, seqlen, nchunks, t_pipe=None, o_ring=None,
    ):  # fmt: skip
        """t_pipe: the T ring of the `t_pre` form (T diag(beta) loaded by TMA: waited for just
        before U^T, released once U^T is complete), or None (T from the aux ring's stage).
        o_ring: the O warp's hand-off (`o_warp`), (full, empty) mbarrier pointers (`_hand_o`), or
        None (the rows stored by this warpgroup, `_store_o`)."""
        blk = value_row_block(part, w, self.state_wgs)  # this warpgroup's 64 rows of S^T
        thr_st = mma_st.get_slice(stid)
        acc_st = cute.make_rmem_tensor(thr_st.partition_shape_C((ROWS, self.k)), Float32)
        if const_expr(self.initial_state):
            self._state_io(mInit, acc_st, thr_st, n, hv, blk, True)
        else:
            acc_st.fill(0.0)
        # Operand descriptors are warpgroup-uniform; thread-dependent views (V^T and stmatrix
        # addresses, coordinates) are rebuilt each chunk from a threadIdx the compiler may not
        # hoist (hoisted, they are live registers across the loop: spills at 192). The t_pre
        # form (o_warp) hoists them: without the O rows' global addresses they fit (0 spills at 192;
        # its state loop 562 -> 506 SASS instructions, bf16). More registers for the state
        # (aux 80, state 200) bought 3 instructions more: the split stays 24 / 104 / 192.
        wg_ks = mma_ks.get_slice(0)
        wg_st = mma_st.get_slice(0)
        acc_shape = wg_ks.partition_shape_C((ROWS, CHUNK))
        tSrS = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, self.k)))
        tXrX = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tUrU = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tUrUd = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tBrK = wg_ks.make_fragment_B(wg_ks.partition_B(sK))
        tBrQ = wg_ks.make_fragment_B(wg_ks.partition_B(sQ))
        tBrT = wg_ks.make_fragment_B(wg_ks.partition_B(sT))
        tBrP = wg_ks.make_fragment_B(wg_ks.partition_B(sP))
        tBrKt = wg_st.make_fragment_B(wg_st.partition_B(transposed(sK)))
        sVt = transposed(sV)  # (V, C, stages)
        out_bar = pipeline.NamedBarrier(barrier_id=int(Bar.OUT) + w, num_threads=THREADS_PER_WG)
        ld = consumer_state(QK_STAGES)
        vs = consumer_state(V_STAGES)
        ax = consumer_state(STAGES)
        ts = consumer_state(STAGES) if const_expr(t_pipe is not None) else None
        for c in cutlass.range(nchunks, unroll=1):
            acc_x = cute.make_rmem_tensor(acc_shape, Float32)
            acc_o = cute.make_rmem_tensor(acc_shape, Float32)
            acc_u = cute.make_rmem_tensor(acc_shape, Float32)
            qk_pipe.consumer_wait(ld)
            acc_to_operand_a(acc_st, tSrS)
            gemm(mma_ks, acc_x, tSrS, tBrK[None, None, None, ld.index], True, -1)
            if const_expr(not self.no_o):
                gemm(mma_ks, acc_o, tSrS, tBrQ[None, None, None, ld.index], True, -1)
            aux_pipe.consumer_wait(ax)
            v_pipe.consumer_wait(vs)
            cute.nvgpu.warpgroup.wait_group(0)
            tid = stid
            if const_expr(not self.o_warp):
                tid = opaque_tid_x() % THREADS_PER_WG
            coords = softmax.acc_coords(mma_ks, tid, (ROWS, CHUNK))
            vt = cute.local_tile(sVt[None, None, vs.index], (ROWS, CHUNK), (w, 0))
            r_v = self._load_vt(mma_ks, vt, tid, acc_shape, self.o_warp)
            self._correct(acc_x, None if const_expr(self.no_o) else acc_o, r_v, coords, sTab,
                          ax.index)  # fmt: skip
            if const_expr(t_pipe is None and not self.o_warp):
                v_pipe.consumer_release(vs)  # v consumed: its stage may load chunk c + 2
            acc_to_operand_a(acc_x, tXrX)
            if const_expr(t_pipe is None):
                gemm(mma_ks, acc_u, tXrX, tBrT[None, None, None, ax.index], True, 0)
                if const_expr(self.o_warp):  # the LDSM V^T: released as the t_pre forms do
                    v_pipe.consumer_release(vs)
            else:
                t_pipe.consumer_wait(ts)
                gemm(mma_ks, acc_u, tXrX, tBrT[None, None, None, ts.index], True, 0)
                t_pipe.consumer_release(ts)
                # v released once U^T, built from V^T, has completed: released after _correct,
                # ptxas hoisted the arrive over the T ring's wait to right behind the V^T loads
                # (3 of 4 LDSM, or 3 of 32 LDS.U16 with state_lds, still in flight), leaving
                # their reads' order against the producer's next box into the stage to the
                # hardware (NOTES, "t_pre failed on the H100"; the standard form reads them all
                # first). The stage is needed again two chunks on.
                v_pipe.consumer_release(vs)
            if const_expr(not self.no_o):
                acc_to_operand_a(acc_u, tUrU)
                gemm(mma_ks, acc_o, tUrU, tBrP[None, None, None, ax.index], False, -1)
            self._scale_by_table(acc_u, coords, sTab, 2, ax.index)
            acc_to_operand_a(acc_u, tUrUd)
            acc_st.store(acc_st.load() * sTab[0, 3, ax.index])
            gemm(mma_st, acc_st, tUrUd, tBrKt[None, None, None, ld.index], False, 0)
            qk_pipe.consumer_release(ld)
            aux_pipe.consumer_release(ax)
            if const_expr(self.no_o):
                pass  # no o (the `no_o` key)
            elif const_expr(o_ring is None):
                self._store_o(acc_o, mma_ks, sO, mO, out_bar, w, blk, tid, hv, bos, c, seqlen)
            else:
                self._hand_o(acc_o, mma_ks, sO, o_ring, w, tid, c)
            ld.advance()
            vs.advance()
            ax.advance()
            if const_expr(t_pipe is not None):
                ts.advance()
        self._state_io(mFinal, acc_st, thr_st, n, hv, blk, False)

    @cute.jit
    def _load_vt(self, mma_ks, vt, tid, acc_shape, ldsm: cutlass.Constexpr[bool]):
        """This warpgroup's V^T (64 value rows, C tokens) in the accumulator layout, fp32.
        ldsm (the `t_pre` form's, `o_warp`): 4 transposed ldmatrix a thread (the v tile is
        token-major, so the accumulator's column pairs are two tokens: 16-bit loads by element
        otherwise, 32 LDS.U16 a thread and their addresses, ~150 cycles of a state warp's chain
        a chunk by scripts/sass_warp_model.py); the same values either way."""
        r_v = cute.make_rmem_tensor(acc_shape, Float32)
        if const_expr(ldsm):
            s2r = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(True, 4), self.dtype),
                mma_ks,
            )
            thr = s2r.get_slice(tid)
            r_v16 = cute.make_rmem_tensor(acc_shape, self.dtype)
            cute.copy(s2r, thr.partition_S(vt), thr.retile(r_v16))
            r_v.store(r_v16.load().to(Float32))
        else:
            r_v.store(mma_ks.get_slice(tid).partition_C(vt).load().to(Float32))
        return r_v

    @cute.jit
    def _correct(self, acc_x, acc_o, r_v, coords, sTab, s):
        """X^T <- V^T - X^T diag(fK), O^T <- O^T diag(fQ) (acc_o None: X^T only)."""
        t0, _, col_base = coords
        x = rows_cols(acc_x)
        v = rows_cols(r_v)
        if const_expr(acc_o is None):
            for c in cutlass.range_constexpr(cute.size(x, mode=[1])):
                fk = sTab[col_base + t0[0, c][1], 0, s]
                for r in cutlass.range_constexpr(cute.size(x, mode=[0])):
                    x[r, c] = v[r, c] - x[r, c] * fk
        else:
            o = rows_cols(acc_o)
            for c in cutlass.range_constexpr(cute.size(x, mode=[1])):
                j = col_base + t0[0, c][1]
                fk = sTab[j, 0, s]
                fq = sTab[j, 1, s]
                for r in cutlass.range_constexpr(cute.size(x, mode=[0])):
                    x[r, c] = v[r, c] - x[r, c] * fk
                    o[r, c] = o[r, c] * fq

    @cute.jit
    def _scale_by_table(self, acc, coords, sTab, table: cutlass.Constexpr[int], s):
        t0, _, col_base = coords
        a = rows_cols(acc)
        for c in cutlass.range_constexpr(cute.size(a, mode=[1])):
            f = sTab[col_base + t0[0, c][1], table, s]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, c] = a[r, c] * f

    @cute.jit
    def _store_o(self, acc_o, mma_ks, sO, mO, out_bar, w, blk, stid, hv, bos, c, seqlen):
        """O^T -> 16 bits -> this warpgroup's O tile c % 2 (transposed stmatrix: token-major)
        -> its rows < the chunk's valid length to global memory (value columns 64 blk ..).
        The tile written two chunks ago was read before this chunk's barrier."""
        r_o = cute.make_rmem_tensor(acc_o.shape, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        buf = 2 * w + c % 2
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.dtype), mma_ks
        )
        thr_r2s = r2s.get_slice(stid)
        # the (value, token) view of the token-major tile
        cute.copy(r2s, thr_r2s.retile(r_o), thr_r2s.partition_D(transposed(sO[None, None, buf])))
        out_bar.arrive_and_wait()
        valid = cutlass.min(seqlen - c * CHUNK, CHUNK)
        self._copy_o_rows(sO[None, None, buf], mO, stid, THREADS_PER_WG, valid, hv,
                          bos + c * CHUNK, blk)  # fmt: skip

    @cute.jit
    def _hand_o(self, acc_o, mma_ks, sO, o_ring, w, stid, c):
        """t_pre: O^T -> 16 bits -> this warpgroup's O tile c % 2 (as `_store_o`), handed to the
        O warp (`_drain_o`) by an mbarrier: no named barrier, no LDS / STG and no global
        addresses on the state chain (~0.5 k cycles of a state warp's ~1.7 k a chunk alone, by
        scripts/sass_warp_model.py). The tile's previous use (chunk c - 2) is waited for
        first: its empty phase completes once the O warp has read it."""
        full, empty = o_ring
        buf = 2 * w + c % 2
        cute.arch.mbarrier_wait(empty + buf, (c // 2) % 2 ^ 1)
        r_o = cute.make_rmem_tensor(acc_o.shape, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.dtype), mma_ks
        )
        thr_r2s = r2s.get_slice(stid)
        cute.copy(r2s, thr_r2s.retile(r_o), thr_r2s.partition_D(transposed(sO[None, None, buf])))
        cute.arch.fence_proxy("async.shared", space="cta")  # the TMA store reads it
        cute.arch.mbarrier_arrive(full + buf)

    @cute.jit
    def _drain_o(self, tma_o, mO4, mO, sO, o_ring, hv, part, bos, seqlen, nchunks):
        """t_pre, warp O_WARP: per chunk and state warpgroup, its O tile -> global memory. A
        whole chunk by one TMA store (64 tokens x 64 value columns); the tail chunk by the
        warp's 16-byte copies of the rows inside the sequence (a box would write the next
        sequence's rows, which another CTA owns). The tile is released once read."""
        full, empty = o_ring
        lane = cute.arch.lane_idx()
        one = cute.make_layout(1)
        g = cute.local_tile(
            cute.domain_offset((bos, 0), mO4[None, None, hv, 0]), (CHUNK, ROWS), (None, None)
        )
        ts, tg = cpasync.tma_partition(
            tma_o, 0, one, cute.group_modes(sO, 0, 2), cute.group_modes(g, 0, 2)
        )
        for c in cutlass.range(nchunks, unroll=1):
            valid = cutlass.min(seqlen - c * CHUNK, CHUNK)
            for w in cutlass.range_constexpr(self.state_wgs):
                buf = 2 * w + c % 2
                blk = value_row_block(part, w, self.state_wgs)
                cute.arch.mbarrier_wait(full + buf, (c // 2) % 2)
                if valid == CHUNK:
                    if lane == 0:  # one thread (the DSL elects none for a TMA store)
                        cute.copy(tma_o, ts[(None, buf)], tg[(None, c, blk)])
                        cute.arch.cp_async_bulk_commit_group()
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                else:
                    self._copy_o_rows(sO[None, None, buf], mO, lane, WARP_SIZE, valid, hv,
                                      bos + c * CHUNK, blk, True)  # fmt: skip
                cute.arch.mbarrier_arrive(empty + buf)  # lane 0's only after its read wait
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def _copy_o_rows(self, tile, mO, tid, nthreads: cutlass.Constexpr[int], valid, hv, row0,
                     blk, rolled: cutlass.Constexpr[bool] = False):  # fmt: skip
        """Rows < valid of an O tile to o rows row0 .., value columns 64 blk ..: 16 bytes a
        thread and copy, `nthreads` threads. rolled: a loop, not unrolled (the O warp's 24
        registers: unrolled, its 16 rows' addresses are hoisted and spill)."""
        steps = CHUNK * (ROWS // VEC) // nthreads
        if const_expr(rolled):
            for k in cutlass.range(steps, unroll=1):
                self._copy_o_row(tile, mO, tid, nthreads, k, valid, hv, row0, blk)
        else:
            for k in cutlass.range_constexpr(steps):
                self._copy_o_row(tile, mO, tid, nthreads, k, valid, hv, row0, blk)

    @cute.jit
    def _copy_o_row(self, tile, mO, tid, nthreads: cutlass.Constexpr[int], k, valid, hv, row0,
                    blk):  # fmt: skip
        per_row = ROWS // VEC
        row = tid // per_row + k * (nthreads // per_row)
        col = tid % per_row
        if row < valid:
            src = cute.local_tile(tile[row, None], (VEC,), (col,))
            dst = cute.local_tile(mO[row0 + row, hv, None], (VEC,), (blk * per_row + col,))
            dst.store(src.load())

    @cute.jit
    def _state_io(self, mS, acc_st, thr_st, n, hv, blk, load: cutlass.Constexpr[bool]):
        """Value rows [64 blk, 64 blk + 64) of (sequence n, head hv)'s state, seen as S^T (V, K)
        (k-last: as stored; fla's (K, V): transposed), to or from the accumulator."""
        head = mS[n, hv, None, None]
        st = head if const_expr(self.k_last) else transposed(head)
        part = thr_st.partition_C(cute.local_tile(st, (ROWS, self.k), (blk, 0)))
        if const_expr(load):
            acc_st.store(part.load())
        else:
            part.store(acc_st.load())
