"""DSA sparse attention backward at H >= 64 in ONE kernel, `h64f` (docs/attention/
DSA_BWD_NOTES.md "H >= 64: dq back in the tile loop"): kernel_h64.py's kv part with dq^T
accumulated in the tile loop, so that the dq part (a second gather of every listed row, 2.36 MB a
token at top-2048) and the dS workspace (written and read, topk x H x 2 B a token each way)
disappear. Per token and 64 heads: one gather and one dkv partial, cuDNN-frontend's bytes.

`DsaSparseBwdFusedSm90`, grid (H / 64, tokens) (a token's head blocks adjacent CTAs), 384
threads (kernel_h64.py's kv part, changes marked):
- warpgroup 0 (setmaxnreg H64F_PRODUCER_REGS): q (64 x 576) and dO (64 x 512) once, every
  tile's 64 listed rows into the one stage (cp.async, invalid rows zero-filled, ids -1).
- warpgroup 1: S^T = K q^T, warpgroup 2: dP^T = V dO^T (m64 n64); the xchg exchange; P^T / dS^T
  of the own 32 heads into shared memory (lse2 / Delta' of the 64 heads read from shared memory,
  not held: 32 registers a thread are what dq^T needs).
- CHANGED: dq^T_b += K_b^T dS^T (m64 n64 k64, both operands MN-major views of the stage and
  of dS^T, kernel_h64.py's dq part's MMA) for the warpgroup's blocks H64F_DQ_BLOCKS[w]
  ({0..3} / {4..8}: 128 / 160 accumulator registers a thread, live over all tiles); the stage
  is released (empty) only after they are waited for, so the next gather runs under the dkv
  blocks and their reductions instead of under the exchange as well.
- the dkv blocks (DKV_BLOCKS split, K = 64 heads, `_reduce_shfl4`), with H64F_KV_ACCS[w]
  accumulators (2: block j + 1's MMAs issued before block j's reductions; 1: each block waited
  for, then reduced: the 160-register warpgroup has no room for the second).
- CHANGED: after the last tile dq (scaled dS K, the op's dq) stored from the accumulators.
MMAs a tile: warpgroup 1 36 + 16 + 36 = 88, warpgroup 2 32 + 20 + 32 = 84 (m64n64k16).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.config import (
    CHUNK,
    DKV_BLOCKS,
    H64_KV_STAGES,
    H64F_CONSUMER_REGS,
    H64F_DQ_BLOCKS,
    H64F_KV_ACCS,
    H64F_PRODUCER_REGS,
    NCHUNK,
    THREADS,
    TILE,
)
from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.kernel_h64 import (
    CONSUMER_THREADS,
    OWN,
    VCHUNK,
    B,
    Bar,
    DsaSparseBwdKvSm90,
    _load_heads,
)
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.warp_mma import copy_row_async, tiled_row_copy


class DsaSparseBwdFusedSm90(DsaSparseBwdKvSm90):
    """Part `fused` (module docstring): kernel_h64.py's kv part (its producer, exchange and
    reductions inherited) plus dq^T in the tile loop; reduce False: the timing probe's build."""

    def __init__(self, reduce: bool = True):
        super().__init__(reduce, shfl4=True)

    def _setup(self, dt):
        super()._setup(dt)
        mn_major = OperandMajorMode.MN
        # dq^T block (64 columns x 64 heads) += K_b^T dS^T, k = the tile's 64 rows
        self.mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mn_major, mn_major, Float32, (1, 1, 1), (CHUNK, B)
        )

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
        """kernel.py's operands (dq (tokens, H, 576) row-major, every element written); H a
        multiple of 64."""
        dt = mQ.element_type
        if const_expr(mKV.element_type != dt or mdO.element_type != dt or mdQ.element_type != dt):
            raise TypeError("q, kv, dO and dq must share one 16-bit dtype")
        if const_expr(mdKV.element_type != Float32 or mLse2.element_type != Float32):
            raise TypeError("lse2, delta and the dkv accumulator are float32")
        self._setup(dt)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, H64_KV_STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, H64_KV_STAGES]
            rows: cute.struct.MemRange[Int32, TILE]
            lse2: cute.struct.MemRange[Float32, B]
            delta: cute.struct.MemRange[Float32, B]
            kv: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_kv)], 1024]
            q: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_q)], 1024]
            do: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_do)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]

        self.shared = Shared
        # (head block, token): a token's head blocks adjacent (`kernel`); grid.y <= 65535
        # tokens a launch (the launcher's chunks, config.H64F_GRID_TOKENS)
        grid = (mQ.shape[1] // B, mQ.shape[0], 1)
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
        # The head blocks of one token are consecutive CTAs (blockIdx.x), so they are dispatched
        # together and walk the same rows within microseconds: at H 128 the second CTA's gather
        # and dkv reductions hit the lines the first brought into L2. With the token as
        # blockIdx.x they ran ~tokens / 132 waves apart, and at S_kv 65536 (dkv 151 MB + cache
        # 75 MB against the 50 MB L2) both paid HBM's read-modify-write (DSA_BWD_NOTES.md "Long
        # caches: a token's head blocks together"). Read from the special registers, not
        # computed from one linear index: the compiler re-reads them where it needs them (a
        # division's result was spilled across setmaxnreg and the tile loops, 16 B).
        hblk, token, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        tiles = cute.ceil_div(mIdx.shape[1], TILE)
        where = (token, hblk * B, tiles)

        storage = SmemAllocator().allocate(self.shared)
        sm = (
            smem_tensor(storage.kv, lay_kv),
            smem_tensor(storage.q, lay_q),
            smem_tensor(storage.do, lay_do),
            smem_tensor(storage.p, lay_p),
            smem_tensor(storage.ds, lay_p),
            storage.rows.get_tensor(cute.make_layout(TILE)),
            # the exchange: (thread, fragment element) fp32 over P^T and dS^T's 16 KB
            cute.make_tensor(
                cute.recast_ptr(storage.p.data_ptr(), dtype=Float32),
                cute.make_layout((THREADS_PER_WG, 2 * OWN)),
            ),
        )
        sLD = (
            storage.lse2.get_tensor(cute.make_layout(B)),
            storage.delta.get_tensor(cute.make_layout(B)),
            # dq's staging after the last tile: the stage as a row-major (64 heads, 576)
            cute.make_tensor(
                storage.kv.data_ptr(),
                cute.make_layout((B, NCHUNK * CHUNK), stride=(NCHUNK * CHUNK, 1)),
            ),
        )
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(full, THREADS_PER_WG)
            cute.arch.mbarrier_init(empty, CONSUMER_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            cute.arch.setmaxregister_decrease(H64F_PRODUCER_REGS)
            self._produce(mQ, mKV, mdO, mIdx, sm, full, empty, where, tidx)
        else:
            cute.arch.setmaxregister_increase(H64F_CONSUMER_REGS)
            ins = (mLse2, mDelta, mdQ, mdKV, scale_log2, scale)
            mmas = (mma_sdp, mma_kv, mma_dq)
            if wg == 1:
                self._consume_f(ins, sm, sLD, full, empty, mmas, where, tidx - 128, 0)
            else:
                self._consume_f(ins, sm, sLD, full, empty, mmas, where, tidx - 128, 1)

    @cute.jit
    def _produce(self, mQ, mKV, mdO, mIdx, sm, full, empty, where, tid):
        """Warpgroup 0: q and dO of the 64 heads, then every tile into the one stage. Tile i +
        1's list entries are loaded while tile i's copies land (their L2 latency, ~600 clk,
        was exposed after the empty wait in kernel_h64.py's order); a row's column blocks are
        issued together (one row address live at a time: what 24 registers afford; columns
        outer spilled 16 B)."""
        token, h0, tiles = where
        sKV, sQ, sdO, _, _, sRows, _ = sm
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        _load_heads(mQ, token, h0, sQ, NCHUNK, gcopy, tid)
        _load_heads(mdO, token, h0, sdO, VCHUNK, gcopy, tid)
        cute.arch.cp_async_commit_group()  # the oldest group: done when tile 0's is
        thr = gcopy.get_slice(tid)
        crd = thr.partition_S(cute.make_identity_tensor((TILE, CHUNK)))
        rows = cute.make_rmem_tensor(cute.size(crd, mode=[1]), Int32)
        nxt = cute.make_rmem_tensor(cute.size(crd, mode=[1]), Int32)
        _tile_rows(mKV, mIdx, token, 0, crd, nxt)
        for i in cutlass.range(tiles, unroll=1):
            for m in cutlass.range_constexpr(cute.size(rows)):
                rows[m] = nxt[m]
            cute.arch.mbarrier_wait(empty, (i & 1) ^ 1)
            _issue_rows(mKV, rows, sKV, sRows, crd, thr, gcopy)
            cute.arch.cp_async_commit_group()
            _tile_rows(mKV, mIdx, token, i + 1, crd, nxt)  # past the last tile: all -1
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async and st.shared, then WGMMA reads
            cute.arch.mbarrier_arrive(full)

    @cute.jit
    def _consume_f(self, ins, sm, sLD, full, empty, mmas, where, ctid,
                   w: cutlass.Constexpr[int]):  # fmt: skip
        """Consumer warpgroup w: every tile (module docstring), then its dq blocks stored."""
        mLse2, mDelta, mdQ, mdKV, scale_log2, scale = ins
        token, h0, tiles = where
        sKV, sQ, sdO, sP, sdS, sRows, sX = sm
        sLse2, sDelta, sOut = sLD
        mma_sdp, mma_kv, mma_dq = mmas
        ltid = ctid % THREADS_PER_WG
        # lse2 / Delta' of the 64 heads into shared memory (read after tile 0's FREE barrier)
        if ctid < B:
            sLse2[ctid] = mLse2[token, h0 + ctid]
        elif ctid < 2 * B:
            sDelta[ctid - B] = mDelta[token, h0 + ctid - B]
        t_sdp = mma_sdp.get_slice(ltid)
        tSK = t_sdp.make_fragment_A(t_sdp.partition_A(sKV))
        tSB = t_sdp.make_fragment_B(t_sdp.partition_B(sQ if const_expr(w == 0) else sdO))
        acc = cute.make_rmem_tensor(t_sdp.partition_shape_C((TILE, B)), Float32)
        crd = t_sdp.partition_C(cute.make_identity_tensor((TILE, B)))
        t_kv = mma_kv.get_slice(ltid)
        frags = (
            t_kv.make_fragment_A(t_kv.partition_A(sdS)),
            t_kv.make_fragment_A(t_kv.partition_A(sP)),
            t_kv.make_fragment_B(t_kv.partition_B(transposed(sQ))),
            t_kv.make_fragment_B(t_kv.partition_B(transposed(sdO))),
        )
        kv_crd = t_kv.partition_C(cute.make_identity_tensor((TILE, CHUNK)))
        kv_accs = [cute.make_rmem_tensor(t_kv.partition_shape_C((TILE, CHUNK)), Float32)
                   for _ in range(H64F_KV_ACCS[w])]  # fmt: skip
        t_dq = mma_dq.get_slice(ltid)
        tQK = t_dq.make_fragment_A(t_dq.partition_A(transposed(sKV)))
        tQdS = t_dq.make_fragment_B(t_dq.partition_B(transposed(sdS)))
        dq_blocks = H64F_DQ_BLOCKS[w]
        dq_accs = [cute.make_rmem_tensor(t_dq.partition_shape_C((CHUNK, B)), Float32)
                   for _ in range(len(dq_blocks))]  # fmt: skip
        for a in dq_accs:
            a.fill(0.0)
        rids = cute.make_rmem_tensor(2, Int32)  # the thread's rows r, r + 8 (both MMAs: m64)

        for i in cutlass.range(tiles, unroll=1):
            cute.arch.mbarrier_wait(full, i & 1)
            for k in cutlass.range_constexpr(NCHUNK if const_expr(w == 0) else VCHUNK):
                gemm(mma_sdp, acc, tSK[None, None, None, k], tSB[None, None, None, k], k == 0,
                     -1)  # fmt: skip
            for h in cutlass.range_constexpr(2):
                rids[h] = sRows[kv_crd[2 * h][0]]
            warpgroup.wait_group(0)
            named_barrier(Bar.FREE, CONSUMER_THREADS).arrive_and_wait()
            self._softmax(acc, sX, sP, sdS, sLse2, sDelta, crd, rids, scale_log2, scale, ltid, w)
            # dq^T: the stage's last readers; then the stage goes back to the producer
            for j in cutlass.range_constexpr(len(dq_blocks)):
                gemm(mma_dq, dq_accs[j], tQK[None, None, None, dq_blocks[j]],
                     tQdS[None, None, None, 0], False, -1)  # fmt: skip
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty)  # every thread: its WGMMAs and row-id reads done
            self._dkv_blocks_f(mma_kv, kv_accs, frags, kv_crd, rids, mdKV, w)

        self._store_dq(mdQ, dq_accs, t_dq, sOut, token, h0, ltid, w)

    @cute.jit
    def _store_dq(self, mdQ, dq_accs, t_dq, sOut, token, h0, ltid, w: cutlass.Constexpr[int]):
        """dq of the warpgroup's column blocks through the dead stage: both warpgroups past their
        last MMAs (the stage's row-major (64 heads, 576) view overlaps every column block), the
        accumulators rounded into it, then 16-byte rows out (a warp: four heads x 128 B
        contiguous) instead of 288 scattered 2-byte stores a thread."""
        named_barrier(Bar.FREE, CONSUMER_THREADS).arrive_and_wait()
        dq_blocks = H64F_DQ_BLOCKS[w]
        dq_crd = t_dq.partition_C(cute.make_identity_tensor((CHUNK, B)))
        for j in cutlass.range_constexpr(len(dq_blocks)):
            for e in cutlass.range_constexpr(cute.size(dq_accs[j])):
                col, head = dq_crd[e]
                sOut[head, dq_blocks[j] * CHUNK + col] = dq_accs[j][e].to(sOut.element_type)
        named_barrier(Bar.XCHG, CONSUMER_THREADS).arrive_and_wait()
        vec = 16 // (sOut.element_type.width // 8)  # elements of one 16-byte vector
        per_row = CHUNK // vec
        for j in cutlass.range_constexpr(len(dq_blocks)):
            for k in cutlass.range_constexpr(B * per_row // THREADS_PER_WG):
                v = ltid + k * THREADS_PER_WG
                head, col = v // per_row, dq_blocks[j] * CHUNK + (v % per_row) * vec
                at = sOut.iterator + (head * NCHUNK * CHUNK + col)
                src = cute.make_ptr(Int32, at.toint(), cute.AddressSpace.smem, assumed_align=16)
                dst = mdQ[token, h0 + head, None].iterator + col
                ptr = cute.make_ptr(Int32, dst.toint(), cute.AddressSpace.gmem, assumed_align=16)
                row = cute.make_tensor(src, cute.make_layout(4)).load()
                cute.make_tensor(ptr, cute.make_layout(4)).store(row)

    @cute.jit
    def _softmax(self, acc, sX, sP, sdS, sLse2, sDelta, crd, rids, scale_log2, scale, ltid,
                 w: cutlass.Constexpr[int]):  # fmt: skip
        """kernel_h64.py's exchange and P^T / dS^T of the own 32 heads into shared memory
        (lse2 / Delta' from shared memory), ending on the PDS barrier."""
        other = (1 - w) * OWN
        for j in cutlass.range_constexpr(OWN):
            sX[ltid, other + j] = acc[other + j]
        named_barrier(Bar.XCHG, CONSUMER_THREADS).arrive_and_wait()
        p_own = cute.make_rmem_tensor(OWN, Float32)
        ds_own = cute.make_rmem_tensor(OWN, Float32)
        for j in cutlass.range_constexpr(OWN):
            e = w * OWN + j
            mine, theirs = acc[e], sX[ltid, e]
            s_val, dp_val = (mine, theirs) if const_expr(w == 0) else (theirs, mine)
            head = crd[e][1]
            p = cute.math.exp2(s_val * scale_log2 - sLse2[head], fastmath=True)
            p = Float32(cutlass.select_(rids[(e // 2) % 2] >= 0, p, Float32(0.0)))
            p_own[j] = p
            ds_own[j] = p * (dp_val - sDelta[head]) * scale
        named_barrier(Bar.XREAD, CONSUMER_THREADS).arrive_and_wait()
        for j in cutlass.range_constexpr(OWN):
            e = w * OWN + j
            sP[crd[e][0], crd[e][1], 0] = p_own[j].to(sP.element_type)
            sdS[crd[e][0], crd[e][1], 0] = ds_own[j].to(sdS.element_type)
        cute.arch.fence_view_async_shared()  # st.shared, then the WGMMAs' reads
        named_barrier(Bar.PDS, CONSUMER_THREADS).arrive_and_wait()

    @cute.jit
    def _dkv_blocks_f(self, mma_kv, kv_accs, frags, kv_crd, rids, mdKV,
                      w: cutlass.Constexpr[int]):  # fmt: skip
        """kernel_h64.py's `_dkv_blocks` with two accumulators; with one, each block's MMAs are
        waited for and the block reduced before the next block's are issued."""
        if const_expr(len(kv_accs) == 2):
            self._dkv_blocks(mma_kv, kv_accs, frags, kv_crd, rids, mdKV, w)
        else:
            tKdS, tKP, tKQ, tKdO = frags
            acc = kv_accs[0]
            for c in DKV_BLOCKS[w]:
                gemm(mma_kv, acc, tKdS[None, None, None, 0], tKQ[None, None, None, c], True,
                     -1 if c < VCHUNK else 0)  # fmt: skip
                if const_expr(c < VCHUNK):
                    gemm(mma_kv, acc, tKP[None, None, None, 0], tKdO[None, None, None, c], False,
                         0)  # fmt: skip
                self._reduce(acc, kv_crd, rids, mdKV, c)


@cute.jit
def _tile_rows(mKV, mIdx, token, i, crd, rows):
    """rows[m]: the slot listed at the thread's m-th row of tile i, -1 where the entry adds
    nothing (position >= topk, -1, outside [0, slots)); the index read clamped into the row."""
    topk, slots = mIdx.shape[1], mKV.shape[0]
    for m in cutlass.range_constexpr(cute.size(rows)):
        pos = i * TILE + crd[0, m, 0][0]
        entry = mIdx[token, cutlass.min(pos, topk - 1)]
        ok = (pos < topk) & (entry >= 0) & (entry < slots)
        rows[m] = Int32(cutlass.select_(ok, entry, -1))


@cute.jit
def _issue_rows(mKV, rows, sKV, sRows, crd, thr, gcopy):
    """The tile's rows into the stage by cp.async (8 threads a row, 4 rows a thread; not
    committed), invalid ones zero-filled (0 x NaN of a stale row would reach an MMA), their
    ids into sRows."""
    for m in cutlass.range_constexpr(cute.size(rows)):
        if crd[0, m, 0][1] == 0:
            sRows[crd[0, m, 0][0]] = rows[m]
        if rows[m] >= 0:
            row = mKV[rows[m], None]
            for k in cutlass.range_constexpr(NCHUNK):
                d = thr.partition_D(sKV[None, None, k])
                seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
                copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])
        else:
            for k in cutlass.range_constexpr(NCHUNK):
                thr.partition_D(sKV[None, None, k])[None, m, None].fill(0.0)


__all__ = ["DsaSparseBwdFusedSm90"]
