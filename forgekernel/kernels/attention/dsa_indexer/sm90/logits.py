"""The lightning indexer's logits for Hopper (sm_90a), FP8 WGMMA with fp32 accumulation:

    logits[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])

q (rows, 64, 128) and k (keys, 128) float8_e4m3fn, w (rows, 64) fp32, k_scale (keys,) fp32
(DeepSeek's order: the key's scale after the head sum).

The keys are the MMA's M and the heads its N (DeepGEMM's choice too): a warpgroup's
accumulator is a tile of 64 keys x (qtokens x 64 heads), so the head sum is in-thread (16
values per row and token) plus two quad shuffles, never a reduction across warps.

One CTA = `qtokens` query rows (the WGMMA's B, loaded once) x one split of their key tiles:
- decode (`paged`): the rows of sequence b = blockIdx.y (its next_n tokens), tiles j of its
  pages (page = block_table[b, j]), deep_gemm's paged cache seen as k (64, 128, pages) and
  k_scale (64, pages), strides 128 / 8448 and 1 / 2112 of its int8 (pages, 64, 1, 132);
  logits columns are the sequence's positions j * 64 + row; all pages up to seq_lens[b];
- prefill (contiguous): rows qtokens x blockIdx.y .. of k (keys, 128), k_scale (keys,), the
  rows' windows k_start / k_end (rows,) int32, tiles of 64 keys from the smallest start
  (rounded down to 4 keys: a TMA box's innermost start must be 16-byte aligned, and the
  scales' box is 1-D) to the largest end; logits columns are key ids.
Splits: blockIdx.x takes tiles [x * per, (x + 1) * per) of that range (per: the launcher's).
Columns of a tile outside a row's own window are written too (they are the same math); the
top-k reads only the window. Rows past the last one (prefill tail) are not written.

Warp roles:
- producer, warp 0 of warpgroup 0 (setmaxnreg 40): Q by TMA once (the `q_pipe` of one stage),
  then each tile's 64 key rows (one TMA box, 128-byte swizzle) and 64 scales (one 256-byte
  box) into the K ring, tile after tile; paged: the block table read 32 entries per warp load.
- consumers, warpgroups 1 and 2 (setmaxnreg 232): warpgroup c takes tiles c, c + 2, ... of the
  CTA's range (stage states advanced twice a tile), so that one's epilogue runs under the
  other's WGMMA. Per tile: WGMMA (64 x N x 128, both operands from shared memory), the two
  scales of the thread's rows read, the stage released, then the epilogue: relu x w summed
  in-thread, two butterfly shuffles over the quad, x scale, stored (lane % 4 == token % 4
  writes token's two rows: 8 consecutive floats per quad row).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    HEAD_DIM,
    HEADS,
    LOGITS_THREADS,
    STAGES,
    TILE,
    key_origin,
)
from forgekernel.kernels.common.sm90 import mma
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)

CONSUMER_WARPS = 4  # one warpgroup releases each stage


class IndexerLogitsSm90:
    """The indexer's logits (module docstring): `qtokens` rows per CTA, paged or contiguous
    keys."""

    def __init__(self, qtokens: int, paged: bool):
        self.qtokens = qtokens
        self.paged = paged
        self.n = qtokens * HEADS
        self.stages = STAGES[qtokens]
        self.producer_regs = 40
        self.consumer_regs = 232

    def _setup(self):
        fp8 = cutlass.Float8E4M3FN
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8,
            fp8,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            tiler_mn=(TILE, self.n),
        )
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, fp8, HEAD_DIM), fp8
        )
        self.sK_layout = cute.tile_to_shape(atom, (TILE, HEAD_DIM, self.stages), (0, 1, 2))
        self.sQ_layout = cute.tile_to_shape(atom, (self.n, HEAD_DIM), (0, 1))
        self.sS_layout = cute.make_layout((TILE, self.stages))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mW: cute.Tensor,
        mK: cute.Tensor,
        mKS: cute.Tensor,
        mTable: cute.Tensor | None,
        mSeqLens: cute.Tensor | None,
        mKStart: cute.Tensor | None,
        mKEnd: cute.Tensor | None,
        mLogits: cute.Tensor,
        per_split: Int32,
        splits: Int32,
        stream: cuda.CUstream,
    ):
        """mQ (rows x 64, 128) fp8, mW (rows, 64) fp32, mLogits (rows, width) fp32. Paged:
        mK (64, 128, pages), mKS (64, pages), mTable (B, max_pages), mSeqLens (B,), mKStart /
        mKEnd None, rows = B x qtokens. Contiguous: mK (keys, 128), mKS (keys,), mTable /
        mSeqLens None, mKStart / mKEnd (rows,). `per_split` key tiles per CTA, `splits` CTAs
        per row group."""
        if const_expr(
            mQ.element_type != cutlass.Float8E4M3FN or mK.element_type != mQ.element_type
        ):
            raise TypeError("q and k must be float8_e4m3fn")
        if const_expr(self.paged != (mTable is not None)):
            raise ValueError("a paged compile takes the block table, a contiguous one k_start")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, self.sQ_layout, (self.n, HEAD_DIM))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.slice_(self.sK_layout, (None, None, 0)), (TILE, HEAD_DIM)
        )
        tma_s, tma_mKS = cpasync.make_tiled_tma_atom(
            g2s, mKS, cute.slice_(self.sS_layout, (None, 0)), (TILE,)
        )
        self.q_bytes = self.n * HEAD_DIM
        self.stage_bytes = TILE * HEAD_DIM + TILE * 4

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sS: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(self.sS_layout)], 128]
            sQ: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sQ_layout)], 1024
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sK_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        groups = mW.shape[0] // self.qtokens
        if const_expr(not self.paged):
            groups = (mW.shape[0] + self.qtokens - 1) // self.qtokens
        self.kernel(
            tma_q, tma_mQ, tma_k, tma_mK, tma_s, tma_mKS, self.tiled_mma, self.sQ_layout,
            self.sK_layout, self.sS_layout, mW, mTable, mSeqLens, mKStart, mKEnd, mLogits,
            per_split,
        ).launch(
            grid=[splits, groups, 1],
            block=[LOGITS_THREADS, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_s: cute.CopyAtom,
        mKS: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sS_layout: cute.Layout,
        mW: cute.Tensor,
        mTable: cute.Tensor | None,
        mSeqLens: cute.Tensor | None,
        mKStart: cute.Tensor | None,
        mKEnd: cute.Tensor | None,
        mLogits: cute.Tensor,
        per_split: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        split, group, _ = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_s)

        storage = SmemAllocator().allocate(self.shared_storage)
        q_pipe = tma_pipeline(storage.q_barriers, 1, self.q_bytes, 2 * CONSUMER_WARPS)
        k_pipe = tma_pipeline(storage.k_barriers, self.stages, self.stage_bytes, CONSUMER_WARPS)
        init_arrive()
        sQ = smem_tensor(storage.sQ, sQ_layout)
        sK = smem_tensor(storage.sK, sK_layout)
        sS = storage.sS.get_tensor(sS_layout)

        row0 = group * self.qtokens
        first, count, key0 = self._range(
            mW, mLogits, mTable, mSeqLens, mKStart, mKEnd, row0, group, split, per_split
        )
        init_wait()
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if count > 0:
            if wg_idx == 0:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self._produce(
                        (tma_q, mQ, sQ, q_pipe), (tma_k, mK, sK, tma_s, mKS, sS, k_pipe),
                        mTable, group, row0, first, count, key0,
                    )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self._consume(
                    tiled_mma, sQ, sK, sS, q_pipe, k_pipe, mW, mLogits, (row0, group),
                    (first, count, key0), wg_idx - 1, tidx % THREADS_PER_WG,
                )  # fmt: skip

    @cute.jit
    def _range(self, mW, mLogits, mTable, mSeqLens, mKStart, mKEnd, row0, group, split, per_split):
        """(first tile, tiles, key of tile 0's first row) of this CTA. Paged: the sequence's
        pages; contiguous: the 64-key tiles from the rows' smallest start to their largest end
        (rows past the last one ignored)."""
        total = Int32(0)
        key0 = Int32(0)
        if const_expr(self.paged):
            # seq_lens past max_pages x 64 are clipped there (the op's contract): the producer
            # never reads the block table past its row
            total = cutlass.min((mSeqLens[group] + TILE - 1) // TILE, mTable.shape[1])
        else:
            rows = mW.shape[0]
            lo = mKStart[row0]
            hi = mKEnd[row0]
            for q in cutlass.range_constexpr(1, self.qtokens):
                r = cutlass.min(row0 + q, rows - 1)
                lo = cutlass.min(lo, mKStart[r])
                hi = cutlass.max(hi, mKEnd[r])
            # rounded down: the scales' 1-D TMA box must start 16-byte aligned (config)
            lo = key_origin(cutlass.max(lo, 0))
            hi = cutlass.min(hi, mLogits.shape[1])
            total = cutlass.max(hi - lo + TILE - 1, 0) // TILE
            key0 = lo
        first = split * per_split
        count = cutlass.max(cutlass.min(first + per_split, total) - first, 0)
        return first, count, key0

    @cute.jit
    def _produce(self, q_src, k_src, mTable, group, row0, first, count, key0):
        """Warp 0: Q once, then every tile of the range into the K ring (module docstring)."""
        tma_q, mQ, sQ, q_pipe = q_src
        tma_k, mK, sK, tma_s, mKS, sS, k_pipe = k_src
        one = cute.make_layout(1)
        gQ = cute.local_tile(mQ, (self.n, HEAD_DIM), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        q_state = producer_state(1)
        q_pipe.producer_acquire(q_state)
        cute.copy(
            tma_q, tQgQ[(None, group)], tQsQ[None], tma_bar_ptr=q_pipe.producer_get_barrier(q_state)
        )
        q_pipe.producer_commit(q_state)

        if const_expr(self.paged):
            gK = mK  # (64, 128, pages): a tile is a page
            gS = mKS  # (64, pages)
        else:
            gK = cute.local_tile(cute.domain_offset((key0, 0), mK), (TILE, HEAD_DIM), (None, 0))
            gS = cute.local_tile(cute.domain_offset((key0,), mKS), (TILE,), (None,))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tSsS, tSgS = cpasync.tma_partition(
            tma_s, 0, one, cute.group_modes(sS, 0, 1), cute.group_modes(gS, 0, 1)
        )
        lane = cute.arch.lane_idx()
        state = producer_state(self.stages)
        for base in cutlass.range(0, count, 32, unroll=1):
            # the block table, 32 entries a warp load, handed out by shuffles
            tile_of_lane = first + base + lane
            page_of_lane = Int32(0)
            if const_expr(self.paged):
                if base + lane < count:
                    page_of_lane = mTable[group, tile_of_lane]
            for i in cutlass.range(cutlass.min(32, count - base), unroll=1):
                where = first + base + i
                if const_expr(self.paged):
                    where = cute.arch.shuffle_sync(page_of_lane, i)
                k_pipe.producer_acquire(state)
                bar = k_pipe.producer_get_barrier(state)
                cute.copy(tma_k, tKgK[(None, where)], tKsK[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_s, tSgS[(None, where)], tSsS[(None, state.index)], tma_bar_ptr=bar)
                k_pipe.producer_commit(state)
                state.advance()
        k_pipe.producer_tail(state)

    @cute.jit
    def _consume(self, tiled_mma, sQ, sK, sS, q_pipe, k_pipe, mW, mLogits, where, tiles, wg, t):
        """Consumer warpgroup `wg` (0 or 1), thread `t` of it: tiles wg, wg + 2, ... of the
        range (module docstring)."""
        row0, group = where
        first, count, key0 = tiles
        thr_mma = tiled_mma.get_slice(t)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sK))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sQ))
        acc = cute.make_rmem_tensor(
            thr_mma.partition_C(cute.make_identity_tensor((TILE, self.n))).shape, Float32
        )
        lane = t % 32
        quad = lane % 4
        r0 = (t // 32) * 16 + lane // 4  # the thread's rows (keys) r0 and r0 + 8 of a tile
        rows = mW.shape[0]
        # weights of the thread's columns: token q, head 8 g + 2 quad + e at [q][2 g + e]
        w = cute.make_rmem_tensor((self.qtokens, 16), Float32)
        for q in cutlass.range_constexpr(self.qtokens):
            r = cutlass.min(row0 + q, rows - 1)
            for g in cutlass.range_constexpr(8):
                for e in cutlass.range_constexpr(2):
                    w[q, 2 * g + e] = mW[r, 8 * g + 2 * quad + e]

        q_pipe.consumer_wait(consumer_state(1))
        # warpgroup wg's first tile is the range's tile wg: its stage state starts there
        read = pipeline.PipelineState(self.stages, Int32(wg), Int32(wg), Int32(0))
        for i in cutlass.range(wg, count, 2, unroll=1):
            k_pipe.consumer_wait(read)
            stage = read.index
            mma.gemm(tiled_mma, acc, tCrA[None, None, None, stage], tCrB, True, 0)
            s0 = sS[r0, stage]
            s1 = sS[r0 + 8, stage]
            k_pipe.consumer_release(read)
            read.advance(2)
            tile = first + i
            col = tile * TILE + key0 + r0
            self._epilogue(acc, w, (s0, s1), mLogits, row0, rows, col, quad)

    @cute.jit
    def _epilogue(self, acc, w, scales, mLogits, row0, rows, col, quad):
        """Per token: relu x weight summed over the thread's 16 heads of each row, then over
        the quad (butterfly), times the key's scale; lane quad == token % 4 stores."""
        s0, s1 = scales
        width = mLogits.shape[1]
        for q in cutlass.range_constexpr(self.qtokens):
            # values 4 g + 2 h + e: column 8 g + 2 quad + e, row r0 + 8 h
            a0, b0, a1, b1 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
            for g in cutlass.range_constexpr(8):
                v = 4 * (8 * q + g)
                a0 = a0 + cutlass.max(acc[v], Float32(0.0)) * w[q, 2 * g]
                b0 = b0 + cutlass.max(acc[v + 1], Float32(0.0)) * w[q, 2 * g + 1]
                a1 = a1 + cutlass.max(acc[v + 2], Float32(0.0)) * w[q, 2 * g]
                b1 = b1 + cutlass.max(acc[v + 3], Float32(0.0)) * w[q, 2 * g + 1]
            v0 = a0 + b0
            v1 = a1 + b1
            for off in cutlass.range_constexpr(2):
                v0 = v0 + cute.arch.shuffle_sync_bfly(v0, 1 << off)
                v1 = v1 + cute.arch.shuffle_sync_bfly(v1, 1 << off)
            row = row0 + q
            if (quad == q % 4) & (row < rows):
                if col < width:
                    mLogits[row, col] = v0 * s0
                if col + 8 < width:
                    mLogits[row, col + 8] = v1 * s1
