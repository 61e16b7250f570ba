"""DeepSeek MLA paged decode, the partial pass of the split-KV plan (sm_90a, WGMMA): the absorbed
form, MQA over one 576-wide latent row per token (512 latent + 64 RoPE columns) that is both the
key (all 576) and the value (the first 512); reference.mla has the math.

A CTA of two warpgroups takes H query heads x Q query tokens (G = H Q rows, zero rows up to the
WGMMA's 64) and one split of one sequence's keys. Q sits in shared memory for the whole split;
the keys stream through it in tiles of TILE latent rows, STAGES deep, gathered by cp.async of
16 bytes per thread and copy (page page_table[b, t // page_size], slot t % page_size; the token
clamped into the split so that masked columns stay finite), the latent and RoPE columns in two
K-major tiles. Per tile:
  1. S: warpgroup w scores keys 32w .. 32w + 31 against all 64 rows (WGMMA 64 x 32, K = 512 +
     64, Q and K from shared memory), masks them, puts its row maxima in shared memory; barrier.
  2. Both warpgroups take the tile's row maxima (one running max per row, the same in both),
     turn their scores into P = exp2(S scale - max scale) (16-bit, into a shared 64 x TILE
     tile), rescale their O and their share of the row sums; barrier.
  3. P V: warpgroup w owns output columns 256w .. 256w + 255 (O 64 x 256 fp32 in registers), all
     TILE keys: WGMMA 64 x 256 with P and V from shared memory, V the latent tile read as an
     MN-major operand (the same bytes as the K-major key tile).
At the end the row sums meet in shared memory and every thread writes its columns of the
split's normalized O (fp32) and the row's LSE in log2 units (-inf where the split saw no key),
the paged decode's partial format, merged by its combine pass.

`sparse` (DeepSeek sparse attention, DSA): query token t attends to the cache rows its top-k
list names (mPT (tokens, topk) int32, entries page * page_size + slot, -1 padding, anywhere),
not to a sequence's pages: a CTA's keys are that list's split, loaded by index (-1 reads row 0,
masked), grid z over the tokens (one query token per CTA, so `qtokens` is 1).

The mma.sync version of this pass (four warps, 16 rows) reached ~85 TFLOP/s and 0.51x FlashMLA;
docs/attention/MLA_NOTES.md has its figures."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    D_ROPE,
    ROWS,
    STAGES,
    THREADS,
    TILE,
    WARPGROUPS,
)
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.softmax import exp2_row, quad_row_max, rescale_o, scaled_max
from forgekernel.kernels.common.sm90.warp_mma import (
    copy_row_async,
    query_row_limits,
    tiled_row_copy,
)

KEYS = TILE // WARPGROUPS  # keys per warpgroup in S
COLS = D_LATENT // WARPGROUPS  # output columns per warpgroup in P V


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

    def _setup(self, dtype):
        k_major = OperandMajorMode.K
        # S: the two warpgroups side by side along the keys; P V: along the output columns
        self.mma_s = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, Float32, (1, WARPGROUPS, 1), (ROWS, KEYS)
        )
        self.mma_o = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, OperandMajorMode.MN, Float32, (1, WARPGROUPS, 1), (ROWS, COLS)
        )
        row = LayoutEnum.ROW_MAJOR
        self.lay_ql = sm90_utils.make_smem_layout_a(row, (ROWS, TILE, D_LATENT), dtype, 1)
        self.lay_qr = sm90_utils.make_smem_layout_a(row, (ROWS, TILE, D_ROPE), dtype, 1)
        self.lay_kl = sm90_utils.make_smem_layout_b(row, (ROWS, TILE, D_LATENT), dtype, STAGES)
        self.lay_kr = sm90_utils.make_smem_layout_b(row, (ROWS, TILE, D_ROPE), dtype, STAGES)
        self.lay_p = sm90_utils.make_smem_layout_a(row, (ROWS, D_LATENT, TILE), dtype, 1)

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
        self._setup(dtype)

        @cute.struct
        class Shared:
            kl: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kl)], 1024]
            kr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kr)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_ql)], 1024]
            qr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_qr)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_p)], 1024]
            red: cute.struct.MemRange[Float32, WARPGROUPS * ROWS]

        self.shared = Shared
        self.kernel(
            mQn, mQp, mCkv, mKpe, mPT, mSeq, mOp, mLp, scale_log2, per_split, page_size, mCuQ,
            causal, self.mma_s, self.mma_o, self.lay_kl, self.lay_kr, self.lay_ql, self.lay_qr,
            self.lay_p,
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
        mma_s: cute.TiledMma,
        mma_o: cute.TiledMma,
        lay_kl: cute.ComposedLayout,
        lay_kr: cute.ComposedLayout,
        lay_ql: cute.ComposedLayout,
        lay_qr: cute.ComposedLayout,
        lay_p: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, head_block, b = cute.arch.block_idx()
        head0 = head_block * self.h
        q_off, sq = b, Int32(1)
        if const_expr(mCuQ is not None):
            q_off = mCuQ[b]
            sq = mCuQ[b + 1] - q_off
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        dtype = mQn.element_type

        sk = mPT.shape[1] if const_expr(self.sparse) else mSeq[b]
        t0 = split * per_split
        t1 = cutlass.min(t0 + per_split, sk)
        tiles = cute.ceil_div(cutlass.max(t1 - t0, 0), TILE)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sKl = smem_tensor(storage.kl, lay_kl)
        sKr = smem_tensor(storage.kr, lay_kr)
        sQl = smem_tensor(storage.ql, lay_ql)
        sQr = smem_tensor(storage.qr, lay_qr)
        sP = smem_tensor(storage.p, lay_p)
        sRed = storage.red.get_tensor(cute.make_layout((WARPGROUPS, ROWS)))

        copy_lat = tiled_row_copy(dtype, D_LATENT, THREADS)
        copy_rope = tiled_row_copy(dtype, D_ROPE, THREADS)
        thr_lat, thr_rope = copy_lat.get_slice(tidx), copy_rope.get_slice(tidx)
        self._load_query(mQn, sQl[None, None, 0], thr_lat, D_LATENT, q_off, sq, head0, copy_lat)
        self._load_query(mQp, sQr[None, None, 0], thr_rope, D_ROPE, q_off, sq, head0, copy_rope)
        kv = (mCkv, mKpe, sKl, sKr, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size)
        for s in cutlass.range_constexpr(STAGES - 1):
            if s < tiles:
                self._load_tile(kv, t0 + s * TILE, t1, s)
            cute.arch.cp_async_commit_group()

        # operand fragments (WGMMA descriptors) from the warpgroup's slice, coordinates from
        # the thread's own
        wg_s = mma_s.get_slice(wg * THREADS_PER_WG)
        wg_o = mma_o.get_slice(wg * THREADS_PER_WG)
        tSrQl = wg_s.make_fragment_A(wg_s.partition_A(sQl))[None, None, None, 0]
        tSrQr = wg_s.make_fragment_A(wg_s.partition_A(sQr))[None, None, None, 0]
        tSrKl = wg_s.make_fragment_B(wg_s.partition_B(sKl))
        tSrKr = wg_s.make_fragment_B(wg_s.partition_B(sKr))
        tOrP = wg_o.make_fragment_A(wg_o.partition_A(sP))[None, None, None, 0]
        tOrV = wg_o.make_fragment_B(wg_o.partition_B(transposed(sKl)))

        acc_o = cute.make_rmem_tensor(wg_o.partition_shape_C((ROWS, D_LATENT)), Float32)
        acc_o.fill(0.0)
        acc_s = cute.make_rmem_tensor(wg_s.partition_shape_C((ROWS, TILE)), Float32)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        corr = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # (row, key in the tile) of this thread's score registers
        thr_s = mma_s.get_slice(tidx)
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((ROWS, TILE))))
        limits = query_row_limits(coords, self.h, self.qt, sq, sk, t1, causal)

        for i in cutlass.range(tiles, unroll=1):
            cute.arch.cp_async_wait_group(STAGES - 2)
            cute.arch.fence_view_async_shared()  # cp.async writes, then WGMMA reads
            cute.arch.sync_threads()
            nxt = i + STAGES - 1
            if nxt < tiles:
                self._load_tile(kv, t0 + nxt * TILE, t1, nxt % STAGES)
            cute.arch.cp_async_commit_group()
            stage = i % STAGES

            # 1. this warpgroup's keys against every row; its row maxima to shared memory
            gemm(mma_s, acc_s, tSrQl, tSrKl[None, None, None, stage], True, -1)
            gemm(mma_s, acc_s, tSrQr, tSrKr[None, None, None, stage], False, 0)
            s = rows_cols(acc_s)
            first_key = t0 + i * TILE
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
                if tidx % 4 == 0:
                    sRed[wg, coords[r, 0][0]] = top
            cute.arch.sync_threads()

            # 2. one running max per row over the whole tile; P to shared memory
            for r in cutlass.range_constexpr(2):
                row = coords[r, 0][0]
                top = cute.arch.fmax(row_max[r], cute.arch.fmax(sRed[0, row], sRed[1, row]))
                cur_scaled = scaled_max(top, scale_log2)
                corr[r] = cute.math.exp2(row_max[r] * scale_log2 - cur_scaled, fastmath=True)
                row_max[r] = top
                row_sum[r] = row_sum[r] * corr[r] + exp2_row(s, r, scale_log2, cur_scaled)
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    sP[row, coords[r, c][1], 0] = s[r, c].to(dtype)
            rescale_o(acc_o, corr)
            cute.arch.fence_view_async_shared()  # P's stores, then WGMMA reads
            cute.arch.sync_threads()

            # 3. P V over this warpgroup's output columns
            gemm(mma_o, acc_o, tOrP, tOrV[None, None, None, stage], False, 0)

        cute.arch.cp_async_wait_group(0)
        self._write_split(
            (mOp, mLp), acc_o, row_max, row_sum, sRed, scale_log2, coords, mma_o,
            (split, q_off, sq, head0, wg, tidx),
        )  # fmt: skip

    @cute.jit
    def _load_query(self, mQ, sQ, thr_g, width: cutlass.Constexpr[int], q_off, sq, head0, gcopy):
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
        mCkv, mKpe, sKl, sKr, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size = kv
        for mX, sX, gcopy, thr, width in (
            (mCkv, sKl, copy_lat, thr_lat, D_LATENT),
            (mKpe, sKr, copy_rope, thr_rope, D_ROPE),
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
    def _write_split(self, outs, acc_o, row_max, row_sum, sRed, scale_log2, coords, mma_o, at):
        """The row sums over the quads and warpgroups (through shared memory), then this
        thread's columns of the split's O / sum and, from warpgroup 0, the rows' LSE (log2); 0
        and -inf where the split saw no key. Rows past G or of tokens past sq are not
        written."""
        mOp, mLp = outs
        split, q_off, sq, head0, wg, tidx = at
        total = cute.make_rmem_tensor(2, Float32)
        cute.arch.sync_threads()  # every thread past its last read of sRed
        for r in cutlass.range_constexpr(2):
            part = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            if tidx % 4 == 0:
                sRed[wg, coords[r, 0][0]] = part
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            row = coords[r, 0][0]
            total[r] = sRed[0, row] + sRed[1, row]
        o = rows_cols(acc_o)
        thr_o = mma_o.get_slice(tidx)
        crd = rows_cols(thr_o.partition_C(cute.make_identity_tensor((ROWS, D_LATENT))))
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
                    mOp[split, q_off + token, head, crd[r, c][1]] = o[r, c] * inv
                if wg == 0 and tidx % 4 == 0:
                    mLp[split, q_off + token, head] = lse
