"""DeepSeek MLA paged decode, the partial pass over 16-bit caches whose pages hold whole 64-key
tiles (page_size a multiple of TILE): the "seesaw" schedule of FlashMLA's sm90 decode, TMA loads
on mbarriers. The math is decode.py's (reference.mla): MQA over one 576-wide latent row per
token (512 latent + 64 RoPE columns), the key all 576, the value the first 512.

A CTA of two warpgroups takes H query heads x Q query tokens (G = pitch Q rows, pitch = max(H,
8); zero rows up to the WGMMA's 64) and one split of one sequence's keys, in tiles of TILE keys:
tile j sits in buffer j % 2, and warpgroup j % 2 scores it (S = Q K^T, 64 x 64, K = 576: the
latent columns with Q from shared memory, the RoPE columns with Q from registers) and runs its
softmax. Each warpgroup owns half of O's columns (COLS = 256) and multiplies both tiles of a
pair by its half of V, its own tile's P from registers, the other's from shared memory. Per pair
(a = 2k in buffer 0, c = a + 1 in buffer 1):

  warpgroup 0                                  warpgroup 1
  softmax(a) against the running max           (S(c) done)
  -> SCALE0                                    SCALE0 -> softmax(c) against a's max
  O_L += P_a V_L(a)                            -> SCALE1; P_c -> shared; O_R += P_c V_R(c)
  SCALE1 -> refill buffer 0's left chunks      P0 -> O_R += P_a V_R(a) -> P1
  P_a x the rescale of c -> shared -> P0       (P V of c done) refill buffer 1's right chunks
  P1 -> O_L *= rescale(c); O_L += P_c V_L(c)   (P V of a done) refill buffer 0's right chunks
  S(a + 2): left chunks, (P V done) refill     S(c + 2), right chunks first
  buffer 1's left chunks, right chunks

so one warpgroup's softmax runs under the other's WGMMAs. Both keep the same running max (sM,
scaled by scale_log2; -inf before any key): a's rescale of O is corr0 = exp2(m_old - m_a),
c's corr1 = exp2(m_a - m_c); warpgroup 0 rescales P_a by corr1 before handing it over (both
halves then add P relative to m_c), warpgroup 1 scales its O by corr0 corr1. Each keeps its
own row sums (its tiles' P), added at the end.

Buffers: K chunk i (columns 64 i .. 64 i + 63 of the 576, i = 8: RoPE) of buffer s is one TMA box
of 64 rows x 128 bytes on its own mbarrier (one arrival + 8 KB), so S starts on the chunks that
landed and a refill goes out as soon as its chunks' last reader is done: the left chunks (V_L,
0 .. 3) after warpgroup 0's P V, the right ones (V_R and RoPE, 4 .. 8) after warpgroup 1's.
Loads are issued by a whole warp (warp 0 of the CTA for tiles 0 and 1, then warp 0 of the
refilling warpgroup): the DSL's TMA copy elects its lane among all 32 (elect.sync), so a copy
under a one-thread branch deadlocks the warp (`_load_chunks`).
Q arrives the same way, on a 19th mbarrier: warp 0 issues its boxes (a token's `pitch` heads x
64 columns, 9 a token; pitch = max(H, 8), the swizzle atom's rows, so token t's rows start at
t x pitch) before tiles 0 and 1, and every thread waits on it after the prologue's
__syncthreads, before loading Q's RoPE columns into registers; rows past G are zeroed by plain
stores. Shared memory: Q (72 KB), two buffers (144 KB), P_a (8 KB); P_c lives in Q's RoPE tile,
whose values each warpgroup keeps in registers from the prologue on (224 KB in all).

A tile's rows past the sequence's end (TMA reads whole 64-row boxes of the page) are stale
cache slots: masked out of S, and their latent zeroed before P V by the warpgroup that scored
the tile (P = 0 times a NaN would be NaN), which then passes a barrier of its own; the other
warpgroup passes one of its own at the same point (no data: racecheck orders the warpgroups'
hand-overs by how many barriers each has passed, `_match_stale`).

At the end the two warpgroups' row sums meet in shared memory; each stages its columns of the
split's normalized O (fp32) in shared memory over the K buffers (every WGMMA and TMA load has
retired: rows O_STRIDE floats apart), and after a __syncthreads one elected lane of warp 0 sends
each written row to global memory by one 2 KB bulk copy (`_send_rows`; 128 scalar stores a
thread before); warpgroup 0 stores the rows' LSE in log2 units (-inf where the split saw no key),
the paged decode's partial format, merged by its combine. The direct form (`direct`, a
plan of one split: the grid's one split covers every key) writes instead the final O, rounded to
q's dtype, and the natural LSE (log2 x ln 2) into the op's outputs: what the combine makes of one
split (weight exp2(0) = 1, sum 1), bit for bit, with no fp32 partials and no combine launch:
by each thread's scalar stores, or (`ostore`, out's rows 16-byte aligned) staged in q's dtype
and sent as the partial O is, a 1 KB bulk copy a row, with which ptxas keeps the steady loops'
TMA operands in uniform registers as in the partial form (MLA_NOTES.md, "next/mla-ur").

The gather form (`gather`; the launcher's default at page size 1, FORGEKERNEL_MLA_GATHER=1 at
every other page size off the tile) takes pages that are not whole tiles (page sizes 1, 16,
...): the same schedule, barriers and buffers, but each chunk's 64 rows are gathered by the
warpgroup that would issue its TMA box, all 128 threads (8 a row, 16 bytes each, 4 rows a
thread; `_gather_chunks`), cp.async into the slots the box fills (the same swizzled layout),
each thread closing a chunk with cp.async.mbarrier.arrive.noinc on its
mbarrier (128 arrivals); tiles 0 and 1 by warpgroups 0 and 1. A row's page and slot come from
the page table a pair ahead (`_gather_rows`, as `_page`), the key clamped to the split's last:
no entry past the split is read, rows past it repeat a real key (masked, P = 0: nothing to
zero, so no `_zero_stale` / `_match_stale`). cp.async writes are the generic proxy's: every
mbarrier wait, and the P V of the tile the other warpgroup waited on, is followed by a proxy
fence before the WGMMA (`_gathered_fence`). MLA_NOTES.md, "The seesaw over gathered rows"."""

from __future__ import annotations

from enum import IntEnum
from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp, StMatrix8x8x16bOp
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    D_ROPE,
    ROWS,
    STAGES,
    THREADS,
    TILE,
)
from forgekernel.kernels.attention.mla.sm90.schedule import HEADER as WORK_HEADER
from forgekernel.kernels.attention.mla.sm90.units import unit_bounds
from forgekernel.kernels.common.sm90 import pdl
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import LN2, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import (
    acc_as_operand_a,
    rows_cols,
    select,
    transposed,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.opaque import opaque_i32
from forgekernel.kernels.common.sm90.pipeline import smem_tensor
from forgekernel.kernels.common.sm90.softmax import exp2_row, quad_row_max, rescale_o
from forgekernel.kernels.common.sm90.warp_mma import (
    copy_row_async,
    query_row_limits,
    tiled_row_copy,
)

CHUNK = 64  # key columns per TMA box and mbarrier: 128 bytes, one swizzle span
LATENT_CHUNKS = D_LATENT // CHUNK
CHUNKS = LATENT_CHUNKS + D_ROPE // CHUNK  # + the RoPE columns
K_BLOCKS = CHUNK // 16  # WGMMA k-blocks per chunk
COLS = D_LATENT // 2  # output columns per warpgroup
LEFT = tuple(range(COLS // CHUNK))  # the chunks of V_L (warpgroup 0's P V reads them)
RIGHT = tuple(range(COLS // CHUNK, CHUNKS))  # V_R and the RoPE columns
WARPS_PER_WG = THREADS_PER_WG // WARP_SIZE
PAIR = 2  # CTAs of a pair's cluster (`pair`)
Q_BOX_MIN = 8  # rows of a 128-byte swizzle atom: the fewest heads a Q box (and token) takes
# The staged partial O's row stride (fp32): 8 floats of padding put the 8 rows of a warp's
# 64-bit accumulator stores 8 banks apart (each half-warp's 16 stores hit 32 distinct banks;
# 512 would put every row on the same 8); rows stay 16-byte aligned for the bulk copies.
O_STRIDE = D_LATENT + 8
# The direct form's staged O (`ostore`, 16-bit): 8 elements (16 bytes) of padding a row put
# the 8 rows of a warp's 32-bit accumulator stores 4 banks apart (32 distinct banks; at 512
# every row starts on bank 0, 8-way conflicts); rows stay 16-byte aligned for the bulk copies.
O16_STRIDE = D_LATENT + 8
# gather: rows of a chunk each thread of the gathering warpgroup copies (16 bytes of each)
GATHER_ROWS = TILE * CHUNK * 2 // 16 // THREADS_PER_WG


class Bar(IntEnum):
    """The kernel's named barriers (id 0 is __syncthreads)."""

    SCALE0 = FIRST_FREE  # warpgroup 0's max and rescale of tile a out: 0 arrives, 1 syncs
    SCALE1 = FIRST_FREE + 1  # warpgroup 1's of tile c: 1 arrives, 0 syncs
    P0 = FIRST_FREE + 2  # P of tile a (rescaled to c's max) in shared memory: 0 arrives, 1 syncs
    P1 = FIRST_FREE + 3  # P of tile c in shared memory, 1's P V on it issued: both sync
    WG0 = FIRST_FREE + 4  # warpgroup 0 alone (its zeroed stale rows before its own P V; racecheck)
    WG1 = FIRST_FREE + 5  # warpgroup 1 alone


class MlaSeesawSm90:
    """The partial pass over a 16-bit paged cache with page_size % TILE == 0; see the module
    docstring. Same arguments as `decode.MlaDecodeSm90` (mScale None); direct: the form of a
    plan of one split (mOp, mLp the op's out and natural LSE)."""

    def __init__(
        self, heads: int, qtokens: int = 1, direct: bool = False, pair: bool = False,
        ostore: bool = False, worklist: bool = False, ranges: bool = False, pdl: bool = True,
        gather: bool = False,
    ):  # fmt: skip
        if heads * qtokens > ROWS:
            raise ValueError(f"heads x query tokens must be <= {ROWS}, got {heads} x {qtokens}")
        self.h = heads
        self.qt = qtokens
        # pair: the two head blocks of a unit (adjacent in grid x) as a cluster of 2, each CTA
        # loading half of every K box's rows by TMA multicast into both (`_release`)
        self.pair = pair
        # Q's rows: token t's heads at rows t x pitch .. (one TMA box of `pitch` heads a token
        # and chunk: at least the 8 rows of a 128-byte swizzle atom; with H < 8 rows H .. 7 of
        # a token hold the next heads or TMA's zero fill, never written)
        self.pitch = max(heads, Q_BOX_MIN)
        self.g = self.pitch * qtokens
        self.direct = direct
        # ostore (direct only): O in q's dtype staged in shared memory over the K buffers, then
        # sent by bulk copies (out rows 16-byte aligned), not 128 scalar stores a thread
        if ostore and not direct:
            raise ValueError("ostore is a form of the direct pass")
        self.ostore = ostore
        # worklist (candidate, partial form only): CTA x takes item x // head blocks of the
        # scheduling kernel's list (schedule.py, worklist.py), passed in mScale's slot (the
        # seesaw's 16-bit caches have no scales): its (unit, split) and the keys per split
        if worklist and (direct or pair):
            raise ValueError("the work list is a form of the partial pass (no direct, no pair)")
        self.worklist = worklist
        # launched with PDL (common/sm90/pdl.py): the CTAs start under the previous kernel's
        # tail (the scheduling kernel's with the work list, q's producer's) and wait at the
        # top. (The mbarrier inits and descriptor prefetch moved above the wait, the work item
        # and sequence read after it: 230 registers against 228, +176 SASS instructions, 37
        # more R2UR in the main loop at bf16 16 x 1, cu12 ptxas, 2026-12-04; not taken.)
        self.pdl = pdl
        # ranges (worklist only; a decode step's schedule): the partials indexed by item,
        # (items, qtokens, Hq, 512): the CTA writes its rows at (item, its token), not at
        # (split, query row), and the combine reduces each row's item range
        if ranges and not worklist:
            raise ValueError("ranges is a form of the work list's pass")
        self.ranges = ranges
        # gather: pages that are not whole tiles (page_size % TILE != 0: 1 by default, 16, ...):
        # each chunk's 64 rows gathered by the refilling warpgroup's 128 threads, cp.async of
        # 16 bytes into the swizzled slots the TMA box fills, on the same chunk mbarriers (128
        # arrivals each, cp.async.mbarrier.arrive.noinc); `_gather_chunks`
        if gather and (pair or worklist):
            raise ValueError("the gather form takes no pair and no work list")
        self.gather = gather

    def _setup(self, dtype):
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        tiled = sm90_utils.make_trivial_tiled_mma
        self.mma_s = tiled(dtype, dtype, k_major, k_major, Float32, (1, 1, 1), (ROWS, TILE))
        self.mma_s_rs = tiled(
            dtype, dtype, k_major, k_major, Float32, (1, 1, 1), (ROWS, TILE), a_source=rmem
        )
        self.mma_pv = tiled(dtype, dtype, k_major, mn_major, Float32, (1, 1, 1), (ROWS, COLS))
        self.mma_pv_rs = tiled(
            dtype, dtype, k_major, mn_major, Float32, (1, 1, 1), (ROWS, COLS), a_source=rmem
        )
        row = LayoutEnum.ROW_MAJOR
        self.lay_ql = sm90_utils.make_smem_layout_a(row, (ROWS, TILE, D_LATENT), dtype, 1)
        self.lay_qr = sm90_utils.make_smem_layout_a(row, (ROWS, TILE, D_ROPE), dtype, 1)
        self.lay_kl = sm90_utils.make_smem_layout_b(row, (ROWS, TILE, D_LATENT), dtype, STAGES)
        self.lay_kr = sm90_utils.make_smem_layout_b(row, (ROWS, TILE, D_ROPE), dtype, STAGES)
        self.lay_p = sm90_utils.make_smem_layout_a(row, (ROWS, D_LATENT, TILE), dtype, 1)
        # one Q box: a token's `pitch` heads x CHUNK columns (the swizzle of lay_ql / lay_qr)
        self.lay_qbox = sm90_utils.make_smem_layout_a(row, (self.pitch, TILE, CHUNK), dtype, 1)
        self.chunk_bytes = TILE * CHUNK * dtype.width // 8
        self.q_bytes = CHUNKS * self.g * CHUNK * dtype.width // 8  # Q's boxes, every token
        k_bytes = (cute.cosize(self.lay_kl) + cute.cosize(self.lay_kr)) * dtype.width // 8
        if ROWS * O_STRIDE * Float32.width // 8 > k_bytes:  # (kl then kr: `Shared`)
            raise ValueError("the staged partial O must fit over the K buffers")
        if ROWS * O16_STRIDE * dtype.width // 8 > k_bytes:
            raise ValueError("the staged direct O must fit over the K buffers")

    @cute.jit
    def __call__(
        self,
        mQn: cute.Tensor,
        mQp: cute.Tensor,
        mCkv: cute.Tensor,
        mKpe: cute.Tensor,
        mScale: cute.Tensor | None,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
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
        """decode.MlaDecodeSm90's arguments: mQn (rows, Hq, 512), mQp (rows, Hq, 64), mCkv
        (num_pages, page_size, 512), mKpe (num_pages, page_size, 64), one 16-bit dtype; mScale
        None; mPT int32 (batch, max_pages); mSeq int32 (batch,); mOp fp32 (splits, rows, Hq,
        512), mLp fp32 (splits, rows, Hq) log2; per_split (the least keys a split takes: a
        unit's own keys spread over the splits in whole tiles) a multiple of TILE and page_size
        of TILE (the launcher's contract: a tile is 64 consecutive rows of one page); mCuQ,
        causal, q_blocks as there. Direct form: mOp (rows, Hq, 512) in q's dtype, mLp fp32
        (rows, Hq) natural log (any strides), one split (per_split covers every key)."""
        dtype = mQn.element_type
        if const_expr(not (dtype == mQp.element_type == mCkv.element_type == mKpe.element_type)):
            raise TypeError("q_nope, q_pe and the caches must share one 16-bit dtype")
        mWork = None
        if const_expr(self.worklist):  # mScale's slot holds the work list
            if const_expr(mScale is None or mScale.element_type != Int32):
                raise TypeError("the worklist form takes the int32 work list in mScale's slot")
            mWork = mScale
        elif const_expr(mScale is not None):
            raise ValueError("the seesaw pass reads 16-bit caches (FP8: decode.MlaDecodeSm90)")
        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")
        if const_expr(self.direct and mOp.element_type != dtype):
            raise TypeError("the direct form writes O in q's dtype")
        self._setup(dtype)
        # TMA boxes of 64 rows x 64 columns over (rows of a page, columns, pages)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        box = cute.slice_(self.lay_kr, (None, None, 0))
        k_op, k_mc = g2s, {}
        if const_expr(self.pair):  # each CTA of the pair loads 32 of a box's 64 rows into both
            k_op, k_mc = cpasync.CopyBulkTensorTileG2SMulticastOp(), {"num_multicast": PAIR}
        if const_expr(self.gather):  # rows by cp.async: the caches as they are, no K atoms
            tma_kl, mKl, tma_kr, mKr = None, mCkv, None, mKpe
        else:
            tma_kl, mKl = cpasync.make_tiled_tma_atom(
                k_op, select(mCkv, [1, 2, 0]), box, (TILE, CHUNK), **k_mc
            )
            tma_kr, mKr = cpasync.make_tiled_tma_atom(
                k_op, select(mKpe, [1, 2, 0]), box, (TILE, CHUNK), **k_mc
            )
        # Q's boxes: `pitch` heads x CHUNK columns of one token, over (heads, columns, rows)
        qbox, qtile = cute.slice_(self.lay_qbox, (None, None, 0)), (self.pitch, CHUNK)
        tma_ql, mQl = cpasync.make_tiled_tma_atom(g2s, select(mQn, [1, 2, 0]), qbox, qtile)
        tma_qr, mQr = cpasync.make_tiled_tma_atom(g2s, select(mQp, [1, 2, 0]), qbox, qtile)

        @cute.struct
        class Shared:
            kl: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kl)], 1024]
            kr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_kr)], 1024]
            ql: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_ql)], 1024]
            qr: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_qr)], 1024]
            p: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(self.lay_p)], 1024]
            m: cute.struct.MemRange[Float32, ROWS]  # the running max, scaled
            scale: cute.struct.MemRange[Float32, 2 * ROWS]  # rescale factors of tiles a, c
            total: cute.struct.MemRange[Float32, 2 * ROWS]  # the warpgroups' final row sums
            # K chunks, then Q; pair: then the (buffer, side) releases (`_release`)
            bars: cute.struct.MemRange[cutlass.Int64, STAGES * CHUNKS + 1 + self._releases()]

        self.shared = Shared
        self.kernel(
            mPT, mSeq, mOp, mLp, scale_log2, per_split, page_size, mCuQ, causal, q_blocks,
            tma_kl, mKl, tma_kr, mKr, tma_ql, mQl, tma_qr, mQr, self.mma_s, self.mma_s_rs,
            self.mma_pv, self.mma_pv_rs, self.lay_kl, self.lay_kr, self.lay_ql, self.lay_qr,
            self.lay_p, mWork,
        ).launch(
            grid=self._grid(mSeq.shape[0] * q_blocks, mQn.shape[1] // self.h, mOp, mWork),
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
            **self._cluster(),
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        q_blocks: Int32,
        tma_kl: cute.CopyAtom | None,
        mKl: cute.Tensor,
        tma_kr: cute.CopyAtom | None,
        mKr: cute.Tensor,
        tma_ql: cute.CopyAtom,
        mQl: cute.Tensor,
        tma_qr: cute.CopyAtom,
        mQr: cute.Tensor,
        mma_s: cute.TiledMma,
        mma_s_rs: cute.TiledMma,
        mma_pv: cute.TiledMma,
        mma_pv_rs: cute.TiledMma,
        lay_kl: cute.ComposedLayout,
        lay_kr: cute.ComposedLayout,
        lay_ql: cute.ComposedLayout,
        lay_qr: cute.ComposedLayout,
        lay_p: cute.ComposedLayout,
        mWork: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        pdl.wait(self.pdl)  # before the work list, seqlens_k, cu_seqlens_q: every global access
        pdl.launch_dependents(self.pdl)
        if const_expr(self.worklist):  # (a CTA past the list's items has left here)
            unit, head_block, split, per_split, item = self._item(mWork, mOp.shape[2])
        else:
            unit, head_block, split = self._block(mOp.shape[1] if self.direct else mOp.shape[2])
        head0 = head_block * self.h
        b, q_off, sq, sk, kv_end = self._unit(mSeq, mCuQ, causal, q_blocks, unit)
        per = per_split
        if const_expr(not self.worklist):
            # the unit's own keys over the grid's splits in whole tiles, at least per_split a
            # split (not the table's width over them: launch.py); the direct form's one split
            # covers them all
            share = cute.ceil_div(cute.ceil_div(kv_end, cute.arch.grid_dim()[2]), TILE) * TILE
            per = cutlass.max(per_split, share)
        t0 = split * per
        t1 = cutlass.min(t0 + per, kv_end)
        tiles = cute.ceil_div(cutlass.max(t1 - t0, 0), TILE)
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sKl = smem_tensor(storage.kl, lay_kl)
        sKr = smem_tensor(storage.kr, lay_kr)
        sQl = smem_tensor(storage.ql, lay_ql)[None, None, 0]
        sQr = smem_tensor(storage.qr, lay_qr)[None, None, 0]
        sP0 = smem_tensor(storage.p, lay_p)[None, None, 0]
        sP1 = smem_tensor(storage.qr, lay_p)[None, None, 0]  # Q's RoPE tile, once in registers
        sM = storage.m.get_tensor(cute.make_layout(ROWS))
        sScale = storage.scale.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        sTotal = storage.total.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        bars = storage.bars.data_ptr()

        # (TMA atom, (row block, chunk, page)) boxes and their shared-memory slots
        one = cute.make_layout(1)
        box = (TILE, CHUNK)
        rank, ctas = 0, one
        if const_expr(self.pair):  # this CTA's rows of each box: rank x 32 .. rank x 32 + 31
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            ctas = cute.make_layout(PAIR)
        if const_expr(self.gather):
            kv = self._gather_view((mKl, mKr), (sKl, sKr), bars, (mPT, b, t0, t1, page_size), tidx)
        else:
            tKsKl, tKgKl = cpasync.tma_partition(
                tma_kl, rank, ctas, cute.zipped_divide(sKl, box), cute.zipped_divide(mKl, box)
            )
            tKsKr, tKgKr = cpasync.tma_partition(
                tma_kr, rank, ctas, cute.zipped_divide(sKr, box), cute.zipped_divide(mKr, box)
            )
            kv = SimpleNamespace(
                tma=(tma_kl, tma_kr), src=(tKgKl, tKgKr), dst=(tKsKl, tKsKr), bars=bars,
                pt=mPT, b=b, t0=t0, page_size=page_size, nbytes=self.chunk_bytes, rank=rank,
            )  # fmt: skip
        # Q: (box, (token, chunk)) slots; boxes at (head0, column, q_off + token) onwards
        qtile = (self.pitch, CHUNK)
        q_src = [
            cute.zipped_divide(cute.domain_offset((head0, 0, q_off), m), qtile) for m in (mQl, mQr)
        ]
        tQsQl, tQgQl = cpasync.tma_partition(
            tma_ql, 0, one, cute.zipped_divide(sQl, qtile), q_src[0]
        )
        tQsQr, tQgQr = cpasync.tma_partition(
            tma_qr, 0, one, cute.zipped_divide(sQr, qtile), q_src[1]
        )
        q_bar = bars + STAGES * CHUNKS
        # Warp 0, whole (see _load_chunks): one elected lane initializes the mbarriers (the
        # same lane that arms them below: elect.sync picks the same lane for the same mask),
        # the warp issues Q (when the split has keys: no wait, no box otherwise) and then
        # tiles 0 and 1, all in flight together.
        warp = cute.arch.make_warp_uniform(tidx // WARP_SIZE)
        if warp == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(STAGES * CHUNKS + 1):
                    # (gather: a K chunk's arrivals are its gathering warpgroup's threads')
                    cute.arch.mbarrier_init(bars + i, self._chunk_arrivals(i))
                for i in cutlass.range_constexpr(self._releases()):  # this CTA's and the peer's
                    cute.arch.mbarrier_init(bars + STAGES * CHUNKS + 1 + i, PAIR)
                cute.arch.mbarrier_init_fence()
        # Every thread waits here, warp 0 between the inits and their first arming. (No data:
        # racecheck attributes the inits, uniform-datapath SYNCS.EXCH, to lane 31 and the
        # arming to the elected lane 0, and reported each armed mbarrier's 8 bytes as a
        # warp-level hazard, 216 + 432 warnings on 2026-12-02 13:49, until warp 0 waited
        # between them. It orders threads by how many barriers each has waited at: a wait of
        # warp 0 alone put its later shared-memory stores one wait behind every reader's,
        # 320 + 544 RAW reports at 18:47, every writer in warp 0: Q's zero rows and its sM
        # rows. The other warps reach this first and wait out the inits, off the loads' path.)
        # pair: the cluster's barrier, so that the peer's first multicast finds the inits.
        self._sync_cluster()
        if warp == 0:
            atoms = (tma_ql, tma_qr) + (() if const_expr(self.gather) else (tma_kl, tma_kr))
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
            if 0 < tiles:
                self._load_query((tma_ql, tma_qr), (tQgQl, tQgQr), (tQsQl, tQsQr), q_bar)
            if const_expr(not self.gather):
                for j in cutlass.range_constexpr(STAGES):  # tiles 0 and 1, every chunk
                    if j < tiles:
                        page, rb = self._page(kv, j)
                        self._load_chunks(kv, j, LEFT + RIGHT, page, rb)
        if const_expr(self.gather):  # tile j (0, 1) by warpgroup j, every chunk
            if wg < tiles:
                self._gather_chunks(kv, wg, LEFT + RIGHT, self._page(kv, wg))
        if tidx < ROWS:
            sM[tidx] = -Float32.inf
        if const_expr(self.g < ROWS):
            self._zero_query_rows(sQl, sQr, tidx)
            cute.arch.fence_view_async_shared()  # the zero rows' stores, then WGMMA reads
        cute.arch.sync_threads()
        if 0 < tiles:
            cute.arch.mbarrier_wait(q_bar, 0)  # Q landed (before _operands' ldmatrix)

        tid = tidx % THREADS_PER_WG
        ops = self._operands(
            (mma_s, mma_s_rs, mma_pv, mma_pv_rs), (sQl, sQr, sKl, sKr, sP0, sP1), tid
        )
        acc_o = cute.make_rmem_tensor(
            mma_pv.get_slice(tid).partition_shape_C((ROWS, COLS)), Float32
        )
        acc_o.fill(0.0)
        row_sum = cute.make_rmem_tensor(2, Float32)
        row_sum.fill(0.0)
        # causal rows see keys < kv_end - sq + token + 1: the block's key bound, not the
        # sequence's length (they differ for every query block of a prefill but the last)
        limits = query_row_limits(ops.coords, self.pitch, self.qt, sq, kv_end, t1, causal)
        st = SimpleNamespace(
            acc_o=acc_o, row_sum=row_sum, limits=limits, sM=sM, sScale=sScale, tid=tid,
            scale_log2=scale_log2, sk=sk, t0=t0, tiles=tiles, sKl=sKl,
            mask_from=self._mask_from(t1, kv_end, sq, causal),
            loader=warp % WARPS_PER_WG == 0,  # the warp of this warpgroup that issues refills
        )  # fmt: skip
        if wg == 0:
            self._warpgroup0(ops, st, kv)
        else:
            self._warpgroup1(ops, st, kv)

        # the row sums of both warpgroups (relative to the final max) meet in shared memory
        for r in cutlass.range_constexpr(2):
            part = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            if tid % 4 == 0:
                sTotal[ops.coords[r, 0][0], wg] = part
        cute.arch.sync_threads()
        row_max = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            row = ops.coords[r, 0][0]
            row_max[r] = sM[row]
            row_sum[r] = sTotal[row, 0] + sTotal[row, 1]
        thr_pv = mma_pv.get_slice(tid)
        o_crd = rows_cols(thr_pv.partition_C(cute.make_identity_tensor((ROWS, COLS))))
        w_split, w_off = split, q_off  # where this CTA's partial rows go
        if const_expr(self.ranges):
            w_split, w_off = item, 0
        self._write_split(
            (mOp, mLp), acc_o, row_max, row_sum, o_crd, (w_split, w_off, sq, head0, wg, tid)
        )
        if const_expr(not self.direct or self.ostore):
            # every WGMMA (wait_group 0 in each warpgroup's last pair) and TMA load (each box
            # waited on by its scorer) of the K buffers retired before the __syncthreads above
            sO, tOrO = self._staged(storage, mOp, acc_o)
            half = cute.local_tile(sO, (ROWS, COLS), (0, wg))
            cute.autovec_copy(tOrO, thr_pv.partition_C(half))
            cute.arch.fence_view_async_shared()  # the stores, then the bulk copies' reads
            cute.arch.sync_threads()
            if warp == 0:
                with cute.arch.elect_one():
                    self._send_rows(mOp, sO, (w_split, w_off, sq, head0))
        if const_expr(self.pair):  # neither CTA leaves while the other may still signal it
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    # ---------------------------------------------------------------- set-up

    def _multicast(self) -> dict:
        """The K copies' multicast argument: pair, into both CTAs of the cluster."""
        return {"mcast_mask": cutlass.Int16((1 << PAIR) - 1)} if self.pair else {}

    def _cluster(self) -> dict:
        """The launch's cluster argument: pair, two CTAs adjacent in grid x (one unit's head
        blocks, `_block`)."""
        return {"cluster": [PAIR, 1, 1]} if self.pair else {}

    def _releases(self) -> int:
        """The pair's release mbarriers: one per buffer and side (LEFT / RIGHT chunks)."""
        return 2 * STAGES if self.pair else 0

    @cute.jit
    def _sync_cluster(self):
        """After the mbarrier inits: __syncthreads, or the cluster's barrier for a pair (relaxed:
        the inits' fence.mbarrier_init is the release at cluster scope, as CUTLASS's pipelines)."""
        if const_expr(self.pair):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    def _splits(self, mOp):
        """The grid's splits: the partials' leading mode; one in the direct form."""
        return 1 if self.direct else mOp.shape[0]

    def _grid(self, units, blocks, mOp, mWork):
        """(units x head blocks, 1, splits); worklist: (the list's capacity x head blocks, 1,
        1), head blocks fastest as `_block`'s."""
        if const_expr(self.worklist):
            return (mWork.shape[0] - WORK_HEADER) * blocks, 1, 1
        return units * blocks, 1, self._splits(mOp)

    @cute.jit
    def _item(self, mWork, hq):
        """(unit, head block, split, keys per split, item) of this CTA from the work list
        (schedule.py: row 0 (keys per split, items), row 1 + i item i's (unit, split)); a CTA
        past the items exits at once, after its PDL wait (no barrier, no mbarrier, no store:
        every thread of it leaves here)."""
        x, _, _ = cute.arch.block_idx()
        blocks = hq // self.h
        item = x // blocks
        if item >= mWork[0, 1]:
            _nvvm.exit()
        return (
            mWork[WORK_HEADER + item, 0],
            x - item * blocks,
            mWork[WORK_HEADER + item, 1],
            mWork[0, 0],
            item,
        )

    @cute.jit
    def _block(self, hq):
        """(unit, head block, split) of this CTA. The head blocks of one unit are adjacent in
        grid x (head block fastest, as FlashMLA's m blocks): they read the same latent tiles,
        so they start in the same wave and stay abreast, the later reader of each tile hitting
        L2. (Units fastest put a unit's second head block a whole batch later: at 128 heads x
        128 sequences, 256 CTAs on 132 SMs, it ran in the second wave and read the cache from
        DRAM again.)"""
        x, _, split = cute.arch.block_idx()
        blocks = hq // self.h
        unit = x // blocks
        return unit, x - unit * blocks, split

    @cute.jit
    def _unit(self, mSeq, mCuQ, causal, q_blocks, unit):
        """(batch b, first query row, query tokens sq, keys sk, key bound kv_end) of CTA x
        `unit`: one sequence (decode), or block `unit % q_blocks` of a sequence's query tokens
        (`qtokens` each; causal, they see keys < kv_end; a block past the end has sq 0 and
        reads no key)."""
        return unit_bounds(mSeq, mCuQ, causal, q_blocks, self.qt, unit)

    @cute.jit
    def _mask_from(self, t1, kv_end, sq, causal):
        """The first key some written row may not see (the split's end; with query tokens and
        causal, token 0's bound): tiles before it need no mask. (Rows of tokens past sq, not
        written, may then see keys past their bound: their queries, the next sequence's or
        TMA's zero fill, give finite scores, row by row.)"""
        bound = t1
        if const_expr(self.qt > 1):
            bound = Int32(cutlass.select_(causal != 0, cutlass.min(t1, kv_end - sq + 1), t1))
        return bound

    @cute.jit
    def _operands(self, mmas, smem, tid):
        """One warpgroup's WGMMA operands: S's (Q's latent columns from shared memory, its RoPE
        columns loaded into registers here, K chunks), P V's (P from registers or from shared
        memory; V halves by buffer), the S accumulator and its (row, column) coordinates."""
        mma_s, mma_s_rs, mma_pv, mma_pv_rs = mmas
        sQl, sQr, sKl, sKr, sP0, sP1 = smem
        thr_s, thr_sr = mma_s.get_slice(tid), mma_s_rs.get_slice(tid)
        q_rope = thr_sr.make_fragment_A(thr_sr.partition_shape_A((ROWS, CHUNK)))
        s2r = cute.make_tiled_copy_A(
            cute.make_copy_atom(LdMatrix8x8x16bOp(False, 4), sQr.element_type), mma_s_rs
        )
        thr_s2r = s2r.get_slice(tid)
        cute.copy(s2r, thr_s2r.partition_S(sQr), thr_s2r.retile(q_rope))
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((ROWS, TILE)), Float32)
        thr_pv, thr_pv_rs = mma_pv.get_slice(tid), mma_pv_rs.get_slice(tid)
        v_all = transposed(sKl)  # (512, TILE, STAGES): the latent tile as an MN-major operand
        halves = [cute.local_tile(v_all, (COLS, TILE, STAGES), (h, 0, 0)) for h in range(2)]
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), sP0.element_type), mma_s
        )
        thr_r2s = r2s.get_slice(tid)
        return SimpleNamespace(
            mma=mmas,
            q_latent=thr_s.make_fragment_A(thr_s.partition_A(sQl)),
            q_rope=q_rope,
            k_latent=thr_s.make_fragment_B(thr_s.partition_B(sKl)),
            k_rope=thr_sr.make_fragment_B(thr_sr.partition_B(sKr)),
            acc_s=acc_s,
            coords=rows_cols(thr_s.partition_C(cute.make_identity_tensor((ROWS, TILE)))),
            p_regs=thr_pv_rs.make_fragment_A(thr_pv_rs.partition_shape_A((ROWS, TILE))),
            p_smem=(
                thr_pv.make_fragment_A(thr_pv.partition_A(sP0)),
                thr_pv.make_fragment_A(thr_pv.partition_A(sP1)),
            ),
            v_rs=[thr_pv_rs.make_fragment_B(thr_pv_rs.partition_B(v)) for v in halves],
            v_ss=[thr_pv.make_fragment_B(thr_pv.partition_B(v)) for v in halves],
            r2s=r2s,
            p_dst=(thr_r2s.partition_D(sP0), thr_r2s.partition_D(sP1)),
            thr_r2s=thr_r2s,
            p16=cute.make_rmem_tensor(acc_s.shape, sP0.element_type),
        )

    @cute.jit
    def _load_query(self, atoms, src, dst, q_bar):
        """One whole warp (`_load_chunks`' rule): Q's rows, token t's `pitch` heads from head0
        on at rows t x pitch, by one TMA box a token and chunk (8 latent + RoPE) on Q's own
        mbarrier, armed once by the elected lane with every box's bytes. Every query token of
        the block is loaded: a token past sq reads the next sequence's query or TMA's zero fill
        past the last row, as heads past Hq (finite scores; the rows are never written)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(q_bar, self.q_bytes)
        for t in cutlass.range_constexpr(self.qt):
            for chunk in cutlass.range_constexpr(CHUNKS):
                if const_expr(chunk < LATENT_CHUNKS):
                    s, d = src[0][None, (0, chunk, t)], dst[0][None, (t, chunk)]
                    cute.copy(atoms[0], s, d, tma_bar_ptr=q_bar)
                else:
                    s, d = src[1][None, (0, 0, t)], dst[1][None, (t, 0)]
                    cute.copy(atoms[1], s, d, tma_bar_ptr=q_bar)

    @cute.jit
    def _zero_query_rows(self, sQl, sQr, tidx):
        """Rows G .. ROWS - 1 of Q (no TMA box lands there) zeroed by generic stores: their
        scores stay finite (the caller fences them for the WGMMA)."""
        for sQ, width in ((sQl, D_LATENT), (sQr, D_ROPE)):
            gcopy = tiled_row_copy(sQ.element_type, width, THREADS)
            thr = gcopy.get_slice(tidx)
            tQsQ = thr.partition_D(sQ)
            tQcQ = thr.partition_S(cute.make_identity_tensor((ROWS, width)))
            for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
                if tQcQ[0, m, 0][0] >= self.g:
                    tQsQ[None, m, None].fill(0.0)

    # ---------------------------------------------------------------- loads

    @cute.jit
    def _page(self, kv, tile):
        """(page, 64-row block of the page) of tile `tile` of the split (the caller keeps
        `tile` inside the split: page-table entries past the sequence are not read). Gather:
        this thread's rows of the tile instead (`_gather_rows`)."""
        if const_expr(self.gather):
            return self._gather_rows(kv, tile)
        token = kv.t0 + tile * TILE
        index = token // kv.page_size
        return kv.pt[kv.b, index], (token - index * kv.page_size) // TILE

    @cute.jit
    def _load_chunks(self, kv, buf, chunks: cutlass.Constexpr, page, rb):
        """One whole warp (all 32 lanes, converged): TMA of `chunks` of a tile (page `page`,
        row block `rb`) into buffer `buf` (static or not), each box on its own mbarrier with
        its byte count. The DSL's TMA copy elects its issuing lane itself (elect.sync over the
        full warp): reached by one lane alone (under `tid == 0`) that lane waits for the other
        31 forever while they wait for it at the branch's reconvergence (ptxas: BRA.DIV to a
        WARPSYNC.COLLECTIVE of all 32 lanes), the hang of the first GPU run. The arrival with
        the expected bytes is one elected lane's (the mbarriers count one arrival)."""
        tma_kl, tma_kr = kv.tma
        (src_l, src_r), (dst_l, dst_r) = kv.src, kv.dst
        for c in cutlass.range_constexpr(len(chunks)):
            chunk = chunks[c]
            bar = kv.bars + buf * CHUNKS + chunk
            # (pair: the whole box's bytes, half from this CTA's copy and half from the peer's)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, kv.nbytes)
            mc = self._multicast()
            if const_expr(chunk < LATENT_CHUNKS):
                cute.copy(
                    tma_kl, src_l[None, (rb, chunk, page)], dst_l[None, (0, chunk, buf)],
                    tma_bar_ptr=bar, **mc,
                )  # fmt: skip
            else:
                cute.copy(
                    tma_kr, src_r[None, (rb, 0, page)], dst_r[None, (0, 0, buf)], tma_bar_ptr=bar,
                    **mc,
                )  # fmt: skip

    @cute.jit
    def _refill(self, kv, st, buf: cutlass.Constexpr, chunks: cutlass.Constexpr, target, k):
        """Warp 0 of the warpgroup, whole (`_load_chunks`): `chunks` of tile `target` (its page
        and row block read beforehand) into buffer `buf`, the refill of pair k (pair: after
        both CTAs released the chunks, `_release`)."""
        if const_expr(self.gather):  # the whole warpgroup (every thread arrives)
            self._gather_chunks(kv, buf, chunks, target)
        elif st.loader:
            if const_expr(self.pair):
                self._release(kv, buf, chunks, k)
            self._load_chunks(kv, buf, chunks, target[0], target[1])

    @cute.jit
    def _release(self, kv, buf: cutlass.Constexpr, chunks: cutlass.Constexpr, k):
        """The pair's cluster-wide release of `chunks` of buffer `buf` before their refill of
        pair k: both CTAs' copies write into both CTAs' buffers, so neither may issue until the
        last reader in each is done. The refilling warp is its CTA's last reader of those
        chunks (the schedule's rule, as without the pair); its elected lane arrives on its own
        release mbarrier and on the peer's (count 2: one arrival from each CTA), and the warp
        waits for the phase of pair k (each (buffer, side) is refilled once a pair, in pair
        order, by the same role in both CTAs: the peer's arrival for pair k + 1 needs tile
        data this CTA sends after this wait, so a phase never runs two ahead)."""
        bar = kv.bars + STAGES * CHUNKS + 1 + buf * 2 + (0 if const_expr(chunks == LEFT) else 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(bar)
            cute.arch.mbarrier_arrive(bar, peer_cta_rank_in_cluster=kv.rank ^ 1)
        cute.arch.mbarrier_wait(bar, k % 2)

    @cute.jit
    def _scores(self, ops, buf: cutlass.Constexpr, chunks: cutlass.Constexpr, phase, fresh):
        """Issue S (+)= Q K^T over `chunks` of buffer `buf`, each after its mbarrier's phase
        `phase`; one commit group. fresh: the first chunk starts the accumulator."""
        atom_ss = cute.make_mma_atom(ops.mma[0].op)
        atom_rs = cute.make_mma_atom(ops.mma[1].op)
        acc = ops.acc_s
        accumulate = not fresh
        for c in cutlass.range_constexpr(len(chunks)):
            chunk = chunks[c]
            cute.arch.mbarrier_wait(self._bar(ops, buf, chunk), phase)
            self._gathered_fence()
            warpgroup.fence()
            for k in cutlass.range_constexpr(K_BLOCKS):
                if const_expr(chunk < LATENT_CHUNKS):
                    kb = chunk * K_BLOCKS + k
                    atom_ss.set(warpgroup.Field.ACCUMULATE, accumulate)
                    a, bk = ops.q_latent[None, None, kb], ops.k_latent[None, None, kb, buf]
                    cute.gemm(atom_ss, acc, a, bk, acc)
                else:
                    atom_rs.set(warpgroup.Field.ACCUMULATE, accumulate)
                    a, bk = ops.q_rope[None, None, k], ops.k_rope[None, None, k, buf]
                    cute.gemm(atom_rs, acc, a, bk, acc)
                accumulate = True
        warpgroup.commit_group()

    # ---------------------------------------------------------------- the gather form

    def _chunk_arrivals(self, i: int) -> int:
        """Arrivals of mbarrier i: a K chunk's gathering warpgroup's threads (gather; one
        cp.async.mbarrier.arrive.noinc each), else one (TMA: the arming lane; Q's always)."""
        return THREADS_PER_WG if self.gather and i < STAGES * CHUNKS else 1

    @cute.jit
    def _gather_view(self, caches, smem, bars, at, tidx):
        """Gather: what `_gather_rows` and `_gather_chunks` read: the caches (pages, page_size,
        columns), the K buffers, this thread's cp.async partition of one chunk (TILE x CHUNK:
        8 threads a row, 16 bytes each, rows tid // 8 + 16 m: a warp's copy covers four whole
        128-byte rows, and each lane's 16 bytes land in the slot the 128-byte swizzle gives
        its row, as the TMA box's), its rows' coordinates, the mbarriers, the split."""
        mPT, b, t0, t1, page_size = at
        tid = tidx % THREADS_PER_WG
        gcopy = tiled_row_copy(caches[0].element_type, CHUNK, THREADS_PER_WG)
        thr = gcopy.get_slice(tid)
        return SimpleNamespace(
            src=caches, dst=smem, bars=bars, pt=mPT, b=b, t0=t0, t1=t1, page_size=page_size,
            gcopy=gcopy, thr=thr, crd=thr.partition_S(cute.make_identity_tensor((TILE, CHUNK))),
        )  # fmt: skip

    @cute.jit
    def _gather_rows(self, kv, tile):
        """This thread's rows of tile `tile` (GATHER_ROWS of them): (pages, slots) int32, the
        cache row of key min(t0 + 64 tile + row, t1 - 1): rows past the split read its last
        key (finite, a key of the sequence: masked in S, P = 0 times it is 0, so nothing is
        zeroed, `_zero_stale`), and no page-table entry past the split is read or
        dereferenced. Read a pair ahead of the refill (as `_page`) so that the table's latency
        is off the copies' path."""
        pages = cute.make_rmem_tensor(GATHER_ROWS, Int32)
        slots = cute.make_rmem_tensor(GATHER_ROWS, Int32)
        for m in cutlass.range_constexpr(GATHER_ROWS):
            token = cutlass.min(kv.t0 + tile * TILE + kv.crd[0, m, 0][0], kv.t1 - 1)
            index = token // kv.page_size
            pages[m] = kv.pt[kv.b, index]
            slots[m] = token - index * kv.page_size
        return pages, slots

    @cute.jit
    def _gather_chunks(self, kv, buf, chunks: cutlass.Constexpr, rows):
        """The whole warpgroup (128 threads): `chunks` of a tile into buffer `buf` (static or
        not), this thread's GATHER_ROWS rows (`_gather_rows`) x 16 bytes of each chunk by
        cp.async, then one cp.async.mbarrier.arrive.noinc on the chunk's mbarrier (128 arrivals
        complete it: every thread's copies into the chunk, and its earlier ones, landed)."""
        pages, slots = rows
        for c in cutlass.range_constexpr(len(chunks)):
            chunk = chunks[c]
            side = 0 if const_expr(chunk < LATENT_CHUNKS) else 1
            col = chunk if const_expr(chunk < LATENT_CHUNKS) else 0
            dst = cute.zipped_divide(kv.dst[side], (TILE, CHUNK))[(None, None), (0, col, buf)]
            tXsX = kv.thr.partition_D(dst)
            for m in cutlass.range_constexpr(GATHER_ROWS):
                row = cute.local_tile(kv.src[side][pages[m], slots[m], None], (CHUNK,), (col,))
                copy_row_async(kv.gcopy, row, CHUNK, tXsX[None, m, None], kv.crd[None, m, None])
            cute.arch.cp_async_mbarrier_arrive_noinc(kv.bars + buf * CHUNKS + chunk)

    @cute.jit
    def _gathered_fence(self):
        """Gather: cp.async writes are the generic proxy's and WGMMA reads the async proxy's: a
        proxy fence after the acquire (the chunk's mbarrier wait, or the named barrier behind
        the other warpgroup's wait) and before the WGMMA that reads the rows. TMA: none. (The
        build without these fences timed 0.995 / 0.983 of this one on the page-1 cases, a tie,
        H100 2026-12-05: dropped, MLA_NOTES.md "gather adopted".)"""
        if const_expr(self.gather):
            cute.arch.fence_view_async_shared()

    def _bar(self, ops, buf, chunk):
        return ops.bars + buf * CHUNKS + chunk

    # ---------------------------------------------------------------- the two roles

    @cute.jit
    def _warpgroup0(self, ops, st, kv):
        """Tiles a = 2k: S(0), then per pair its softmax, P V of a and c on columns 0 .. 255,
        S(a + 2). Steady pairs (a + 2 exists) in the loop, the last pair after it."""
        ops.bars = kv.bars
        if 0 < st.tiles:
            self._scores(ops, 0, LEFT + RIGHT, 0, True)
            warpgroup.wait_group(0)
        steady = cutlass.max((st.tiles - 1) // 2, 0)
        for k in cutlass.range(steady, unroll=1):
            self._pair0(ops, st, kv, k, True, True)
        a = 2 * steady
        if a + 1 < st.tiles:
            self._pair0(ops, st, kv, steady, True, False)
        elif a < st.tiles:
            self._pair0(ops, st, kv, steady, False, False)

    @cute.jit
    def _warpgroup1(self, ops, st, kv):
        """Tiles c = 2k + 1: S(1), then per pair its softmax after a's, P V of c and a on
        columns 256 .. 511, S(c + 2)."""
        ops.bars = kv.bars
        if 1 < st.tiles:
            self._scores(ops, 1, RIGHT + LEFT, 0, True)
            warpgroup.wait_group(0)
        steady = cutlass.max((st.tiles - 2) // 2, 0)
        for k in cutlass.range(steady, unroll=1):
            self._pair1(ops, st, kv, k, True, True, True)
        a = 2 * steady
        if a + 2 < st.tiles:  # c exists, c + 2 does not; then a + 2 alone
            self._pair1(ops, st, kv, steady, True, True, False)
            self._pair1(ops, st, kv, steady + 1, False, False, False)
        elif a + 1 < st.tiles:
            self._pair1(ops, st, kv, steady, True, False, False)
        elif a < st.tiles:
            self._pair1(ops, st, kv, steady, False, False, False)

    @cute.jit
    def _pair0(self, ops, st, kv, k, has_c: cutlass.Constexpr, more: cutlass.Constexpr):
        """Warpgroup 0's turn of pair k (a = 2k; has_c: tile a + 1 exists; more: a + 2
        exists, whence c too)."""
        a = 2 * k
        if const_expr(more):
            nxt_a = self._page(kv, a + 2)
            nxt_c = self._page(kv, cutlass.min(a + 3, st.tiles - 1))
        if const_expr(not has_c and not self.gather):  # a is the last tile
            self._zero_stale(ops, st, 0, a, Bar.WG0)
        if const_expr(has_c and not more and not self.gather):  # c is (warpgroup 1 zeroes it)
            self._match_stale(st, a + 1, Bar.WG0)
        corr, part = self._softmax(ops, st, a, 0, not more)
        named_barrier(Bar.SCALE0, THREADS).arrive()
        for r in cutlass.range_constexpr(2):
            st.row_sum[r] = st.row_sum[r] * corr[r] + part[r]
        self._rescale(st.acc_o, corr)
        self._p16(ops, None)
        self._p_regs(ops)
        gemm(ops.mma[3], st.acc_o, ops.p_regs, ops.v_rs[0][None, None, None, 0], False, 0)
        named_barrier(Bar.SCALE1, THREADS).arrive_and_wait()
        self._own_barrier(Bar.WG0)  # (racecheck: sScale[:, 1]'s loads a wait past its stores)
        if const_expr(more):
            self._refill(kv, st, 0, LEFT, nxt_a, k)
        corr1 = cute.make_rmem_tensor(2, Float32)
        for r in cutlass.range_constexpr(2):
            corr1[r] = st.sScale[ops.coords[r, 0][0], 1]
        self._p16(ops, corr1)
        self._p_smem(ops, 0)
        cute.arch.fence_view_async_shared()  # P's stores, then the other warpgroup's WGMMA
        named_barrier(Bar.P0, THREADS).arrive()
        if const_expr(has_c):
            named_barrier(Bar.P1, THREADS).arrive_and_wait()
            self._gathered_fence()  # (gather: c's V_L, waited on by warpgroup 1 alone)
            self._rescale(st.acc_o, corr1)
            for r in cutlass.range_constexpr(2):
                st.row_sum[r] = st.row_sum[r] * corr1[r]
            gemm(ops.mma[2], st.acc_o, ops.p_smem[1], ops.v_ss[0][None, None, None, 1], False, -1)
        if const_expr(more):
            self._scores(ops, 0, LEFT, (k + 1) % 2, True)
            if a + 3 < st.tiles:
                warpgroup.wait_group(1)  # P V of c done: buffer 1's left chunks are free
                self._refill(kv, st, 1, LEFT, nxt_c, k)
            self._scores(ops, 0, RIGHT, (k + 1) % 2, False)
        warpgroup.wait_group(0)

    @cute.jit
    def _pair1(
        self,
        ops,
        st,
        kv,
        k,
        has_c: cutlass.Constexpr,
        more_a: cutlass.Constexpr,
        more_c: cutlass.Constexpr,
    ):
        """Warpgroup 1's turn of pair k (c = 2k + 1; has_c: c exists; more_a / more_c: a + 2 /
        c + 2 exist)."""
        a = 2 * k
        c = a + 1
        if const_expr(more_a):
            nxt_a = self._page(kv, a + 2)
        if const_expr(more_c):
            nxt_c = self._page(kv, c + 2)
        if const_expr(has_c and not more_a and not self.gather):  # c is the last tile
            self._zero_stale(ops, st, 1, c, Bar.WG1)
        if const_expr(not has_c and not self.gather):  # a is (warpgroup 0 zeroes it)
            self._match_stale(st, a, Bar.WG1)
        named_barrier(Bar.SCALE0, THREADS).arrive_and_wait()
        corr, part = self._softmax(ops, st, c, 1, not more_c)  # (no tile c: all masked, corr 1)
        named_barrier(Bar.SCALE1, THREADS).arrive()
        both = cute.make_rmem_tensor(2, Float32)  # a's and c's rescales
        for r in cutlass.range_constexpr(2):
            both[r] = st.sScale[ops.coords[r, 0][0], 0] * corr[r]
            st.row_sum[r] = st.row_sum[r] * both[r] + part[r]
        self._rescale(st.acc_o, both)
        if const_expr(has_c):
            self._p16(ops, None)
            self._p_smem(ops, 1)
            self._p_regs(ops)
            gemm(ops.mma[3], st.acc_o, ops.p_regs, ops.v_rs[1][None, None, None, 1], False, -1)
            cute.arch.fence_view_async_shared()  # P's stores, then the other warpgroup's WGMMA
        named_barrier(Bar.P0, THREADS).arrive_and_wait()
        self._gathered_fence()  # (gather: a's V_R, waited on by warpgroup 0 alone)
        gemm(ops.mma[2], st.acc_o, ops.p_smem[0], ops.v_ss[1][None, None, None, 0], False, -1)
        if const_expr(has_c):  # (a wait, not an arrive: racecheck's count; warpgroup 0 waits
            named_barrier(Bar.P1, THREADS).arrive_and_wait()  # there already: no stall)
        if const_expr(more_c):
            warpgroup.wait_group(1)  # P V of c done: buffer 1's right chunks are free
            self._refill(kv, st, 1, RIGHT, nxt_c, k)
        if const_expr(more_a):
            warpgroup.wait_group(0)  # P V of a done: buffer 0's right chunks are free
            self._refill(kv, st, 0, RIGHT, nxt_a, k)
        if const_expr(more_c):
            self._scores(ops, 1, RIGHT + LEFT, (k + 1) % 2, True)
        warpgroup.wait_group(0)

    # ---------------------------------------------------------------- softmax and P

    @cute.jit
    def _softmax(self, ops, st, tile, slot: cutlass.Constexpr, tail: cutlass.Constexpr):
        """S of `tile` (this warpgroup's, done) -> P (fp32, in place) against the running max;
        tail (one of the split's last two tiles): the mask applied where the tile reaches past
        a written row's bound (keys past the row's limit, or past the split). (Earlier tiles
        lie wholly before every written row's bound: a causal bound trails the split's end by
        at most qtokens - 1 < TILE keys.) The max and this tile's rescale factor exp2(m_old -
        m_new) go to shared memory (slot 0 / 1). Returns (the rescale factors, this thread's
        part of P's row sums)."""
        s = rows_cols(ops.acc_s)
        first_key = st.t0 + tile * TILE
        corr = cute.make_rmem_tensor(2, Float32)
        part = cute.make_rmem_tensor(2, Float32)
        m_new = cute.make_rmem_tensor(2, Float32)
        coords, limits = ops.coords, st.limits
        if const_expr(tail):
            if first_key + TILE > st.mask_from:  # the last tile (or, causal, the last two)
                for r in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                        if first_key + coords[r, c][1] >= limits[r]:
                            s[r, c] = -Float32.inf
        for r in cutlass.range_constexpr(2):
            m_old = st.sM[ops.coords[r, 0][0]]
            top = quad_row_max(s, r, -Float32.inf) * st.scale_log2
            m_new[r] = cute.arch.fmax(m_old, top)
            base = m_new[r]
            if base == -Float32.inf:
                base = Float32(0.0)
            corr[r] = cute.math.exp2(m_old - base, fastmath=True)
            part[r] = exp2_row(s, r, st.scale_log2, base)
        cute.arch.sync_warp()  # the quad's reads of the old max, then its leader's write
        s_max, s_scale, coords = st.sM, st.sScale, ops.coords  # (locals: stores in a branch)
        if st.tid % 4 == 0:
            for r in cutlass.range_constexpr(2):
                s_max[coords[r, 0][0]] = m_new[r]
                s_scale[coords[r, 0][0], slot] = corr[r]
        return corr, part

    @cute.jit
    def _rescale(self, acc_o, corr):
        """O's rows times their rescale factors, unless every one of the warp's is 1 (the max
        did not move: rows of zero queries always, the others ever more often)."""
        moved = (corr[0] != Float32(1.0)) | (corr[1] != Float32(1.0))
        if cute.arch.vote_any_sync(moved):
            rescale_o(acc_o, corr)

    @cute.jit
    def _p16(self, ops, corr):
        """P (fp32, times corr per row if given) -> 16 bits (ops.p16)."""
        if const_expr(corr is not None):
            s = rows_cols(ops.acc_s)
            for r in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                    s[r, c] = s[r, c] * corr[r]
        ops.p16.store(ops.acc_s.load().to(ops.p16.element_type))

    @cute.jit
    def _p_regs(self, ops):
        """ops.p16 as the register A operand of P V (the same registers, in order)."""
        p_as_a = acc_as_operand_a(ops.p16)
        for i in cutlass.range_constexpr(cute.size(ops.p_regs)):
            ops.p_regs[i] = p_as_a[i]

    @cute.jit
    def _p_smem(self, ops, slot: cutlass.Constexpr):
        """ops.p16 -> shared memory slot 0 (sP0) / 1 (sP1), by stmatrix (4 per thread)."""
        cute.copy(ops.r2s, ops.thr_r2s.retile(ops.p16), ops.p_dst[slot])

    @cute.jit
    def _zero_stale(self, ops, st, buf: cutlass.Constexpr, tile, wg_bar):
        """Rows of `tile` (in buffer `buf`) past the sequence's end hold stale cache slots:
        their latent columns are zeroed (P V would multiply them by P = 0) by this warpgroup,
        which scored the tile; fenced and synced before its own P V (the other warpgroup's
        comes after a barrier this one arrives at later). (Not in the gather form: its rows
        past the split repeat the split's last key, finite, and no stale slot is read; so
        neither this barrier nor `_match_stale`'s.)"""
        valid = st.sk - (st.t0 + tile * TILE)
        s_k = st.sKl  # (a local: stores in a branch)
        vec = 128 // s_k.element_type.width  # elements per 16-byte chunk
        per_row = D_LATENT // vec
        if valid < TILE:
            for i in cutlass.range(st.tid, (TILE - valid) * per_row, THREADS_PER_WG, unroll=1):
                row = valid + i // per_row
                col = (i % per_row) * vec
                for e in cutlass.range_constexpr(vec):
                    s_k[row, col + e, buf] = s_k.element_type(0.0)
            cute.arch.fence_view_async_shared()
            named_barrier(wg_bar, THREADS_PER_WG).arrive_and_wait()

    @cute.jit
    def _match_stale(self, st, tile, wg_bar):
        """The other warpgroup zeroes `tile` (the split's last) and passes its own barrier
        (`_zero_stale`) when the tile reaches past the sequence: this warpgroup then passes its
        own too (no data), at the same point of the pair, so that both have passed as many
        barriers at every hand-over after it. The hardware needs none: compute-sanitizer's
        racecheck (H200, 2026-12-02) reported the hand-overs after an unmatched one, ordering
        two warpgroups' accesses by the count of barriers each had passed (the barrier-interval
        rule: tests/mla_seesaw.py, scripts/diag_racecheck_arrive.py). One 128-thread bar.sync
        per CTA whose last tile is partial."""
        if st.sk - (st.t0 + tile * TILE) < TILE:
            named_barrier(wg_bar, THREADS_PER_WG).arrive_and_wait()

    @cute.jit
    def _own_barrier(self, wg_bar):
        """This warpgroup's own bar.sync (128 threads, no data), for compute-sanitizer's
        racecheck alone: it orders two warpgroups' shared-memory accesses between two
        __syncthreads only if the later access's thread has waited at more named barriers
        (bar.sync; a bar.arrive counts for nothing) than the earlier's had (the rule that gives
        every verdict of scripts/diag_racecheck_arrive.py on the H200). Warpgroup 0 passes it
        after SCALE1 in every pair, so that its loads of sScale[:, 1] come one wait after
        warpgroup 1's stores (which follow its SCALE0 wait); warpgroup 1 balances it by waiting
        at P1 instead of arriving. Warpgroup 0's four warps leave SCALE1 together: the barrier
        completes at once."""
        named_barrier(wg_bar, THREADS_PER_WG).arrive_and_wait()

    # ---------------------------------------------------------------- output

    @cute.jit
    def _write_split(self, outs, acc_o, row_max, row_sum, o_crd, at):
        """The rows' LSE (log2: the max is kept scaled), from warpgroup 0's quad leaders, and
        this thread's columns of O normalized in place (0 where the split saw no key, LSE
        -inf), staged and sent by the caller (`_send_rows`). Rows past G or of tokens past sq
        are not written. Direct form: O in q's dtype stored here, the LSE natural."""
        mOp, mLp = outs
        split, q_off, sq, head0, wg, tid = at
        o = rows_cols(acc_o)
        for r in cutlass.range_constexpr(2):
            # (opaque: with G <= 8 rows the compiler would prove rows r + 8 never written)
            row = opaque_i32(o_crd[r, 0][0])
            token = row // self.pitch
            inv = Float32(0.0)
            lse = -Float32.inf
            if row_sum[r] > 0.0:
                inv = 1.0 / row_sum[r]
                lse = row_max[r] + cute.math.log2(row_sum[r], fastmath=True)
            if const_expr(not self.direct or self.ostore):  # every row, in place (staged)
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    o[r, c] = o[r, c] * inv
            if self._written(row, token, sq):
                head = head0 + row % self.pitch
                if const_expr(self.direct):
                    for c in cutlass.range_constexpr(
                        0 if self.ostore else cute.size(o, mode=[1])
                    ):  # ostore: staged and sent by the caller (`_send_rows`)
                        value = (o[r, c] * inv).to(mOp.element_type)
                        mOp[q_off + token, head, wg * COLS + o_crd[r, c][1]] = value
                    if wg == 0 and tid % 4 == 0:
                        mLp[q_off + token, head] = lse * LN2
                else:
                    if wg == 0 and tid % 4 == 0:
                        mLp[split, q_off + token, head] = lse

    @cute.jit
    def _written(self, row, token, sq):
        """Whether Q row `row` (of token `token`) is one of the op's: inside G, of a token
        < sq, and of a head of the block (rows H .. pitch - 1 of a token are not, H < 8)."""
        ours = (row < self.g) & (token < sq)
        if const_expr(self.pitch > self.h):
            ours = ours & (row % self.pitch < self.h)
        return ours

    def _staged(self, storage, mOp, acc_o):
        """(sO, tOrO): the O staged over kl and this thread's values of it, normalized in
        `_write_split`: the partials' fp32 accumulator, rows O_STRIDE floats apart; the direct
        form's (`ostore`) converted to out's dtype, rows O16_STRIDE elements apart."""
        o_type, stride, tOrO = Float32, O_STRIDE, acc_o
        if self.direct:
            o_type, stride = mOp.element_type, O16_STRIDE
            tOrO = cute.make_rmem_tensor_like(acc_o, o_type)
            tOrO.store(acc_o.load().to(o_type))
        sO = cute.make_tensor(
            cute.recast_ptr(storage.kl.data_ptr(), dtype=o_type),
            cute.make_layout((ROWS, D_LATENT), stride=(stride, 1)),
        )
        return sO, tOrO

    @cute.jit
    def _send_rows(self, mOp, sO, at):
        """One thread (warp 0's elected lane, after the __syncthreads that follows every
        thread's staging stores and proxy fence): the staged rows r < G of tokens < sq, each
        one bulk copy to its row of mOp: the partials' mOp[split, q_off + token, head0 + r % H]
        (the launcher's contiguous fp32 scratch: 2 KB), the direct form's out[q_off + token,
        head0 + r % H] (`ostore`: q's dtype, 1 KB, rows 16-byte aligned: the compile's and the
        launcher's check); one bulk group, waited until read (the CTA's shared memory must
        outlive the reads; the writes reach global memory before the grid completes, so the
        combine's launch, or the next kernel's, sees them)."""
        split, q_off, sq, head0 = at
        bulk = cute.make_copy_atom(cpasync.CopyBulkS2GOp(), mOp.element_type)  # (elects no lane)
        for r in cutlass.range(self.g, unroll=1):
            token = r // self.pitch
            if self._written(r, token, sq):
                at_row = (q_off + token, head0 + r % self.pitch, None)
                if const_expr(not self.direct):
                    at_row = (split,) + at_row
                row = mOp[at_row].iterator
                cute.copy(bulk, sO[r, None], cute.make_tensor(row, cute.make_layout(D_LATENT)))
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
