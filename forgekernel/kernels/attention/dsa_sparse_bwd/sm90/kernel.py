"""DeepSeek sparse attention backward (DSA, issue 22), sm_90a, v1: dq of one query token's
head block and its share of dkv, from the forward's out / LSE folded by the launcher's
preprocess into lse2 = log2(e) logaddexp(lse, sink) (+inf for a row that saw nothing) and
Delta' = rowsum(dO O) - dlse exp(lse_all - lse) (reference.dsa `dsa_sparse_attention_bwd_ref`):

    P^T  = exp2(scale log2(e) K q^T - lse2)       (64 gathered rows x BLOCK heads, a tile)
    dS^T = scale P^T (V dO^T - Delta')
    dq  += dS K                                   (kept transposed: dq^T = K^T dS^T)
    dkv[row] += dS^T q + P^T dO (first 512 columns)  fp32 reductions (red4s below, or v2)

K = the 576-wide gathered rows, V their first 512 columns. An entry is valid when its list
position is < topk and 0 <= entry < slots: an invalid row is zero-filled in shared memory, its
P is 0 and it adds nothing. Rows on the WGMMAs' M, heads on N (docs/attention/DSA_BWD_NOTES.md,
"Kernel v1"; config.py has the shared-memory plan).

Warp roles (one CTA per (token, head block), 384 threads):
- warpgroup 0 (setmaxnreg 56) gathers: q (BLOCK x 576) and dO (BLOCK x 512) once, then per
  tile the 64 listed rows K-chunk by K-chunk into stage i % STAGES by cp.async (8 threads a
  row, 4 rows a thread), the stage's row ids (-1: invalid) into shared memory; it waits for
  its own copies, fences them for the async proxy and arrives on full[stage] (128 arrivals).
- warpgroups 1 and 2 (setmaxnreg 224), per tile: S^T and dP^T (64 x BLOCK / 2 each: warpgroup
  w takes heads [w BLOCK / 2, ...)), P^T and dS^T rounded into shared memory; a named barrier;
  then dq^T += K^T dS^T on their column blocks (config.DQ_BLOCKS, registers across the tiles)
  and dkv blocks (config.DKV_BLOCKS: 64 x 64 accumulators, two alternating so that one
  block's reductions run under the next one's MMAs). empty[stage] is released (one arrival per
  consumer thread: racecheck orders a thread's loads of the row ids before the producer's
  next stores only through that thread's own arrive, not a warp's lane 0 after a warp sync;
  H200 2026-12-03) once the dq MMAs, the last readers of the stage, are done.
- at the end each consumer stores its dq^T blocks (q's dtype, scalar stores).

The reductions `red4s` (blocks 16 and 32; measured 2026-12-04 00:37, config.py): instead of
the fragments' `red.global.add.v2.f32`, each warp stages its 16 rows of a dkv block in shared
memory and reads them back by 128-bit loads into `red.global.add.v4.f32`, the staging placed in
the current tile's stage (no extra shared memory, so that block 32's 221 KB take it too): once a
warpgroup's dq^T MMAs of the tile are done (its threads' waits, then a named barrier over the
warpgroup), the stage's column blocks
config.DQ_BLOCKS[w] have no reader left in the tile and hold that warpgroup's four staging
buffers; empty[stage] is then released after the thread's last staging read of the tile (the
last dkv block's loads, before its reductions) instead of after block 0's wait
(`_reduce_v4s`; config.py `RED4S_OFFSET` has the hazards). The standard build is xchg4s,
red4s under `xchg` (the same dead blocks, barrier and release: config.py; measured 2026-12-04
04:23: 0.919 / 0.934 of red4s's time at H 16 / 128), red4s alone a candidate.
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

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import (
    CHUNK,
    CONSUMER_REGS,
    CONSUMERS,
    D_V,
    DKV_BLOCKS,
    DQ_BLOCKS,
    NCHUNK,
    PRODUCER_REGS,
    RED4S_OFFSET,
    STAGE_CHUNK_FLOATS,
    STAGING_ROWS,
    STAGING_STRIDE,
    THREADS,
    TILE,
    WIDTH,
    stages,
)
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.warp_mma import copy_row_async, tiled_row_copy

CONSUMER_THREADS = CONSUMERS * THREADS_PER_WG
VCHUNK = D_V // CHUNK  # 8 chunks of V / dO


class Bar(IntEnum):
    PDS = FIRST_FREE  # consumer threads: the tile's P^T / dS^T are in shared memory
    FREE = 2  # consumer threads: the previous tile's MMAs that read P^T / dS^T are done
    XCHG = 3  # xchg: each warpgroup's half of S^T / dP^T is in the exchange buffer
    XREAD = 4  # xchg: the exchange buffer (P^T / dS^T's bytes) has been read
    DQ_DONE = 5  # red4s / xchg4s, 5 + w: warpgroup w's dq^T MMAs of the tile are done (all warps)


def _rows_cols(t: cute.Tensor) -> cute.Tensor:
    """`layout.rows_cols`, also for an 8-column accumulator ((2, 2), M, N) (no V mode: the
    16-head block's S^T / dP^T halves)."""
    shape = t.layout.shape
    if const_expr(cute.rank(shape[0]) == 3):
        return rows_cols(t)
    s = cute.make_layout(shape).stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[2])),
        stride=((s[0][1], s[1]), (s[0][0], s[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


class DsaSparseBwdSm90:
    """See the module docstring; `block` is BLOCK (the heads of one CTA, the WGMMAs' N)."""

    def __init__(
        self,
        block: int,
        reduce: bool = True,
        xchg: bool = False,
        red4s: bool = False,
    ):
        self.block = block
        self.stages = stages(block)
        # xchg (the standard form, with red4s): warpgroup 1 computes S^T, warpgroup 2 dP^T, all
        # heads each (the K tile read once, N = BLOCK), halves swapped through fp32 shared memory
        # aliasing P^T / dS^T; then each warpgroup rounds P^T / dS^T of its half of the heads
        self.xchg = xchg
        # False: the timing probe (config.params_for): the reductions' guard is never true
        self.reduce = reduce
        # red4s (with xchg the standard form xchg4s, alone a candidate): dkv blocks staged per
        # warp in the current tile's stage (the warpgroup's dq^T column blocks, dead once its
        # dq^T MMAs are done), read back into red.global.add.v4.f32; False: the fragments'
        # red.global.add.v2.f32
        self.red4s = red4s

    def _setup(self, dt):
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        b, half = self.block, self.block // CONSUMERS
        # S^T = K q^T, dP^T = V dO^T: the two warpgroups split the heads (N = BLOCK / 2 each)
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, CONSUMERS, 1), (TILE, half)
        )
        if const_expr(self.xchg):  # one warpgroup, all heads
            self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
                dt, dt, k_major, k_major, Float32, (1, 1, 1), (TILE, b)
            )
        # dkv block (64 rows x 64 columns) = dS^T q_c + P^T dO_c: A K-major, B the transposed
        # (MN-major) view of q / dO's chunk c; one warpgroup each
        self.mma_kv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (TILE, CHUNK)
        )
        # dq^T block (64 columns x BLOCK heads) += K_b^T dS^T: both operands MN-major views
        self.mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mn_major, mn_major, Float32, (1, 1, 1), (CHUNK, b)
        )
        row = LayoutEnum.ROW_MAJOR
        # gathered rows (64, CHUNK, NCHUNK x stages), q (BLOCK, CHUNK, NCHUNK), dO (.., 8),
        # all K-major with 128-byte swizzle; P^T / dS^T (64, BLOCK) K-major
        self.lay_kv = sm90_utils.make_smem_layout_a(row, (TILE, b, CHUNK), dt, NCHUNK * self.stages)
        self.lay_q = sm90_utils.make_smem_layout_b(row, (TILE, b, CHUNK), dt, NCHUNK)
        self.lay_do = sm90_utils.make_smem_layout_b(row, (TILE, b, CHUNK), dt, VCHUNK)
        self.lay_p = sm90_utils.make_smem_layout_a(row, (TILE, CHUNK, b), dt, 1)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mdO: cute.Tensor,
        mLse2: cute.Tensor,
        mDelta: cute.Tensor,
        mIdx: cute.Tensor,
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        scale_log2: Float32,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ (tokens, H, 576), mKV (slots, 576), mdO (tokens, H, 512) 16-bit, rows 16-byte
        aligned; mLse2, mDelta (tokens, H) fp32 (module docstring); mIdx int32 (tokens, topk),
        unit column stride, topk >= 1; mdQ (tokens, H, 576) q's dtype; mdKV (slots, 576) fp32,
        zeroed by the caller, unit column stride and even row stride; H a multiple of BLOCK."""
        dt = mQ.element_type
        if const_expr(mKV.element_type != dt or mdO.element_type != dt):
            raise TypeError("q, kv and dO must share one 16-bit dtype")
        if const_expr(mdKV.element_type != Float32 or mLse2.element_type != Float32):
            raise TypeError("lse2, delta and the dkv accumulator are float32")
        self._setup(dt)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            rows: cute.struct.MemRange[Int32, TILE * self.stages]
            kv: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_kv)], 1024]
            q: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_q)], 1024]
            do: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_do)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]

        self.shared = Shared
        grid = (mQ.shape[0], mQ.shape[1] // self.block, 1)
        self.kernel(
            mQ, mKV, mdO, mLse2, mDelta, mIdx, mdQ, mdKV, scale_log2, scale, self.mma_sdp,
            self.mma_kv, self.mma_dq, self.lay_kv, self.lay_q, self.lay_do, self.lay_p,
        ).launch(grid=grid, block=[THREADS, 1, 1], min_blocks_per_mp=1, stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mdO: cute.Tensor,
        mLse2: cute.Tensor,
        mDelta: cute.Tensor,
        mIdx: cute.Tensor,
        mdQ: cute.Tensor,
        mdKV: cute.Tensor,
        scale_log2: Float32,
        scale: Float32,
        mma_sdp: cute.TiledMma,
        mma_kv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        lay_kv: cute.ComposedLayout,
        lay_q: cute.ComposedLayout,
        lay_do: cute.ComposedLayout,
        lay_p: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, hblk, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        tiles = cute.ceil_div(mIdx.shape[1], TILE)
        where = (token, hblk * self.block, tiles)

        storage = SmemAllocator().allocate(self.shared)
        sm = (
            smem_tensor(storage.kv, lay_kv),
            smem_tensor(storage.q, lay_q),
            smem_tensor(storage.do, lay_do),
            smem_tensor(storage.p, lay_p),
            smem_tensor(storage.ds, lay_p),
            storage.rows.get_tensor(cute.make_layout((TILE, self.stages))),
            # xchg: (thread, fragment element) fp32 over P^T and dS^T's bytes (adjacent fields)
            cute.make_tensor(
                cute.recast_ptr(storage.p.data_ptr(), dtype=Float32),
                cute.make_layout((THREADS_PER_WG, self.block // 2)),
            ),
            # red4s: the stages' bytes as fp32 (stage, float): the staging (`_tile_red`)
            cute.make_tensor(
                cute.recast_ptr(storage.kv.data_ptr(), dtype=Float32),
                cute.make_layout((self.stages, NCHUNK * STAGE_CHUNK_FLOATS),
                                 stride=(NCHUNK * STAGE_CHUNK_FLOATS, 1)),
            ),
        )  # fmt: skip
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(full + s, THREADS_PER_WG)
                cute.arch.mbarrier_init(empty + s, CONSUMER_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self._gather(mQ, mKV, mdO, mIdx, sm, full, empty, where, tidx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            mmas = (mma_sdp, mma_kv, mma_dq)
            ins = (mLse2, mDelta, mdQ, mdKV, scale_log2, scale)
            if wg == 1:
                self._consume(ins, sm, full, empty, mmas, where, tidx - THREADS_PER_WG, 0)
            else:
                self._consume(ins, sm, full, empty, mmas, where, tidx - THREADS_PER_WG, 1)

    # ---- producer ------------------------------------------------------------------------

    @cute.jit
    def _load_rows(self, m3, token, h0, dst, n_chunks: cutlass.Constexpr[int], gcopy, tid):
        """Rows h0 .. h0 + BLOCK of m3[token] (q or dO), chunk by chunk, by cp.async."""
        thr = gcopy.get_slice(tid)
        crd = thr.partition_S(cute.make_identity_tensor((self.block, CHUNK)))
        for k in cutlass.range_constexpr(n_chunks):
            d = thr.partition_D(dst[None, None, k])
            for m in cutlass.range_constexpr(cute.size(d, mode=[1])):
                row = m3[token, h0 + crd[0, m, 0][0], None]
                seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])

    @cute.jit
    def _gather(self, mQ, mKV, mdO, mIdx, sm, full, empty, where, tid):
        """Warpgroup 0: q and dO, then every tile's rows into its stage (module docstring)."""
        token, h0, tiles = where
        sKV, sQ, sdO, _, _, sRows, _, _ = sm
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        self._load_rows(mQ, token, h0, sQ, NCHUNK, gcopy, tid)
        self._load_rows(mdO, token, h0, sdO, VCHUNK, gcopy, tid)
        cute.arch.cp_async_commit_group()  # the oldest group: done when tile 0's is

        thr = gcopy.get_slice(tid)
        crd = thr.partition_S(cute.make_identity_tensor((TILE, CHUNK)))
        per_thread = cute.size(crd, mode=[1])
        rows = cute.make_rmem_tensor(per_thread, Int32)
        topk, slots = mIdx.shape[1], mKV.shape[0]
        for i in cutlass.range(tiles, unroll=1):
            s = i % self.stages
            cute.arch.mbarrier_wait(empty + s, ((i // self.stages) & 1) ^ 1)
            for m in cutlass.range_constexpr(per_thread):
                r = crd[0, m, 0][0]
                pos = i * TILE + r
                entry = mIdx[token, cutlass.min(pos, topk - 1)]
                ok = (pos < topk) & (entry >= 0) & (entry < slots)
                rows[m] = Int32(cutlass.select_(ok, entry, -1))
                if crd[0, m, 0][1] == 0:
                    sRows[r, s] = rows[m]
            for k in cutlass.range_constexpr(NCHUNK):
                d = thr.partition_D(sKV[None, None, s * NCHUNK + k])
                for m in cutlass.range_constexpr(per_thread):
                    if rows[m] >= 0:
                        row = mKV[rows[m], None]
                        seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                        copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])
                    else:  # zeros: a stale row would put 0 x NaN into dq's reduction
                        d[None, m, None].fill(0.0)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async and st.shared, then WGMMA reads
            cute.arch.mbarrier_arrive(full + s)

    # ---- consumers -----------------------------------------------------------------------

    @cute.jit
    def _consume(self, ins, sm, full, empty, mmas, where, ctid, w: cutlass.Constexpr[int]):
        """Consumer warpgroup w (ctid: 0 .. 255 over both): every tile (module docstring)."""
        mLse2, mDelta, mdQ, mdKV, scale_log2, scale = ins
        token, h0, tiles = where
        sKV, sQ, sdO, sP, sdS, sRows, sX, sRed = sm
        mma_sdp, mma_kv, mma_dq = mmas
        ltid = ctid % THREADS_PER_WG
        if const_expr(self.xchg):
            sc = self._xchg_setup(mLse2, mDelta, sKV, sQ, sdO, mma_sdp, token, h0, ltid, w)
        else:
            sc = self._split_setup(mLse2, mDelta, sKV, sQ, sdO, mma_sdp, token, h0, ctid)
        # dkv blocks: A = dS^T / P^T, B = q / dO chunk (transposed views)
        t_kv = mma_kv.get_slice(ltid)
        tKdS = t_kv.make_fragment_A(t_kv.partition_A(sdS))
        tKP = t_kv.make_fragment_A(t_kv.partition_A(sP))
        tKQ = t_kv.make_fragment_B(t_kv.partition_B(transposed(sQ)))
        tKdO = t_kv.make_fragment_B(t_kv.partition_B(transposed(sdO)))
        kv_crd = t_kv.partition_C(cute.make_identity_tensor((TILE, CHUNK)))
        kv_shape = t_kv.partition_shape_C((TILE, CHUNK))
        kv_accs = [cute.make_rmem_tensor(kv_shape, Float32) for _ in range(2)]
        # dq^T blocks: A = K^T (transposed stage chunk), B = dS (transposed dS^T)
        t_dq = mma_dq.get_slice(ltid)
        tQK = t_dq.make_fragment_A(t_dq.partition_A(transposed(sKV)))
        tQdS = t_dq.make_fragment_B(t_dq.partition_B(transposed(sdS)))
        dq_shape = t_dq.partition_shape_C((CHUNK, self.block))
        dq_accs = [cute.make_rmem_tensor(dq_shape, Float32) for _ in DQ_BLOCKS[w]]
        for acc in dq_accs:
            acc.fill(0.0)
        # the two rows' ids (r, r + 8); red4s: then rows 2 k + lane // 16 of the warp's 16
        rids = cute.make_rmem_tensor(10 if const_expr(self.red4s) else 2, Int32)
        lane = ctid % 32

        for i in cutlass.range(tiles, unroll=1):
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) & 1)
            if const_expr(self.xchg):
                self._xchg_tile(sc, sm, mma_sdp, s, scale_log2, scale, ltid, w)
            else:
                self._split_tile(sc, sm, mma_sdp, s, scale_log2, scale)
            cute.arch.fence_view_async_shared()  # st.shared, then the WGMMAs' reads
            named_barrier(Bar.PDS, CONSUMER_THREADS).arrive_and_wait()
            for h in cutlass.range_constexpr(2):  # this thread's two dkv rows (r, r + 8)
                rids[h] = sRows[kv_crd[2 * h][0], s]
            if const_expr(self.red4s):
                for k in cutlass.range_constexpr(8):
                    rids[2 + k] = sRows[16 * (ltid // 32) + 2 * k + lane // 16, s]
            red = self._tile_red(sRed, s, ltid, lane, w)
            for j, b in enumerate(DQ_BLOCKS[w]):
                gemm(mma_dq, dq_accs[j], tQK[None, None, None, s * NCHUNK + b],
                     tQdS[None, None, None, 0], False, -1)  # fmt: skip
            self._dkv_blocks(mma_kv, kv_accs, (tKdS, tKP, tKQ, tKdO), kv_crd, rids, mdKV, w,
                             empty + s, red)  # fmt: skip
        self._store_dq(mdQ, dq_accs, t_dq, token, h0, w)

    def _tile_red(self, sRed, s, ltid, lane, w: int):
        """The staging of tile i (stage s), (buffer, lane): red4s: this warp's (16, 72) buffer in
        stage s's dq^T column blocks of warpgroup w (config.RED4S_OFFSET); v2: none."""
        if const_expr(not self.red4s):
            return (None, lane)
        off = RED4S_OFFSET[w] + (ltid // 32) * (STAGING_ROWS * STAGING_STRIDE)
        layout = cute.make_layout((STAGING_ROWS, STAGING_STRIDE), stride=(STAGING_STRIDE, 1))
        return (cute.make_tensor(sRed[s, None].iterator + off, layout), lane)

    @cute.jit
    def _split_setup(self, mLse2, mDelta, sKV, sQ, sdO, mma_sdp, token, h0, ctid):
        """S^T / dP^T of this warpgroup's half of the heads (the 256-thread tiled MMA)."""
        t_sdp = mma_sdp.get_slice(ctid)
        tSK = t_sdp.make_fragment_A(t_sdp.partition_A(sKV))
        tSQ = t_sdp.make_fragment_B(t_sdp.partition_B(sQ))
        tSdO = t_sdp.make_fragment_B(t_sdp.partition_B(sdO))
        acc_s = cute.make_rmem_tensor(t_sdp.partition_shape_C((TILE, self.block)), Float32)
        acc_dp = cute.make_rmem_tensor(t_sdp.partition_shape_C((TILE, self.block)), Float32)
        crd = _rows_cols(t_sdp.partition_C(cute.make_identity_tensor((TILE, self.block))))
        n_cols = cute.size(crd, mode=[1])
        lse2 = cute.make_rmem_tensor(n_cols, Float32)
        delta = cute.make_rmem_tensor(n_cols, Float32)
        for c in cutlass.range_constexpr(n_cols):
            lse2[c] = mLse2[token, h0 + crd[0, c][1]]
            delta[c] = mDelta[token, h0 + crd[0, c][1]]
        return tSK, tSQ, tSdO, acc_s, acc_dp, crd, lse2, delta

    @cute.jit
    def _split_tile(self, sc, sm, mma_sdp, s, scale_log2, scale):
        """S^T, dP^T of this warpgroup's heads, then P^T / dS^T of them into shared memory."""
        tSK, tSQ, tSdO, acc_s, acc_dp, crd, lse2, delta = sc
        _, _, _, sP, sdS, sRows, _, _ = sm
        for k in cutlass.range_constexpr(NCHUNK):
            gemm(mma_sdp, acc_s, tSK[None, None, None, s * NCHUNK + k],
                 tSQ[None, None, None, k], k == 0, -1)  # fmt: skip
        for k in cutlass.range_constexpr(VCHUNK):
            gemm(mma_sdp, acc_dp, tSK[None, None, None, s * NCHUNK + k],
                 tSdO[None, None, None, k], k == 0, -1)  # fmt: skip
        warpgroup.wait_group(0)
        # the previous tile's readers of P^T / dS^T (both warpgroups) are done
        named_barrier(Bar.FREE, CONSUMER_THREADS).arrive_and_wait()
        s_rc, dp_rc = _rows_cols(acc_s), _rows_cols(acc_dp)
        for r in cutlass.range_constexpr(cute.size(crd, mode=[0])):
            row = crd[r, 0][0]
            valid = sRows[row, s] >= 0
            for c in cutlass.range_constexpr(cute.size(crd, mode=[1])):
                p = cute.math.exp2(s_rc[r, c] * scale_log2 - lse2[c], fastmath=True)
                p = Float32(cutlass.select_(valid, p, Float32(0.0)))
                ds = p * (dp_rc[r, c] - delta[c]) * scale
                sP[row, crd[r, c][1], 0] = p.to(sP.element_type)
                sdS[row, crd[r, c][1], 0] = ds.to(sdS.element_type)

    @cute.jit
    def _xchg_setup(self, mLse2, mDelta, sKV, sQ, sdO, mma_sdp, token, h0, ltid, w):
        """xchg: S^T (w 0) or dP^T (w 1) of all heads; this thread's own fragment elements are
        the first (w 0) or second (w 1) half of its fragment: its heads [w BLOCK / 2, ...)
        (raw order ((2, 2, V), 1, 1): element i is in column block i // 4 of 8 columns)."""
        t_sdp = mma_sdp.get_slice(ltid)
        tSK = t_sdp.make_fragment_A(t_sdp.partition_A(sKV))
        tSB = t_sdp.make_fragment_B(t_sdp.partition_B(sQ if const_expr(w == 0) else sdO))
        acc = cute.make_rmem_tensor(t_sdp.partition_shape_C((TILE, self.block)), Float32)
        crd = t_sdp.partition_C(cute.make_identity_tensor((TILE, self.block)))
        own = cute.size(acc) // 2
        lse2 = cute.make_rmem_tensor(own, Float32)
        delta = cute.make_rmem_tensor(own, Float32)
        for j in cutlass.range_constexpr(own):
            lse2[j] = mLse2[token, h0 + crd[w * own + j][1]]
            delta[j] = mDelta[token, h0 + crd[w * own + j][1]]
        return tSK, tSB, acc, crd, lse2, delta

    @cute.jit
    def _xchg_tile(self, sc, sm, mma_sdp, s, scale_log2, scale, ltid, w: cutlass.Constexpr[int]):
        """xchg: this warpgroup's S^T or dP^T, the other warpgroup's half swapped in through sX
        (thread ltid of one warpgroup holds the same coordinates as ltid of the other), P^T /
        dS^T of the own half into shared memory (over sX's bytes: read first)."""
        tSK, tSB, acc, crd, lse2, delta = sc
        _, _, _, sP, sdS, sRows, sX, _ = sm
        for k in cutlass.range_constexpr(NCHUNK if const_expr(w == 0) else VCHUNK):
            gemm(mma_sdp, acc, tSK[None, None, None, s * NCHUNK + k],
                 tSB[None, None, None, k], k == 0, -1)  # fmt: skip
        warpgroup.wait_group(0)
        named_barrier(Bar.FREE, CONSUMER_THREADS).arrive_and_wait()
        own = cute.size(acc) // 2
        other = (1 - w) * own
        for j in cutlass.range_constexpr(own):
            sX[ltid, other + j] = acc[other + j]
        named_barrier(Bar.XCHG, CONSUMER_THREADS).arrive_and_wait()
        p_own = cute.make_rmem_tensor(own, Float32)
        ds_own = cute.make_rmem_tensor(own, Float32)
        for j in cutlass.range_constexpr(own):
            i = w * own + j
            mine, theirs = acc[i], sX[ltid, i]
            s_val, dp_val = (mine, theirs) if const_expr(w == 0) else (theirs, mine)
            p = cute.math.exp2(s_val * scale_log2 - lse2[j], fastmath=True)
            p = Float32(cutlass.select_(sRows[crd[i][0], s] >= 0, p, Float32(0.0)))
            p_own[j] = p
            ds_own[j] = p * (dp_val - delta[j]) * scale
        named_barrier(Bar.XREAD, CONSUMER_THREADS).arrive_and_wait()
        for j in cutlass.range_constexpr(own):
            i = w * own + j
            sP[crd[i][0], crd[i][1], 0] = p_own[j].to(sP.element_type)
            sdS[crd[i][0], crd[i][1], 0] = ds_own[j].to(sdS.element_type)

    @cute.jit
    def _dkv_blocks(self, mma_kv, kv_accs, frags, kv_crd, rids, mdKV, w: cutlass.Constexpr[int],
                    empty_s, red):  # fmt: skip
        """This warpgroup's dkv blocks of the tile: block j's MMAs issued, then block j - 1's
        reductions (its MMAs done); the stage released once block 0's MMAs (and the dq MMAs
        issued before them) are done. red4s: there the warpgroup's named barrier instead (its
        dq^T column blocks of the stage become the staging), the release after the last
        block's staging loads (`_reduce_v4s`)."""
        tKdS, tKP, tKQ, tKdO = frags
        blocks = DKV_BLOCKS[w]
        for j, c in enumerate(blocks):
            acc = kv_accs[j % 2]
            # wait for all but this block's groups (1 or 2): the previous block's and dq's
            gemm(mma_kv, acc, tKdS[None, None, None, 0], tKQ[None, None, None, c], True,
                 -1 if c < VCHUNK else 1)  # fmt: skip
            if const_expr(c < VCHUNK):
                gemm(mma_kv, acc, tKP[None, None, None, 0], tKdO[None, None, None, c], False, 2)
            if const_expr(j == 0):
                if const_expr(self.red4s):  # all four warps' dq^T MMAs are done: the stage's
                    # dq^T blocks of w are dead in this tile (the staging goes there)
                    named_barrier(Bar.DQ_DONE + w, THREADS_PER_WG).arrive_and_wait()
                else:
                    cute.arch.mbarrier_arrive(empty_s)  # every thread: its reads of the row ids
            else:
                self._reduce(kv_accs[(j - 1) % 2], kv_crd, rids, mdKV, blocks[j - 1], red)
        warpgroup.wait_group(0)
        if const_expr(self.red4s):  # the stage released after the last staging loads
            self._reduce_v4s(kv_accs[(len(blocks) - 1) % 2], kv_crd, rids, mdKV, blocks[-1], red,
                             empty_s)  # fmt: skip
        else:
            self._reduce(kv_accs[(len(blocks) - 1) % 2], kv_crd, rids, mdKV, blocks[-1], red)

    @cute.jit
    def _reduce(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int], red):
        """dkv[row, 64 c ..] += the block, valid rows only: red4s `_reduce_v4s`, else
        `_reduce_v2`."""
        if const_expr(self.red4s):
            self._reduce_v4s(acc, kv_crd, rids, mdKV, c, red, None)
        else:
            self._reduce_v2(acc, kv_crd, rids, mdKV, c)

    @cute.jit
    def _reduce_v2(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int]):
        """v2 (red4s False): two adjacent columns a `red.global.add.v2.f32` from the registers
        (raw fragment order: i = col pair + 2 (row half) + 4 (pair group))."""
        for h in cutlass.range_constexpr(2):  # one branch and one row address per row half
            ok = rids[h] >= 0 if const_expr(self.reduce) else rids[h] == -2  # ids are >= -1
            if ok:
                row = mdKV[rids[h], None]
                for i in cutlass.range_constexpr(2 * h, cute.size(acc), 4):
                    pair = cute.make_tensor(acc.iterator + i, cute.make_layout(2)).load()
                    cute.arch.red(row.iterator + (c * CHUNK + kv_crd[i][1]), pair, op="add",
                                  dtype=Float32, sem="relaxed", scope="gpu")  # fmt: skip

    @cute.jit
    def _stage(self, acc, kv_crd, sw):
        """This thread's fragment of the block -> the warp's (16, 72) staging buffer."""
        for i in cutlass.range_constexpr(0, cute.size(acc), 2):
            r, col = kv_crd[i]
            off = (r % STAGING_ROWS) * STAGING_STRIDE + col
            ptr = cute.make_ptr(Float32, (sw.iterator + off).toint(), cute.AddressSpace.smem,
                                assumed_align=8)  # fmt: skip
            pair = cute.make_tensor(acc.iterator + i, cute.make_layout(2)).load()
            cute.make_tensor(ptr, cute.make_layout(2)).store(pair)

    @cute.jit
    def _reduce_v4s(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int], red, release):
        """red4s: the warp's 16 rows of the block staged into its buffer in the stage (`_stage`),
        read back two rows a 128-bit load (lane l: row 2 k + l // 16, columns 4 (l % 16) ..), the
        eight loads first; release (the tile's last block): then this thread's empty arrival
        (its last read of the stage in the tile, the producer's next gather may overwrite it);
        then the valid rows added by `red.global.add.v4.f32`."""
        sw, lane = red
        cute.arch.sync_warp()  # every lane's reads of the previous block are done
        self._stage(acc, kv_crd, sw)
        cute.arch.sync_warp()
        col = (lane % 16) * 4
        quads = cute.make_rmem_tensor((4, 8), Float32)
        for k in cutlass.range_constexpr(8):
            off = (2 * k + lane // 16) * STAGING_STRIDE + col
            ptr = cute.make_ptr(Float32, (sw.iterator + off).toint(), cute.AddressSpace.smem,
                                assumed_align=16)  # fmt: skip
            quads[None, k].store(cute.make_tensor(ptr, cute.make_layout(4)).load())
        if const_expr(release is not None):
            cute.arch.mbarrier_arrive(release)  # every thread: its own staging and row-id reads
        for k in cutlass.range_constexpr(8):
            rid = rids[2 + k]
            ok = rid >= 0 if const_expr(self.reduce) else rid == -2  # ids are >= -1
            if ok:
                cute.arch.red(mdKV[rid, None].iterator + (c * CHUNK + col), quads[None, k].load(),
                              op="add", dtype=Float32, sem="relaxed", scope="gpu")  # fmt: skip

    @cute.jit
    def _store_dq(self, mdQ, dq_accs, t_dq, token, h0, w: cutlass.Constexpr[int]):
        """dq[token, h0 + head, 64 b + col] = dq^T block b (dS carried the scale)."""
        crd = t_dq.partition_C(cute.make_identity_tensor((CHUNK, self.block)))
        for j, b in enumerate(DQ_BLOCKS[w]):
            acc = dq_accs[j]
            for i in cutlass.range_constexpr(cute.size(acc)):
                col, head = crd[i]
                mdQ[token, h0 + head, b * CHUNK + col] = acc[i].to(mdQ.element_type)


__all__ = ["DsaSparseBwdSm90", "WIDTH"]
