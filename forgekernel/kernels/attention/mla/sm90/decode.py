"""DeepSeek MLA paged decode, the partial pass of the split-KV plan (sm_90a, WGMMA): the absorbed
form, MQA over one 576-wide latent row per token (512 latent + 64 RoPE columns) that is both the
key (all 576) and the value (the first 512); reference.mla has the math.

A CTA of two warpgroups takes H query heads x Q query tokens (G = H Q rows, zero rows up to the
WGMMA's 64) and one split of one sequence's keys. Q sits in shared memory for the whole split;
the keys stream through it in tiles of TILE latent rows, two stages, gathered by cp.async of 16
bytes per thread and copy (page page_table[b, t // page_size], slot t % page_size; the token
clamped into the split so that masked columns stay finite), the latent and RoPE columns in two
K-major tiles. The warpgroups split the work by role, FlashMLA's first sm90 design:
  - warpgroup 0 (softmax): S = Q K^T of the whole tile (WGMMA 64 x 64, K = 512 + 64: Q read
    from shared memory once per 64 keys), the mask, the online softmax (it owns the row maxima
    and sums), P (16-bit) and each row's O rescale factor into shared memory, then P V over
    output columns 0 .. 255;
  - warpgroup 1 (loads): P V over columns 256 .. 511 once P is out, then the tile after next
    into the stage both warpgroups have finished with, then it waits for the next tile's
    bytes and hands it over.
The two halves of P V run side by side; S of tile i + 1 does not overlap them: warpgroup 1
hands tile i + 1 over after its P V of tile i and the stage's release, so P_FREE (arrived
before that hand-over) never blocks. Handing it over under the P V would overlap S with P V
but, 16-bit, issue tile i + 2 only once tile i + 1 landed (MLA_NOTES.md, review).
Named barriers order them (Bar): FULL (tile landed: 1 arrives, 0 waits), P_READY (P and the
scales written: 0 arrives, 1 waits), P_FREE (1 has read P: 1 arrives, 0 waits before the next
P), STAGE_FREE (0's P V done: 0 arrives, 1 waits before refilling the stage). Warpgroup 0's
P V takes P from its registers, warpgroup 1's from shared memory. V is the latent
tile read as an MN-major operand (the same bytes as the K-major key tile).
At the end warpgroup 0's row maxima and sums go through shared memory and every thread writes
its columns of the split's normalized O (fp32) and warpgroup 0 the rows' LSE in log2 units
(-inf where the split saw no key), the paged decode's partial format, merged by its combine.
The direct form (`direct`, a plan of one split: the grid's one split covers every key) writes
instead the final O, rounded to q's dtype, and the natural LSE (log2 x ln 2) into the op's
outputs: what the combine makes of one split (weight exp2(0) = 1, sum 1), bit for bit, with no
fp32 partials and no combine launch (seesaw.py's direct form, here for the paged pass over
pages of partial tiles or an FP8 cache and for the sparse pass). Only the epilogue's stores
differ: the pass, its registers and its shared memory are the partial form's.

`fp8` (FlashMLA's FP8 cache, bf16 queries; fp8.py has the format and the dequantization):
tile 0's latent goes global -> registers -> bf16 -> st.shared into the same swizzled 16-bit tile,
by every thread before the loop. From tile 1 on warpgroup 1 issues a tile's e4m3 bytes, its
scales and its RoPE columns by cp.async into the stage it refills (the bytes into the stage's
upper half, free until they are dequantized; the scales into one tile's buffer: all 227 KB of
shared memory), and a turn later, right after issuing its half of P V, dequantizes the bytes in
place (three phases, fp8.py) and hands the tile over (`_load_wg_staged`): no register waits on
memory. (It replaced warpgroup 1 loading every tile's e4m3 into registers, which waited about
three memory round trips a tile; this form took 0.873-0.943x its time on dsa_sparse's FP8
cases, H200 2026-12-03 06:21: MLA_NOTES.md.)

`lean` (the sparse pass over an FP8 cache; the launcher's default where config.takes_lean):
warpgroup 1 issues a tile's bytes first after the stage's release (its rows' entries in one
batch, the RoPE rows by the fast divisor), and prefetches the rows of the tile after it into L2
behind the commit by three 128-byte line prefetches a thread, its list entry loaded at the top
of the turn; the bulk prefetch of the form before (a per-warp loop over distinct rows, before
the issue) goes. Only loads move (MLA_NOTES.md, "DSA FP8: the two gaps to FlashMLA, and the
issue's chain"; 0.78-0.87x the form before's time, H100 2026-12-05: "lean and lean_wide
adopted"). Its prefetch two tiles ahead ("far") was measured a split (1.025 / 0.978 / 0.997 of
lean) and dropped.

`wide` (the sparse direct pass, not fused; the launcher's default with `lean` at
config.WIDE_HEADS, 64 heads a CTA, where out's rows are 16-byte aligned): `_write_split`
normalizes O in place, the epilogue stages it in q's dtype over the retired K stages and sends
16-byte vectors (`_send_wide`) instead of 128 scalar 16-bit stores a thread (lean_wide 0.776x
the form before's time at t64-h128, H100 2026-12-05; a tie at 16 heads). Each warpgroup
stages and sends only its own 256 columns, parted by its own named barrier (Bar.O_STAGED +
wg, 128 threads), not a __syncthreads: with every thread sending both halves, racecheck
reported 512 RAW hazards a launch (warpgroup 1's staging stores, warpgroup 0's 16-byte
reads; H100 2026-12-05, MLA_NOTES.md "The wide epilogue's racecheck report"), and no
hand-over between the warpgroups is left to misorder.

`sparse` (DeepSeek sparse attention, DSA): query token t attends to the cache rows its top-k
list names (mPT (tokens, topk) int32, entries page * page_size + slot, -1 padding, anywhere),
not to a sequence's pages: a CTA's keys are that list's split, loaded by index (-1 reads row 0,
masked), grid x over the tokens (one query token per CTA, so `qtokens` is 1).

`sink` (sparse direct form): the epilogue scales a row's O by sigmoid(lse - attn_sink[h]) (the
sink in the softmax denominator only) before its one rounding; the LSE stays the keys' own.
`fused` (sparse direct form, 16-bit or with `fp8` over FlashMLA's FP8 cache; the fused DSA
prefill, issue 22): q_pe rotated in shared memory at the token's position before the first
scores (`_rope_query`), and the epilogue (`_write_fused`, fused.py's arithmetic) rotates O's
last 64 columns back (the conjugate) in fp32 registers and casts O to e4m3 per 32 columns with
UE8M0 scales (a group's amax over a quad's registers). Over the FP8 cache the mainloop is the
fp8 pass's as it is (the cache's scales viewed from its latent view's rows, the scales' slot
carrying out_scale). Both keyed only when on: the other compiles' SASS is unchanged
(MLA_NOTES.md, "The fused DSA prefill", "The fused DSA prefill over the FP8 cache").

docs/attention/MLA_NOTES.md has the earlier versions' figures (mma.sync; both warpgroups on S
along the keys)."""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.mla.sm90 import fp8 as fp8_cache
from forgekernel.kernels.attention.mla.sm90 import fused as fused_math
from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    D_ROPE,
    FP8_CHUNK,
    ROWS,
    STAGES,
    THREADS,
    TILE,
    WARPGROUPS,
)
from forgekernel.kernels.attention.mla.sm90.units import unit_bounds
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import LN2, THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import acc_as_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.opaque import opaque_i32
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.softmax import exp2_row, quad_row_max, rescale_o, scaled_max
from forgekernel.kernels.common.sm90.warp_mma import (
    copy_row_async,
    query_row_limits,
    tiled_row_copy,
)

COLS = D_LATENT // WARPGROUPS  # output columns per warpgroup in P V
FP8_CHUNKS_PER_ROW = D_LATENT // FP8_CHUNK  # 16-byte e4m3 loads per latent row
FP8_HALF = FP8_CHUNKS_PER_ROW // 2  # a half row: 16 threads, 256 bytes
# FP8 tiles after tile 0: their e4m3 bytes wait in the upper half of their own stage (fp8.py
# `staged_raw_offset`), dequantized in place a turn later (`_dequant_stage_fp8`)
FP8_STAGE_BYTES = 2 * fp8_cache.STAGED_RAW_BASE  # a stage of the 16-bit latent tile
FP8_SCALES = 4  # per row
# `wide`: the staged O's row stride, 8 elements (16 bytes) of padding (the 8 rows of a warp's
# 32-bit stores 4 banks apart; rows 16-byte aligned for the LDS.128), as seesaw.py's O16_STRIDE
O16_STRIDE = D_LATENT + 8
OSTORE_VEC = 8  # 16-bit elements a thread moves per 16-byte vector (LDS.128 / STG.E.128)


class Bar(IntEnum):
    """The kernel's named barriers (id 0 is __syncthreads): FULL .. STAGE_FREE over both
    warpgroups, STAGED and O_STAGED over one (128 threads)."""

    FULL = FIRST_FREE  # the next tile landed: warpgroup 1 arrives, 0 waits
    P_READY = FIRST_FREE + 1  # P and the rescale factors written: 0 arrives, 1 waits
    P_FREE = FIRST_FREE + 2  # warpgroup 1 has read P: 1 arrives, 0 waits
    STAGE_FREE = FIRST_FREE + 3  # warpgroup 0's P V done: 0 arrives, 1 waits
    STAGED = FIRST_FREE + 4  # fp8: warpgroup 1 alone, between the in-place phases
    # `wide`: 6, 7: warpgroup w's half of O staged (O_STAGED + w, its 128 threads alone)
    O_STAGED = FIRST_FREE + 5


class MlaDecodeSm90:
    """The partial pass; see the module docstring."""

    def __init__(
        self,
        heads: int,
        qtokens: int = 1,
        sparse: bool = False,
        fp8: bool = False,
        direct: bool = False,
        sink: bool = False,
        fused: bool = False,
        neox: bool = False,
        lean: bool = False,
        wide: bool = False,
    ):
        if heads * qtokens > ROWS:
            raise ValueError(f"heads x query tokens must be <= {ROWS}, got {heads} x {qtokens}")
        if sparse and qtokens != 1:
            raise ValueError("sparse attention takes one query token per CTA")
        self.h = heads
        self.qt = qtokens
        self.g = heads * qtokens
        self.sparse = sparse
        self.fp8 = fp8
        self.direct = direct  # a plan of one split: out and lse written here (module docstring)
        if (sink or fused) and not (sparse and direct):
            raise ValueError("the sink and the fused form are forms of the sparse direct pass")
        if neox and not fused:
            raise ValueError("neox (half-split RoPE pairs) is a form of the fused pass")
        self.sink = sink  # out rows x sigmoid(lse - sink[h]) in the epilogue (module docstring)
        self.fused = fused  # query RoPE, output RoPE and the FP8 cast (module docstring)
        self.neox = neox
        if lean and not (sparse and fp8):
            raise ValueError("lean is a form of the sparse pass over an FP8 cache")
        self.lean = lean  # the issue first, per-thread L2 prefetches behind it
        if wide and not (sparse and direct and not fused):
            raise ValueError("wide is a form of the sparse direct pass (not the fused one)")
        self.wide = wide  # O staged over the K stages, 16-byte stores (`_send_wide`)

    def _setup(self, dtype):
        k_major = OperandMajorMode.K
        # S: warpgroup 0 alone, the whole tile; P V: the two side by side along the columns
        self.mma_s = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, k_major, Float32, (1, 1, 1), (ROWS, TILE)
        )
        self.mma_o = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, OperandMajorMode.MN, Float32, (1, WARPGROUPS, 1), (ROWS, COLS)
        )
        # warpgroup 0's half of P V takes P from its registers
        self.mma_o_rs = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, k_major, OperandMajorMode.MN, Float32, (1, 1, 1), (ROWS, COLS),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
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
        mScale: cute.Tensor | None,
        mPT: cute.Tensor,
        mSeq: cute.Tensor | None,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        q_blocks: Int32,
        stream: cuda.CUstream,
    ):
        """mQn (rows, Hq, 512), mQp (rows, Hq, 64) 16-bit, rows = batch or, with mCuQ int32
        (batch + 1,), total_q; mCkv (num_pages, page_size, 512), mKpe (num_pages, page_size,
        64) in q's dtype (fp8: mCkv uint8 (num_pages, page_size, 512) e4m3 bytes, mScale fp32
        (num_pages, page_size, 4), mKpe bf16: views of FlashMLA's FP8 rows; else mScale None);
        mPT int32 (batch, max_pages); mSeq int32 (batch,); mOp fp32 (splits,
        rows, Hq, 512), mLp fp32 (splits, rows, Hq) log2; causal 0 / 1 (query tokens among
        themselves, bottom-right); q_blocks: with mCuQ, the CTAs per sequence along its query
        tokens (`qtokens` each: chunked prefill; grid x = batch x q_blocks), else 1. sparse:
        mPT the top-k lists (rows, topk), mSeq None, mCuQ None, causal and q_blocks unused.
        Direct form: mOp (rows, Hq, 512) in q's dtype (rows of 512 contiguous), mLp fp32 (rows,
        Hq) natural log (any strides), one split (per_split covers every key).
        Sink (sparse direct): mSeq carries attn_sink fp32 (Hq,). Fused (sparse direct): mQn the
        whole q (tokens, Hq, 576) (rows 16-byte aligned: its q_pe view starts 1 KB in), mQp
        the [cos | sin] cache (positions, 64) fp32 or q's dtype, mCuQ the positions int32 /
        int64 (tokens,), mScale out_scale fp32 (tokens, Hq, 16), mOp out_fp8 as uint8 (tokens,
        Hq, 512), mLp the natural LSE (the slots the sparse 16-bit pass leaves None); fused
        over an FP8 cache (fp8 too): mCkv / mKpe its latent / RoPE views as the fp8 pass's, its
        scales' view made here from the latent's (fp8.py `row_scales`: the same rows, 512
        bytes in), out_scale taking their slot."""
        mSink = mCS = mPos = mOsc = None
        if const_expr(self.sink):
            mSink, mSeq = mSeq, None  # the sparse pass has no seqlens_k: its slot has the sink
            if const_expr(mSink is None or mSink.element_type != Float32):
                raise TypeError("the sink form takes attn_sink fp32 (Hq,) in seqlens_k's slot")
        if const_expr(self.fused):
            q, mCS, mPos, mOsc = mQn, mQp, mCuQ, mScale
            mScale = mCuQ = None
            if const_expr(self.fp8):  # the cache's scales: bytes 512 .. 527 of its rows
                mScale = fp8_cache.row_scales(mCkv)
            rows = (q.shape[0], q.shape[1])
            mQn = cute.make_tensor(q.iterator, cute.make_layout((*rows, D_LATENT), stride=q.stride))
            mQp = cute.make_tensor(
                q.iterator + D_LATENT, cute.make_layout((*rows, D_ROPE), stride=q.stride)
            )
            if const_expr(mOp.element_type != cutlass.Uint8 or mOsc.element_type != Float32):
                raise TypeError("the fused form writes out_fp8 as uint8 and out_scale fp32")
            if const_expr(mCS.element_type not in (Float32, q.element_type)):
                raise TypeError("cos_sin_cache is fp32 or q's dtype")
            if const_expr(mPos.element_type not in (Int32, cutlass.Int64)):
                raise TypeError("positions are int32 or int64")
        dtype = mQn.element_type
        if const_expr(self.fp8):
            if const_expr(not (dtype == mQp.element_type == mKpe.element_type == cutlass.BFloat16)):
                raise TypeError("an FP8 cache takes bf16 queries and RoPE columns")
            if const_expr(mCkv.element_type != cutlass.Uint8 or mScale is None):
                raise TypeError("an FP8 cache's latent comes as uint8 bytes with fp32 scales")
        elif const_expr(not (dtype == mQp.element_type == mCkv.element_type == mKpe.element_type)):
            raise TypeError("q_nope, q_pe and the caches must share one 16-bit dtype")
        if const_expr((mScale is not None) != self.fp8):
            raise ValueError("mScale comes with an FP8 cache, and only then")
        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")
        if const_expr(self.sparse != (mSeq is None)):
            raise ValueError("seqlens_k comes with the paged form, and only then")
        if const_expr(self.direct and not self.fused and mOp.element_type != dtype):
            raise TypeError("the direct form writes O in q's dtype")
        units = mQn.shape[0] if const_expr(self.sparse) else mSeq.shape[0] * q_blocks
        self._setup(dtype)

        @cute.struct
        class Shared:
            kl: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kl)], 1024]
            kr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kr)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_ql)], 1024]
            qr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_qr)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_p)], 1024]
            red: cute.struct.MemRange[Float32, 3 * ROWS]  # rescale factors; final max and sum
            valid: cute.struct.MemRange[cutlass.Uint32, STAGES * 2]  # sparse: keys by stage

        @cute.struct
        class SharedStaged:  # 231424 bytes (padded to 1 KB) + 1 KB static: all of the 227 KB
            kl: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kl)], 1024]
            kr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kr)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_ql)], 1024]
            qr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_qr)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_p)], 1024]
            # one tile's scales: tile i + 1's are read (turn i, before STAGE_FREE) before tile
            # i + 2's land (issued after it); two stages' would not fit
            scl: cute.struct.Align[cute.struct.MemRange[Float32, TILE * FP8_SCALES], 16]
            red: cute.struct.MemRange[Float32, 3 * ROWS]
            valid: cute.struct.MemRange[cutlass.Uint32, STAGES * 2]

        self.shared = SharedStaged if const_expr(self.fp8) else Shared
        self.kernel(
            mQn, mQp, mCkv, mKpe, mScale, mPT, mSeq, mOp, mLp, scale_log2, per_split, page_size,
            mCuQ, causal, q_blocks, self.mma_s, self.mma_o, self.mma_o_rs, self.lay_kl,
            self.lay_kr, self.lay_ql, self.lay_qr, self.lay_p, mSink, mCS, mPos, mOsc,
        ).launch(
            # units on x (up to 2^31 - 1: prefill blocks, DSA tokens), splits on z (<= a wave);
            # neighbouring CTAs are neighbouring query blocks of a sequence (shared keys in L2)
            grid=(units, mQn.shape[1] // self.h, 1 if const_expr(self.direct) else mOp.shape[0]),
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
        mScale: cute.Tensor | None,
        mPT: cute.Tensor,
        mSeq: cute.Tensor | None,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        q_blocks: Int32,
        mma_s: cute.TiledMma,
        mma_o: cute.TiledMma,
        mma_o_rs: cute.TiledMma,
        lay_kl: cute.ComposedLayout,
        lay_kr: cute.ComposedLayout,
        lay_ql: cute.ComposedLayout,
        lay_qr: cute.ComposedLayout,
        lay_p: cute.ComposedLayout,
        mSink: cute.Tensor | None,
        mCS: cute.Tensor | None,
        mPos: cute.Tensor | None,
        mOsc: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        unit, head_block, split = cute.arch.block_idx()
        head0 = head_block * self.h
        b, q_off, sq = unit, unit, Int32(1)
        if const_expr(self.sparse):
            kv_end = mPT.shape[1]  # the top-k list's width
        else:  # this CTA's sequence, or block of its query tokens (units.py)
            b, q_off, sq, _, kv_end = unit_bounds(mSeq, mCuQ, causal, q_blocks, self.qt, unit)
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        dtype = mQn.element_type

        # the unit's own keys over the grid's splits in whole tiles, at least per_split a split
        # (not the table's width over them: launch.py; DSA's lists are all the plan's width)
        share = cute.ceil_div(cute.ceil_div(kv_end, cute.arch.grid_dim()[2]), TILE) * TILE
        per = cutlass.max(per_split, share)
        t0 = split * per
        t1 = cutlass.min(t0 + per, kv_end)
        tiles = cute.ceil_div(cutlass.max(t1 - t0, 0), TILE)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sKl = smem_tensor(storage.kl, lay_kl)
        sKr = smem_tensor(storage.kr, lay_kr)
        sQl = smem_tensor(storage.ql, lay_ql)
        sQr = smem_tensor(storage.qr, lay_qr)
        sP = smem_tensor(storage.p, lay_p)
        sRed = storage.red.get_tensor(cute.make_layout((3, ROWS)))
        sValid = storage.valid.get_tensor(cute.make_layout((2, STAGES)))
        staged = None
        if const_expr(self.fp8):
            raw = cute.recast_ptr(storage.kl.data_ptr(), dtype=cutlass.Uint8)
            raw = raw + fp8_cache.STAGED_RAW_BASE
            # (byte, chunk % 8, row, chunk // 8, stage): fp8.py's `staged_raw_offset`
            raw_lay = cute.make_layout(
                (FP8_CHUNK, 8, TILE, FP8_SCALES, STAGES),
                stride=(1, FP8_CHUNK, fp8_cache.STAGED_ROW_BYTES, fp8_cache.STAGED_RAW_BLOCK,
                        FP8_STAGE_BYTES),
            )  # fmt: skip
            staged = (
                cute.make_tensor(raw, raw_lay),
                storage.scl.get_tensor(cute.make_layout((FP8_SCALES, TILE))),
            )

        # Q and tile 0 by every thread, tile 1 then by warpgroup 1 (its loads from there on)
        copy_lat = tiled_row_copy(dtype, D_LATENT, THREADS)
        copy_rope = tiled_row_copy(dtype, D_ROPE, THREADS)
        thr_lat, thr_rope = copy_lat.get_slice(tidx), copy_rope.get_slice(tidx)
        self._load_query(mQn, sQl[None, None, 0], thr_lat, D_LATENT, q_off, sq, head0, copy_lat)
        self._load_query(mQp, sQr[None, None, 0], thr_rope, D_ROPE, q_off, sq, head0, copy_rope)
        kv_all = (mCkv, mKpe, sKl, sKr, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size,
                  (mScale, tidx, THREADS))  # fmt: skip
        if 0 < tiles:
            self._load_tile(kv_all, t0, t1, 0)
            if const_expr(self.sparse):
                if tidx // 64 == 2:  # warpgroup 1's first two warps
                    self._store_valid(mPT, b, t0, t1, 0, sValid, tidx - THREADS_PER_WG)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()  # cp.async writes, then WGMMA reads
        cute.arch.sync_threads()
        if const_expr(self.fused):  # q_pe rotated in place (every thread's rows landed)
            self._rope_query(sQr[None, None, 0], mCS, mPos[q_off], tidx)
            cute.arch.fence_view_async_shared()  # st.shared, then WGMMA reads
            cute.arch.sync_threads()

        wg_o = mma_o.get_slice(wg * THREADS_PER_WG)
        tOrP = wg_o.make_fragment_A(wg_o.partition_A(sP))[None, None, None, 0]
        tOrV = wg_o.make_fragment_B(wg_o.partition_B(transposed(sKl)))
        acc_o = cute.make_rmem_tensor(wg_o.partition_shape_C((ROWS, D_LATENT)), Float32)
        acc_o.fill(0.0)
        row_max = cute.make_rmem_tensor(2, Float32)
        row_sum = cute.make_rmem_tensor(2, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # (row, column) of this thread's O registers; rows as in S (the same M partition)
        o_crd = rows_cols(
            mma_o.get_slice(tidx).partition_C(cute.make_identity_tensor((ROWS, D_LATENT)))
        )
        bars = (
            named_barrier(Bar.FULL, THREADS),
            named_barrier(Bar.P_READY, THREADS),
            named_barrier(Bar.P_FREE, THREADS),
            named_barrier(Bar.STAGE_FREE, THREADS),
        )
        if wg == 0:
            self._softmax_wg(
                (sQl, sQr, sKl, sKr, sP, sRed, sValid), (tOrP, tOrV, acc_o), mma_s, mma_o_rs, bars,
                (row_max, row_sum), (mPT, b, sq, kv_end, t0, t1, tiles, scale_log2, causal, tidx),
            )  # fmt: skip
        else:
            copy_lat1 = tiled_row_copy(dtype, D_LATENT, THREADS_PER_WG)
            copy_rope1 = tiled_row_copy(dtype, D_ROPE, THREADS_PER_WG)
            tid1 = tidx - THREADS_PER_WG
            kv_wg = (
                mCkv, mKpe, sKl, sKr, copy_lat1, copy_rope1, copy_lat1.get_slice(tid1),
                copy_rope1.get_slice(tid1), mPT, b, page_size, (mScale, tid1, THREADS_PER_WG),
            )  # fmt: skip
            o_ops, span = (tOrP, tOrV, acc_o), (t0, t1, tiles)
            if const_expr(self.fp8):
                self._load_wg_staged(
                    kv_wg, o_ops, mma_o, bars, sRed, sValid, o_crd, span, tid1, staged
                )
            else:
                self._load_wg(kv_wg, o_ops, mma_o, bars, sRed, sValid, o_crd, span, tid1)
        # the rows' final max and sum, from warpgroup 0 (which holds them) to both
        if wg == 0:
            for r in cutlass.range_constexpr(2):
                total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
                if tidx % 4 == 0:
                    sRed[1, o_crd[r, 0][0]] = row_max[r]  # (row 0: warpgroup 1 may still read)
                    sRed[2, o_crd[r, 0][0]] = total
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            row_max[r] = sRed[1, o_crd[r, 0][0]]
            row_sum[r] = sRed[2, o_crd[r, 0][0]]
        at = (split, q_off, sq, head0, wg, tidx)
        if const_expr(self.fused):
            self._write_fused((mOp, mLp, mOsc, mSink), acc_o, row_max, row_sum, scale_log2,
                              o_crd, at, (mCS, mPos[q_off]))  # fmt: skip
        else:
            self._write_split((mOp, mLp), acc_o, row_max, row_sum, scale_log2, o_crd, at, mSink)
        if const_expr(self.wide):
            # every WGMMA on the K stages retired (each warpgroup's wait_group 0) and every
            # cp.async into them waited before the __syncthreads above: generic stores may
            # overwrite them. Each warpgroup stages its own columns (wg COLS .. + COLS - 1 of
            # every row) and sends them itself after its own barrier: no hand-over between
            # the warpgroups (`_send_wide`)
            sO = cute.make_tensor(
                cute.recast_ptr(storage.kl.data_ptr(), dtype=mOp.element_type),
                cute.make_layout((ROWS, D_LATENT), stride=(O16_STRIDE, 1)),
            )
            tOrO = cute.make_rmem_tensor_like(acc_o, mOp.element_type)
            tOrO.store(acc_o.load().to(mOp.element_type))  # normalized in `_write_split`
            cute.autovec_copy(tOrO, mma_o.get_slice(tidx).partition_C(sO))
            # this warpgroup's rows staged before any of its threads reads one (ids as
            # immediates: BAR.SYNC 0x6 / 0x7, 0x80)
            if wg == 0:
                named_barrier(Bar.O_STAGED, THREADS_PER_WG).arrive_and_wait()
            else:
                named_barrier(Bar.O_STAGED + 1, THREADS_PER_WG).arrive_and_wait()
            self._send_wide(mOp, sO, q_off, head0, tidx)

    @cute.jit
    def _softmax_wg(self, smem, o_ops, mma_s, mma_o_rs, bars, stats, at):
        """Warpgroup 0: per tile, S, mask, online softmax, P and the rescale factors out, its
        half of P V."""
        sQl, sQr, sKl, sKr, sP, sRed, sValid = smem
        _, _, acc_o = o_ops
        full, p_ready, p_free, stage_free = bars
        row_max, row_sum = stats
        mPT, b, sq, sk, t0, t1, tiles, scale_log2, causal, tidx = at
        thr_s = mma_s.get_slice(tidx)
        tSrQl = thr_s.make_fragment_A(thr_s.partition_A(sQl))[None, None, None, 0]
        tSrQr = thr_s.make_fragment_A(thr_s.partition_A(sQr))[None, None, None, 0]
        tSrKl = thr_s.make_fragment_B(thr_s.partition_B(sKl))
        tSrKr = thr_s.make_fragment_B(thr_s.partition_B(sKr))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, TILE)), Float32)
        corr = cute.make_rmem_tensor(2, Float32)
        coords = rows_cols(thr_s.partition_C(cute.make_identity_tensor((ROWS, TILE))))
        limits = query_row_limits(coords, self.h, self.qt, sq, sk, t1, causal)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), sP.element_type), mma_s
        )
        thr_r2s = r2s.get_slice(tidx)
        s_p_dst = thr_r2s.partition_D(sP[None, None, 0])
        r_p = cute.make_rmem_tensor(acc_s.shape, sP.element_type)
        # its half of P V: P from registers (the C layout of S in 16 bits is the A layout),
        # V its 256 columns of the latent tile
        thr_o0 = mma_o_rs.get_slice(tidx)
        tOrV0 = thr_o0.make_fragment_B(
            thr_o0.partition_B(cute.local_tile(transposed(sKl), (COLS, TILE, STAGES), (0, 0, 0)))
        )
        tOrP0 = thr_o0.make_fragment_A(thr_o0.partition_shape_A((ROWS, TILE)))
        p_as_a = acc_as_operand_a(r_p)
        for i in cutlass.range(tiles, unroll=1):
            if i > 0:
                full.arrive_and_wait()  # tile i landed
            stage = i % STAGES
            gemm(mma_s, acc_s, tSrQl, tSrKl[None, None, None, stage], True, -1)
            gemm(mma_s, acc_s, tSrQr, tSrKr[None, None, None, stage], False, 0)
            s = rows_cols(acc_s)
            first_key = t0 + i * TILE
            if const_expr(self.sparse):  # the list positions loaded with a valid entry
                words = (sValid[0, stage], sValid[1, stage])
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    col = coords[r, c][1]
                    if const_expr(self.sparse):
                        word = cutlass.select_(col < 32, words[0], words[1])
                        if ((word >> (col % 32)) & 1) == 0:
                            s[r, c] = -Float32.inf
                    else:
                        if first_key + col >= limits[r]:
                            s[r, c] = -Float32.inf
                top = quad_row_max(s, r, row_max[r])
                cur_scaled = scaled_max(top, scale_log2)
                corr[r] = cute.math.exp2(row_max[r] * scale_log2 - cur_scaled, fastmath=True)
                row_max[r] = top
                row_sum[r] = row_sum[r] * corr[r] + exp2_row(s, r, scale_log2, cur_scaled)
            if i > 0:
                p_free.arrive_and_wait()  # warpgroup 1 is done with the last P
            r_p.store(acc_s.load().to(sP.element_type))
            cute.copy(r2s, thr_r2s.retile(r_p), s_p_dst)  # stmatrix: 4 per thread
            for r in cutlass.range_constexpr(2):
                if tidx % 4 == 0:
                    sRed[0, coords[r, 0][0]] = corr[r]
            cute.arch.fence_view_async_shared()  # P's stores, then WGMMA reads
            p_ready.arrive()
            rescale_o(acc_o, corr)
            for k in cutlass.range_constexpr(cute.size(tOrP0)):
                tOrP0[k] = p_as_a[k]  # a renaming: the same registers in the same order
            gemm(mma_o_rs, acc_o, tOrP0, tOrV0[None, None, None, stage], False, 0)
            stage_free.arrive()

    @cute.jit
    def _load_wg(self, kv, o_ops, mma_o, bars, sRed, sValid, o_crd, span, tid1):
        """Warpgroup 1 over a 16-bit cache: per tile, its half of P V once P is out, then the
        tile after next into the freed stage, then the next tile handed over once landed (an FP8
        cache: `_load_wg_staged`)."""
        tOrP, tOrV, acc_o = o_ops
        full, p_ready, p_free, stage_free = bars
        t0, t1, tiles = span
        corr = cute.make_rmem_tensor(2, Float32)
        if 1 < tiles:
            self._load_tile(kv, t0 + TILE, t1, 1)
            if const_expr(self.sparse):
                if tid1 < 64:
                    self._store_valid(kv[8], kv[9], t0 + TILE, t1, 1, sValid, tid1)
        cute.arch.cp_async_commit_group()
        # Early hand-over (rows > 16: the tensor cores are the bottleneck): tile i + 1 goes to
        # warpgroup 0 as soon as P of tile i is out, so its S runs under this warpgroup's P V;
        # with 16 rows (decode at 16 heads, bound by memory) tile i + 2's loads go out first.
        early = const_expr(self.g > 16)
        for i in cutlass.range(tiles, unroll=1):
            stage = i % STAGES
            p_ready.arrive_and_wait()
            if const_expr(early):
                if i + 1 < tiles:  # its loads are the one commit group in flight
                    cute.arch.cp_async_wait_group(0)
                    cute.arch.fence_view_async_shared()  # cp.async, then WGMMA
                    full.arrive()
            for r in cutlass.range_constexpr(2):
                corr[r] = sRed[0, o_crd[r, 0][0]]
            rescale_o(acc_o, corr)
            gemm(mma_o, acc_o, tOrP, tOrV[None, None, None, stage], False, 0)
            if i + 1 < tiles:
                p_free.arrive()
            stage_free.arrive_and_wait()  # both warpgroups are done with this stage
            nxt = i + STAGES
            if nxt < tiles:
                self._load_tile(kv, t0 + nxt * TILE, t1, stage)
                if const_expr(self.sparse):
                    if tid1 < 64:
                        self._store_valid(kv[8], kv[9], t0 + nxt * TILE, t1, stage, sValid, tid1)
            cute.arch.cp_async_commit_group()
            if const_expr(not early):
                if i + 1 < tiles:
                    cute.arch.cp_async_wait_group(1)  # tile i + 1 (the group before this one)
                    cute.arch.fence_view_async_shared()
                    full.arrive()

    @cute.jit
    def _load_wg_staged(self, kv, o_ops, mma_o, bars, sRed, sValid, o_crd, span, tid1, staged):
        """Warpgroup 1 over an FP8 cache, per tile i: its half of P V issued once P is out;
        under it tile i + 1 (its bytes cp.async'd a turn ago into its stage) dequantized in
        place and handed over; once the stage of tile i is free, tile i + 2's bytes, scales and
        RoPE columns issued into it by cp.async, no register waiting on them. Memory latency
        leaves this warpgroup's turn (the register loads it replaced waited ~3 round trips a
        tile, MLA_NOTES.md); the dequantization runs beside both halves of P V on the tensor
        cores."""
        tOrP, tOrV, acc_o = o_ops
        full, p_ready, p_free, stage_free = bars
        t0, t1, tiles = span
        sRaw, sScl = staged
        wg1 = named_barrier(Bar.STAGED, THREADS_PER_WG)
        corr = cute.make_rmem_tensor(2, Float32)
        # the rows' page / slot by multiply-shift (an integer division was ~20 instructions)
        div = cute.fast_divmod_create_divisor_v2(kv[10])
        staged = (sRaw, sScl, div)
        if 1 < tiles:
            self._issue_fp8(kv, staged, sValid, t0 + TILE, t1, 1, tid1)
        cute.arch.cp_async_commit_group()
        if const_expr(self.lean):  # tile 2 into L2
            ahead = self._lean_entry(kv, t0 + STAGES * TILE, t1, tid1)
            self._prefetch_lines(kv, ahead, t0 + STAGES * TILE, t1, tid1, div)
        else:
            self._prefetch_fp8(kv, t0 + STAGES * TILE, t1, tid1)  # tile 2 into L2
        for i in cutlass.range(tiles, unroll=1):
            stage = i % STAGES
            if const_expr(self.lean):  # the next prefetch's list entry, a turn before its use
                ahead = self._lean_entry(kv, t0 + (i + STAGES + 1) * TILE, t1, tid1)
            p_ready.arrive_and_wait()
            for r in cutlass.range_constexpr(2):
                corr[r] = sRed[0, o_crd[r, 0][0]]
            rescale_o(acc_o, corr)
            gemm(mma_o, acc_o, tOrP, tOrV[None, None, None, stage], False, -1)
            if i + 1 < tiles:  # its cp.async group is the one in flight
                cute.arch.cp_async_wait_group(0)
                wg1.arrive_and_wait()  # every thread's bytes landed
                self._dequant_stage_fp8(kv[2], sRaw, sScl, 1 - stage, tid1, wg1)
                cute.arch.fence_view_async_shared()  # st.shared and cp.async, then WGMMA
                full.arrive()
            warpgroup.wait_group(0)
            if i + 1 < tiles:
                p_free.arrive()
            stage_free.arrive_and_wait()  # both warpgroups are done with this stage
            nxt = i + STAGES
            if const_expr(not self.lean):
                self._prefetch_fp8(kv, t0 + (nxt + 1) * TILE, t1, tid1)  # a turn ahead, into L2
            if nxt < tiles:
                self._issue_fp8(kv, staged, sValid, t0 + nxt * TILE, t1, stage, tid1)
            cute.arch.cp_async_commit_group()
            if const_expr(self.lean):  # behind the issue, which waits on nothing of it
                self._prefetch_lines(kv, ahead, t0 + (nxt + 1) * TILE, t1, tid1, div)

    @cute.jit
    def _issue_fp8(self, kv, staged, sValid, first, t1, stage, tid):
        """FP8: keys first .. first + TILE - 1 (clamped as `_load_tile`) into stage
        `stage` by warpgroup 1's thread `tid`, all cp.async: the RoPE columns as `_load_tile`'s,
        the e4m3 bytes into the stage's upper half (fp8.py `staged_raw_offset`), the scales into
        sScl (one tile's; threads tid < TILE, row tid; 0 for -1 padding), and the valid bits
        (sparse)."""
        mCkv, mPT, b = kv[0], kv[8], kv[9]
        mScale = kv[11][0]
        sRaw, sScl, div = staged
        if const_expr(not self.lean):
            self._load_tile(kv, first, t1, stage, False)
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Uint8,
            num_bits_per_copy=FP8_CHUNK * 8,
        )  # fmt: skip
        loads = TILE * FP8_CHUNKS_PER_ROW // THREADS_PER_WG
        for j in cutlass.range_constexpr(0, loads, 2):  # one row, both halves
            r, _ = fp8_cache.staged_issue_job(tid, j)
            token = cutlass.min(first + r, t1 - 1)
            page, slot = self._cache_row_by(mPT, b, token, div)
            for half in cutlass.range_constexpr(2):
                _, c = fp8_cache.staged_issue_job(tid, j + half)
                rptr = cute.make_ptr(cutlass.Uint8, mCkv[page, slot, None].iterator.toint(),
                                     cute.AddressSpace.gmem, assumed_align=FP8_CHUNK)  # fmt: skip
                src = cute.make_tensor(rptr, cute.make_layout((FP8_CHUNK, FP8_CHUNKS_PER_ROW)))
                cute.copy(atom, src[None, c], sRaw[None, c % 8, r, c // 8, stage])
        if const_expr(self.lean):  # the latent's bytes first, the RoPE rows (by `div`) after
            self._load_tile(kv, first, t1, stage, False, div)
        if tid < TILE:
            token = cutlass.min(first + tid, t1 - 1)
            page, slot = self._cache_row_by(mPT, b, token, div)
            dst = sScl[None, tid]
            listed = Int32(0)
            if const_expr(self.sparse):
                listed = mPT[b, token]
            if listed >= 0:
                sptr = cute.make_ptr(Float32, mScale[page, slot, None].iterator.toint(),
                                     cute.AddressSpace.gmem, assumed_align=FP8_CHUNK)  # fmt: skip
                satom = cute.make_copy_atom(
                    cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Float32,
                    num_bits_per_copy=FP8_CHUNK * 8,
                )  # fmt: skip
                cute.copy(satom, cute.make_tensor(sptr, cute.make_layout(FP8_SCALES)), dst)
            else:  # -1 padding: scale 0 (row 0's e4m3 bytes read as finite values)
                dst.fill(0.0)
            if const_expr(self.sparse):
                self._store_valid(mPT, b, first, t1, stage, sValid, tid)

    @cute.jit
    def _dequant_chunk(self, sRaw, sScl, sK, r, c, stage):
        """Chunk c (16 e4m3 bytes) of tile row r, from the stage's upper half to the 16-bit
        tile sK (the stage's), times its scale."""
        raw = cute.make_rmem_tensor(FP8_CHUNK, cutlass.Uint8)
        cute.autovec_copy(sRaw[None, c % 8, r, c // 8, stage], raw)
        mult = fp8_cache.bf16_multiplier(sScl[c // 8, r])
        fp8_cache.store_chunk(raw, mult, sK[r, None], c)

    @cute.jit
    def _dequant_stage_fp8(self, sKl, sRaw, sScl, stage, tid, wg1):
        """FP8: the e4m3 bytes of stage `stage` (landed, every thread's) into its 16-bit
        tile, in place, by warpgroup 1 (thread tid): columns 0 .. 255 (blocks 0 .. 3, the bytes
        in blocks 4, 5); after a barrier 256 .. 383 (blocks 4, 5, from block 6), holding
        384 .. 511 (block 7) in registers; after a barrier those into blocks 6, 7. 16 chunks a
        thread: lanes 0-15 / 16-31 (0-7, ...) on one row's consecutive chunks."""
        sK = sKl[None, None, stage]
        warp, lane = tid // 32, tid % 32
        jobs = fp8_cache.STAGED_JOBS
        for j in cutlass.range_constexpr(jobs[0]):
            r, c = fp8_cache.staged_job(0, j, warp, lane)
            self._dequant_chunk(sRaw, sScl, sK, r, c, stage)
        wg1.arrive_and_wait()  # blocks 4, 5 read by every thread
        last = cute.make_rmem_tensor((FP8_CHUNK, jobs[2]), cutlass.Uint8)
        for j in cutlass.range_constexpr(jobs[2]):
            r, c = fp8_cache.staged_job(2, j, warp, lane)
            cute.autovec_copy(sRaw[None, c % 8, r, c // 8, stage], last[None, j])
        for j in cutlass.range_constexpr(jobs[1]):
            r, c = fp8_cache.staged_job(1, j, warp, lane)
            self._dequant_chunk(sRaw, sScl, sK, r, c, stage)
        wg1.arrive_and_wait()  # blocks 6, 7 read by every thread
        for j in cutlass.range_constexpr(jobs[2]):
            r, c = fp8_cache.staged_job(2, j, warp, lane)
            mult = fp8_cache.bf16_multiplier(sScl[c // 8, r])
            fp8_cache.store_chunk(last[None, j], mult, sK[r, None], c)

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
    def _store_valid(self, mPT, b, first, t1, stage, sValid, tid):
        """Sparse: which of list positions first .. first + TILE - 1 hold an entry (before t1,
        not -1 padding), a bit each, by the two warps of threads tid 0 .. 63 (ballots)."""
        token = first + tid
        entry = mPT[b, cutlass.min(token, t1 - 1)]
        bits = cute.arch.vote_ballot_sync(Int32(cutlass.select_(token < t1, entry, -1)) >= 0)
        if tid % 32 == 0:
            sValid[tid // 32, stage] = bits

    @cute.jit
    def _load_tile(self, kv, first, t1, stage, latent: cutlass.Constexpr[bool] = True, div=None):
        """Keys first .. first + TILE - 1 (clamped to t1 - 1: finite, masked later), latent and
        RoPE columns, into pipeline stage `stage` (fp8: the latent by `_load_latent_fp8` unless
        `latent` is False, the RoPE columns cp.async as 16-bit ones; `div`, the `lean` form's:
        a sparse row's page / slot by that fast divisor of page_size)."""
        mCkv, mKpe, sKl, sKr, copy_lat, copy_rope, thr_lat, thr_rope, mPT, b, page_size, f8 = kv
        async_parts = [(mKpe, sKr, copy_rope, thr_rope, D_ROPE)]
        if const_expr(not self.fp8):
            async_parts.insert(0, (mCkv, sKl, copy_lat, thr_lat, D_LATENT))
        for mX, sX, gcopy, thr, width in async_parts:
            tXsX = thr.partition_D(sX[None, None, stage])
            crd = thr.partition_S(cute.make_identity_tensor((TILE, width)))
            for m in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                token = cutlass.min(first + crd[0, m, 0][0], t1 - 1)
                if const_expr(self.sparse):
                    listed = mPT[b, token]
                    entry = cutlass.max(listed, 0)
                    if const_expr(div is not None):
                        page, slot = divmod(entry, div)
                        row = mX[page, slot, None]
                    else:
                        page = entry // page_size
                        row = mX[page, entry - page * page_size, None]
                    if listed >= 0:
                        copy_row_async(gcopy, row, width, tXsX[None, m, None], crd[None, m, None])
                    else:  # -1 padding: zeros, not a cache row (P = 0 times NaN would be NaN)
                        tXsX[None, m, None].fill(0.0)
                else:
                    page = token // page_size
                    row = mX[mPT[b, page], token - page * page_size, None]
                    copy_row_async(gcopy, row, width, tXsX[None, m, None], crd[None, m, None])
        if const_expr(self.fp8 and latent):
            mScale, tid, threads = f8
            self._load_latent_fp8(
                mCkv, mScale, sKl[None, None, stage], (mPT, b, page_size), first, t1, tid, threads
            )

    @cute.jit
    def _prefetch_fp8(self, kv, first, t1, tid1):
        """FP8: the rows of the tile at `first` (if any) into L2 (thread tid1 < TILE: row
        tid1), for its register loads a turn later."""
        mCkv, mPT, b, page_size = kv[0], kv[8], kv[9], kv[10]
        if tid1 < TILE:
            if first < t1:  # (t1 - 1 may be no position at all otherwise)
                token = cutlass.min(first + tid1, t1 - 1)
                page, slot = self._cache_row(mPT, b, token, page_size)
                fp8_cache.prefetch_row_l2(mCkv[page, slot, None])

    @cute.jit
    def _lean_entry(self, kv, first, t1, tid1):
        """`lean`: the list entry of row tid1 // 2 of the tile at `first` (clamped into the
        split; -1 where the tile is past it), which `_prefetch_lines` takes a turn later: loaded
        at the top of warpgroup 1's turn, its miss under the turn."""
        mPT, b = kv[8], kv[9]
        entry = Int32(-1)
        if first < t1:
            entry = mPT[b, cutlass.min(first + tid1 // 2, t1 - 1)]
        return entry

    @cute.jit
    def _prefetch_lines(self, kv, entry, first, t1, tid1, div):
        """`lean`: the rows of the tile at `first` (if any) into L2, row tid1 // 2 by threads
        tid1 and tid1 ^ 1, three 128-byte lines each (fp8.py `prefetch_lines_l2`; -1 padding
        prefetches row 0, as `_prefetch_fp8`)."""
        if first < t1:
            page, slot = divmod(cutlass.max(entry, 0), div)
            fp8_cache.prefetch_lines_l2(kv[0][page, slot, None], tid1 % 2)

    @cute.jit
    def _cache_row(self, mPT, b, token, page_size):
        """(page, slot) of the key at list / sequence position `token` (sparse: entry -1 reads
        row 0, masked, and zeroed by the loads)."""
        if const_expr(self.sparse):
            entry = cutlass.max(mPT[b, token], 0)
            page = entry // page_size
            return page, entry - page * page_size
        page = token // page_size
        return mPT[b, page], token - page * page_size

    @cute.jit
    def _cache_row_by(self, mPT, b, token, div):
        """`_cache_row` with the page size as a fast divisor (`fast_divmod_create_divisor_v2`)."""
        if const_expr(self.sparse):
            page, slot = divmod(cutlass.max(mPT[b, token], 0), div)
            return page, slot
        page, within = divmod(token, div)
        return mPT[b, page], within

    @cute.jit
    def _load_latent_fp8(self, mCkv, mScale, sK, rows, first, t1, tid, threads):
        """The e4m3 latent of keys first .. first + TILE - 1 (clamped as `_load_tile`) into the
        16-bit tile sK (TILE, D_LATENT) by `threads` threads (the CTA: tile 0), every load of a
        thread issued before it converts any: `_fetch_latent_fp8`, then `_store_latent_fp8`."""
        raw, scale = self._fetch_latent_fp8(mCkv, mScale, rows, first, t1, tid, threads)
        self._store_latent_fp8(raw, scale, sK, tid, threads)

    @cute.jit
    def _fp8_row(self, tid, threads: cutlass.Constexpr[int], load: cutlass.Constexpr[int]):
        """(tile row, 16-byte chunk) of a thread's load `load`: warp w's lanes 0-15 / 16-31
        take rows 2w, 2w + 1 (+ 2 x warps per pair of loads), half a row (256 bytes) per load,
        so that each 16-byte store instruction fills whole 128-byte lines of the swizzled tile
        (the two rows' chunks land on the even and odd 16-byte slots)."""
        warp, lane = tid // 32, tid % 32
        row = (load // 2) * 2 * (threads // 32) + 2 * warp + lane // 16
        return row, (load % 2) * FP8_HALF + lane % 16

    @cute.jit
    def _fetch_latent_fp8(self, mCkv, mScale, rows, first, t1, tid, threads):
        """This thread's loads of the tile (`_fp8_row`; TILE x FP8_CHUNKS_PER_ROW / threads):
        (raw (16, loads) uint8, scale (loads,) fp32) registers, the loads issued, nothing
        waited."""
        mPT, b, page_size = rows
        loads = TILE * FP8_CHUNKS_PER_ROW // threads
        raw = cute.make_rmem_tensor((FP8_CHUNK, loads), cutlass.Uint8)
        scale = cute.make_rmem_tensor(loads, Float32)
        for j in cutlass.range_constexpr(0, loads, 2):  # one row, both halves
            r, _ = self._fp8_row(tid, threads, j)
            token = cutlass.min(first + r, t1 - 1)
            page, slot = self._cache_row(mPT, b, token, page_size)
            for half in cutlass.range_constexpr(2):
                _, chunk = self._fp8_row(tid, threads, j + half)
                fp8_cache.load_chunk(mCkv[page, slot, None], chunk, raw[None, j + half])
                scale[j + half] = mScale[page, slot, fp8_cache.chunk_scale_index(chunk)]
                if const_expr(self.sparse):  # -1 padding: scale 0 (its e4m3 bytes are finite)
                    if mPT[b, token] < 0:
                        scale[j + half] = Float32(0.0)
        return raw, scale

    @cute.jit
    def _store_latent_fp8(self, raw, scale, sK, tid, threads):
        """`_fetch_latent_fp8`'s registers dequantized into their rows of the 16-bit tile sK."""
        for j in cutlass.range_constexpr(cute.size(scale)):
            r, chunk = self._fp8_row(tid, threads, j)
            mult = fp8_cache.bf16_multiplier(scale[j])
            fp8_cache.store_chunk(raw[None, j], mult, sK[r, None], chunk)

    @cute.jit
    def _write_split(self, outs, acc_o, row_max, row_sum, scale_log2, o_crd, at, mSink=None):
        """This thread's columns of the split's O / sum and, from warpgroup 0, the rows' LSE
        (log2); 0 and -inf where the split saw no key. Rows past G or of tokens past sq are
        not written. Direct form: O rounded to q's dtype into out, the LSE natural (the
        combine's one-split result: its fp32 O_0 x 1 / 1, its log2 LSE x ln 2). mSink (the
        sink form, direct): O x 1 / sum x sigmoid(lse - sink[head]) before the rounding, the
        LSE without the sink (a row that saw no key stays 0 / -inf)."""
        mOp, mLp = outs
        split, q_off, sq, head0, wg, tidx = at
        o = rows_cols(acc_o)
        for r in cutlass.range_constexpr(2):
            # (opaque: with G <= 8 rows the compiler would prove rows r + 8 never written, and
            # ptxas then serialized every WGMMA of the kernel)
            row = opaque_i32(o_crd[r, 0][0])
            token = row // self.h
            if row < self.g and token < sq:
                inv = Float32(0.0)
                lse = -Float32.inf
                if row_sum[r] > 0.0:
                    inv = 1.0 / row_sum[r]
                    lse = row_max[r] * scale_log2 + cute.math.log2(row_sum[r], fastmath=True)
                    if const_expr(mSink is not None):
                        inv = inv * fused_math.sink_weight(lse, mSink[head0 + row % self.h])
                head = head0 + row % self.h
                if const_expr(self.wide):  # normalized in place, staged by the caller
                    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                        o[r, c] = o[r, c] * inv
                if const_expr(self.direct and not self.wide):
                    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                        value = (o[r, c] * inv).to(mOp.element_type)
                        mOp[q_off + token, head, o_crd[r, c][1]] = value
                if const_expr(self.direct):
                    if wg == 0 and tidx % 4 == 0:
                        mLp[q_off + token, head] = lse * LN2
                else:
                    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                        mOp[split, q_off + token, head, o_crd[r, c][1]] = o[r, c] * inv
                    if wg == 0 and tidx % 4 == 0:
                        mLp[split, q_off + token, head] = lse

    @cute.jit
    def _send_wide(self, mOp, sO, q_off, head0, tidx):
        """`wide` (after warpgroup wg's O_STAGED barrier that follows its staging): warpgroup
        wg sends its own columns, those its acc_o held and its threads staged: its thread t =
        tidx - 128 wg takes the 16-byte vectors i = t + 128 k (k < 16) of its half rows, row
        i // 32, columns 256 wg + 8 (i % 32) .. + 7 (a warp: one half row, 512 contiguous
        bytes), to out[q_off, head0 + r] for the rows r < G (one query token a CTA); out's
        rows 16-byte aligned (the compile's).

        Why per warpgroup: every thread sent vectors of both halves after a __syncthreads
        (warp 1 the first half row of warpgroup 1's columns), and compute-sanitizer's
        racecheck reported 512 RAW hazards a launch on t3-h128-p16-k64-L0-64-scattered-fp8
        (H100 2026-12-05: warpgroup 1's staging STS, warpgroup 0's LDS.128, the BAR.SYNC 0x0
        between them; MLA_NOTES.md, "The wide epilogue's racecheck report"). No thread reads
        a byte another warpgroup wrote now: the hand-over is within one warpgroup, at its own
        named barrier, whatever either warpgroup's barrier history."""
        per_half = COLS // OSTORE_VEC  # a warpgroup's vectors a row
        # (from tidx, not the warp-uniform wg: the compiler then knows 0 <= t < 128, and drops
        # the vectors of rows past G at compile time, 12 of 16 at 16 heads)
        wg, t = tidx // THREADS_PER_WG, tidx % THREADS_PER_WG
        for k in cutlass.range_constexpr(ROWS * per_half // THREADS_PER_WG):
            i = t + k * THREADS_PER_WG
            r = i // per_half
            if r < self.g:
                dst = mOp[q_off, head0 + r, None]
                col = wg * per_half + i % per_half
                cute.autovec_copy(
                    cute.local_tile(sO[r, None], (OSTORE_VEC,), (col,)),
                    cute.local_tile(dst, (OSTORE_VEC,), (col,)),
                )

    @cute.jit
    def _rope_query(self, sQr, mCS, pos, tidx):
        """Fused: q_pe's rows in shared memory (64 x 64, q's dtype, after every thread's
        cp.async landed) rotated by +angle at `pos` (every row is of the CTA's one token) in
        fp32, rounded back to q's dtype: y0 = x0 cos - x1 sin, y1 = x0 sin + x1 cos over the
        pairs (2i, 2i + 1) (neox: (i, i + 32)), cos_i = cache[pos, i], sin_i = cache[pos, 32
        + i]. Thread t: row t // 4, pairs 8 (t % 4) .. + 7; rows past G (zeros) skipped."""
        row = tidx // 4
        if row < self.g:
            for k in cutlass.range_constexpr(D_ROPE // 8):
                i = (tidx % 4) * (D_ROPE // 8) + k
                c0, c1 = 2 * i, 2 * i + 1
                if const_expr(self.neox):
                    c0, c1 = i, i + D_ROPE // 2
                cs = mCS[pos, i].to(Float32)
                sn = mCS[pos, D_ROPE // 2 + i].to(Float32)
                x0 = sQr[row, c0].to(Float32)
                x1 = sQr[row, c1].to(Float32)
                sQr[row, c0] = (x0 * cs - x1 * sn).to(sQr.element_type)
                sQr[row, c1] = (x0 * sn + x1 * cs).to(sQr.element_type)

    @cute.jit
    def _write_fused(self, outs, acc_o, row_max, row_sum, scale_log2, o_crd, at, rope):
        """Fused epilogue (direct form, one split): per row of this thread, O x 1 / sum (x the
        sink weight), the output's RoPE columns 448 .. 511 rotated by -angle in fp32, then the
        e4m3 cast per group of 32 columns with its UE8M0 scale (fused.py), the LSE natural.

        Fragment (rows_cols of acc_o, this warpgroup's 256 columns; printed on the CPU,
        tests/test_dsa_fused_prefill_compile.py pins it): thread lane l of warp w holds rows
        16 (w % 4) + l // 4 (+ 8 for r = 1) and, at c = 2 j + e (j < 32, e < 2), column
        256 wg + 8 j + 2 (l % 4) + e. So a pair (2i, 2i + 1) is (c, c + 1) of one thread, a
        NeoX pair (i, i + 32) is (c, c + 8), warpgroup 1's c >= 48 are the RoPE columns (448 +
        8 (j - 24) + ...), and group g of 32 columns is c in [8 g', 8 g' + 8) (g' = g % 8)
        of the four lanes of a quad: its amax is the thread's 8 values' then two butterfly
        shuffles (warp_reduction_max over 4 lanes). Each pair goes out as one 16-bit store of
        two e4m3 bytes; the quad's lane 0 writes the group's scale."""
        mOp, mLp, mOsc, mSink = outs
        mCS, pos = rope
        _, q_off, sq, head0, wg, tidx = at
        o = rows_cols(acc_o)
        cols = cute.size(o, mode=[1])
        first_rope = cols - D_ROPE // 4  # warpgroup 1's c of columns 448 ..
        pairs = D_ROPE // 8  # RoPE pairs a thread holds (interleaved or half-split)
        cs = cute.make_rmem_tensor(pairs, Float32)
        sn = cute.make_rmem_tensor(pairs, Float32)
        if wg == 1:
            for k in cutlass.range_constexpr(pairs):
                c = first_rope + (2 * k if const_expr(not self.neox) else k)
                i = o_crd[0, c][1] - fused_math.ROPE_OUT_FIRST
                if const_expr(not self.neox):
                    i = i // 2
                cs[k] = mCS[pos, i].to(Float32)
                sn[k] = mCS[pos, D_ROPE // 2 + i].to(Float32)
        v = cute.make_rmem_tensor(cols, Float32)
        for r in cutlass.range_constexpr(2):
            # every row computed (rows past G: zero queries, finite), only the stores guarded:
            # the quad shuffles need every lane of the warp (G < 8 splits a warp's rows)
            row = opaque_i32(o_crd[r, 0][0])  # (as _write_split)
            token = row // self.h
            head = head0 + row % self.h
            inv = Float32(0.0)
            lse = -Float32.inf
            if row_sum[r] > 0.0:
                inv = 1.0 / row_sum[r]
                lse = row_max[r] * scale_log2 + cute.math.log2(row_sum[r], fastmath=True)
                if const_expr(mSink is not None):
                    inv = inv * fused_math.sink_weight(lse, mSink[head])
            for c in cutlass.range_constexpr(cols):
                v[c] = o[r, c] * inv
            if wg == 1:  # conjugate: y0 = x0 cos + x1 sin, y1 = x1 cos - x0 sin
                for k in cutlass.range_constexpr(pairs):
                    c0 = first_rope + 2 * k
                    c1 = c0 + 1
                    if const_expr(self.neox):
                        c0 = first_rope + k
                        c1 = c0 + 8
                    x0, x1 = v[c0], v[c1]
                    v[c0] = x0 * cs[k] + x1 * sn[k]
                    v[c1] = x1 * cs[k] - x0 * sn[k]
            out_row = mOp[cutlass.min(q_off + token, mOp.shape[0] - 1), head, None]
            pairs_ptr = cute.make_ptr(cutlass.Uint16, out_row.iterator.toint(),
                                      cute.AddressSpace.gmem, assumed_align=2)  # fmt: skip
            out_pairs = cute.make_tensor(pairs_ptr, cute.make_layout(D_LATENT // 2))
            for g in cutlass.range_constexpr(cols // 8):
                amax = Float32(0.0)
                for k in cutlass.range_constexpr(8):
                    amax = cute.arch.fmax(amax, cute.math.absf(v[8 * g + k]))
                amax = cute.arch.warp_reduction_max(amax, threads_in_group=4)
                scale = fused_math.ue8m0_scale(amax)
                mult = fused_math.pow2_inverse(scale)
                if row < self.g and token < sq:
                    for k in cutlass.range_constexpr(0, 8, 2):
                        c = 8 * g + k
                        word = fused_math.e4m3x2(v[c] * mult, v[c + 1] * mult)
                        out_pairs[o_crd[r, c][1] // 2] = word.to(cutlass.Uint16)
                    if tidx % 4 == 0:
                        group = o_crd[r, 8 * g][1] // fused_math.FP8_GROUP
                        mOsc[q_off + token, head, group] = scale
            if row < self.g and token < sq:
                if wg == 0 and tidx % 4 == 0:
                    mLp[q_off + token, head] = lse * LN2
