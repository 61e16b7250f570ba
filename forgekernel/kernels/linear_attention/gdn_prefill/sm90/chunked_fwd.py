"""Chunked Gated DeltaNet forward (prefill) for Hopper (sm_90a): TMA + WGMMA, one CTA per
(sequence, value head), or V_SPLIT CTAs each holding V / V_SPLIT value rows of its state (the
aux work repeated in each), the state on chip for the whole sequence.

Per value head hv of sequence n, state S (K, V) fp32, chunks of C = 64 tokens; inside a chunk
G2 = log2(e) cumsum(g) (all exponents below are differences G2_i - G2_j with j <= i, G2_C -
G2_j or G2_j: never positive), with l2norm the inverse row norms rq_i, rk_j folded into the
factors (the bf16 q / k tiles are never rewritten):

    L   = beta_i rk_i rk_j 2^(G2_i - G2_j) (K K^T)_ij            j < i, else 0
    T   = (I + L)^-1                       blocked, the merges tf32 (inverse.py, inverse_mma.py)
    P   = scale rq_i rk_j 2^(G2_i - G2_j) (Q K^T)_ij              j <= i, else 0
    U   = T diag(beta) (V - diag(rk 2^G2) K S)                   the chunk's corrected values
    O   = diag(scale rq 2^G2) Q S + P U
    S  <- 2^G2_C S + K^T diag(rk 2^(G2_C - G2)) U

The state side is computed transposed, S^T (V, K) with the value rows on the MMA's M: each
state warpgroup keeps 64 rows of S^T as a WGMMA accumulator (64 fp32 registers a thread) and
feeds them to the next chunk's products as a 16-bit register A operand, so S never goes
through shared memory (FlashInfer's sm90 prefill does the same). Per chunk and state
warpgroup, A operands from registers, B from shared memory:

    X^T = S^T K^T, O^T = S^T Q^T           (64 x 64 x K each)
    U^T = [V^T - X^T diag(rk 2^G2)] (T diag(beta))^T          (64 x 64 x 64)
    O^T = diag(..) O^T + U^T P^T           (64 x 64 x 64)
    S^T = 2^G2_C S^T + [U^T diag(rk 2^(G2_C - G2))] K         (64 x K x 64, K an MN-major B)

Warp roles (4 warpgroups, 512 threads, setmaxnreg split in config.py; with a V split of 2, one
state warpgroup and two aux warpgroups that take alternate chunks, each with its own scratch
and named barrier, its ring states starting at its index and stepping by two):
- warpgroup 0, warp 0 (producer): TMA loads of q, k (head hv // (HV / H)) and v, one 64-token
  box each per chunk, into the `qk` and `v` rings.
- warpgroup 0, warp 1 (gates): g and beta of the chunk (0 past the sequence's end), the
  cumulative G2 by a warp scan, into the `gate` ring.
- warpgroup 1 (aux, `aux_wy.py`): Q K^T and K K^T (SS WGMMA), the row norms (l2norm), the
  masks and decays; P to shared memory (stmatrix), L to an fp32 scratch, T = (I + L)^-1 (the
  diagonal blocks in fp32 on the CUDA cores, `inverse.py`, the merges by mma.sync tf32,
  `inverse_mma.py`), T diag(beta) to shared memory; per-token factor tables
  for the state warpgroups. Runs a chunk ahead of them through the `aux` ring.
- warpgroups 2, 3 (state, `state_wg.py`): value rows [64 b, 64 b + 64) of S^T, b = part x
  state warpgroups + w (`config.value_row_block`; part: the CTA's share of the split); the
  products above; O^T to shared memory (transposed stmatrix) and to global memory with
  16-byte stores of the rows inside the sequence; the initial state read and the final state
  written from the accumulator.

Pipelines (mbarrier rings, depths in config.py): `qk` (TMA, producer warp -> the aux and state
warps; 3 deep, so that the aux warpgroup loads and works up to two chunks ahead), `v` (TMA ->
the state warps), `gate` (gate warp -> aux), `aux` (aux -> state warpgroups; the aux takes its
stage only to write P, T and the tables, after the inverse). Named barriers: `Bar`.

The `t_pre` form (compile key t_pre; the launcher's `t_pre=True`, the bench's variant): T
diag(beta) of every chunk comes from the precompute kernel (`t_pre.py`, one CTA per chunk and
value head, all at once) through a T ring (warpgroup 0's warp 2 loads the (C, C) tile of slot
bos // C + n + c by TMA; the state warpgroups wait for it just before U^T and release it once
U^T is complete); the aux warpgroup (`aux_p.py`) forms only Q K^T, P and the tables (its loop
644 SASS instructions against 1846, bf16), and the inverse's scratch is gone. Its state chain is
shorter (state loop 754 -> 506 SASS instructions a warp, bf16): V^T by transposed ldmatrix,
the thread-dependent views hoisted, and O handed by an mbarrier ring (full: the state
warpgroup's 128 threads after stmatrix and a proxy fence; empty: the O warp's 32 lanes once
read) to warpgroup 0's warp 3 (`roles.O_WARP`), which stores whole chunks by one TMA box and
the tail chunk's rows by 16-byte copies. Key field state_lds keeps next/gdn-tpre's state chain
(the bench's A/B, `t_pre_state_lds`). Key field no_o (t_pre form): no o (no q boxes nor q norms,
no Q K^T or P, no O^T, U^T P^T or O tiles; the O warp idle): the segmented path's pass
B, whose o pass C overwrites (the launcher's default there: 0.885x at 1 x 131072 h16 hv16,
H100). Key field o_warp (standard form; the launcher's default form of it, the bench's A/B
`no_o_warp` without): the standard form with the t_pre form's state chain (V^T by ldmatrix,
the views hoisted, O through the O warp), T still formed by its aux: 0.943-0.986x of the
standard form without it on the H100 (next/tpre-batch-gap, next/gdn-prefill-adopt in
docs/linear_attention/NOTES.md).

Ragged edges: a chunk that runs past its sequence loads the next sequence's rows (or TMA's
zero fill past T): their g and beta are 0 (so G2 is flat and those rows of L, T - I and U
vanish, and their columns are above every valid row's diagonal), and their O rows are not
stored; every factor stays finite, so nothing of theirs reaches a valid output or the state.

Constraints: K = V = 128, 16-bit q / k / v / o with unit last strides, token strides multiples
of 8 elements and 16-byte aligned bases (TMA); g, beta fp32 (T, HV); states fp32.
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

from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import packed_as_sdhb
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.aux_p import AuxP
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.aux_wy import AuxWy
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    AUX_REGS,
    BLOCK,
    CHUNK,
    PRODUCER_REGS,
    QK_STAGES,
    ROWS_PER_STATE_WG,
    SCRATCH_STUB,
    STAGES,
    STATE_REGS,
    V_STAGES,
    W_STRIDE,
    X_STRIDE,
    aux_wgs,
    first_slot,
    o_ring_barriers,
    state_wgs,
    threads,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.gates import chunk_gates
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import (
    GATE_WARP,
    O_EMPTY_ARRIVALS,
    O_FULL_ARRIVALS,
    O_WARP,
    PRODUCER_WARP,
    T_WARP,
    gate_warp_witnesses_qk,
    qk_consumer_warps,
    v_consumer_warps,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.state_wg import StateWg


def _async_ring(barriers, producers: int, consumers: int) -> pipeline.PipelineAsync:
    """A STAGES-deep ring of plain mbarrier hand-overs where every producer and every consumer
    thread arrives (each thread's own shared-memory writes are released by its arrival)."""
    return pipeline.PipelineAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
        defer_sync=True,
    )


class GdnChunkedFwdSm90(AuxWy, AuxP, StateWg):
    """Warp-specialized chunked Gated DeltaNet forward; see the module docstring. t_pre: the
    form that reads T diag(beta) of every chunk from the precompute (`t_pre.py`): warp T_WARP
    of warpgroup 0 loads it by TMA into the T ring (the state warpgroups wait for it at U^T and
    release it after), the aux warpgroup forms only P and the tables (`aux_p.py`); the inverse's
    scratch fields shrink to stubs (their views unused)."""

    def __init__(
        self, k: int, v: int, *, k_last: bool, l2norm: bool, initial_state: bool, v_split: int = 1,
        t_pre: bool = False, state_lds: bool = False, o_warp: bool = False, no_o: bool = False,
    ):  # fmt: skip
        if (k, v) != (128, 128):
            raise ValueError(f"(K, V) must be (128, 128), got {(k, v)}")
        self.k, self.v = k, v
        self.k_last = k_last
        self.l2norm = l2norm
        self.initial_state = initial_state
        self.v_split = v_split
        self.t_pre = t_pre
        # O by warp O_WARP's TMA stores, V^T by ldmatrix: the t_pre form's, or the standard
        # form's with its o_warp key
        self.o_warp = (t_pre and not state_lds) or o_warp
        self.no_o = no_o  # no o: the state chain without O^T, U^T P^T and the O hand-off
        self.o_drain = self.o_warp and not no_o  # the O warp stores O tiles (its ring built)
        # q only for its products: the no_o key forms no q norm either (l2norm: O's factor
        # rq, the tables' column 1, is unread there)
        self.q_load = not no_o
        self.state_wgs = state_wgs(v, v_split)
        self.aux_wgs = aux_wgs(v_split)
        self.v_cols = self.state_wgs * ROWS_PER_STATE_WG  # value columns of one CTA
        self.threads = threads(v, v_split)

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        dt = self.dtype
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        one_wg = (1, 1, 1)
        rmem = warpgroup.OperandSource.RMEM
        # aux: Q K^T and K K^T, (C, C) over K, both operands K-major in shared memory
        self.mma_aux = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, one_wg, (CHUNK, CHUNK)
        )
        # state: (64 value rows, C tokens), A from registers, B K-major (k, q, T diag(beta), P)
        self.mma_ks = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, one_wg, (ROWS_PER_STATE_WG, CHUNK), a_source=rmem
        )
        # state update: (64 value rows, K), B = the k tile's transposed (MN-major) view
        self.mma_st = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, one_wg, (ROWS_PER_STATE_WG, self.k),
            a_source=rmem,
        )  # fmt: skip
        row = LayoutEnum.ROW_MAJOR
        # q, k, v: (C tokens, D), K-major 128-byte swizzle; one layout serves as the aux GEMMs'
        # A and B, the state GEMMs' K-major B and (transposed) the update's MN-major B.
        self.sQK_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), dt, QK_STAGES)
        self.sV_layout = sm90_utils.make_smem_layout_b(
            row, (CHUNK, CHUNK, self.v_cols), dt, V_STAGES
        )
        # P and T diag(beta): (i, j) row-major, the K-major B of U^T = (..) T^T and O^T += U^T P^T
        self.sPT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), dt, STAGES)
        # O tiles: (C tokens, 64 value columns) row-major, two per state warpgroup
        self.sO_layout = sm90_utils.make_smem_layout_a(
            row, (CHUNK, ROWS_PER_STATE_WG, ROWS_PER_STATE_WG), dt, 2 * self.state_wgs
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        scale: Float32,
        mTpre: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mQ, mK (T, H, K); mV, mO (T, HV, V); mG, mBeta fp32 (T, HV); mCu int32 (N + 1,);
        mInit (or None) and mFinal fp32 (N, HV, K, V), or (N, HV, V, K) with k_last; mTpre
        (t_pre only, else None): T diag(beta) (slots x C, HV, C) in q's dtype (`t_pre.py`)."""
        self.dtype = mQ.element_type
        for t in (mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"q, k, v, o must share one dtype, got {t.element_type}")
        self._setup()
        mQ4, mK4, mV4 = (packed_as_sdhb(t) for t in (mQ, mK, mV))  # (T, D, H, 1)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sQK_tile = cute.slice_(self.sQK_layout, (None, None, 0))
        sV_tile = cute.slice_(self.sV_layout, (None, None, 0))
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ4, sQK_tile, (CHUNK, self.k))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK4, sQK_tile, (CHUNK, self.k))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV4, sV_tile, (CHUNK, self.v_cols))
        self.qk_bytes = (2 if self.q_load else 1) * cute.size_in_bytes(self.dtype, sQK_tile)
        self.v_bytes = cute.size_in_bytes(self.dtype, sV_tile)
        tma_t, tma_mT, tma_o, mO4 = None, None, None, None
        w_words = self.aux_wgs * CHUNK * W_STRIDE
        x_words = self.aux_wgs * 2 * BLOCK * X_STRIDE
        t_barriers = 0
        o_barriers = 0
        if const_expr(self.t_pre):
            sT_tile = cute.slice_(self.sPT_layout, (None, None, 0))
            tma_t, tma_mT = cpasync.make_tiled_tma_atom(g2s, packed_as_sdhb(mTpre), sT_tile,
                                                        (CHUNK, CHUNK))  # fmt: skip
            self.t_bytes = cute.size_in_bytes(self.dtype, sT_tile)
            w_words = x_words = SCRATCH_STUB  # no inverse here
            t_barriers = 2 * STAGES
        if const_expr(self.o_drain):
            sO_tile = cute.slice_(self.sO_layout, (None, None, 0))
            tma_o, mO4 = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(),
                                                     packed_as_sdhb(mO), sO_tile,
                                                     (CHUNK, ROWS_PER_STATE_WG))  # fmt: skip
            o_barriers = o_ring_barriers(self.state_wgs)

        @cute.struct
        class SharedStorage:
            qk_barriers: cute.struct.MemRange[cutlass.Int64, 2 * QK_STAGES]
            v_barriers: cute.struct.MemRange[cutlass.Int64, 2 * V_STAGES]
            gate_barriers: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
            aux_barriers: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, STAGES * CHUNK], 16]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, STAGES * CHUNK], 16]
            sTab: cute.struct.Align[cute.struct.MemRange[Float32, STAGES * 4 * CHUNK], 16]
            sNorm: cute.struct.Align[cute.struct.MemRange[Float32, STAGES * 3 * CHUNK], 16]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, w_words], 16]
            sX: cute.struct.Align[cute.struct.MemRange[Float32, x_words], 16]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sQK_layout)], 1024
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sQK_layout)], 1024
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024
            ]
            sP: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sPT_layout)], 1024
            ]
            sT: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sPT_layout)], 1024
            ]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sO_layout)], 1024
            ]
            t_ring: cute.struct.MemRange[cutlass.Int64, t_barriers]  # t_pre: the T ring's
            o_ring: cute.struct.MemRange[cutlass.Int64, o_barriers]  # o_warp: O full, empty

        self.shared_storage = SharedStorage
        self.kernel(
            tma_q,
            tma_mQ,
            tma_k,
            tma_mK,
            tma_v,
            tma_mV,
            mG,
            mBeta,
            mInit,
            mCu,
            mO,
            mFinal,
            scale,
            self.mma_aux,
            self.mma_ks,
            self.mma_st,
            self.sQK_layout,
            self.sV_layout,
            self.sPT_layout,
            self.sO_layout,
            tma_t,
            tma_mT,
            tma_o,
            mO4,
        ).launch(  # fmt: skip
            grid=(mV.shape[1] * self.v_split, mCu.shape[0] - 1, 1),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ4: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV4: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        scale: Float32,
        mma_aux: cute.TiledMma,
        mma_ks: cute.TiledMma,
        mma_st: cute.TiledMma,
        sQK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPT_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tma_t: cute.CopyAtom | None,
        mT4: cute.Tensor | None,
        tma_o: cute.CopyAtom | None,
        mO4: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == PRODUCER_WARP:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.t_pre):
                cpasync.prefetch_descriptor(tma_t)
            if const_expr(self.o_drain):
                cpasync.prefetch_descriptor(tma_o)
        storage = SmemAllocator().allocate(self.shared_storage)
        wgs = self.state_wgs
        qk_pipe = tma_pipeline(
            storage.qk_barriers, QK_STAGES, self.qk_bytes, qk_consumer_warps(wgs)
        )
        v_pipe = tma_pipeline(storage.v_barriers, V_STAGES, self.v_bytes, v_consumer_warps(wgs))
        gate_pipe = _async_ring(storage.gate_barriers, WARP_SIZE, THREADS_PER_WG)
        aux_pipe = _async_ring(storage.aux_barriers, THREADS_PER_WG, wgs * THREADS_PER_WG)
        t_pipe, o_ring = None, None
        if const_expr(self.t_pre):
            t_pipe = tma_pipeline(storage.t_ring, STAGES, self.t_bytes, v_consumer_warps(wgs))
        if const_expr(self.o_drain):
            o_full = storage.o_ring.data_ptr()
            o_ring = (o_full, o_full + 2 * wgs)  # full[2 w + c % 2], empty[..]
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for i in cutlass.range_constexpr(2 * wgs):
                        cute.arch.mbarrier_init(o_ring[0] + i, O_FULL_ARRIVALS)
                    for i in cutlass.range_constexpr(2 * wgs):
                        cute.arch.mbarrier_init(o_ring[1] + i, O_EMPTY_ARRIVALS)
        init_arrive()
        sQ = smem_tensor(storage.sQ, sQK_layout)
        sK = smem_tensor(storage.sK, sQK_layout)
        sV = smem_tensor(storage.sV, sV_layout)
        sP = smem_tensor(storage.sP, sPT_layout)
        sT = smem_tensor(storage.sT, sPT_layout)
        sO = smem_tensor(storage.sO, sO_layout)
        sG = storage.sG.get_tensor(cute.make_layout((CHUNK, STAGES)))
        sBeta = storage.sBeta.get_tensor(cute.make_layout((CHUNK, STAGES)))
        sTab = storage.sTab.get_tensor(cute.make_layout((CHUNK, 4, STAGES)))
        sNorm = storage.sNorm.get_tensor(cute.make_layout((CHUNK, 3, STAGES)))
        sW = storage.sW.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)))
        sX = storage.sX.get_tensor(cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1)))
        init_wait()

        bx, n, _ = cute.arch.block_idx()
        hv = bx // self.v_split  # the split's CTAs adjacent: q / k read twice close in time
        part = bx % self.v_split
        head = hv // (mV4.shape[2] // mQ4.shape[2])
        bos = mCu[n]
        seqlen = mCu[n + 1] - bos
        nchunks = (seqlen + CHUNK - 1) // CHUNK
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == PRODUCER_WARP:
                self._produce(
                    tma_q, tma_k, tma_v, mQ4, mK4, mV4, sQ, sK, sV, qk_pipe, v_pipe, head, hv,
                    part, bos, nchunks,
                )  # fmt: skip
            elif warp_idx == GATE_WARP:
                self._gates(mG, mBeta, sG, sBeta, gate_pipe, qk_pipe, hv, bos, seqlen, nchunks)
            if const_expr(self.t_pre):
                if warp_idx == T_WARP:
                    self._produce_t(tma_t, mT4, sT, t_pipe, hv, first_slot(bos, n), nchunks)
            if const_expr(self.o_drain):
                if warp_idx == O_WARP:
                    self._drain_o(tma_o, mO4, mO, sO, o_ring, hv, part, bos, seqlen, nchunks)
        elif wg == 1 if const_expr(self.aux_wgs == 1) else wg <= self.aux_wgs:
            cute.arch.setmaxregister_decrease(AUX_REGS)
            a = 0  # aux warpgroup a takes chunks a, a + aux_wgs, ...
            sW_a, sX_a = sW, sX
            if const_expr(self.aux_wgs > 1):  # then each its own scratch
                a = wg - 1
                sW_a = cute.make_tensor(sW.iterator + a * (CHUNK * W_STRIDE), sW.layout)
                sX_a = cute.make_tensor(sX.iterator + a * (2 * BLOCK * X_STRIDE), sX.layout)
            if const_expr(self.t_pre):
                self._aux_p(
                    mma_aux, sQ, sK, sP, sG, sBeta, sTab, sNorm, qk_pipe, gate_pipe, aux_pipe,
                    scale, nchunks, a,
                )  # fmt: skip
            else:
                self._aux(
                    mma_aux, sQ, sK, sP, sT, sG, sBeta, sTab, sNorm, sW_a, sX_a,
                    qk_pipe, gate_pipe, aux_pipe, scale, nchunks, a,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(STATE_REGS)
            first = 1 + self.aux_wgs  # the first state warpgroup
            self._state(
                wg - first, tidx - (wg * THREADS_PER_WG), mma_ks, mma_st, sQ, sK, sV, sP, sT,
                sTab, sO, mInit, mFinal, mO, qk_pipe, v_pipe, aux_pipe, hv, part, n, bos,
                seqlen, nchunks, t_pipe, o_ring,
            )  # fmt: skip

    # ---------------------------------------------------------------- producer warps
    @cute.jit
    def _produce(
        self, tma_q, tma_k, tma_v, mQ4, mK4, mV4, sQ, sK, sV, qk_pipe, v_pipe, head, hv, part,
        bos, nchunks,
    ):  # fmt: skip
        """TMA: per chunk one (C, D) box of q, k (head `head`) into the q / k ring, then of v
        (head hv, this CTA's value columns: part `part` of the split) into the v ring. Boxes
        past the sequence read the next one's rows (masked by the zero gates), past T zeros."""
        one = cute.make_layout(1)
        loads = []
        for atom, m, s, h, d, col in ((tma_q, mQ4, sQ, head, self.k, 0),
                                      (tma_k, mK4, sK, head, self.k, 0),
                                      (tma_v, mV4, sV, hv, self.v_cols, part)):  # fmt: skip
            g = cute.local_tile(
                cute.domain_offset((bos, 0), m[None, None, h, 0]), (CHUNK, d), (None, col)
            )
            ts, tg = cpasync.tma_partition(
                atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
            loads.append((atom, ts, tg))
        qk = producer_state(QK_STAGES)
        vs = producer_state(V_STAGES)
        for c in cutlass.range(nchunks, unroll=1):
            qk_pipe.producer_acquire(qk)
            bar = qk_pipe.producer_get_barrier(qk)
            for atom, ts, tg in loads[0 if self.q_load else 1 : 2]:
                cute.copy(atom, tg[(None, c)], ts[(None, qk.index)], tma_bar_ptr=bar)
            qk.advance()
            v_pipe.producer_acquire(vs)
            atom, ts, tg = loads[2]
            cute.copy(atom, tg[(None, c)], ts[(None, vs.index)],
                      tma_bar_ptr=v_pipe.producer_get_barrier(vs))  # fmt: skip
            vs.advance()

    @cute.jit
    def _produce_t(self, tma_t, mT4, sT, t_pipe, hv, slot0, nchunks):
        """t_pre: per chunk c the (C, C) T diag(beta) tile of slot slot0 + c, head hv, into the T
        ring: warp T_WARP's own loop (in the producer warp's, its waits for the state
        warpgroups' releases would hold back the q / k / v loads they wait for)."""
        g = cute.local_tile(mT4[None, None, hv, 0], (CHUNK, CHUNK), (None, 0))
        ts, tg = cpasync.tma_partition(
            tma_t, 0, cute.make_layout(1), cute.group_modes(sT, 0, 2), cute.group_modes(g, 0, 2)
        )
        st = producer_state(STAGES)
        for c in cutlass.range(nchunks, unroll=1):
            t_pipe.producer_acquire(st)
            cute.copy(tma_t, tg[(None, slot0 + c)], ts[(None, st.index)],
                      tma_bar_ptr=t_pipe.producer_get_barrier(st))  # fmt: skip
            st.advance()

    @cute.jit
    def _gates(self, mG, mBeta, sG, sBeta, gate_pipe, qk_pipe, hv, bos, seqlen, nchunks):
        """Per chunk: lane l takes tokens 2 l and 2 l + 1; g and beta (0 past the sequence), the
        inclusive cumulative sum of g over the chunk by a warp scan, times log2(e). With two
        aux warpgroups, committed only once the chunk's q / k have landed (waited on in chunk
        order, never released: `roles.gate_warp_witnesses_qk`)."""
        lane = cute.arch.lane_idx()
        st = producer_state(STAGES)
        ld = consumer_state(QK_STAGES)
        for c in cutlass.range(nchunks, unroll=1):
            before, incl, vals = chunk_gates(mG, mBeta, hv, bos, seqlen, c, lane)
            gate_pipe.producer_acquire(st)
            sG[2 * lane, st.index] = (before + vals[0][0]) * LOG2E
            sG[2 * lane + 1, st.index] = incl * LOG2E
            sBeta[2 * lane, st.index] = vals[0][1]
            sBeta[2 * lane + 1, st.index] = vals[1][1]
            if const_expr(gate_warp_witnesses_qk(self.aux_wgs)):
                qk_pipe.consumer_wait(ld)
                ld.advance()
            gate_pipe.producer_commit(st)
            st.advance()
