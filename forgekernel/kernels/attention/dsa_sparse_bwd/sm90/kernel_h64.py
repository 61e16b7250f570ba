"""DSA sparse attention backward at H >= 64, `h64` (the launcher's default at H a multiple of 64
since 2026-12-06; docs/attention/DSA_BWD_NOTES.md "H >= 64: one gather a token", "h64
adopted"): the v1 kernel (kernel.py) splits the heads into CTAs of 32, each gathering the
token's rows and reducing its own dkv partial. Here one CTA takes 64 heads (so H 64 gathers and
reduces once a token, H 128 twice), made possible by moving dq out of the tile loop into a second
kernel:

`DsaSparseBwdKvSm90` (part `kv`), grid (tokens, H / 64), 384 threads:
- warpgroup 0 (setmaxnreg 56): q (64 x 576) and dO (64 x 512) once, then every tile's 64 listed
  rows into the ONE stage (cp.async, invalid rows zero-filled, their ids -1), full[0].
- warpgroup 1: S^T = K q^T (m64 n64 k576), warpgroup 2: dP^T = V dO^T (m64 n64 k512); each reads
  its two rows' ids, waits for its WGMMAs and arrives on empty[0]: the stage has no other reader
  (no dq^T MMA here), so the gather of tile i + 1 runs under the rest of tile i. Then kernel.py's
  xchg exchange (FREE, XCHG, XREAD over P^T / dS^T's bytes), P^T / dS^T of the own half of the
  heads into shared memory, and dS also into the workspace mWs[token, position, head] (16-bit,
  two heads a 32-bit store), then the dkv blocks (config.DKV_BLOCKS split, K = the 64 heads),
  added by red.global.add.v4.f32 after one butterfly shuffle a float (`_reduce_shfl4`; no room
  for red4s's staging: the stage is refilled under them), or kernel.py's v2 (key `v2`).

`DsaSparseBwdDqSm90` (part `dq`), grid (tokens, H / 64), 512 threads
  (at H a multiple of 128: grid (tokens, H / 128 x 3), 128 heads and one 192-column group a
  CTA, so that the rows are gathered once a token, not twice)
- warpgroup 0 gathers the rows again (the CTA's column blocks) into two stages, with the
  tile's dS (64 positions x 64 / 128 heads of the workspace) beside them, two tiles in flight
  (lag 1);
- warpgroups 1 .. 3 (setmaxnreg 152): dq^T of three 64-column blocks each at 64 heads (m64
  n64, 96 registers a thread) or one at 128 heads (m64 n128, 64 registers) += K_b^T dS^T (k64,
  both operands MN-major views), in registers over the tiles; empty[stage] after their wait;
  dq stored at the end.
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
    H64_BLOCK,
    H64_DQ_CHUNKS_PER_WG,
    H64_DQ_CONSUMER_REGS,
    H64_DQ_CONSUMERS,
    H64_DQ_STAGES,
    H64_DQ_THREADS,
    H64_KV_STAGES,
    NCHUNK,
    PRODUCER_REGS,
    THREADS,
    TILE,
)
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.ptx import cvt_pair
from forgekernel.kernels.common.sm90.warp_mma import copy_row_async, tiled_row_copy

CONSUMER_THREADS = CONSUMERS * THREADS_PER_WG
VCHUNK = D_V // CHUNK
B = H64_BLOCK
OWN = TILE * B // THREADS_PER_WG // 2  # fp32 elements of S^T / dP^T a thread rounds (16)


class Bar(IntEnum):
    PDS = FIRST_FREE  # consumer threads: the tile's P^T / dS^T are in shared memory
    FREE = 2  # consumer threads: the previous tile's dkv MMAs (P^T / dS^T readers) are done
    XCHG = 3  # each warpgroup's half of S^T / dP^T is in the exchange buffer
    XREAD = 4  # the exchange buffer (P^T / dS^T's bytes) has been read


@cute.jit
def _gather_tile(mKV, mIdx, token, i, sKV, k0, sRows, gcopy, tid,
                 n_chunks: cutlass.Constexpr[int] = NCHUNK, c0=0):  # fmt: skip
    """Tile i's 64 listed rows of `token`, column blocks c0 .. c0 + n_chunks, into sKV[:, :, k0
    .. k0 + n_chunks], cp.async by the 128 producer threads (8 a row, 4 rows a thread); invalid
    entries (position >= topk, -1, outside [0, slots)) zero-filled (a stale or never-written row
    would put 0 x NaN into an MMA) and, if sRows is given, their id -1 there. Not committed."""
    thr = gcopy.get_slice(tid)
    crd = thr.partition_S(cute.make_identity_tensor((TILE, CHUNK)))
    per_thread = cute.size(crd, mode=[1])
    rows = cute.make_rmem_tensor(per_thread, Int32)
    topk, slots = mIdx.shape[1], mKV.shape[0]
    for m in cutlass.range_constexpr(per_thread):
        r = crd[0, m, 0][0]
        pos = i * TILE + r
        entry = mIdx[token, cutlass.min(pos, topk - 1)]
        ok = (pos < topk) & (entry >= 0) & (entry < slots)
        rows[m] = Int32(cutlass.select_(ok, entry, -1))
        if const_expr(sRows is not None):
            if crd[0, m, 0][1] == 0:
                sRows[r] = rows[m]
    for k in cutlass.range_constexpr(n_chunks):
        d = thr.partition_D(sKV[None, None, k0 + k])
        for m in cutlass.range_constexpr(per_thread):
            if rows[m] >= 0:
                row = mKV[rows[m], None]
                seg = cute.make_tensor(row.iterator + (c0 + k) * CHUNK, cute.make_layout(CHUNK))
                copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])
            else:
                d[None, m, None].fill(0.0)


@cute.jit
def _load_heads(m3, token, h0, dst, n_chunks: cutlass.Constexpr[int], gcopy, tid):
    """Rows h0 .. h0 + 64 of m3[token] (q or dO), chunk k (columns 64 k ..) into dst[:, :, k]
    for k < n_chunks, cp.async; not committed."""
    thr = gcopy.get_slice(tid)
    crd = thr.partition_S(cute.make_identity_tensor((B, CHUNK)))
    for k in cutlass.range_constexpr(n_chunks):
        d = thr.partition_D(dst[None, None, k])
        for m in cutlass.range_constexpr(cute.size(d, mode=[1])):
            row = m3[token, h0 + crd[0, m, 0][0], None]
            seg = cute.make_tensor(row.iterator + k * CHUNK, cute.make_layout(CHUNK))
            copy_row_async(gcopy, seg, CHUNK, d[None, m, None], crd[None, m, None])


class DsaSparseBwdKvSm90:
    """Part `kv` (module docstring). reduce False: the timing probe's build (the reductions'
    guard never true, dkv stays 0); shfl4 True: the dkv blocks added by red.global.add.v4.f32
    after one butterfly shuffle a float (`_reduce_shfl4`), False: kernel.py's v2 form."""

    def __init__(self, reduce: bool = True, shfl4: bool = True):
        self.reduce = reduce
        self.shfl4 = shfl4

    def _setup(self, dt):
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        # S^T = K q^T (warpgroup 1), dP^T = V dO^T (warpgroup 2): one warpgroup, all 64 heads
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (TILE, B)
        )
        # dkv block (64 rows x 64 columns) = dS^T q_c + P^T dO_c, K = the 64 heads
        self.mma_kv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (TILE, CHUNK)
        )
        row = LayoutEnum.ROW_MAJOR
        self.lay_kv = sm90_utils.make_smem_layout_a(row, (TILE, B, CHUNK), dt, NCHUNK)
        self.lay_q = sm90_utils.make_smem_layout_b(row, (TILE, B, CHUNK), dt, NCHUNK)
        self.lay_do = sm90_utils.make_smem_layout_b(row, (TILE, B, CHUNK), dt, VCHUNK)
        self.lay_p = sm90_utils.make_smem_layout_a(row, (TILE, CHUNK, B), dt, 1)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mdO: cute.Tensor,
        mLse2: cute.Tensor,
        mDelta: cute.Tensor,
        mIdx: cute.Tensor,
        mWs: cute.Tensor,
        mdKV: cute.Tensor,
        scale_log2: Float32,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """kernel.py's operands, with mWs (tokens, >= TILE x tiles, H) in q's dtype, unit head
        stride and outer strides multiples of 8 elements (the dq part's 16-byte cp.async; dS,
        written for every position of every tile) in place of dq; H a multiple of 64."""
        dt = mQ.element_type
        if const_expr(mKV.element_type != dt or mdO.element_type != dt or mWs.element_type != dt):
            raise TypeError("q, kv, dO and the dS workspace must share one 16-bit dtype")
        if const_expr(mdKV.element_type != Float32 or mLse2.element_type != Float32):
            raise TypeError("lse2, delta and the dkv accumulator are float32")
        self._setup(dt)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, H64_KV_STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, H64_KV_STAGES]
            rows: cute.struct.MemRange[Int32, TILE]
            kv: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_kv)], 1024]
            q: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_q)], 1024]
            do: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_do)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_p)], 1024]

        self.shared = Shared
        grid = (mQ.shape[0], mQ.shape[1] // B, 1)
        self.kernel(
            mQ, mKV, mdO, mLse2, mDelta, mIdx, mWs, mdKV, scale_log2, scale, self.mma_sdp,
            self.mma_kv, self.lay_kv, self.lay_q, self.lay_do, self.lay_p,
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
        mWs: cute.Tensor,
        mdKV: cute.Tensor,
        scale_log2: Float32,
        scale: Float32,
        mma_sdp: cute.TiledMma,
        mma_kv: cute.TiledMma,
        lay_kv: cute.ComposedLayout,
        lay_q: cute.ComposedLayout,
        lay_do: cute.ComposedLayout,
        lay_p: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, hblk, _ = cute.arch.block_idx()
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
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(full, THREADS_PER_WG)
            cute.arch.mbarrier_init(empty, CONSUMER_THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self._produce(mQ, mKV, mdO, mIdx, sm, full, empty, where, tidx)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ins = (mLse2, mDelta, mWs, mdKV, scale_log2, scale)
            if wg == 1:
                self._consume(ins, sm, full, empty, (mma_sdp, mma_kv), where, tidx - 128, 0)
            else:
                self._consume(ins, sm, full, empty, (mma_sdp, mma_kv), where, tidx - 128, 1)

    @cute.jit
    def _produce(self, mQ, mKV, mdO, mIdx, sm, full, empty, where, tid):
        """Warpgroup 0: q and dO of the 64 heads, then every tile into the one stage."""
        token, h0, tiles = where
        sKV, sQ, sdO, _, _, sRows, _ = sm
        gcopy = tiled_row_copy(mQ.element_type, CHUNK, THREADS_PER_WG)
        _load_heads(mQ, token, h0, sQ, NCHUNK, gcopy, tid)
        _load_heads(mdO, token, h0, sdO, VCHUNK, gcopy, tid)
        cute.arch.cp_async_commit_group()  # the oldest group: done when tile 0's is
        for i in cutlass.range(tiles, unroll=1):
            cute.arch.mbarrier_wait(empty, (i & 1) ^ 1)
            _gather_tile(mKV, mIdx, token, i, sKV, 0, sRows, gcopy, tid)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()  # cp.async and st.shared, then WGMMA reads
            cute.arch.mbarrier_arrive(full)

    @cute.jit
    def _consume(self, ins, sm, full, empty, mmas, where, ctid, w: cutlass.Constexpr[int]):
        """Consumer warpgroup w: every tile (module docstring)."""
        mLse2, mDelta, mWs, mdKV, scale_log2, scale = ins
        token, h0, tiles = where
        sKV, sQ, sdO, sP, sdS, sRows, sX = sm
        mma_sdp, mma_kv = mmas
        ltid = ctid % THREADS_PER_WG
        t_sdp = mma_sdp.get_slice(ltid)
        tSK = t_sdp.make_fragment_A(t_sdp.partition_A(sKV))
        tSB = t_sdp.make_fragment_B(t_sdp.partition_B(sQ if const_expr(w == 0) else sdO))
        acc = cute.make_rmem_tensor(t_sdp.partition_shape_C((TILE, B)), Float32)
        # raw fragment order ((2, 2, V), 1, 1): element i in row r + 8 ((i // 2) % 2), column
        # 8 (i // 4) + 2 (lane % 4) + i % 2; the own half: heads [32 w, 32 w + 32)
        crd = t_sdp.partition_C(cute.make_identity_tensor((TILE, B)))
        lse2 = cute.make_rmem_tensor(OWN, Float32)
        delta = cute.make_rmem_tensor(OWN, Float32)
        for j in cutlass.range_constexpr(OWN):
            lse2[j] = mLse2[token, h0 + crd[w * OWN + j][1]]
            delta[j] = mDelta[token, h0 + crd[w * OWN + j][1]]
        t_kv = mma_kv.get_slice(ltid)
        frags = (
            t_kv.make_fragment_A(t_kv.partition_A(sdS)),
            t_kv.make_fragment_A(t_kv.partition_A(sP)),
            t_kv.make_fragment_B(t_kv.partition_B(transposed(sQ))),
            t_kv.make_fragment_B(t_kv.partition_B(transposed(sdO))),
        )
        kv_crd = t_kv.partition_C(cute.make_identity_tensor((TILE, CHUNK)))
        kv_accs = [cute.make_rmem_tensor(t_kv.partition_shape_C((TILE, CHUNK)), Float32)
                   for _ in range(2)]  # fmt: skip
        rids = cute.make_rmem_tensor(2, Int32)  # the thread's rows r, r + 8 (both MMAs: m64)
        bf16 = sP.element_type is cutlass.BFloat16
        ws_pair = cute.make_rmem_tensor(OWN // 2, Int32)

        for i in cutlass.range(tiles, unroll=1):
            cute.arch.mbarrier_wait(full, i & 1)
            for k in cutlass.range_constexpr(NCHUNK if const_expr(w == 0) else VCHUNK):
                gemm(mma_sdp, acc, tSK[None, None, None, k], tSB[None, None, None, k], k == 0,
                     -1)  # fmt: skip
            for h in cutlass.range_constexpr(2):
                rids[h] = sRows[kv_crd[2 * h][0]]
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty)  # every thread: its WGMMAs and row-id reads done
            named_barrier(Bar.FREE, CONSUMER_THREADS).arrive_and_wait()
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
                p = cute.math.exp2(s_val * scale_log2 - lse2[j], fastmath=True)
                p = Float32(cutlass.select_(rids[(e // 2) % 2] >= 0, p, Float32(0.0)))
                p_own[j] = p
                ds_own[j] = p * (dp_val - delta[j]) * scale
            for j in cutlass.range_constexpr(OWN // 2):
                ws_pair[j] = cvt_pair(ds_own[2 * j], ds_own[2 * j + 1], bf16)
            named_barrier(Bar.XREAD, CONSUMER_THREADS).arrive_and_wait()
            for j in cutlass.range_constexpr(OWN):
                e = w * OWN + j
                sP[crd[e][0], crd[e][1], 0] = p_own[j].to(sP.element_type)
                sdS[crd[e][0], crd[e][1], 0] = ds_own[j].to(sdS.element_type)
            cute.arch.fence_view_async_shared()  # st.shared, then the WGMMAs' reads
            named_barrier(Bar.PDS, CONSUMER_THREADS).arrive_and_wait()
            self._store_ds(mWs, ws_pair, crd, token, h0, i, w)
            self._dkv_blocks(mma_kv, kv_accs, frags, kv_crd, rids, mdKV, w)

    @cute.jit
    def _store_ds(self, mWs, ws_pair, crd, token, h0, i, w: cutlass.Constexpr[int]):
        """dS of the own heads, two adjacent heads a 32-bit store: mWs[token, 64 i + row, h0 +
        head ..] (the dq kernel's B operand; positions past topk hold 0)."""
        for j in cutlass.range_constexpr(OWN // 2):
            row, head = crd[w * OWN + 2 * j]
            dst = mWs[token, i * TILE + row, None].iterator + (h0 + head)
            ptr = cute.make_ptr(Int32, dst.toint(), cute.AddressSpace.gmem, assumed_align=4)
            cute.make_tensor(ptr, cute.make_layout(1))[0] = ws_pair[j]

    @cute.jit
    def _dkv_blocks(self, mma_kv, kv_accs, frags, kv_crd, rids, mdKV, w: cutlass.Constexpr[int]):
        """kernel.py's v2 form: block j's MMAs issued, then block j - 1's reductions; the last
        block's after a full wait (which also retires every read of P^T / dS^T before FREE)."""
        tKdS, tKP, tKQ, tKdO = frags
        blocks = DKV_BLOCKS[w]
        for j, c in enumerate(blocks):
            acc = kv_accs[j % 2]
            gemm(mma_kv, acc, tKdS[None, None, None, 0], tKQ[None, None, None, c], True,
                 -1 if c < VCHUNK else 1)  # fmt: skip
            if const_expr(c < VCHUNK):
                gemm(mma_kv, acc, tKP[None, None, None, 0], tKdO[None, None, None, c], False, 2)
            if const_expr(j > 0):
                self._reduce(kv_accs[(j - 1) % 2], kv_crd, rids, mdKV, blocks[j - 1])
        warpgroup.wait_group(0)
        self._reduce(kv_accs[(len(blocks) - 1) % 2], kv_crd, rids, mdKV, blocks[-1])

    @cute.jit
    def _reduce(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int]):
        if const_expr(self.shfl4):
            self._reduce_shfl4(acc, kv_crd, rids, mdKV, c)
        else:
            self._reduce_v2(acc, kv_crd, rids, mdKV, c)

    @cute.jit
    def _reduce_shfl4(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int]):
        """dkv[row, 64 c ..] += the block, four columns a red.global.add.v4.f32 (half v2's
        instructions, two sectors a row line instead of one, no shared memory): lanes l and
        l ^ 1 hold columns 8 v + 2 (l % 4) .. + 1 of each 8-column group v (raw pairs 4 v + 2 h,
        row half h); for each pair of groups (2 g, 2 g + 1) the even lane keeps its group-2g pair
        and takes its partner's (columns + 2, + 3), the odd lane keeps its group-(2g + 1) pair
        behind its partner's: one butterfly shuffle a float, 16 a block."""
        lane = cute.arch.lane_idx()
        odd = (lane % 2) == 1
        for h in cutlass.range_constexpr(2):
            quads = cute.make_rmem_tensor((4, 4), Float32)
            for g in cutlass.range_constexpr(4):
                ev, od = 8 * g + 2 * h, 8 * g + 4 + 2 * h
                for x in cutlass.range_constexpr(2):
                    send = Float32(cutlass.select_(odd, acc[ev + x], acc[od + x]))
                    keep = Float32(cutlass.select_(odd, acc[od + x], acc[ev + x]))
                    got = cute.arch.shuffle_sync_bfly(send, offset=1)
                    quads[x, g] = Float32(cutlass.select_(odd, got, keep))
                    quads[2 + x, g] = Float32(cutlass.select_(odd, keep, got))
            ok = rids[h] >= 0 if const_expr(self.reduce) else rids[h] == -2  # ids are >= -1
            if ok:
                row = mdKV[rids[h], None]
                for g in cutlass.range_constexpr(4):
                    ev, od = 8 * g + 2 * h, 8 * g + 4 + 2 * h
                    col = Int32(cutlass.select_(odd, kv_crd[od][1] - 2, kv_crd[ev][1]))
                    cute.arch.red(row.iterator + (c * CHUNK + col), quads[None, g].load(),
                                  op="add", dtype=Float32, sem="relaxed", scope="gpu")  # fmt: skip

    @cute.jit
    def _reduce_v2(self, acc, kv_crd, rids, mdKV, c: cutlass.Constexpr[int]):
        """dkv[row, 64 c ..] += the block, two columns a red.global.add.v2.f32, valid rows only."""
        for h in cutlass.range_constexpr(2):
            ok = rids[h] >= 0 if const_expr(self.reduce) else rids[h] == -2  # ids are >= -1
            if ok:
                row = mdKV[rids[h], None]
                for e in cutlass.range_constexpr(2 * h, cute.size(acc), 4):
                    pair = cute.make_tensor(acc.iterator + e, cute.make_layout(2)).load()
                    cute.arch.red(row.iterator + (c * CHUNK + kv_crd[e][1]), pair, op="add",
                                  dtype=Float32, sem="relaxed", scope="gpu")  # fmt: skip


class DsaSparseBwdDqSm90:
    """Part `dq` (module docstring): dq = dS K of `heads` (64 or 128) heads a CTA. 64: the CTA
    takes all nine 64-column blocks, three a consumer warpgroup (m64 n64); 128: one of three
    column groups (config.h64_dq_groups), one block a warpgroup at m64 n128, so that at H 128
    the rows are gathered once a token (three CTAs of 192 columns) instead of twice (two of 64
    heads), for the workspace read three times (16 KB a tile a CTA)."""

    def __init__(self, heads: int = B):
        self.heads = heads
        self.per_wg = H64_DQ_CHUNKS_PER_WG[heads]  # column blocks a consumer warpgroup
        self.group = self.per_wg * H64_DQ_CONSUMERS  # column blocks a CTA (9 or 3)
        self.groups = NCHUNK // self.group

    def _setup(self, dt):
        mn_major = OperandMajorMode.MN
        # dq^T block (64 columns x heads) += K_b^T dS^T: both operands MN-major views
        self.mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mn_major, mn_major, Float32, (1, 1, 1), (CHUNK, self.heads)
        )
        row = LayoutEnum.ROW_MAJOR
        self.lay_kv = sm90_utils.make_smem_layout_a(
            row, (TILE, B, CHUNK), dt, self.group * H64_DQ_STAGES
        )
        self.lay_ds = sm90_utils.make_smem_layout_a(
            row, (TILE, CHUNK, self.heads), dt, H64_DQ_STAGES
        )

    @cute.jit
    def __call__(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mWs: cute.Tensor,
        mdQ: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mKV (slots, 576), mIdx int32 (tokens, topk), mWs (tokens, >= TILE x tiles, H) the kv
        part's dS (rows 16-byte aligned), mdQ (tokens, H, 576) row-major; one 16-bit dtype; H a
        multiple of `heads`."""
        dt = mKV.element_type
        if const_expr(mWs.element_type != dt or mdQ.element_type != dt):
            raise TypeError("kv, the dS workspace and dq must share one 16-bit dtype")
        self._setup(dt)

        @cute.struct
        class Shared:
            full: cute.struct.MemRange[cutlass.Int64, H64_DQ_STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, H64_DQ_STAGES]
            kv: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_kv)], 1024]
            ds: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.lay_ds)], 1024]

        self.shared = Shared
        grid = (mdQ.shape[0], mdQ.shape[1] // self.heads * self.groups, 1)
        self.kernel(mKV, mIdx, mWs, mdQ, self.mma_dq, self.lay_kv, self.lay_ds).launch(
            grid=grid, block=[H64_DQ_THREADS, 1, 1], min_blocks_per_mp=1, stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mKV: cute.Tensor,
        mIdx: cute.Tensor,
        mWs: cute.Tensor,
        mdQ: cute.Tensor,
        mma_dq: cute.TiledMma,
        lay_kv: cute.ComposedLayout,
        lay_ds: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, y, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        tiles = cute.ceil_div(mIdx.shape[1], TILE)
        # (token, first head, tiles, first column block of the CTA's group)
        where = (token, (y // self.groups) * self.heads, tiles, (y % self.groups) * self.group)
        storage = SmemAllocator().allocate(self.shared)
        sKV = smem_tensor(storage.kv, lay_kv)
        sdS = smem_tensor(storage.ds, lay_ds)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(H64_DQ_STAGES):
                cute.arch.mbarrier_init(full + s, THREADS_PER_WG)
                cute.arch.mbarrier_init(empty + s, H64_DQ_CONSUMERS * THREADS_PER_WG)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self._produce(mKV, mIdx, mWs, sKV, sdS, full, empty, where, tidx)
        else:
            cute.arch.setmaxregister_increase(H64_DQ_CONSUMER_REGS)
            ins = (mdQ, sKV, sdS, full, empty, mma_dq, where, tidx % THREADS_PER_WG)
            if wg == 1:
                self._consume(*ins, 0)
            elif wg == 2:
                self._consume(*ins, 1)
            else:
                self._consume(*ins, 2)

    @cute.jit
    def _produce(self, mKV, mIdx, mWs, sKV, sdS, full, empty, where, tid):
        """Warpgroup 0: tile i's rows (the group's column blocks) and its dS block (positions
        64 i .., heads h0 ..) into stage i % STAGES, lag 1: tile i's copies are issued before
        tile i - 1 is waited for and signalled, so two tiles are in flight (the part is
        gather-bound: ~3,600 clk of L2 traffic a tile against ~1,150 of MMAs at 64 heads) and
        no tile waits on the next one's issue."""
        token, h0, tiles, c0 = where
        gcopy = tiled_row_copy(mKV.element_type, CHUNK, THREADS_PER_WG)
        dcopy = tiled_row_copy(mKV.element_type, self.heads, THREADS_PER_WG)
        for i in cutlass.range(tiles, unroll=1):
            s = i % H64_DQ_STAGES
            cute.arch.mbarrier_wait(empty + s, ((i // H64_DQ_STAGES) & 1) ^ 1)
            _gather_tile(mKV, mIdx, token, i, sKV, s * self.group, None, gcopy, tid,
                         self.group, c0)  # fmt: skip
            _load_wide(mWs, token, i * TILE, h0, self.heads, sdS[None, None, s], dcopy, tid)
            cute.arch.cp_async_commit_group()
            if i > 0:
                cute.arch.cp_async_wait_group(1)  # this thread's copies of tile i - 1
                cute.arch.fence_view_async_shared()  # cp.async and st.shared, then WGMMA reads
                cute.arch.mbarrier_arrive(full + (i - 1) % H64_DQ_STAGES)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.mbarrier_arrive(full + (tiles - 1) % H64_DQ_STAGES)

    @cute.jit
    def _consume(self, mdQ, sKV, sdS, full, empty, mma_dq, where, ltid,
                 w: cutlass.Constexpr[int]):  # fmt: skip
        """Consumer warpgroup w: dq^T of the group's column blocks w x per_wg .. over every
        tile, then stored."""
        token, h0, tiles, c0 = where
        t_dq = mma_dq.get_slice(ltid)
        tQK = t_dq.make_fragment_A(t_dq.partition_A(transposed(sKV)))
        tQdS = t_dq.make_fragment_B(t_dq.partition_B(transposed(sdS)))
        dq_accs = [cute.make_rmem_tensor(t_dq.partition_shape_C((CHUNK, self.heads)), Float32)
                   for _ in range(self.per_wg)]  # fmt: skip
        for acc in dq_accs:
            acc.fill(0.0)
        for i in cutlass.range(tiles, unroll=1):
            s = i % H64_DQ_STAGES
            cute.arch.mbarrier_wait(full + s, (i // H64_DQ_STAGES) & 1)
            for j in cutlass.range_constexpr(self.per_wg):
                k = s * self.group + w * self.per_wg + j  # the stage's column block
                gemm(mma_dq, dq_accs[j], tQK[None, None, None, k], tQdS[None, None, None, s],
                     False, -1)  # fmt: skip
            warpgroup.wait_group(0)
            cute.arch.mbarrier_arrive(empty + s)
        crd = t_dq.partition_C(cute.make_identity_tensor((CHUNK, self.heads)))
        for j in cutlass.range_constexpr(self.per_wg):
            col0 = (c0 + w * self.per_wg + j) * CHUNK
            for e in cutlass.range_constexpr(cute.size(dq_accs[j])):
                col, head = crd[e]
                mdQ[token, h0 + head, col0 + col] = dq_accs[j][e].to(mdQ.element_type)


@cute.jit
def _load_wide(m3, a, b0, c0, width: cutlass.Constexpr[int], dst, gcopy, tid):
    """Rows b0 .. b0 + TILE of m3[a], columns c0 .. c0 + width, into dst ((TILE, width), any
    swizzled layout), cp.async by a `width`-wide tiled copy; not committed."""
    thr = gcopy.get_slice(tid)
    crd = thr.partition_S(cute.make_identity_tensor((TILE, width)))
    d = thr.partition_D(dst)
    for m in cutlass.range_constexpr(cute.size(d, mode=[1])):
        row = m3[a, b0 + crd[0, m, 0][0], None]
        seg = cute.make_tensor(row.iterator + c0, cute.make_layout(width))
        copy_row_async(gcopy, seg, width, d[None, m, None], crd[None, m, None])


__all__ = ["DsaSparseBwdDqSm90", "DsaSparseBwdKvSm90"]
