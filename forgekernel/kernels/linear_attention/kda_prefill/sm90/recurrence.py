"""Kimi Delta Attention forward, the recurrence pass (sm_90a): TMA + WGMMA, one CTA per
(sequence, value head), the state on chip for the whole sequence.

Per value head hv of sequence n, state S (K, V) fp32; chunk c of the sequence is global chunk
gc = mChunk[n] + c of the first pass's outputs (`config.py`; `reference.kda_chunked.
chunk_operands` is their definition), whose padded rows are exact zeros:

    Kg, Qg, Kd   (64, K) bf16        K e^G, scale Q e^G, K e^(G_C - G)   (per key channel)
    Tb, P        (64, 64) bf16       T diag(beta), the masked decayed Q K^T
    D            (K,) fp32           e^(G_C)

    U = Tb (V - Kg S),   O = Qg S + P U,   S <- diag(D) S + Kd^T U

The state side is Gated DeltaNet's (`gdn_prefill/sm90/state_wg.py`, whose output and state
I/O this class reuses): S^T (V, K) with the value rows on the MMA's M, 64 rows per state
warpgroup as an fp32 WGMMA accumulator fed back as a 16-bit register A operand:

    X^T = S^T Kg^T, O^T = S^T Qg^T         (64 x 64 x K each, one commit group)
    X^T <- V^T - X^T                       V^T through the v tile's transposed view
    U^T = X^T Tb^T                         (64 x 64 x 64)
    O^T += U^T P^T                         (64 x 64 x 64)
    S^T <- S^T diag(D) + U^T Kd            (64 x K x 64, Kd an MN-major B)

The per-channel decay of the state is a per-column scale of the accumulator; every other
decay sits in the operands. Warp roles: warpgroup 0 warp 0 issues the TMA loads (rings `qk`:
Qg, Kg; `v`; `aux`: Kd, Tb, P, D); warpgroups 1, 2 are the state warpgroups. v boxes past a
sequence read the next sequence's rows (or TMA's zero fill): Tb's columns of those tokens are
zero, so they reach nothing; O rows past the end are not stored.

Constraints: K = V = 128; q-side operands bf16 (T_pad, HV, K) rows gc * 64 ..; Tb, P bf16
(T_pad, HV, 64); D fp32 (NC, HV, K); v / o 16-bit (T, HV, V); states fp32 (N, HV, K, V).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import (
    acc_to_operand_a,
    packed_as_sdhb,
    rows_cols,
    transposed,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import Bar
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.state_wg import StateWg
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import (
    AUX_STAGES,
    CHUNK,
    PRODUCER_REGS,
    QK_STAGES,
    ROWS_PER_STATE_WG,
    STATE_REGS,
    STATE_WGS,
    V_STAGES,
)

ROWS = ROWS_PER_STATE_WG
PRODUCER_WARP = 0


class KdaRecurrenceSm90(StateWg):
    """The recurrence pass; see the module docstring. From StateWg: `_store_o` (O^T through a
    transposed stmatrix to the rows inside the sequence) and `_state_io` (the state to or from
    the accumulator), which read self.dtype (here the v / o dtype), self.k and self.k_last."""

    def __init__(self, k: int, v: int, *, initial_state: bool, value_split: bool = False,
                 warmup: bool = False):  # fmt: skip
        if (k, v) != (128, 128):
            raise ValueError(f"(K, V) must be (128, 128), got {(k, v)}")
        self.k, self.v = k, v
        self.k_last = False  # fla's (N, HV, K, V) state layout
        self.initial_state = initial_state
        # value_split: grid z = 2, each CTA one state warpgroup for value rows 64 z .. (twice
        # the CTAs where (sequences x heads) would leave SMs idle; the operands load twice)
        self.value_split = value_split
        # warmup (opt-in, `launch._pieces`): sequence n starts mWarm[n] chunks before mCu[n]
        # (from its mInit, or zero) and stores o from mCu[n] on: a piece of a long sequence
        # after warm-up chunks whose decays bound what the state before them can still add
        self.warmup = warmup
        self.state_wgs = 1 if value_split else STATE_WGS
        self.threads = (1 + self.state_wgs) * THREADS_PER_WG
        self.consumer_warps = self.state_wgs * THREADS_PER_WG // WARP_SIZE
        self.v_cols = ROWS if value_split else v  # value columns of the v tile

    def _setup(self):
        op_dt, io_dt = self.op_dtype, self.dtype
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        one_wg = (1, 1, 1)
        rmem = warpgroup.OperandSource.RMEM
        # (64 value rows, C tokens), A from registers, B K-major (Kg, Qg, Tb, P)
        self.mma_ks = sm90_utils.make_trivial_tiled_mma(
            op_dt, op_dt, k_major, k_major, Float32, one_wg, (ROWS, CHUNK), a_source=rmem
        )
        # the update (64 value rows, K), B = the Kd tile's transposed (MN-major) view
        self.mma_st = sm90_utils.make_trivial_tiled_mma(
            op_dt, op_dt, k_major, mn_major, Float32, one_wg, (ROWS, self.k), a_source=rmem
        )
        row = LayoutEnum.ROW_MAJOR
        self.sQK_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), op_dt,
                                                        QK_STAGES)  # fmt: skip
        self.sKd_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), op_dt,
                                                        AUX_STAGES)  # fmt: skip
        self.sPT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), op_dt,
                                                        AUX_STAGES)  # fmt: skip
        self.sV_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.v_cols), io_dt,
                                                       V_STAGES)  # fmt: skip
        self.sO_layout = sm90_utils.make_smem_layout_a(
            row, (CHUNK, ROWS, ROWS), io_dt, 2 * STATE_WGS
        )
        self.sD_layout = cute.make_layout((1, self.k, AUX_STAGES), stride=(self.k, 1, self.k))

    @cute.jit
    def __call__(
        self,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mT: cute.Tensor,
        mP: cute.Tensor,
        mD: cute.Tensor,
        mV: cute.Tensor,
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mChunk: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        mWarm: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mQg, mKg, mKd bf16 (R, HV, K); mT, mP bf16 (R, HV, 64); mD fp32 (NC, HV, K); mV, mO
        (T, HV, V); mCu int32 (N + 1,); mChunk int32 (N,) the first global chunk of each
        sequence; mInit (or None), mFinal fp32 (N, HV, K, V); mWarm int32 (N,) with `warmup`
        (else None): chunks walked before mCu[n], their o not stored."""
        self.op_dtype = mQg.element_type
        self.dtype = mV.element_type
        if const_expr(mO.element_type != self.dtype):
            raise TypeError("v and o must share one dtype")
        for t in (mKg, mKd, mT, mP):
            if const_expr(t.element_type != self.op_dtype):
                raise TypeError("the chunk operands must share one dtype")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        qk_tile = cute.slice_(self.sQK_layout, (None, None, 0))
        pt_tile = cute.slice_(self.sPT_layout, (None, None, 0))
        v_tile = cute.slice_(self.sV_layout, (None, None, 0))
        d_tile = cute.slice_(self.sD_layout, (None, None, 0))
        mQg4, mKg4, mKd4, mT4, mP4, mV4, mD4 = (
            packed_as_sdhb(t) for t in (mQg, mKg, mKd, mT, mP, mV, mD)
        )
        tma_qg, tma_mQg = cpasync.make_tiled_tma_atom(g2s, mQg4, qk_tile, (CHUNK, self.k))
        tma_kg, tma_mKg = cpasync.make_tiled_tma_atom(g2s, mKg4, qk_tile, (CHUNK, self.k))
        tma_kd, tma_mKd = cpasync.make_tiled_tma_atom(g2s, mKd4, qk_tile, (CHUNK, self.k))
        tma_t, tma_mT = cpasync.make_tiled_tma_atom(g2s, mT4, pt_tile, (CHUNK, CHUNK))
        tma_p, tma_mP = cpasync.make_tiled_tma_atom(g2s, mP4, pt_tile, (CHUNK, CHUNK))
        tma_d, tma_mD = cpasync.make_tiled_tma_atom(g2s, mD4, d_tile, (1, self.k))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV4, v_tile, (CHUNK, self.v_cols))
        self.qk_bytes = 2 * cute.size_in_bytes(self.op_dtype, qk_tile)
        self.v_bytes = cute.size_in_bytes(self.dtype, v_tile)
        self.aux_bytes = (
            cute.size_in_bytes(self.op_dtype, qk_tile)
            + 2 * cute.size_in_bytes(self.op_dtype, pt_tile)
            + cute.size_in_bytes(Float32, d_tile)
        )

        @cute.struct
        class SharedStorage:
            qk_barriers: cute.struct.MemRange[cutlass.Int64, 2 * QK_STAGES]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * V_STAGES]
            aux_barriers: cute.struct.MemRange[cutlass.Int64, 2 * AUX_STAGES]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, AUX_STAGES * self.k], 128]
            sQg: cute.struct.Align[
                cute.struct.MemRange[self.op_dtype, cute.cosize(self.sQK_layout)], 1024
            ]
            sKg: cute.struct.Align[
                cute.struct.MemRange[self.op_dtype, cute.cosize(self.sQK_layout)], 1024
            ]
            sKd: cute.struct.Align[
                cute.struct.MemRange[self.op_dtype, cute.cosize(self.sKd_layout)], 1024
            ]
            sT: cute.struct.Align[
                cute.struct.MemRange[self.op_dtype, cute.cosize(self.sPT_layout)], 1024
            ]
            sP: cute.struct.Align[
                cute.struct.MemRange[self.op_dtype, cute.cosize(self.sPT_layout)], 1024
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024
            ]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sO_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_qg, tma_mQg, tma_kg, tma_mKg, tma_kd, tma_mKd, tma_t, tma_mT, tma_p, tma_mP,
            tma_d, tma_mD, tma_v, tma_mV, mInit, mCu, mChunk, mO, mFinal, mWarm,
            self.mma_ks, self.mma_st, self.sQK_layout, self.sKd_layout, self.sPT_layout,
            self.sV_layout, self.sO_layout, self.sD_layout,
        ).launch(
            grid=(mV.shape[1], mCu.shape[0] - 1, 2 if self.value_split else 1),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        tma_qg: cute.CopyAtom,
        mQg4: cute.Tensor,
        tma_kg: cute.CopyAtom,
        mKg4: cute.Tensor,
        tma_kd: cute.CopyAtom,
        mKd4: cute.Tensor,
        tma_t: cute.CopyAtom,
        mT4: cute.Tensor,
        tma_p: cute.CopyAtom,
        mP4: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD4: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV4: cute.Tensor,
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mChunk: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        mWarm: cute.Tensor | None,
        mma_ks: cute.TiledMma,
        mma_st: cute.TiledMma,
        sQK_layout: cute.ComposedLayout,
        sKd_layout: cute.ComposedLayout,
        sPT_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sD_layout: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == PRODUCER_WARP:
            for atom in (tma_qg, tma_kg, tma_kd, tma_t, tma_p, tma_d, tma_v):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        warps = self.consumer_warps
        qk_pipe = tma_pipeline(storage.qk_barriers, QK_STAGES, self.qk_bytes, warps)
        v_pipe = tma_pipeline(storage.v_barriers, V_STAGES, self.v_bytes, warps)
        aux_pipe = tma_pipeline(storage.aux_barriers, AUX_STAGES, self.aux_bytes, warps)
        init_arrive()
        smem = {
            "qg": smem_tensor(storage.sQg, sQK_layout),
            "kg": smem_tensor(storage.sKg, sQK_layout),
            "kd": smem_tensor(storage.sKd, sKd_layout),
            "t": smem_tensor(storage.sT, sPT_layout),
            "p": smem_tensor(storage.sP, sPT_layout),
            "v": smem_tensor(storage.sV, sV_layout),
            "o": smem_tensor(storage.sO, sO_layout),
            "d": storage.sD.get_tensor(sD_layout),
        }
        init_wait()

        hv, n, half = cute.arch.block_idx()
        bos = mCu[n]
        seqlen = mCu[n + 1] - bos
        first = mChunk[n]
        warm = 0
        if const_expr(self.warmup):
            warm = mWarm[n]
            bos = bos - warm * CHUNK
            seqlen = seqlen + warm * CHUNK
            first = first - warm
        nchunks = (seqlen + CHUNK - 1) // CHUNK
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == PRODUCER_WARP:
                loads = ((tma_qg, mQg4), (tma_kg, mKg4), (tma_kd, mKd4), (tma_t, mT4),
                         (tma_p, mP4), (tma_d, mD4), (tma_v, mV4))  # fmt: skip
                self._produce(loads, smem, qk_pipe, v_pipe, aux_pipe, hv, bos, first, nchunks,
                              half)  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(STATE_REGS)
            w = half if const_expr(self.value_split) else wg - 1
            self._recur(
                w, tidx - wg * THREADS_PER_WG, mma_ks, mma_st, smem, mInit, mFinal, mO,
                qk_pipe, v_pipe, aux_pipe, hv, n, bos, seqlen, nchunks, warm,
            )  # fmt: skip

    @cute.jit
    def _produce(self, loads, smem, qk_pipe, v_pipe, aux_pipe, hv, bos, first, nchunks, half):
        """TMA, per chunk: Qg, Kg (global chunk first + c) into the qk ring; v (rows bos + 64
        c) into the v ring; Kd, Tb, P and D into the aux ring."""
        one = cute.make_layout(1)
        qg, kg, kd, tb, pp, dd, vv = loads

        def view(pair, s, tile, row0, col=0):
            atom, m = pair
            g = cute.local_tile(
                cute.domain_offset((row0, 0), m[None, None, hv, 0]), tile, (None, col)
            )
            ts, tg = cpasync.tma_partition(
                atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
            return atom, ts, tg

        rows0 = first * CHUNK
        qk_loads = [view(qg, smem["qg"], (CHUNK, self.k), rows0),
                    view(kg, smem["kg"], (CHUNK, self.k), rows0)]  # fmt: skip
        aux_loads = [view(kd, smem["kd"], (CHUNK, self.k), rows0),
                     view(tb, smem["t"], (CHUNK, CHUNK), rows0),
                     view(pp, smem["p"], (CHUNK, CHUNK), rows0),
                     view(dd, smem["d"], (1, self.k), first)]  # fmt: skip
        v_col = half if const_expr(self.value_split) else 0
        v_load = view(vv, smem["v"], (CHUNK, self.v_cols), bos, v_col)
        qs = producer_state(QK_STAGES)
        vs = producer_state(V_STAGES)
        xs = producer_state(AUX_STAGES)
        for c in cutlass.range(nchunks, unroll=1):
            qk_pipe.producer_acquire(qs)
            bar = qk_pipe.producer_get_barrier(qs)
            for atom, ts, tg in qk_loads:
                cute.copy(atom, tg[(None, c)], ts[(None, qs.index)], tma_bar_ptr=bar)
            qs.advance()
            v_pipe.producer_acquire(vs)
            atom, ts, tg = v_load
            cute.copy(atom, tg[(None, c)], ts[(None, vs.index)],
                      tma_bar_ptr=v_pipe.producer_get_barrier(vs))  # fmt: skip
            vs.advance()
            aux_pipe.producer_acquire(xs)
            bar = aux_pipe.producer_get_barrier(xs)
            for atom, ts, tg in aux_loads:
                cute.copy(atom, tg[(None, c)], ts[(None, xs.index)], tma_bar_ptr=bar)
            xs.advance()

    @cute.jit
    def _recur(
        self, w, stid, mma_ks, mma_st, smem, mInit, mFinal, mO, qk_pipe, v_pipe, aux_pipe, hv,
        n, bos, seqlen, nchunks, warm,
    ):  # fmt: skip
        thr_st = mma_st.get_slice(stid)
        acc_st = cute.make_rmem_tensor(thr_st.partition_shape_C((ROWS, self.k)), Float32)
        if const_expr(self.initial_state):
            self._state_io(mInit, acc_st, thr_st, n, hv, w, True)
        else:
            acc_st.fill(0.0)
        wg_ks = mma_ks.get_slice(0)
        wg_st = mma_st.get_slice(0)
        acc_shape = wg_ks.partition_shape_C((ROWS, CHUNK))
        tSrS = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, self.k)))
        tXrX = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tUrU = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tBrK = wg_ks.make_fragment_B(wg_ks.partition_B(smem["kg"]))
        tBrQ = wg_ks.make_fragment_B(wg_ks.partition_B(smem["qg"]))
        tBrT = wg_ks.make_fragment_B(wg_ks.partition_B(smem["t"]))
        tBrP = wg_ks.make_fragment_B(wg_ks.partition_B(smem["p"]))
        tBrKd = wg_st.make_fragment_B(wg_st.partition_B(transposed(smem["kd"])))
        sVt = transposed(smem["v"])  # (V, C, stages)
        out_bar = pipeline.NamedBarrier(barrier_id=int(Bar.OUT) + w, num_threads=THREADS_PER_WG)
        ld = consumer_state(QK_STAGES)
        vs = consumer_state(V_STAGES)
        ax = consumer_state(AUX_STAGES)
        for c in cutlass.range(nchunks, unroll=1):
            acc_x = cute.make_rmem_tensor(acc_shape, Float32)
            acc_o = cute.make_rmem_tensor(acc_shape, Float32)
            acc_u = cute.make_rmem_tensor(acc_shape, Float32)
            qk_pipe.consumer_wait(ld)
            acc_to_operand_a(acc_st, tSrS)
            gemm(mma_ks, acc_x, tSrS, tBrK[None, None, None, ld.index], True, -1)
            gemm(mma_ks, acc_o, tSrS, tBrQ[None, None, None, ld.index], True, -1)
            v_pipe.consumer_wait(vs)
            warpgroup.wait_group(0)
            qk_pipe.consumer_release(ld)  # Qg, Kg consumed: the stage may load chunk c + 2
            tid = opaque_tid_x() % THREADS_PER_WG
            vt = cute.local_tile(sVt[None, None, vs.index], (ROWS, CHUNK),
                                 (0 if const_expr(self.value_split) else w, 0))  # fmt: skip
            r_v = mma_ks.get_slice(tid).partition_C(vt).load().to(Float32)
            acc_x.store(r_v - acc_x.load())
            v_pipe.consumer_release(vs)
            aux_pipe.consumer_wait(ax)
            acc_to_operand_a(acc_x, tXrX)
            gemm(mma_ks, acc_u, tXrX, tBrT[None, None, None, ax.index], True, 0)
            acc_to_operand_a(acc_u, tUrU)
            gemm(mma_ks, acc_o, tUrU, tBrP[None, None, None, ax.index], False, -1)
            self._decay_state(acc_st, mma_st, smem["d"], ax.index)
            gemm(mma_st, acc_st, tUrU, tBrKd[None, None, None, ax.index], False, 0)
            aux_pipe.consumer_release(ax)
            if const_expr(self.warmup):
                if c >= warm:
                    self._store_o(acc_o, mma_ks, smem["o"], mO, out_bar, w, w, tid, hv, bos, c,
                                  seqlen)  # fmt: skip
            else:
                self._store_o(acc_o, mma_ks, smem["o"], mO, out_bar, w, w, tid, hv, bos, c,
                              seqlen)  # fmt: skip
            ld.advance()
            vs.advance()
            ax.advance()
        self._state_io(mFinal, acc_st, thr_st, n, hv, w, False)

    @cute.jit
    def _decay_state(self, acc_st, mma_st, sD, s):
        """S^T <- S^T diag(D): column j (key channel j) of the accumulator times D_j."""
        tid = opaque_tid_x() % THREADS_PER_WG
        t0, _, col_base = softmax.acc_coords(mma_st, tid, (ROWS, self.k))
        a = rows_cols(acc_st)
        for c in cutlass.range_constexpr(cute.size(a, mode=[1])):
            d = sD[0, col_base + t0[0, c][1], s]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, c] = a[r, c] * d
