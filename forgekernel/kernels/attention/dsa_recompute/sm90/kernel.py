"""DeepSeek sparse attention's score recompute (DSA, issue 22), sm_90a: the indexer's training
target, cuDNN-frontend's `sparse_attn_score_recompute` (reference.dsa `dsa_score_target_ref`):

    S[t, j]      = sum_h exp(scale q[t, h] . kv[row(t, j)] - lse[t, h])     (natural log)
    target[t, j] = S[t, j] / (sum_j' S[t, j'] + L1_EPS)                       fp32

over the valid entries j of token t's top-k list (j < topk_length[t] when given, and the entry
e inside its batch's keys: 0 <= e - offset < s_kv); everything else is 0. A head whose lse is
-inf (its forward saw no key) adds 0. row(t, j) = b s_kv + e - offset, b = t // s_q the
token's batch, offset = b s_kv for global indices, else 0.

One CTA per query token, three warpgroups (config.py has the plan):
- warpgroup 0 gathers: Q (H x 576, all heads of the token) by cp.async into NCHUNK K-chunks of
  shared memory, then for each key tile the TILE listed rows, K-chunk by K-chunk, into the ring
  (cp.async of 16 bytes, 8 threads a row, 4 rows a thread, their list entries loaded during
  the previous tile; invalid entries are not read: their rows hold stale bytes, which the
  epilogue discards). All heads share the one gather. Chunk c
  is signalled (full[slot], 128 arrivals) once chunk c + lag is issued (config.lag): a thread
  waits for its own older groups, fences them for the async proxy (WGMMA reads), then arrives.
- warpgroups 1 and 2 take alternate key tiles: per tile, NCHUNK WGMMAs 64 x H x 64 (A: the
  chunk's 64 keys, B: Q's chunk; swap-AB, so a key is an accumulator row and the head sum a
  row reduction), each chunk's slot released (empty[slot], one arrival per warp) once the next
  chunk's MMA is issued and the earlier one done; then exp2(s scale_log2 - lse_log2[h]) summed
  over the thread's heads and the quad (4 threads share a row), S[t, j] stored unnormalized in
  the output row by the quad's first thread and added to its running total.
- at the end the consumers' totals meet in shared memory and the consumers rescale the row in
  place by 1 / (total + L1_EPS) (the row was written by this CTA: a barrier orders it), zeros
  past topk_length.
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

from forgekernel.kernels.attention.dsa_recompute.sm90.config import (
    CHUNK,
    CONSUMERS,
    L1_EPS,
    NCHUNK,
    THREADS,
    TILE,
    WIDTH,
    lag,
    ring_slots,
)
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import rows_cols
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.warp_mma import copy_row_async, tiled_row_copy

CONSUMER_THREADS = CONSUMERS * THREADS_PER_WG
CONSUMER_WARPS = CONSUMER_THREADS // WARP_SIZE
CHAINS = 4  # independent sums per row (a 32-long dependency chain otherwise at 128 heads)


class Bar(IntEnum):
    TOTALS = FIRST_FREE  # consumer threads: every total written, every score stored


class DsaRecomputeSm90:
    """See the module docstring; `heads` is H (the WGMMA's N)."""

    def __init__(self, heads: int):
        self.h = heads
        self.slots = ring_slots(heads)
        self.lag = lag(heads)

    def _setup(self, dtype):
        k_major = OperandMajorMode.K
        self.mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, Float32, (1, 1, 1), (TILE, self.h)
        )
        row = LayoutEnum.ROW_MAJOR
        # the ring (TILE keys, CHUNK, slots) and Q (H, CHUNK, NCHUNK), both K-major
        self.lay_kv = sm90_utils.make_smem_layout_a(row, (TILE, self.h, CHUNK), dtype, self.slots)
        self.lay_q = sm90_utils.make_smem_layout_b(row, (TILE, self.h, CHUNK), dtype, NCHUNK)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mLse: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor | None,
        mOut: cute.Tensor,
        scale_log2: Float32,
        s_q: Int32,
        s_kv: Int32,
        global_indices: Int32,
        stream: cuda.CUstream,
    ):
        """mQ (tokens, H, 576) and mKV (B s_kv, 576) 16-bit, rows 16-byte aligned; mLse
        (tokens, H) fp32 natural log (any strides); mIdx int32 (tokens, topk) (unit column
        stride); mLen int32 (tokens,) or None; mOut fp32 (tokens, topk) (unit column stride);
        scale_log2 = softmax_scale log2(e); tokens = B s_q; global_indices 1: entries are
        b s_kv + e (cuDNN's topk_indices_global), 0: e."""
        dtype = mQ.element_type
        if const_expr(mKV.element_type != dtype):
            raise TypeError("q and kv must share one 16-bit dtype")
        if const_expr(mLse.element_type != Float32 or mOut.element_type != Float32):
            raise TypeError("lse and out are float32")
        self._setup(dtype)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, self.slots]
            empty: cute.struct.MemRange[cutlass.Int64, self.slots]
            totals: cute.struct.MemRange[Float32, CONSUMER_WARPS]
            q: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_q)], 1024]
            kv: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kv)], 1024]

        self.shared = Shared
        self.kernel(
            mQ, mKV, mLse, mIdx, mLen, mOut, scale_log2, s_q, s_kv, global_indices, self.mma,
            self.lay_q, self.lay_kv,
        ).launch(grid=(mQ.shape[0], 1, 1), block=[THREADS, 1, 1], stream=stream)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mLse: cute.Tensor,
        mIdx: cute.Tensor,
        mLen: cute.Tensor | None,
        mOut: cute.Tensor,
        scale_log2: Float32,
        s_q: Int32,
        s_kv: Int32,
        global_indices: Int32,
        mma: cute.TiledMma,
        lay_q: cute.ComposedLayout,
        lay_kv: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        topk = mIdx.shape[1]
        limit = topk
        if const_expr(mLen is not None):
            limit = cutlass.min(cutlass.max(mLen[token], 0), topk)
        tiles = cute.ceil_div(limit, TILE)
        batch = token // s_q
        base = batch * s_kv  # the batch's first kv row
        where = (token, limit, tiles, base, base * global_indices, s_kv)

        storage = SmemAllocator().allocate(self.shared)
        sQ = smem_tensor(storage.q, lay_q)
        sKV = smem_tensor(storage.kv, lay_kv)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(self.slots):
                cute.arch.mbarrier_init(full + s, THREADS_PER_WG)
                cute.arch.mbarrier_init(empty + s, THREADS_PER_WG // WARP_SIZE)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            self._gather(mQ, mKV, mIdx, sQ, sKV, full, empty, where, tidx)
        else:
            total = self._score(
                mLse, mIdx, mOut, sQ, sKV, full, empty, mma, where, scale_log2, wg - 1, tidx
            )
            self._normalize(mOut, storage.totals, total, where, tidx - THREADS_PER_WG)

    @cute.jit
    def _gather(self, mQ, mKV, mIdx, sQ, sKV, full, empty, where, tid):
        """Warpgroup 0: Q, then every chunk of the walk into its slot (module docstring)."""
        token, limit, tiles, base, offset, s_kv = where
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        thr = gcopy.get_slice(tid)
        q_crd = thr.partition_S(cute.make_identity_tensor((self.h, CHUNK)))
        for k in cutlass.range_constexpr(NCHUNK):
            q_dst = thr.partition_D(sQ[None, None, k])
            for m in cutlass.range_constexpr(cute.size(q_dst, mode=[1])):
                q_row = mQ[token, q_crd[0, m, 0][0], None]
                q_seg = cute.make_tensor(q_row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                copy_row_async(gcopy, q_seg, CHUNK, q_dst[None, m, None], q_crd[None, m, None])
        cute.arch.cp_async_commit_group()  # Q: the oldest group, done before chunk 0 is

        kv_crd = thr.partition_S(cute.make_identity_tensor((TILE, CHUNK)))
        rows_per_thread = cute.size(kv_crd, mode=[1])
        rows = cute.make_rmem_tensor(rows_per_thread, Int32)  # kv row, or -1: not read
        listed = cute.make_rmem_tensor(rows_per_thread, Int32)  # the next tile's entries
        self._load_entries(mIdx, token, 0, limit, kv_crd, listed)
        for i in cutlass.range(tiles, unroll=1):
            for m in cutlass.range_constexpr(rows_per_thread):
                pos = i * TILE + kv_crd[0, m, 0][0]
                entry = listed[m] - offset
                ok = (pos < limit) & (entry >= 0) & (entry < s_kv)
                rows[m] = Int32(cutlass.select_(ok, base + entry, -1))
            # tile i + 1's entries, loaded under this tile's chunks (used next iteration)
            self._load_entries(mIdx, token, i + 1, limit, kv_crd, listed)
            for k in cutlass.range_constexpr(NCHUNK):
                c = i * NCHUNK + k
                slot = c % self.slots
                cute.arch.mbarrier_wait(empty + slot, ((c // self.slots) & 1) ^ 1)
                dst = thr.partition_D(sKV[None, None, slot])
                for m in cutlass.range_constexpr(rows_per_thread):
                    if rows[m] >= 0:
                        row = mKV[rows[m], None]
                        seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                        copy_row_async(gcopy, seg, CHUNK, dst[None, m, None], kv_crd[None, m, None])
                cute.arch.cp_async_commit_group()
                if c >= self.lag:
                    cute.arch.cp_async_wait_group(self.lag)
                    cute.arch.fence_view_async_shared()  # cp.async writes, then WGMMA reads
                    cute.arch.mbarrier_arrive(full + (c - self.lag) % self.slots)
        chunks = tiles * NCHUNK
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        for c in cutlass.range(cutlass.max(chunks - self.lag, 0), chunks, unroll=1):
            cute.arch.mbarrier_arrive(full + c % self.slots)

    @cute.jit
    def _load_entries(self, mIdx, token, tile, limit, kv_crd, listed):
        """This thread's list entries of key tile `tile`, positions clamped into [0, limit - 1]
        (0 when limit is 0: topk >= 1, launch returns before a 0-wide list), so every address
        lies inside the row; the caller tests the position."""
        for m in cutlass.range_constexpr(cute.size(listed)):
            pos = tile * TILE + kv_crd[0, m, 0][0]
            listed[m] = mIdx[token, cutlass.max(cutlass.min(pos, limit - 1), 0)]

    @cute.jit
    def _score(self, mLse, mIdx, mOut, sQ, sKV, full, empty, mma, where, scale_log2, w, tidx):
        """Consumer warpgroup w: its key tiles w, w + CONSUMERS, ...; returns this thread's
        total of the scores it stored."""
        token, limit, tiles, base, offset, s_kv = where
        ltid = tidx % THREADS_PER_WG
        lane = tidx % WARP_SIZE
        thr = mma.get_slice(ltid)
        tA = thr.make_fragment_A(thr.partition_A(sKV))
        tB = thr.make_fragment_B(thr.partition_B(sQ))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((TILE, self.h)), Float32)
        crd = rows_cols(thr.partition_C(cute.make_identity_tensor((TILE, self.h))))
        s = rows_cols(acc)
        cols = cute.size(s, mode=[1])
        # each column's lse in log2 units; -inf (the head saw no key) as +inf: it adds 0
        lse2 = cute.make_rmem_tensor(cols, Float32)
        for c in cutlass.range_constexpr(cols):
            v = mLse[token, crd[0, c][1]]
            lse2[c] = Float32(cutlass.select_(v == -Float32.inf, Float32.inf, v * LOG2E))
        total = Float32(0.0)
        for i in cutlass.range(w, tiles, CONSUMERS, unroll=1):
            for k in cutlass.range_constexpr(NCHUNK):
                c = i * NCHUNK + k
                slot = c % self.slots
                cute.arch.mbarrier_wait(full + slot, (c // self.slots) & 1)
                gemm(mma, acc, tA[None, None, None, slot], tB[None, None, None, k], k == 0,
                     -1 if k == 0 else 1)  # fmt: skip
                if const_expr(k > 0):  # chunk k - 1's MMA is done: its slot is free
                    if lane == 0:
                        cute.arch.mbarrier_arrive(empty + (c - 1) % self.slots)
            warpgroup.wait_group(0)
            if lane == 0:
                cute.arch.mbarrier_arrive(empty + (i * NCHUNK + NCHUNK - 1) % self.slots)
            for r in cutlass.range_constexpr(2):
                part = [Float32(0.0)] * CHAINS
                for c in cutlass.range_constexpr(cols):
                    p = cute.math.exp2(s[r, c] * scale_log2 - lse2[c], fastmath=True)
                    part[c % CHAINS] = part[c % CHAINS] + p
                row_sum = (part[0] + part[1]) + (part[2] + part[3])
                row_sum = cute.arch.warp_reduction_sum(row_sum, threads_in_group=4)
                pos = i * TILE + crd[r, 0][0]
                if ltid % 4 == 0 and pos < limit:
                    entry = mIdx[token, pos] - offset
                    ok = (entry >= 0) & (entry < s_kv)
                    val = Float32(cutlass.select_(ok, row_sum, Float32(0.0)))
                    mOut[token, pos] = val
                    total = total + val
        return total

    @cute.jit
    def _normalize(self, mOut, totals, total, where, ctid):
        """The consumers: the row's total, then out[t, j] /= total + L1_EPS in place for
        j < limit, 0 for limit <= j < topk."""
        token, limit, _, _, _, _ = where
        sTot = totals.get_tensor(cute.make_layout(CONSUMER_WARPS))
        warp_total = cute.arch.warp_reduction_sum(total)
        if ctid % WARP_SIZE == 0:
            sTot[ctid // WARP_SIZE] = warp_total
        named_barrier(Bar.TOTALS, CONSUMER_THREADS).arrive_and_wait()
        grand = Float32(0.0)
        for w in cutlass.range_constexpr(CONSUMER_WARPS):
            grand = grand + sTot[w]
        inv = Float32(1.0) / (grand + Float32(L1_EPS))
        topk = mOut.shape[1]
        for j in cutlass.range(ctid, limit, CONSUMER_THREADS, unroll=1):
            mOut[token, j] = mOut[token, j] * inv
        for j in cutlass.range(limit + ctid, topk, CONSUMER_THREADS, unroll=1):
            mOut[token, j] = Float32(0.0)


__all__ = ["DsaRecomputeSm90", "WIDTH"]
