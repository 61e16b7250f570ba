"""DeepSeek MLA paged decode, the partial pass of the split-KV plan (sm_90a, mma.sync m16n8k16):
the absorbed form, MQA over one 576-wide latent row per token (512 latent + 64 RoPE columns)
that is both the key (all 576) and the value (the first 512); reference.mla has the math.

A CTA takes H query heads (H x Q (token, head) rows, Q query tokens, zero rows up to the MMA's
16) and one split of one sequence's keys, streamed through shared memory in tiles of TILE keys,
STAGES deep, by cp.async of 16 bytes per thread and copy (page page_table[b, t // page_size],
slot t % page_size; the token clamped into the split so that masked columns stay finite), the
latent and RoPE columns in two swizzled tiles. Per tile:
  1. S: warp w scores keys 16w .. 16w + 15 against all rows (Q and K by ldmatrix, 32 + 4 MMAs
     of K = 16 along the latent and RoPE columns), masks them and puts its row maxima in shared
     memory; barrier.
  2. Every warp takes the tile's row maxima, so all four keep one running max per row, turns
     its scores into P = exp2(S scale - max scale) (16-bit, into a shared 16 x TILE tile),
     rescales its O and its share of the row sums; barrier.
  3. P V: warp w owns output columns 128w .. 128w + 127 (O 16 x 128 fp32 in registers), all
     TILE keys (4 steps of K = 16: P by ldmatrix, V by transposed ldmatrix of the latent tile).
At the end the row sums meet in shared memory and every warp writes its columns of the split's
normalized O (fp32) and the row's LSE in log2 units (-inf where the split saw no key), the
paged decode's partial format, merged by its combine pass.

`sparse` (DeepSeek sparse attention, DSA): query token t attends to the cache rows its top-k
list names (mPT (tokens, topk) int32, entries page * page_size + slot, -1 padding, anywhere),
not to a sequence's pages: a CTA's keys are that list's split, loaded by index (-1 reads row 0,
masked), grid z over the tokens (one query token per CTA, so `qtokens` is 1).

Memory-bound at decode: 2 x 16 x 576 + 2 x 16 x 512 FMAs per 1152-byte row; the per-tile
barriers and the exchange of maxima are the price of sharing one P among the column owners."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    D_ROPE,
    ROWS,
    STAGES,
    THREADS,
    TILE,
    WARPS,
)
from forgekernel.kernels.common.sm90.layout import rows_cols, transposed
from forgekernel.kernels.common.sm90.softmax import exp2_row, quad_row_max, rescale_o, scaled_max
from forgekernel.kernels.common.sm90.warp_mma import (
    as_wide_acc,
    copy_row_async,
    query_row_limits,
    swizzled_rows,
    tiled_row_copy,
)

KEYS = TILE // WARPS  # keys per warp in S
COLS = D_LATENT // WARPS  # output columns per warp in P V


class MlaDecodeSm90:
    """The partial pass; see the module docstring."""

    def __init__(self, heads: int, qtokens: int = 1, sparse: bool = False):
        if heads * qtokens > ROWS:
            raise ValueError(f"heads x query tokens must be <= {ROWS}, got {heads} x {qtokens}")
        if sparse and qtokens != 1:
            raise ValueError("sparse attention takes one query token per CTA")
        self.h = heads
        self.qt = qtokens
        self.g = heads * qtokens
        self.sparse = sparse

    @cute.jit
    def __call__(
        self,
        mQn: cute.Tensor,
        mQp: cute.Tensor,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor | None,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        stream: cuda.CUstream,
    ):
        """mQn (rows, Hq, 512), mQp (rows, Hq, 64) 16-bit, rows = batch or, with mCuQ int32
        (batch + 1,), total_q; mCkv (num_pages, page_size, 512), mKpe (num_pages, page_size,
        64) in q's dtype; mPT int32 (batch, max_pages); mSeq int32 (batch,); mOp fp32 (splits,
        rows, Hq, 512), mLp fp32 (splits, rows, Hq) log2; causal 0 / 1 (query tokens among
        themselves, bottom-right). sparse: mPT the top-k lists (rows, topk), mSeq None,
        mCuQ None, causal unused."""
        dtype = mQn.element_type
        if const_expr(not (dtype == mQp.element_type == mCkv.element_type == mKpe.element_type)):
            raise TypeError("q_nope, q_pe and the caches must share one 16-bit dtype")
        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")
        if const_expr(self.sparse != (mSeq is None)):
            raise ValueError("seqlens_k comes with the paged form, and only then")
        units = mQn.shape[0] if const_expr(self.sparse) else mSeq.shape[0]

        @cute.struct
        class Shared:
            lat: cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(swizzled_rows(TILE, D_LATENT, STAGES))],
                1024,
            ]
            rope: cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(swizzled_rows(TILE, D_ROPE, STAGES))], 1024
            ]
            qlat: cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(swizzled_rows(ROWS, D_LATENT))], 1024
            ]
            qrope: cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(swizzled_rows(ROWS, D_ROPE))], 1024
            ]
            p: cute.struct.Align[
                cute.struct.MemRange[dtype, cute.cosize(swizzled_rows(ROWS, TILE))], 128
            ]
            red: cute.struct.MemRange[Float32, WARPS * ROWS]

        self.shared = Shared
        self.kernel(
            mQn, mQp, mCkv, mKpe, mPT, mSeq, mOp, mLp, scale_log2, per_split, page_size, mCuQ,
            causal,
        ).launch(
            grid=(mOp.shape[0], mQn.shape[1] // self.h, units),
            block=[THREADS, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQn: cute.Tensor,
        mQp: cute.Tensor,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor | None,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        mCuQ: cute.Tensor | None,
        causal: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, head_block, b = cute.arch.block_idx()
        head0 = head_block * self.h
        q_off, sq = b, Int32(1)
        if const_expr(mCuQ is not None):
            q_off = mCuQ[b]
            sq = mCuQ[b + 1] - q_off
        lane = tidx % 32
        warp_idx = cute.arch.make_warp_uniform(tidx // 32)
        dtype = mQn.element_type

        sk = mPT.shape[1] if const_expr(self.sparse) else mSeq[b]
        t0 = split * per_split
        t1 = cutlass.min(t0 + per_split, sk)
        tiles = cute.ceil_div(cutlass.max(t1 - t0, 0), TILE)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sLat = storage.lat.get_tensor(swizzled_rows(TILE, D_LATENT, STAGES))
        sRope = storage.rope.get_tensor(swizzled_rows(TILE, D_ROPE, STAGES))
        sQl = storage.qlat.get_tensor(swizzled_rows(ROWS, D_LATENT))
        sQr = storage.qrope.get_tensor(swizzled_rows(ROWS, D_ROPE))
        sP = storage.p.get_tensor(swizzled_rows(ROWS, TILE))
        sRed = storage.red.get_tensor(cute.make_layout((WARPS, ROWS)))

        copy_lat = tiled_row_copy(dtype, D_LATENT, THREADS)
        copy_rope = tiled_row_copy(dtype, D_ROPE, THREADS)
        thr_lat, thr_rope = copy_lat.get_slice(tidx), copy_rope.get_slice(tidx)
        self._load_query(mQn, sQl, copy_lat, thr_lat, D_LATENT, q_off, sq, head0)
        self._load_query(mQp, sQr, copy_rope, thr_rope, D_ROPE, q_off, sq, head0)
        kv = (mCkv, mKpe, sLat, sRope, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size)
        for s in cutlass.range_constexpr(STAGES - 1):
            if s < tiles:
                self._load_tile(kv, t0 + s * TILE, t1, s)
            cute.arch.cp_async_commit_group()

        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (1, 1, 1))
        thr_mma = mma.get_slice(lane)
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), dtype)
        copy_a = cute.make_tiled_copy_A(ldsm, mma).get_slice(lane)
        copy_b = cute.make_tiled_copy_B(ldsm, mma).get_slice(lane)
        copy_bt = cute.make_tiled_copy_B(ldsm_t, mma).get_slice(lane)

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, COLS)), Float32)
        acc_o.fill(0.0)
        o_wide = as_wide_acc(acc_o)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        corr = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # (row, key) of this thread's score registers, keys relative to the warp's first
        coords = rows_cols(
            as_wide_acc(thr_mma.partition_C(cute.make_identity_tensor((ROWS, KEYS))))
        )
        limits = query_row_limits(coords, self.h, self.qt, sq, sk, t1, causal)

        for i in cutlass.range(tiles, unroll=1):
            cute.arch.cp_async_wait_group(STAGES - 2)
            cute.arch.sync_threads()
            nxt = i + STAGES - 1
            if nxt < tiles:
                self._load_tile(kv, t0 + nxt * TILE, t1, nxt % STAGES)
            cute.arch.cp_async_commit_group()
            stage = i % STAGES

            # 1. this warp's 16 keys against every row; its row maxima to shared memory
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((ROWS, KEYS)), Float32)
            acc_s.fill(0.0)
            for sQ_, sK_ in ((sQl, sLat), (sQr, sRope)):
                self._scores(mma, thr_mma, copy_a, copy_b, sQ_, sK_[None, None, stage],
                             warp_idx, acc_s)  # fmt: skip
            s_wide = as_wide_acc(acc_s)
            s = rows_cols(s_wide)
            first_key = t0 + i * TILE + warp_idx * KEYS
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    key = first_key + coords[r, c][1]
                    if key >= limits[r]:
                        s[r, c] = -Float32.inf
                    if const_expr(self.sparse):
                        if key < limits[r]:
                            if mPT[b, key] < 0:  # padding
                                s[r, c] = -Float32.inf
                top = quad_row_max(s, r, -Float32.inf)
                if lane % 4 == 0:
                    sRed[warp_idx, coords[r, 0][0]] = top
            cute.arch.sync_threads()

            # 2. one running max per row over the whole tile; P to shared memory
            for r in cutlass.range_constexpr(2):
                row = coords[r, 0][0]
                top = row_max[r]
                for w in cutlass.range_constexpr(WARPS):
                    top = cute.arch.fmax(top, sRed[w, row])
                cur_scaled = scaled_max(top, scale_log2)
                corr[r] = cute.math.exp2(row_max[r] * scale_log2 - cur_scaled, fastmath=True)
                row_max[r] = top
                row_sum[r] = row_sum[r] * corr[r] + exp2_row(s, r, scale_log2, cur_scaled)
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    sP[row, warp_idx * KEYS + coords[r, c][1]] = s[r, c].to(dtype)
            rescale_o(o_wide, corr)
            cute.arch.sync_threads()

            # 3. P V over this warp's output columns
            sVt = transposed(cute.local_tile(sLat[None, None, stage], (TILE, COLS), (0, warp_idx)))
            tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
            tOsP = copy_a.partition_S(sP)
            tOrP_view = copy_a.retile(tOrP)
            tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            tOsV = copy_bt.partition_S(sVt)
            tOrV_view = copy_bt.retile(tOrV)
            for k in cutlass.range_constexpr(TILE // 16):
                cute.copy(copy_a, tOsP[None, None, k], tOrP_view[None, None, k])
                cute.copy(copy_bt, tOsV[None, None, k], tOrV_view[None, None, k])
                cute.gemm(mma, acc_o, tOrP[None, None, k], tOrV[None, None, k], acc_o)

        cute.arch.cp_async_wait_group(0)
        self._write_split(
            (mOp, mLp), acc_o, row_max, row_sum, sRed, scale_log2, thr_mma, coords,
            (split, q_off, sq, head0, warp_idx, lane),
        )  # fmt: skip

    @cute.jit
    def _load_query(self, mQ, sQ, gcopy, thr_g, width: cutlass.Constexpr[int], q_off, sq, head0):
        """Query rows r = (token r // H, head head0 + r % H) for r < G and token < sq, in the
        first commit group; zeros elsewhere."""
        tQsQ = thr_g.partition_D(sQ)
        tQcQ = thr_g.partition_S(cute.make_identity_tensor((ROWS, width)))
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            r = tQcQ[0, m, 0][0]
            token = r // self.h
            if r < self.g and token < sq:
                row = mQ[q_off + token, head0 + r % self.h, None]
                copy_row_async(gcopy, row, width, tQsQ[None, m, None], tQcQ[None, m, None])
            else:
                tQsQ[None, m, None].fill(0.0)

    @cute.jit
    def _load_tile(self, kv, first, t1, stage):
        """Keys first .. first + TILE - 1 (clamped to t1 - 1: finite, masked later), latent and
        RoPE columns, into pipeline stage `stage`."""
        mCkv, mKpe, sLat, sRope, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size = kv
        for mX, sX, gcopy, thr, width in (
            (mCkv, sLat, copy_lat, thr_lat, D_LATENT),
            (mKpe, sRope, copy_rope, thr_rope, D_ROPE),
        ):
            tXsX = thr.partition_D(sX[None, None, stage])
            crd = thr.partition_S(cute.make_identity_tensor((TILE, width)))
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                token = cutlass.min(first + crd[0, m, 0][0], t1 - 1)
                if const_expr(self.sparse):
                    entry = cutlass.max(mPT[b, token], 0)  # -1 padding: row 0, masked
                    page = entry // page_size
                    row = mX[page, entry - page * page_size, None]
                else:
                    page = token // page_size
                    row = mX[mPT[b, page], token - page * page_size, None]
                copy_row_async(gcopy, row, width, tXsX[None, m, None], crd[None, m, None])

    @cute.jit
    def _scores(self, mma, thr_mma, copy_a, copy_b, sQ, sK, warp_idx, acc_s):
        """acc_s += Q K_w^T over one column group (latent or RoPE) of this warp's 16 keys."""
        width = cute.size(sQ, mode=[1])
        sKw = cute.local_tile(sK, (KEYS, width), (warp_idx, 0))
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSsQ = copy_a.partition_S(sQ)
        tSrQ_view = copy_a.retile(tSrQ)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKw))
        tSsK = copy_b.partition_S(sKw)
        tSrK_view = copy_b.retile(tSrK)
        for k in cutlass.range_constexpr(width // 16):
            cute.copy(copy_a, tSsQ[None, None, k], tSrQ_view[None, None, k])
            cute.copy(copy_b, tSsK[None, None, k], tSrK_view[None, None, k])
            cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

    @cute.jit
    def _write_split(self, outs, acc_o, row_max, row_sum, sRed, scale_log2, thr_mma, coords, at):
        """The row sums over the quads and warps (through shared memory), then this warp's
        columns of the split's O / sum and, from warp 0, the rows' LSE (log2); 0 and -inf where
        the split saw no key. Rows past G or of tokens past sq are not written."""
        mOp, mLp = outs
        split, q_off, sq, head0, warp_idx, lane = at
        total = cute.make_rmem_tensor(2, Float32)
        cute.arch.sync_threads()  # every warp past its last read of sRed
        for r in cutlass.range_constexpr(2):
            part = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            if lane % 4 == 0:
                sRed[warp_idx, coords[r, 0][0]] = part
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            row = coords[r, 0][0]
            acc = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                acc += sRed[w, row]
            total[r] = acc
        o = rows_cols(as_wide_acc(acc_o))
        crd = rows_cols(as_wide_acc(thr_mma.partition_C(cute.make_identity_tensor((ROWS, COLS)))))
        for r in cutlass.range_constexpr(2):
            row = crd[r, 0][0]
            token = row // self.h
            if row < self.g and token < sq:
                inv = Float32(0.0)
                lse = -Float32.inf
                if total[r] > 0.0:
                    inv = 1.0 / total[r]
                    lse = row_max[r] * scale_log2 + cute.math.log2(total[r], fastmath=True)
                head = head0 + row % self.h
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    mOp[split, q_off + token, head, warp_idx * COLS + crd[r, c][1]] = o[r, c] * inv
                if warp_idx == 0 and lane % 4 == 0:
                    mLp[split, q_off + token, head] = lse
