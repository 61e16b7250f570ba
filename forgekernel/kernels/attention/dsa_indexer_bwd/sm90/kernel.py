"""DSA lightning indexer backward (issue 22), sm_90a: dq, dw of one query row and its share of
the fp32 dK accumulator, cuDNN-frontend 1.32's `indexer_backward_wrapper` math
(reference/dsa_indexer_bwd.py):

    G[i]     = valid ? g[i] - p[i] sum_j g[j] : 0,  g = -scale max(target, e^-100) [p >= e^-100]
    S        = q K^T                    (64 heads x TILE slots a tile, GEMM1, K = 128)
    dS       = G[i] w[h] sm_scale [sm_scale S > 0]        (rounded to 16 bits, as cuDNN)
    dw[h]   += sum_i G[i] relu(sm_scale S)
    dq      += dS K                     (GEMM3, dS the register A operand)
    dK[id]  += dS^T q                   (GEMM2, dS^T through shared memory; fp32 reductions)

scale = grad_loss[0] x coeff (coeff = loss_coeff / (B S_q), read on the device: CUDA-graph safe).
A slot is valid when its id (per batch: e; global: e - b S_kv) lies in [0, S_kv): no K row is
read for the others (zero-filled in shared memory), G = 0 there, and dK gets nothing.

Warp roles (one CTA per query row; config.py has the plans `STANDARD` and `PAIR` and the
shared-memory figures):
- prologue, all threads: the row's target / predict / ids once (TOPK_MAX slots at most, every
  load issued before any mask), sum g by a block reduction, G and the flat key ids into shared
  memory, the last valid position (tiles past it are not run: the causal rows' padded tails).
- warpgroup 0 (setmaxnreg 24; pair 40) gathers q[t] once (issued before the prologue, in
  flight under it), then each tile's TILE key rows by cp.async (8 threads a 64-column chunk
  row), LAG tiles in flight: tile i's group waited (wait_group LAG), fenced for the async proxy
  and signalled on full[stage] when tile i + LAG has been issued.
- the consumer warpgroups (standard: two, setmaxnreg 240, alternate tiles i % 2, one CTA an SM;
  pair: one, setmaxnreg 216, every tile, two CTAs an SM), per tile: GEMM1, the epilogue (dS,
  dw), GEMM3 from registers, dS^T into the warpgroup's own shared buffer by stmatrix (after a
  128-thread barrier: every warp's previous GEMM2, the buffer's last reader, done), GEMM2
  (pair: one 64-column chunk at a time), then the stage released (after GEMM3, its last reader)
  and dK added: `red.global.add.v4.f32` straight from the GEMM2 accumulator, a lane pair's
  halves swapped by one shuffle each (lane 2m: row r, lane 2m + 1: row r + 8, four adjacent
  columns; 16 reductions a thread a tile, whole 32-byte sectors, no staging, no barrier). The
  candidate `staged` (`_reduce_staged`): the warp's rows staged in the tile's dead stage (a
  128-thread barrier first: every warp's GEMM3 done), read back as two full 256-byte rows a
  warp instruction (the sparse backward's red4s), the stage released after the last read-back.
  Consumer thread indices are 0 .. 127 within each warpgroup (the MMA slices, the staging and
  the exchange rows).
- end: dw over the quad; standard: warpgroup 2's dq / dw partials through shared memory to
  warpgroup 1, which stores them; pair: the consumer stores its own.
"""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.config import (
    CHUNK,
    CLIP_PROB_MIN,
    DIM,
    HEADS,
    LAG,
    NCHUNK,
    TILE,
    TOPK_MAX,
    exchange_floats,
    plan,
)
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import acc_as_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.warp_mma import copy_row_async, tiled_row_copy

STAGE_FLOATS = TILE * DIM * 2 // 4  # one 16-bit stage as fp32
WARP_FLOATS = 16 * CHUNK  # staged: a warp's 16 rows x 64 columns of a dK chunk


class Bar(IntEnum):
    DS_READY = FIRST_FREE  # 1 + w: consumer warpgroup w's dS^T tile is in shared memory
    EXCHANGE = 3  # both consumers: warpgroup 2's dq / dw partials are in shared memory
    STAGE_DEAD = 4  # staged, 4 + w: warpgroup w's GEMM3 (all warps) of the tile is done
    DS_FREE = 6  # 6 + w: warpgroup w's previous GEMM2 (all warps) is done: dS^T may be rewritten


class DsaIndexerBwdSm90:
    """See the module docstring (compile key: the 16-bit dtype; 64 heads x 128); reduce False:
    the timing probe (config.params_for): the dK reductions' guard is never true."""

    def __init__(self, reduce: bool = True, staged: bool = False, pair: bool = False):
        self.p = plan(pair)  # config.Plan: warp roles, ring, registers, CTAs an SM
        self.reduce = reduce
        # staged (a candidate): dK through the tile's dead stage, read back as two 256-byte rows
        # a warp instruction (`_reduce_staged`); False: the lane-pair swap (`_reduce_dk`)
        self.staged = staged

    def _setup(self, dt):
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # S (64 heads, TILE slots) = q K^T: both K-major
        self.mma_s = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (HEADS, TILE)
        )
        # dq chunk (64 heads, 64 columns) += dS K: A (dS) from registers, B the stage's
        # transposed (MN-major) chunk
        self.mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (HEADS, CHUNK), a_source=rmem
        )
        # dK chunk (TILE slots, 64 columns) = dS^T q: A MN-major (slots contiguous: dS's
        # stmatrix stores of S's layout), B q's transposed chunk
        self.mma_dk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mn_major, mn_major, Float32, (1, 1, 1), (TILE, CHUNK)
        )
        row, col = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
        # q (64, CHUNK, NCHUNK), the key ring (TILE, CHUNK, NCHUNK x STAGES): 128-byte swizzled
        # K-major tiles; dS^T (TILE, HEADS, CONSUMERS) slots contiguous (M-major), written by
        # stmatrix through its transposed view (S's layout: 8 stores a thread, not 32 scalar
        # ones whose 32 swizzled addresses spilled)
        self.lay_q = sm90_utils.make_smem_layout_a(row, (HEADS, TILE, CHUNK), dt, NCHUNK)
        self.lay_k = sm90_utils.make_smem_layout_b(
            row, (HEADS, TILE, CHUNK), dt, NCHUNK * self.p.stages
        )
        self.lay_ds = sm90_utils.make_smem_layout_a(col, (TILE, CHUNK, HEADS), dt, self.p.consumers)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mW: cute.Tensor,
        mK: cute.Tensor,
        mTarget: cute.Tensor,
        mPredict: cute.Tensor,
        mIdx: cute.Tensor,
        mGradLoss: cute.Tensor,
        mdQ: cute.Tensor,
        mdW: cute.Tensor,
        mdK: cute.Tensor,
        sm_scale: Float32,
        coeff: Float32,
        s_q: Int32,
        s_kv: Int32,
        global_ids: Int32,
        stream: cuda.CUstream,
    ):
        """mQ (rows, 64, 128), mK (B S_kv, 128) 16-bit, rows 16-byte aligned; mW (rows, 64) the
        same dtype; mTarget, mPredict (rows, topk) fp32 and mIdx (rows, topk) int32, unit
        column stride, 1 <= topk <= TOPK_MAX; mGradLoss (1,) fp32; mdQ (rows, 64, 128), mdW
        (rows, 64) in the inputs' dtype; mdK (B S_kv, 128) fp32 zeroed by the caller, rows
        16-byte aligned. rows = B s_q (row t is batch t // s_q); global_ids != 0: ids are
        b s_kv + e."""
        dt = mQ.element_type
        if const_expr(mK.element_type != dt or mW.element_type != dt):
            raise TypeError("q, k and weights must share one 16-bit dtype")
        if const_expr(mdK.element_type != Float32 or mTarget.element_type != Float32):
            raise TypeError("target, predict and the dK accumulator are float32")
        self._setup(dt)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, self.p.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.p.stages]
            part: cute.struct.MemRange[Float32, self.p.warps]
            last: cute.struct.MemRange[Int32, self.p.warps]
            g: cute.struct.MemRange[Float32, TOPK_MAX]
            ids: cute.struct.MemRange[Int32, TOPK_MAX]
            x: cute.struct.MemRange[Float32, exchange_floats(self.p)]
            q: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_q)], 1024]
            k: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_k)], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_ds)], 1024]

        self.shared = Shared
        scalars = (sm_scale, coeff, s_q, s_kv, global_ids)
        self.kernel(
            mQ, mW, mK, mTarget, mPredict, mIdx, mGradLoss, mdQ, mdW, mdK, scalars,
            self.mma_s, self.mma_dq, self.mma_dk, self.lay_q, self.lay_k, self.lay_ds,
        ).launch(grid=(mQ.shape[0], 1, 1), block=[self.p.threads, 1, 1],
                 min_blocks_per_mp=self.p.ctas,
                 preferred_smem_carveout=100,  # percent: the whole 228 KB (no device query)
                 stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mW: cute.Tensor,
        mK: cute.Tensor,
        mTarget: cute.Tensor,
        mPredict: cute.Tensor,
        mIdx: cute.Tensor,
        mGradLoss: cute.Tensor,
        mdQ: cute.Tensor,
        mdW: cute.Tensor,
        mdK: cute.Tensor,
        scalars,
        mma_s: cute.TiledMma,
        mma_dq: cute.TiledMma,
        mma_dk: cute.TiledMma,
        lay_q: cute.ComposedLayout,
        lay_k: cute.ComposedLayout,
        lay_ds: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        storage = SmemAllocator().allocate(self.shared)
        sG = storage.g.get_tensor(cute.make_layout(TOPK_MAX))
        sIds = storage.ids.get_tensor(cute.make_layout(TOPK_MAX))
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.p.stages):
                cute.arch.mbarrier_init(full + s, THREADS_PER_WG)
                cute.arch.mbarrier_init(empty + s, THREADS_PER_WG)
        cute.arch.mbarrier_init_fence()
        sm = (smem_tensor(storage.q, lay_q), smem_tensor(storage.k, lay_k),
              smem_tensor(storage.ds, lay_ds), sG, sIds)  # fmt: skip
        if wg == 0:  # q[t] in flight under the prologue (the oldest cp.async group)
            self._load_q(mQ, sm[0], t, tidx)
        tiles = self._prologue(mTarget, mPredict, mIdx, mGradLoss, scalars, storage, sG, sIds,
                               t, tidx)  # fmt: skip
        if wg == 0:
            cute.arch.setmaxregister_decrease(self.p.producer_regs)
            self._gather(mQ, mK, sm, full, empty, t, tiles, tidx)
        else:
            cute.arch.setmaxregister_increase(self.p.consumer_regs)
            ins = (mW, mdQ, mdW, mdK, scalars[0])
            mmas = (mma_s, mma_dq, mma_dk)
            sX = storage.x.get_tensor(cute.make_layout(exchange_floats(self.p)))
            if const_expr(self.p.consumers == 2):
                sX = storage.x.get_tensor(
                    cute.make_layout((THREADS_PER_WG, HEADS * DIM // THREADS_PER_WG + 2))
                )
            # staged: the ring's bytes as fp32 (stage, float), a stage 16 KB = 4096 floats
            sRed = cute.make_tensor(
                cute.recast_ptr(storage.k.data_ptr(), dtype=Float32),
                cute.make_layout((self.p.stages, STAGE_FLOATS), stride=(STAGE_FLOATS, 1)),
            )
            sX = (sX, sRed)
            ctid = tidx - THREADS_PER_WG
            if const_expr(self.p.consumers == 1):
                self._consume(ins, sm, sX, full, empty, mmas, t, tiles, ctid, 0)
            elif wg == 1:
                self._consume(ins, sm, sX, full, empty, mmas, t, tiles, ctid, 0)
            else:
                self._consume(ins, sm, sX, full, empty, mmas, t, tiles, ctid - THREADS_PER_WG, 1)

    # ---- prologue (all threads) -----------------------------------------------------------

    @cute.jit
    def _prologue(self, mTarget, mPredict, mIdx, mGradLoss, scalars, storage, sG, sIds, t, tidx):
        """G and the flat ids of the row's slots into shared memory (positions past topk up to
        the next multiple of TILE: G 0, id -1); returns the tiles to run (through the last
        valid slot)."""
        _, coeff, s_q, s_kv, global_ids = scalars
        topk = mIdx.shape[1]
        padded = (topk + TILE - 1) // TILE * TILE
        base = (t // s_q) * s_kv
        shift = Int32(cutlass.select_(global_ids != 0, base, Int32(0)))
        scale = mGradLoss[0] * coeff
        per, threads, warps = self.p.per_thread, self.p.threads, self.p.warps
        g = cute.make_rmem_tensor(per, Float32)
        p = cute.make_rmem_tensor(per, Float32)
        ids = cute.make_rmem_tensor(per, Int32)
        # every load first, at clamped positions (no branch between them: one memory latency,
        # not one a slot; 2026-12-04 SASS: six serialized round trips with the loads inside
        # `if j < topk`), then the masks
        for m in cutlass.range_constexpr(per):
            jc = cutlass.min(tidx + m * threads, topk - 1)
            ids[m] = mIdx[t, jc]
            p[m] = mPredict[t, jc]
            g[m] = mTarget[t, jc]
        total = Float32(0.0)
        last = Int32(-1)
        for m in cutlass.range_constexpr(per):
            j = tidx + m * threads
            local = ids[m] - shift
            valid = (j < topk) & (local >= 0) & (local < s_kv)
            keep = (j < topk) & (p[m] >= Float32(CLIP_PROB_MIN))
            tc = cutlass.max(g[m], Float32(CLIP_PROB_MIN))
            g[m] = Float32(cutlass.select_(keep, -scale * tc, Float32(0.0)))
            total = total + g[m]
            last = Int32(cutlass.select_(valid, j, last))  # j grows with m
            ids[m] = Int32(cutlass.select_(valid, local + base, Int32(-1)))
            if j < padded:
                sIds[j] = ids[m]
        for off in cutlass.range_constexpr(5):
            total = total + cute.arch.shuffle_sync_bfly(total, 16 >> off)
            last = cutlass.max(last, cute.arch.shuffle_sync_bfly(last, 16 >> off))
        sPart = storage.part.get_tensor(cute.make_layout(warps))
        sLast = storage.last.get_tensor(cute.make_layout(warps))
        lane = tidx % 32
        if lane == 0:
            sPart[tidx // 32] = total
            sLast[tidx // 32] = last
        cute.arch.sync_threads()
        total = Float32(0.0)
        last = Int32(-1)
        for v in cutlass.range_constexpr(warps):  # the same order in every thread
            total = total + sPart[v]
            last = cutlass.max(last, sLast[v])
        for m in cutlass.range_constexpr(per):
            j = tidx + m * threads
            if j < padded:  # padding (ids -1, past topk included): 0
                sG[j] = Float32(cutlass.select_(ids[m] >= 0, g[m] - p[m] * total, Float32(0.0)))
        cute.arch.sync_threads()
        return (last + TILE) // TILE

    # ---- producer ------------------------------------------------------------------------

    @cute.jit
    def _load_q(self, mQ, sQ, t, tid):
        """Warpgroup 0, before the prologue: q[t] by cp.async, one commit group (the oldest:
        done when tile 0's is)."""
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        thr = gcopy.get_slice(tid)
        qcrd = thr.partition_S(cute.make_identity_tensor((HEADS, CHUNK)))
        for k in cutlass.range_constexpr(NCHUNK):
            d = thr.partition_D(sQ[None, None, k])
            for m in cutlass.range_constexpr(cute.size(d, mode=[1])):
                row = mQ[t, qcrd[0, m, 0][0], None]
                seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                copy_row_async(gcopy, seg, CHUNK, d[None, m, None], qcrd[None, m, None])
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _gather(self, mQ, mK, sm, full, empty, t, tiles, tid):
        """Warpgroup 0: every tile's key rows into its stage (module docstring); q[t]'s group
        was committed before the prologue."""
        _, sK, _, _, sIds = sm
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        thr = gcopy.get_slice(tid)
        crd = thr.partition_S(cute.make_identity_tensor((TILE, CHUNK)))
        per_thread = cute.size(crd, mode=[1])
        rows = cute.make_rmem_tensor(per_thread, Int32)
        for i in cutlass.range(tiles + LAG, unroll=1):
            if i < tiles:
                s = i % self.p.stages
                cute.arch.mbarrier_wait(empty + s, ((i // self.p.stages) & 1) ^ 1)
                for m in cutlass.range_constexpr(per_thread):
                    rows[m] = sIds[i * TILE + crd[0, m, 0][0]]
                for k in cutlass.range_constexpr(NCHUNK):
                    d = thr.partition_D(sK[None, None, s * NCHUNK + k])
                    for m in cutlass.range_constexpr(per_thread):
                        if rows[m] >= 0:
                            row = mK[rows[m], None]
                            seg = cute.make_tensor(row.iterator + k * CHUNK,
                                                   cute.make_layout(CHUNK))  # fmt: skip
                            copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])
                        else:  # zeros: a stale row would put 0 x NaN into dq
                            d[None, m, None].fill(0.0)
            cute.arch.cp_async_commit_group()  # empty past the last tile: the count stays LAG
            if i >= LAG:
                cute.arch.cp_async_wait_group(LAG)  # tile i - LAG's rows (and q) have landed
                cute.arch.fence_view_async_shared()  # cp.async and st.shared, then WGMMA reads
                cute.arch.mbarrier_arrive(full + (i - LAG) % self.p.stages)
        cute.arch.cp_async_wait_group(0)

    # ---- consumers -----------------------------------------------------------------------

    @cute.jit
    def _consume(self, ins, sm, sX, full, empty, mmas, t, tiles, ltid,
                 w: cutlass.Constexpr[int]):  # fmt: skip
        """Consumer warpgroup w (ltid 0 .. 127): tiles w, w + 2, ... (module docstring)."""
        mW, mdQ, mdW, mdK, sm_scale = ins
        sQ, sK, sdS, sG, sIds = sm
        sX, sRed = sX
        mma_s, mma_dq, mma_dk = mmas
        lane = ltid % 32
        # GEMM1: S = q K^T
        t_s = mma_s.get_slice(ltid)
        tSQ = t_s.make_fragment_A(t_s.partition_A(sQ))
        tSK = t_s.make_fragment_B(t_s.partition_B(sK))
        acc_s = cute.make_rmem_tensor(t_s.partition_shape_C((HEADS, TILE)), Float32)
        s_crd = rows_cols(t_s.partition_C(cute.make_identity_tensor((HEADS, TILE))))
        s_rc = rows_cols(acc_s)
        n_rows, n_cols = cute.size(s_crd, mode=[0]), cute.size(s_crd, mode=[1])
        # dS: 16-bit copy of S's accumulator, the stmatrix into this warpgroup's dS^T buffer
        rdS = cute.make_rmem_tensor(acc_s.shape, sdS.element_type)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), sdS.element_type),
            mma_s,
        )
        thr_r2s = r2s.get_slice(ltid)
        tdSsdS = thr_r2s.partition_D(transposed(sdS)[None, None, w])
        # GEMM3: dq += dS K
        t_dq = mma_dq.get_slice(ltid)
        tQdS = t_dq.make_fragment_A(t_dq.partition_shape_A((HEADS, TILE)))
        tQK = t_dq.make_fragment_B(t_dq.partition_B(transposed(sK)))
        acc_dq = [cute.make_rmem_tensor(t_dq.partition_shape_C((HEADS, CHUNK)), Float32)
                  for _ in range(NCHUNK)]  # fmt: skip
        for acc in acc_dq:
            acc.fill(0.0)
        # GEMM2: dK = dS^T q
        t_dk = mma_dk.get_slice(ltid)
        tKdS = t_dk.make_fragment_A(t_dk.partition_A(sdS))
        tKQ = t_dk.make_fragment_B(t_dk.partition_B(transposed(sQ)))
        acc_dk = [cute.make_rmem_tensor(t_dk.partition_shape_C((TILE, CHUNK)), Float32)
                  for _ in range(self.p.dk_chunks)]  # fmt: skip
        dk_crd = t_dk.partition_C(cute.make_identity_tensor((TILE, CHUNK)))
        # this lane's dK row of a tile: lane 2m row r, lane 2m + 1 row r + 8 (`_reduce_dk`)
        dk_row = dk_crd[0][0] + 8 * (lane % 2)
        dk_col = 4 * ((lane % 4) // 2)
        # w sm_scale of the thread's two heads, its dw partials
        ws = cute.make_rmem_tensor(n_rows, Float32)
        dw = cute.make_rmem_tensor(n_rows, Float32)
        for r in cutlass.range_constexpr(n_rows):
            ws[r] = mW[t, s_crd[r, 0][0]].to(Float32) * sm_scale
            dw[r] = Float32(0.0)
        ds_ready = named_barrier(Bar.DS_READY + w, THREADS_PER_WG)
        ds_free = named_barrier(Bar.DS_FREE + w, THREADS_PER_WG)
        stage_dead = named_barrier(Bar.STAGE_DEAD + w, THREADS_PER_WG)
        warp = ltid // 32
        # staged: the lane's read-back rows 2 k + lane // 16 of its warp's 16
        rids = cute.make_rmem_tensor(8, Int32)

        for i in cutlass.range(w, tiles, self.p.consumers, unroll=1):
            s = i % self.p.stages
            cute.arch.mbarrier_wait(full + s, (i // self.p.stages) & 1)
            for c in cutlass.range_constexpr(NCHUNK):
                gemm(mma_s, acc_s, tSQ[None, None, None, c], tSK[None, None, None, s * NCHUNK + c],
                     c == 0, -1)  # fmt: skip
            warpgroup.wait_group(0)
            slot0 = i * TILE
            for c in cutlass.range_constexpr(n_cols):
                gc = sG[slot0 + s_crd[0, c][1]]
                for r in cutlass.range_constexpr(n_rows):
                    x = s_rc[r, c] * sm_scale
                    dw[r] = dw[r] + gc * cutlass.max(x, Float32(0.0))
                    s_rc[r, c] = Float32(cutlass.select_(x > Float32(0.0), gc * ws[r],
                                                         Float32(0.0)))  # fmt: skip
            rdS.store(acc_s.load().to(sdS.element_type))
            tQdS.store(acc_as_operand_a(rdS).load())
            for c in cutlass.range_constexpr(NCHUNK):
                gemm(mma_dq, acc_dq[c], tQdS, tQK[None, None, None, s * NCHUNK + c], False, -1)
            # dS^T into this warpgroup's buffer. Its last readers are the previous tile's GEMM2
            # WGMMAs of all four warps, and each warp's wait_group 0 covers its own only: warp v
            # writes rows every warp's GEMM2 slice reads (A = dS^T, K = the heads), so all four
            # waits must precede any warp's stores (review 2026-12-04: no barrier stood between
            # them; the same per-warp model as STAGE_DEAD and the stage's 128 empty arrivals)
            ds_free.arrive_and_wait()
            cute.copy(r2s, thr_r2s.retile(rdS), tdSsdS)
            cute.arch.fence_view_async_shared()  # st.shared, then the WGMMAs' reads
            ds_ready.arrive_and_wait()
            nacc = self.p.dk_chunks  # GEMM2's chunks issued at once (pair: one at a time)
            for c in cutlass.range_constexpr(nacc):
                gemm(mma_dk, acc_dk[c], tKdS[None, None, None, w], tKQ[None, None, None, c],
                     True, -1)  # fmt: skip
            rid = sIds[slot0 + dk_row]
            if const_expr(self.staged):
                for k in cutlass.range_constexpr(8):
                    rids[k] = sIds[slot0 + 16 * warp + 2 * k + lane // 16]
            warpgroup.wait_group(nacc)  # GEMM3, the stage's last reader, is done
            if const_expr(self.staged):  # every warp's part of it: the stage is staging room
                stage_dead.arrive_and_wait()
            else:
                cute.arch.mbarrier_arrive(empty + s)
            for c in cutlass.range_constexpr(NCHUNK):
                acc = acc_dk[c % nacc]
                if const_expr(c >= nacc):  # pair: the accumulator's reductions were issued
                    gemm(mma_dk, acc, tKdS[None, None, None, w], tKQ[None, None, None, c],
                         True, -1)  # fmt: skip
                warpgroup.wait_group(nacc - 1 - c if c < nacc else 0)
                if const_expr(self.staged):
                    sw = cute.make_tensor(sRed[s, None].iterator + warp * WARP_FLOATS,
                                          cute.make_layout(WARP_FLOATS))  # fmt: skip
                    release = empty + s if const_expr(c == NCHUNK - 1) else None
                    self._reduce_staged(acc, mdK, rids, c * CHUNK, lane, sw, release)
                else:
                    self._reduce_dk(acc, mdK, rid, c * CHUNK + dk_col, lane)
        self._finish(mdQ, mdW, acc_dq, dw, t_dq, s_crd, sX, t, ltid, w)

    @cute.jit
    def _reduce_dk(self, acc, mdK, rid, col0, lane):
        """dK[rid, col0 + 8 j ..] += four columns a `red.global.add.v4.f32`: the accumulator's
        raw element 4 j + 2 h + e is (row r + 8 h, column 8 j + 2 (lane % 4) + e); lanes 2m and
        2m + 1 swap the halves the other keeps (one shuffle a value), so lane 2m holds row r's
        columns 8 j + 4 (lane % 4 // 2) .. + 3 and lane 2m + 1 row r + 8's, written back in
        place (acc[4 j ..]; GEMM2 zero-initializes it next); then the reductions under one
        branch (the row id is the lane's for the whole tile: one branch, not sixteen)."""
        odd = (lane % 2) == 1
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            a0, a1 = acc[4 * j], acc[4 * j + 1]  # row r
            b0, b1 = acc[4 * j + 2], acc[4 * j + 3]  # row r + 8
            y0 = cute.arch.shuffle_sync_bfly(Float32(cutlass.select_(odd, a0, b0)), 1)
            y1 = cute.arch.shuffle_sync_bfly(Float32(cutlass.select_(odd, a1, b1)), 1)
            acc[4 * j] = Float32(cutlass.select_(odd, y0, a0))
            acc[4 * j + 1] = Float32(cutlass.select_(odd, y1, a1))
            acc[4 * j + 2] = Float32(cutlass.select_(odd, b0, y0))
            acc[4 * j + 3] = Float32(cutlass.select_(odd, b1, y1))
        ok = rid >= 0 if const_expr(self.reduce) else rid == -2  # ids are >= -1
        if ok:
            row = mdK[rid, None].iterator + col0
            for j in cutlass.range_constexpr(cute.size(acc) // 4):
                quad = cute.make_tensor(acc.iterator + 4 * j, cute.make_layout(4)).load()
                cute.arch.red(row + 8 * j, quad, op="add", dtype=Float32, sem="relaxed",
                              scope="gpu")  # fmt: skip

    @cute.jit
    def _reduce_staged(self, acc, mdK, rids, col0, lane, sw, release):
        """staged: the warp's 16 rows of the chunk into its 4 KB of the dead stage (64 floats a
        row, 16-byte pieces XOR-swizzled by row % 8: conflict-free 64-bit stores and 128-bit
        loads), read back as rows 2 k + lane // 16, columns 4 (lane % 16) .. + 3, then (release:
        the tile's last chunk) this thread's empty arrival after its last read of the stage, then
        `red.global.add.v4.f32`: two 256-byte rows a warp instruction."""
        cute.arch.sync_warp()  # every lane's reads of the previous chunk are done
        quad = lane % 4
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for h in cutlass.range_constexpr(2):
                row = lane // 4 + 8 * h
                piece = (2 * j + quad // 2) ^ (row % 8)
                off = row * CHUNK + piece * 4 + 2 * (quad % 2)
                ptr = cute.make_ptr(Float32, (sw.iterator + off).toint(), cute.AddressSpace.smem,
                                    assumed_align=8)  # fmt: skip
                pair = cute.make_tensor(acc.iterator + 4 * j + 2 * h, cute.make_layout(2)).load()
                cute.make_tensor(ptr, cute.make_layout(2)).store(pair)
        cute.arch.sync_warp()
        quads = cute.make_rmem_tensor((4, 8), Float32)
        piece = lane % 16
        for k in cutlass.range_constexpr(8):
            row = 2 * k + lane // 16
            off = row * CHUNK + (piece ^ (row % 8)) * 4
            ptr = cute.make_ptr(Float32, (sw.iterator + off).toint(), cute.AddressSpace.smem,
                                assumed_align=16)  # fmt: skip
            quads[None, k].store(cute.make_tensor(ptr, cute.make_layout(4)).load())
        if const_expr(release is not None):
            cute.arch.mbarrier_arrive(release)  # every thread: its own staging and id reads
        for k in cutlass.range_constexpr(8):
            ok = rids[k] >= 0 if const_expr(self.reduce) else rids[k] == -2  # ids are >= -1
            if ok:
                cute.arch.red(mdK[rids[k], None].iterator + (col0 + 4 * piece),
                              quads[None, k].load(), op="add", dtype=Float32, sem="relaxed",
                              scope="gpu")  # fmt: skip

    @cute.jit
    def _finish(self, mdQ, mdW, acc_dq, dw, t_dq, s_crd, sX, t, ltid, w: cutlass.Constexpr[int]):
        """dw over the quad (the lanes sharing a head), then warpgroup 2's dq / dw partials to
        warpgroup 1 through sX (lane ltid of either holds the same coordinates), which adds its
        own and stores dq[t] (64 x 128) and dw[t] (64)."""
        n_rows = cute.size(dw)
        for r in cutlass.range_constexpr(n_rows):
            for off in cutlass.range_constexpr(2):
                dw[r] = dw[r] + cute.arch.shuffle_sync_bfly(dw[r], 1 << off)
        per = cute.size(acc_dq[0])
        exchange = named_barrier(Bar.EXCHANGE, 2 * THREADS_PER_WG)
        if const_expr(self.p.consumers == 1):  # pair: the only consumer stores its own
            crd = t_dq.partition_C(cute.make_identity_tensor((HEADS, CHUNK)))
            for c in cutlass.range_constexpr(NCHUNK):
                for e in cutlass.range_constexpr(per):
                    head, col = crd[e]
                    mdQ[t, head, c * CHUNK + col] = acc_dq[c][e].to(mdQ.element_type)
            if ltid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows):
                    mdW[t, s_crd[r, 0][0]] = dw[r].to(mdW.element_type)
        elif const_expr(w == 1):
            for c in cutlass.range_constexpr(NCHUNK):
                for e in cutlass.range_constexpr(per):
                    sX[ltid, c * per + e] = acc_dq[c][e]
            for r in cutlass.range_constexpr(n_rows):
                sX[ltid, NCHUNK * per + r] = dw[r]
            exchange.arrive()
        else:
            exchange.arrive_and_wait()
            crd = t_dq.partition_C(cute.make_identity_tensor((HEADS, CHUNK)))
            for c in cutlass.range_constexpr(NCHUNK):
                for e in cutlass.range_constexpr(per):
                    head, col = crd[e]
                    v = acc_dq[c][e] + sX[ltid, c * per + e]
                    mdQ[t, head, c * CHUNK + col] = v.to(mdQ.element_type)
            if ltid % 4 == 0:
                for r in cutlass.range_constexpr(n_rows):
                    v = dw[r] + sX[ltid, NCHUNK * per + r]
                    mdW[t, s_crd[r, 0][0]] = v.to(mdW.element_type)


__all__ = ["DsaIndexerBwdSm90"]
