"""Paged GQA attention decode on tensor cores (sm_90a, mma.sync m16n8k16): the partial pass of
the split-KV plan (combine.py has the plan's bookkeeping, the speculative rows and the combine
pass), 16-bit or FP8 (e4m3) caches.

A CTA takes the H query heads of one KV head (H x Q (token, head) rows, Q query tokens, padded with
zero rows to the MMA's 16, or to two row blocks of 16 past 16 rows: `rows.row_cap`, so that GQA 8 x
4 tokens and GQA 16 x 2 stream each KV head once) and one split of one sequence's keys. The keys
stream through shared memory in tiles of TILE tokens, STAGES deep: every thread issues cp.async
copies of 16 bytes for its rows of the tile (page page_table[b, t // page_size], slot t %
page_size, the token clamped into the split so that masked columns hold finite values; 16-bit
caches at D 128, and D 64 at one row block, read a tile's page ids an iteration before its copies:
`page_ahead`), one commit group per tile, one CTA barrier per tile. Warp w takes keys 16w .. 16w +
15 of every tile with its own online softmax: S = Q K_w^T (16 x 16, D / 16 MMAs of K = 16, Q and K
by ldmatrix from the swizzled tiles), scaled inside the exponent (the toolkit's base-2 online
softmax), P to 16-bit registers as the A operand of O += P V_w (V by transposed ldmatrix; one K =
16 step, D / 8 MMAs; with 32 rows every MMA twice, V's fragment loaded 32 columns at a time). The
warps' (max, sum, O) meet in shared memory at the end (`combine.write_split`).

FP8 caches: the tiles stay bytes in shared memory (half the 16-bit tiles: `config.STAGES_FP8`
stages and `config.RESIDENT_FP8` CTAs per SM), read by ldmatrix and widened in registers into
the MMA operands (fp8.py: exact; no 16-bit copy, no second barrier), Q stored with its columns
permuted to match K's register order, O's columns put back in place when staged for the
merge; P V in f16. The per-KV-head K scale (per-tensor scales come as (Hkv,) tensors) rides in
the exponent's scale, V's multiplies O at the end, so dequantization costs nothing per element.

Memory-bound: the MMAs are a few per 512 bytes of K and V; what matters is bytes in flight
(STAGES - 1 tiles per CTA, 2 CTAs per SM at D = 128: `config.RESIDENT`).

The ramp (`early_ids`, the leaves that read page ids ahead; PAGED_NOTES.md "Small-batch decode:
the ramp and the combine"): before the PDL wait each thread prefetches into L2 the K and V rows
of one token of the first tiles of the split the table's width gives (`_prefetch_guess`: page
ids read before the wait address prefetches only); after it the first STAGES tiles' page ids of
that split are read beside the sequence length (`_guess_ids`) and kept where the sequence's own
split is that one, else read again, all at once."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import T, dsl_user_op

from forgekernel.kernels.attention.mla.sm90.schedule import HEADER as WORK_HEADER
from forgekernel.kernels.attention.paged.sm90 import fp8
from forgekernel.kernels.attention.paged.sm90.combine import write_split
from forgekernel.kernels.attention.paged.sm90.config import (
    RESIDENT,
    RESIDENT_FP8,
    ROWS,
    STAGES,
    STAGES_FP8,
    THREADS,
    TILE,
    WARPS,
)
from forgekernel.kernels.attention.paged.sm90.rows import MAX_ROWS, row_cap
from forgekernel.kernels.common.sm90 import pdl
from forgekernel.kernels.common.sm90.constants import LN2
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.softmax import online_softmax, rescale_o
from forgekernel.kernels.common.sm90.warp_mma import (
    as_wide_acc,
    copy_row_async,
    query_row_limits,
    swizzled_rows,
    tiled_row_copy,
)

KEYS = TILE // WARPS  # keys per warp per tile: one K = 16 step of P V
V_COLS = 32  # O's columns a piece of P V with 32 rows (`_pv_in_pieces`)


LINE = 128  # bytes of an L2 prefetch (`prefetch_l2`)


@dsl_user_op
def prefetch_l2(ptr, *, loc=None, ip=None) -> None:
    """The 128-byte line at global address `ptr` into L2, no register or shared memory
    written (`_prefetch_guess`). Per thread: the bulk form (cp.async.bulk.prefetch.L2, its
    operands uniform registers) became a loop over the warp's distinct addresses in SASS."""
    llvm.inline_asm(
        None,
        [ptr.llvm_ptr],
        "prefetch.global.L2 [$0];",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def after(value, dep, *, loc=None, ip=None) -> Int32:
    """`value` as a result of `dep` too: max.s32(value, dep | 0x80000000), that is value
    itself where value >= 0 (dep | 0x80000000 is negative whatever dep is) and still negative
    where it is negative (a bad length keeps giving no keys), so that ptxas issues every use
    of it after dep's load: left alone it put the sequence length's first use among
    `_guess_ids`' reads, and the warp's wait on the length before the rest of them (SASS
    2026-12-04)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(value).ir_value(loc=loc, ip=ip), Int32(dep).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b32 t;\nor.b32 t, $2, 0x80000000;\nmax.s32 $0, $1, t;\n}",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def load_pinned(ptr, ok, *, loc=None, ip=None) -> Int32:
    """One int32 from global memory where `ok` != 0 (else 0, nothing read), as predicated
    inline PTX with side effects: no branch, and LLVM neither sinks it into the branch that
    uses it nor drops it (`_guess_ids`' reads, which must issue before the sequence's length
    is used; as plain loads under an `if` they were sunk past it, SASS 2026-12-04)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [ptr.llvm_ptr, Int32(ok).ir_value(loc=loc, ip=ip)],
            "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, 0;\n"
            "@p ld.global.b32 $0, [$1];\n}",
            "=r,l,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


class PagedDecodeSm90:
    """The partial pass on tensor cores; see the module docstring."""

    def __init__(
        self, head_dim: int, heads: int, qtokens: int = 1, fp8: bool = False,
        page_ahead: bool = True, merge_rows: bool = False, pdl: bool = True, ranges: bool = False,
        early_ids: bool = True,
    ):  # fmt: skip
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim must be 64, 128 or 256, got {head_dim}")
        cap = row_cap(head_dim, "float8_e4m3fn" if fp8 else "")
        if heads * qtokens > cap:
            raise ValueError(f"heads x query tokens must be <= {cap}, got {heads} x {qtokens}")
        self.d = head_dim
        self.h = heads
        self.qt = qtokens
        self.g = heads * qtokens
        # the MMA's rows: one m16 block, or two (a warp's S and O twice as tall) past 16 rows
        self.rows = ROWS if self.g <= ROWS else MAX_ROWS
        self.stages = STAGES_FP8[head_dim] if fp8 else STAGES[head_dim]
        self.fp8 = fp8
        # 16-bit caches: a tile's page ids read one loop iteration before its copies
        # (`_page_ids`; 8 more registers), where the registers allow it: D 128 (2 CTAs an SM,
        # up to 255: 164-252 with them) and D 64 at one row block (105-132, under the 170 of
        # 3 CTAs an SM); not at D 256 (255 and spills) nor D 64 with 32 rows (227; capped at
        # 170 it spilled 40-48 bytes). False: read beside the copies (the 18:47 pass)
        self.page_ahead = (
            page_ahead and not fp8 and (head_dim == 128 or (head_dim == 64 and self.rows == ROWS))
        )
        # the page ids of the first STAGES tiles read together before the first copy, and (not
        # ranges) issued with the seqlens read, from the split the page table's width would
        # give (`_guess_ids`), kept where the sequence's own split is that one: the ramp's
        # chain seqlens -> page table -> K / V loses its middle DRAM latency where a
        # sequence fills its table (the b1 cases); and (not ranges) that split's first rows
        # prefetched into L2 before the PDL wait (`_prefetch_guess`). False (compile key ramp
        # "serial"): read after the seqlens, tile by tile, nothing prefetched
        self.early_ids = early_ids and self.page_ahead
        # the warps' merge with each row's weights computed once (`_write_rows`), a candidate
        # (compile key merge "rows") of the 16-bit D 128 leaves (G x D a multiple of THREADS);
        # False: `combine.write_split`, per element
        if merge_rows and (fp8 or head_dim != 128):
            raise ValueError("merge_rows: 16-bit caches at D 128 only")
        self.merge_rows = merge_rows
        # ranges (a decode step's schedule, `forgekernel.attention_paged_schedule`; 16-bit
        # decode, one query token): CTA x takes item x of the step's work list (the scheduling
        # kernel's ranges form, mla/sm90/worklist.py: row 0 (keys per split, items), row 1 + i
        # item i's (sequence, split)), passed in the K scales' slot (None for 16-bit caches),
        # and writes its partial at (item, 0): partials (items, 1, Hq, D), the combine's ranges
        # form reducing each sequence's item range (combine.PagedCombineRangesSm90); a
        # sequence of one item writes its final O and LSE directly instead (`singles`)
        if ranges and (fp8 or qtokens != 1 or merge_rows):
            raise ValueError("ranges: 16-bit caches, one query token, the per-element merge")
        self.ranges = ranges
        # launched with PDL (common/sm90/pdl.py): the op's first kernel waits at its top for
        # whatever kernel precedes it in the stream (q's producer, a previous call's combine
        # still reading the partials), then lets its combine be scheduled
        self.pdl = pdl

    def _fp8_shared(self, dtype):
        """Shared memory of an FP8 cache: K's and V's byte tiles in one range (seen 16-bit:
        `fp8.byte_tiles`), the merge's fp32 O over it, Q (columns permuted), max and sum."""
        tiles = cute.cosize(fp8.byte_tiles(TILE, self.d, self.stages))
        q_cosize = cute.cosize(swizzled_rows(self.rows, self.d))
        fields = {  # annotations built here: this module's are strings (no local scope)
            "kv": cute.struct.Align[cute.struct.MemRange[dtype, 2 * tiles], 1024],
            "q": cute.struct.Align[cute.struct.MemRange[dtype, q_cosize], 1024],
            "m": cute.struct.MemRange[Float32, WARPS * self.rows],
            "lsum": cute.struct.MemRange[Float32, WARPS * self.rows],
        }
        return cute.struct(type("SharedFp8", (), {"__annotations__": fields}))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        direct: Int32,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        group: Int32,
        mKScale: cute.Tensor | None,
        mVScale: cute.Tensor | None,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        stream: cuda.CUstream,
    ):
        """mQ (B, Hq, D) or, with mCuQ int32 (B + 1,), (total_q, Hq, D); mK, mV (num_pages,
        page_size, Hkv, D) in q's dtype, or float8_e4m3fn with mKScale, mVScale fp32 (Hkv,)
        (else None); mPT int32 (B, max_pages); mSeq int32 (B,); mOp fp32 (splits, rows, Hq,
        D); mLp fp32 (splits, rows, Hq) log2; mO (rows, Hq, D) in q's dtype and mLSE fp32
        (rows, Hq) (any strides), written instead when `direct` != 0 (one split: no combine);
        per_split the least keys a split takes (a sequence's keys spread over the grid's
        splits, combine.py); group = Hq / Hkv; causal 0 / 1 (query tokens among themselves,
        bottom-right)."""
        if const_expr(mK.element_type != mV.element_type):
            raise TypeError("k_cache and v_cache must share one dtype")
        if const_expr(self.fp8 != (mK.element_type == cutlass.Float8E4M3FN)):
            raise TypeError("the kernel was built for the other cache dtype")
        if const_expr(not self.fp8 and mK.element_type != mQ.element_type):
            raise TypeError("a 16-bit cache must have q's dtype")
        if const_expr(self.fp8 and (mKScale is None or mVScale is None)):
            raise TypeError("an FP8 cache comes with k and v scales")
        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")
        dtype, cache = mQ.element_type, mK.element_type
        q_layout = swizzled_rows(self.rows, self.d)
        kv_cosize = cute.cosize(swizzled_rows(TILE, self.d, self.stages))
        # the warps' O meets over K's buffer, and V's right after it past 16 rows (K's bytes
        # a multiple of the 1024-byte alignment: V follows with no gap)
        merge_bytes = WARPS * self.rows * self.d * 4
        if const_expr(not self.fp8 and self.rows > ROWS):
            assert kv_cosize * 2 % 1024 == 0 and merge_bytes <= 2 * kv_cosize * 2

        @cute.struct
        class Shared:
            k: cute.struct.Align[cute.struct.MemRange[cache, kv_cosize], 1024]
            v: cute.struct.Align[cute.struct.MemRange[cache, kv_cosize], 1024]
            wide: cute.struct.Align[cute.struct.MemRange[dtype, 1], 1024]
            q: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_layout)], 1024]
            m: cute.struct.MemRange[Float32, WARPS * self.rows]
            lsum: cute.struct.MemRange[Float32, WARPS * self.rows]

        self.shared = Shared
        grid = (mOp.shape[0], mQ.shape[1] // self.h, mSeq.shape[0])
        if const_expr(self.ranges):  # the list's capacity in x (CTAs past its items leave)
            grid = (mKScale.shape[0] - WORK_HEADER, mQ.shape[1] // self.h, 1)
        args = (
            mQ, mK, mV, mPT, mSeq, mOp, mLp, mO, mLSE, direct, scale_log2, per_split, page_size,
            group, mKScale, mVScale, mCuQ, causal,
        )  # fmt: skip
        if const_expr(self.fp8):
            self.shared = self._fp8_shared(dtype)
        # Registers capped for the CTAs per SM shared memory allows (.minnctapersm): FP8
        # always (RESIDENT_FP8); 16-bit D 128 with one row block too (RESIDENT: left to itself
        # the cu13 ptxas, the GPU host's, held bf16 8 heads x 1 token with the page ids read
        # ahead at 168 registers and spilled 8 bytes a tile, 2026-12-02; told, 254 and no
        # stack), not its 32-row leaves (told, they took 255 and spilled 40-48 bytes; left
        # alone 250-252 and none). The carveout only reaches the DSL's JIT loader (an exported
        # kernel sets none: the driver's default choice), and given, the compile needs no
        # device query for min_blocks_per_mp.
        hint = {}
        if const_expr(self.fp8 or (self.d == 128 and self.rows == ROWS)):
            resident = (RESIDENT_FP8 if self.fp8 else RESIDENT)[self.d]
            hint = {"min_blocks_per_mp": resident, "preferred_smem_carveout": 100}
        self.kernel(*args).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl, **hint
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mPT: cute.Tensor,
        mSeq: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        direct: Int32,
        scale_log2: Float32,
        per_split: Int32,
        page_size: Int32,
        group: Int32,
        mKScale: cute.Tensor | None,
        mVScale: cute.Tensor | None,
        mCuQ: cute.Tensor | None,
        causal: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, head_block, b = cute.arch.block_idx()
        if const_expr(self.early_ids and not self.ranges):
            # the one global access before the wait: page ids that address L2 prefetches only
            if tidx == 0:  # the length's line: its read after the wait hits L2
                prefetch_l2(mSeq.iterator + b)
            self._prefetch_guess(mK, mV, mPT, (b, split, head_block), per_split, page_size, group,
                                 tidx)  # fmt: skip
        pdl.wait(self.pdl)  # before the first global access (its prologue reads mCuQ, mSeq)
        pdl.launch_dependents(self.pdl)
        item = split
        single = Int32(0)
        if const_expr(self.ranges):  # the list in the K scales' slot (16-bit: no scales)
            items = mKScale[0, 1]
            if item >= items:  # past the list's items: no barrier, no store, gone
                _nvvm.exit()
            b = mKScale[WORK_HEADER + item, 0]
            split = mKScale[WORK_HEADER + item, 1]
            # a sequence of one item (its first, and the next item another sequence's: a unit's
            # items are consecutive) writes its final O and LSE itself, as the width plan's one
            # split does, and the combine leaves its row (PagedCombineRangesSm90 `singles`)
            if split == 0:
                single = Int32(1)
                if item + 1 < items:
                    if mKScale[WORK_HEADER + item + 1, 0] == b:
                        single = Int32(0)
        head0 = head_block * self.h
        kvh = head0 // group
        q_off, sq = b, Int32(1)
        if const_expr(mCuQ is not None):
            q_off = mCuQ[b]
            sq = mCuQ[b + 1] - q_off
        lane = tidx % 32
        warp_idx = cute.arch.make_warp_uniform(tidx // 32)
        dtype = mQ.element_type

        sk = mSeq[b]
        ids, guess = None, None
        if const_expr(self.early_ids):
            ids = [cute.make_rmem_tensor(self.page_rows, Int32) for _ in range(self.stages)]
            if const_expr(not self.ranges):
                guess = self._guess_ids(mK, mPT, b, split, per_split, page_size, tidx, ids)
                # sk's uses after the guessed reads' issue, not among them (`after`)
                sk = after(sk, ids[self.stages - 1][self.page_rows - 1])
        # the sequence's own keys over the grid's splits, at least per_split a split: not the
        # table's width over them (a table sized for the longest context a server admits would
        # leave a short sequence's keys in its first split); ranges: the list's keys per split
        per = cutlass.max(per_split, cute.ceil_div(sk, cute.arch.grid_dim()[0]))
        if const_expr(self.ranges):
            per = mKScale[0, 0]
        t0 = split * per
        t1 = cutlass.min(t0 + per, sk)
        tiles = cute.ceil_div(cutlass.max(t1 - t0, 0), TILE)
        kept = Int32(0)  # the guessed ids are this split's (uniform over the CTA)
        if const_expr(guess is not None):
            if per == guess[0]:
                if t1 == guess[1]:
                    kept = Int32(1)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        sQ = storage.q.get_tensor(swizzled_rows(self.rows, self.d))
        if const_expr(self.fp8):
            sK, sV = self._fp8_views(storage)
            self._load_query_fp8(mQ, sQ, tidx, q_off, sq, head0)
            # byte rows seen 16-bit; the page of a token by multiply-shift, not division
            gcopy = fp8.row_copy(dtype, self.d // 2, THREADS)
            pages = cute.fast_divmod_create_divisor_v2(page_size)
        else:
            kv_layout = swizzled_rows(TILE, self.d, self.stages)
            sK = storage.k.get_tensor(kv_layout)
            sV = storage.v.get_tensor(kv_layout)
            gcopy_q = tiled_row_copy(dtype, self.d, THREADS)
            self._load_query(mQ, sQ, gcopy_q, gcopy_q.get_slice(tidx), q_off, sq, head0)
            gcopy = tiled_row_copy(mK.element_type, self.d, THREADS)
            pages = page_size
            if const_expr(self.page_ahead):
                pages = cute.fast_divmod_create_divisor_v2(page_size)
        thr_g = gcopy.get_slice(tidx)
        kv = (mK, mV, sK, sV, mPT, b, kvh, pages)
        first_ids = [None] * self.stages
        if const_expr(self.early_ids):
            first_ids = ids
            # the first STAGES tiles' page ids, all in flight before the first copy waits on
            # one, unless the guess read them already
            if kept == 0:
                for s in cutlass.range_constexpr(self.stages):
                    if s < tiles:
                        self._page_ids(kv, thr_g, t0 + s * TILE, t1, ids[s])
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < tiles:
                self._load_tile(kv, gcopy, thr_g, t0 + s * TILE, t1, s, first_ids[s])
            cute.arch.cp_async_commit_group()
        # the page ids of the next tile to load, read a loop iteration ahead of its copies
        page_ids = None
        if const_expr(self.early_ids):
            page_ids = ids[self.stages - 1]
        elif const_expr(self.page_ahead):
            page_ids = cute.make_rmem_tensor(self._rows_per_thread(thr_g), Int32)
            if self.stages - 1 < tiles:
                self._page_ids(kv, thr_g, t0 + (self.stages - 1) * TILE, t1, page_ids)
        # an FP8 cache's K scale rides in the exponent, V's on O at the end
        exp_scale = scale_log2
        if const_expr(self.fp8):
            exp_scale = scale_log2 * mKScale[kvh]

        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), (1, 1, 1))
        thr_mma = mma.get_slice(lane)
        ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        copy_q = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, dtype), mma).get_slice(lane)
        copy_k = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, dtype), mma).get_slice(lane)
        copy_v = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, dtype), mma).get_slice(lane)
        # FP8: P V in f16 whatever q's dtype (fp8.py)
        pv_type = cutlass.Float16 if const_expr(self.fp8) else dtype
        mma_pv = cute.make_tiled_mma(warp.MmaF16BF16Op(pv_type, Float32, (16, 8, 16)), (1, 1, 1))

        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.rows, self.d)), Float32)
        acc_o.fill(0.0)
        o_wide = as_wide_acc(acc_o)
        # a thread's rows: r and r + 8 of each 16-row block
        row_max = cute.make_rmem_tensor(self.rows // 8, Float32)
        row_sum = cute.make_rmem_tensor(self.rows // 8, Float32)
        rescale = cute.make_rmem_tensor(self.rows // 8, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # (row, key) of this thread's score registers, keys relative to the warp's first
        coords = rows_cols(
            as_wide_acc(thr_mma.partition_C(cute.make_identity_tensor((self.rows, KEYS))))
        )
        if const_expr(self.fp8):
            coords = self._real_rows(coords, mode=0)
        limits = query_row_limits(coords, self.h, self.qt, sq, sk, t1, causal)
        first_limit, real_stats = None, None
        if const_expr(self.fp8):
            first_limit = limits[0]
            for r in cutlass.range_constexpr(1, cute.size(limits)):
                first_limit = cutlass.min(first_limit, limits[r])
            real_stats = [self._real_rows(t, mode=None) for t in (row_max, row_sum, rescale)]

        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSsQ = copy_q.partition_S(sQ)
        tSrQ_view = copy_q.retile(tSrQ)
        # the K / V tiles' width in the views ldmatrix reads (FP8: bytes seen 16-bit)
        width = self.d // 2 if const_expr(self.fp8) else self.d
        for i in cutlass.range(tiles, unroll=1):
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.sync_threads()
            nxt = i + self.stages - 1
            if nxt < tiles:
                self._load_tile(kv, gcopy, thr_g, t0 + nxt * TILE, t1, nxt % self.stages, page_ids)
                if const_expr(self.page_ahead):  # the next one's (past the last: clamped)
                    self._page_ids(kv, thr_g, t0 + (nxt + 1) * TILE, t1, page_ids)
            cute.arch.cp_async_commit_group()

            stage = i % self.stages
            sKw = cute.local_tile(sK[None, None, stage], (KEYS, width), (warp_idx, 0))
            sVw = cute.local_tile(sV[None, None, stage], (KEYS, width), (warp_idx, 0))
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.rows, KEYS)), Float32)
            acc_s.fill(0.0)
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKw))
            tSsK = copy_k.partition_S(sKw)
            tSrK_view = copy_k.retile(tSrK)
            if const_expr(self.fp8):
                cute.copy(copy_k, tSsK, tSrK_view)
                tSrK_wide = cute.make_rmem_tensor(thr_mma.partition_shape_B((KEYS, self.d)), dtype)
                fp8.widen_k(tSrK, tSrK_wide)
                for k in cutlass.range_constexpr(self.d // 16):
                    cute.copy(copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
                    cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK_wide[None, None, k], acc_s)
            else:
                for k in cutlass.range_constexpr(self.d // 16):
                    cute.copy(copy_q, tSsQ[None, None, k], tSrQ_view[None, None, k])
                    cute.copy(copy_k, tSsK[None, None, k], tSrK_view[None, None, k])
                    cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)

            s_wide = as_wide_acc(acc_s)
            first_key = t0 + i * TILE + warp_idx * KEYS
            if const_expr(self.fp8):
                # FP8 tiles are half the bytes: per-tile work that does nothing is skipped, the
                # mask before the rows' limits and, with G <= 8, the padding rows 8 .. 15 (zero
                # queries: their raw scores, 0, become P = 0)
                s_real = self._real_rows(s_wide)
                if first_key + KEYS > first_limit:
                    self._mask(s_real, coords, limits, first_key)
                online_softmax(s_real, *real_stats, exp_scale)
                rescale_o(self._real_rows(o_wide), real_stats[2])
            else:
                self._mask(s_wide, coords, limits, first_key)
                online_softmax(s_wide, row_max, row_sum, rescale, exp_scale)
                rescale_o(o_wide, rescale)
            tOrP = cute.make_rmem_tensor(thr_mma.partition_shape_A((self.rows, KEYS)), pv_type)
            acc_to_operand_a(s_wide, tOrP)

            sVt = transposed(sVw)
            if const_expr(self.rows > ROWS):
                # 32 rows: O is 128 registers at D 128; V's fragment in pieces of V_COLS
                # columns (8 registers, not 32) keeps the pass under 255 with no spill
                self._pv_in_pieces(mma, thr_mma, copy_v, acc_o, tOrP, sVt)
            elif const_expr(self.fp8):
                tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
                cute.copy(copy_v, copy_v.partition_S(sVt), copy_v.retile(tOrV))
                tOrV_wide = cute.make_rmem_tensor(
                    thr_mma.partition_shape_B((self.d, KEYS)), pv_type
                )
                fp8.widen_v(tOrV, tOrV_wide)
                cute.gemm(mma_pv, acc_o, tOrP, tOrV_wide, acc_o)
            else:
                tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
                cute.copy(copy_v, copy_v.partition_S(sVt), copy_v.retile(tOrV))
                cute.gemm(mma, acc_o, tOrP, tOrV, acc_o)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # the pipeline's buffers free: O meets there
        if const_expr(self.fp8):
            v_scale = mVScale[kvh]
            for j in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[j] = acc_o[j] * v_scale
        self._stage_warp(storage, o_wide, row_max, row_sum, exp_scale, thr_mma, warp_idx)
        cute.arch.sync_threads()
        if const_expr(self.merge_rows):
            self._write_rows(storage, (mOp, mLp, mO, mLSE, direct), split, (q_off, sq), head0, tidx)
        else:
            # ranges: the partial at (item, the unit's first token 0); a one-item sequence's
            # final O and LSE at its row b, directly
            w_split, w_off, w_direct = split, q_off, direct
            if const_expr(self.ranges):
                w_split, w_off = item, Int32(0)
                if single != 0:
                    w_off, w_direct = b, Int32(1)
            write_split(
                self._merge_views(storage), (mOp, mLp, mO, mLSE, w_direct), w_split,
                (w_off, sq), head0, self.h, self.g, self.d, tidx,
            )  # fmt: skip

    @cute.jit
    def _write_rows(self, storage, outs, split, rows, head0, tidx):
        """`combine.write_split`'s outputs, each row's merge weights computed once: thread g < G
        turns row g's warp stats (max in log2 units, sum) into the weights exp2(m_w - top) /
        total in place of the maxima and the row's log2 LSE (-inf where no warp saw a key:
        weights 0) in place of warp 0's sum; after a barrier each (row, column) of O is the
        weighted sum of the warps' O, no exponent or division per element (write_split: 4
        exp2, a division and a log2 per element, 64-93 instructions, in a loop of G x D / THREADS
        iterations: 16 at 16 rows, against 4 at the decode's 4; PAGED_NOTES.md "Speculative
        decoding: the same kernel")."""
        sm, sl, so = self._merge_views(storage)
        mOp, mLp, mO, mLSE, direct = outs
        q_off, sq = rows
        if tidx < self.g:
            top = sm[0, tidx]
            for w in cutlass.range_constexpr(1, WARPS):
                top = cute.arch.fmax(top, sm[w, tidx])
            # a row no warp saw a key of: all maxima -inf, exp2(-inf - 0) = 0, total 0
            base = cutlass.select_(top == -Float32.inf, Float32(0.0), top)
            weights = cute.make_rmem_tensor(WARPS, Float32)
            total = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                weights[w] = cute.math.exp2(sm[w, tidx] - base, fastmath=True)
                total += sl[w, tidx] * weights[w]
            seen = total > 0.0
            inv = cutlass.select_(seen, 1.0 / total, Float32(0.0))
            for w in cutlass.range_constexpr(WARPS):
                sm[w, tidx] = weights[w] * inv
            lse = top + cute.math.log2(total, fastmath=True)
            sl[0, tidx] = cutlass.select_(seen, lse, -Float32.inf)
        cute.arch.sync_threads()
        n = self.g * self.d
        # 4 (row, column) elements at a time: the 32-row leaf's registers (unrolled fully, its
        # 32 iterations took 255 and spilled 56 bytes)
        for j in cutlass.range(n // THREADS, unroll=4):
            i = tidx + j * THREADS
            g = i // self.d
            d = i - g * self.d
            # rows of tokens past sq are not written (i < n always: D 128 = THREADS)
            if g // self.h < sq:
                # a row no warp saw a key of reads no O (write_split's 0; an O of 0 x inf from
                # a later token's keys would be NaN)
                acc = Float32(0.0)
                if sl[0, g] != -Float32.inf:
                    for w in cutlass.range_constexpr(WARPS):
                        acc += so[w, g, d] * sm[w, g]
                token = q_off + g // self.h
                head = head0 + g % self.h
                if direct != 0:
                    mO[token, head, d] = acc.to(mO.element_type)
                    if d == 0:
                        mLSE[token, head] = sl[0, g] * LN2
                else:
                    mOp[split, token, head, d] = acc
                    if d == 0:
                        mLp[split, token, head] = sl[0, g]

    @cute.jit
    def _pv_in_pieces(self, mma, thr_mma, copy_v, acc_o, tOrP, sVt):
        """O += P V over D in pieces of V_COLS columns: each piece's V fragment loaded, then its
        MMAs on the piece's accumulator registers (O's columns are its outermost mode).

        The pieces are slices of the whole tile's ldmatrix partition, never a `local_tile` of
        sVt: a tile of the swizzled view at column 32 j gets its offset both in the pointer and
        inside the swizzle (DSL 4.8.1 lowering: every piece past the first read 32 columns, i.e.
        64 bytes, off; the 2026-12-02 13:49 GPU failures of 32 rows)."""
        pieces = self.d // V_COLS
        tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        tOsV = copy_v.partition_S(sVt)
        tOrV_copy = copy_v.retile(tOrV)
        per_copy = cute.size(tOsV, mode=[1]) // pieces
        acc_layout = cute.make_layout(thr_mma.partition_shape_C((self.rows, V_COLS)))
        v_layout = cute.make_layout(thr_mma.partition_shape_B((V_COLS, KEYS)))
        for j in cutlass.range_constexpr(pieces):
            for n in cutlass.range_constexpr(j * per_copy, (j + 1) * per_copy):
                cute.copy(copy_v, tOsV[None, n, None], tOrV_copy[None, n, None])
            acc_j = cute.make_tensor(acc_o.iterator + j * cute.size(acc_layout), acc_layout)
            tOrV_j = cute.make_tensor(tOrV.iterator + j * cute.size(v_layout), v_layout)
            cute.gemm(mma, acc_j, tOrP, tOrV_j, acc_j)

    @cute.jit
    def _load_query(self, mQ, sQ, gcopy, thr_g, q_off, sq, head0):
        """The rows x D query tile: row r = (token r // H, head head0 + r % H) for r < G and
        token < sq, cp.async in the first commit group; zeros elsewhere."""
        tQsQ = thr_g.partition_D(sQ)
        tQcQ = thr_g.partition_S(cute.make_identity_tensor((self.rows, self.d)))
        for m in cutlass.range_constexpr(cute.size(tQsQ, mode=[1])):
            r = tQcQ[0, m, 0][0]
            token = r // self.h
            if r < self.g and token < sq:
                row = mQ[q_off + token, head0 + r % self.h, None]
                copy_row_async(gcopy, row, self.d, tQsQ[None, m, None], tQcQ[None, m, None])
            else:
                tQsQ[None, m, None].fill(0.0)

    def _rows_per_thread(self, thr_g) -> int:
        """The K / V tile rows a thread copies (16-bit caches: TILE x D / 8 chunks of 16 bytes
        over THREADS threads, one chunk column per thread: 8 at D 128)."""
        return cute.size(thr_g.partition_D(cute.make_identity_tensor((TILE, self.d))), mode=[1])

    @property
    def page_rows(self) -> int:
        """The K / V tile rows a thread copies on a 16-bit cache (`_rows_per_thread`)."""
        return TILE * self.d // 8 // THREADS

    @cute.jit
    def _prefetch_guess(self, mK, mV, mPT, where, per_split, page_size, group, tidx):
        """Before the PDL wait: the K and V rows of the first STAGES - 1 tiles of the split the
        table's width gives (`_guess_ids`' split) into L2, one token a thread (two at D 64),
        so that the HBM streams this call's first tiles while the kernel before it (a
        previous call's combine, ~3 us at b1 x 16k with its handoffs) still runs.

        An exception to common/sm90/pdl.py's rule 1, and why it is safe: the page ids read
        here (the page table may still be written by an earlier kernel) address prefetches
        only, never a value this kernel computes with: every read that counts is made again
        after the wait. A stale or garbage id is clamped into the cache (0 .. pages - 1): the
        prefetch reads some page of it, in bounds, and L2 is the device's point of coherence,
        so a prefetched line never hides a later write. Without PDL (no wait) it runs first
        all the same."""
        b, split, head_block = where
        width = mPT.shape[1] * page_size
        per = cutlass.max(per_split, cute.ceil_div(width, cute.arch.grid_dim()[0]))
        t0 = split * per
        t1 = cutlass.min(t0 + per, width)
        kvh = head_block * self.h // group
        tokens = (self.stages - 1) * TILE
        lines = self.d * mK.element_type.width // 8 // LINE  # a row's: 2 at D 128, 16-bit
        for j in cutlass.range_constexpr(cute.ceil_div(tokens, THREADS)):
            i = tidx + j * THREADS
            token = t0 + i
            if i < tokens and token < t1:
                page = token // page_size
                pid = mPT[b, page]
                if pid >= 0 and pid < mK.shape[0]:
                    slot = token - page * page_size
                    for cache in (mK, mV):
                        row = cache[pid, slot, kvh, None].iterator
                        for n in cutlass.range_constexpr(lines):
                            prefetch_l2(row + n * (LINE * 8 // mK.element_type.width))

    @cute.jit
    def _guess_ids(self, mK, mPT, b, split, per_split, page_size, tidx, ids):
        """The page ids of the first STAGES tiles of split `split` as the page table's width
        would cut it (per the launcher's per_split or width / splits, the kernel's own `per`
        where the sequence fills its table) into `ids`, issued before the sequence's length
        arrives; returns (that per, that t1) for the caller's check. Every token read is below
        the width (an empty guess reads nothing): in bounds whatever the length."""
        width = mPT.shape[1] * page_size
        per = cutlass.max(per_split, cute.ceil_div(width, cute.arch.grid_dim()[0]))
        t0 = split * per
        t1 = cutlass.min(t0 + per, width)
        thr_g = tiled_row_copy(mK.element_type, self.d, THREADS).get_slice(tidx)
        pages = cute.fast_divmod_create_divisor_v2(page_size)
        table = (None, None, None, None, mPT, b, None, pages)  # `_page_ids`' kv, what it reads
        ok = Int32(0)  # an empty guess (a split past the width): nothing read
        if t0 < t1:
            ok = Int32(1)
        for s in cutlass.range_constexpr(self.stages):
            self._page_ids(table, thr_g, t0 + s * TILE, t1, ids[s], pinned=ok)
        return per, t1

    @cute.jit
    def _page_ids(self, kv, thr_g, first, t1, page_ids, pinned=None):
        """The page ids of this thread's rows of the tile at key `first` (tokens clamped to
        t1 - 1, as `_load_tile` clamps them: always a page of the sequence) into page_ids,
        registers read by the tile's `_load_tile` one loop iteration later: the page-table
        reads are off the copies' path (read beside them, ptxas issued them in two or three
        dependent rounds a tile in the speculative kernels, one in decode's: 2026-12-02)."""
        mK, mV, sK, sV, mPT, b, kvh, pages = kv
        crd = thr_g.partition_S(cute.make_identity_tensor((TILE, self.d)))
        for m in cutlass.range_constexpr(cute.size(crd, mode=[1])):
            token = cutlass.min(first + crd[0, m, 0][0], t1 - 1)
            page, _ = divmod(token, pages)
            if const_expr(pinned is not None):
                page_ids[m] = load_pinned(mPT[b, None].iterator + page, pinned)
            else:
                page_ids[m] = mPT[b, page]

    @cute.jit
    def _load_tile(self, kv, gcopy, thr_g, first, t1, stage, page_ids=None):
        """Keys first .. first + TILE - 1 (clamped to t1 - 1: finite, masked later) of K and V
        into pipeline stage `stage`; page_ids: this thread's rows' page ids (`_page_ids`),
        else read here."""
        mK, mV, sK, sV, mPT, b, kvh, page_size = kv
        tKsK = thr_g.partition_D(sK[None, None, stage])
        tVsV = thr_g.partition_D(sV[None, None, stage])
        if const_expr(self.fp8):  # byte rows seen 16-bit; page_size a fast divisor
            crd = thr_g.partition_S(cute.make_identity_tensor((TILE, self.d // 2)))
            for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
                token = cutlass.min(first + crd[0, m, 0][0], t1 - 1)
                page, slot = divmod(token, page_size)
                page_id = mPT[b, page]
                for cache, dst in ((mK, tKsK), (mV, tVsV)):
                    row = self._row16(cache[page_id, slot, kvh, None], sK.element_type)
                    copy_row_async(gcopy, row, self.d // 2, dst[None, m, None], crd[None, m, None])
        else:
            crd = thr_g.partition_S(cute.make_identity_tensor((TILE, self.d)))
            for m in cutlass.range_constexpr(cute.size(tKsK, mode=[1])):
                token = cutlass.min(first + crd[0, m, 0][0], t1 - 1)
                if const_expr(self.page_ahead):  # page_size a fast divisor
                    page, slot = divmod(token, page_size)
                    if const_expr(page_ids is not None):
                        page_id = page_ids[m]
                    else:  # the prologue's tiles
                        page_id = mPT[b, page]
                else:
                    page = token // page_size
                    slot = token - page * page_size
                    page_id = mPT[b, page]
                copy_row_async(gcopy, mK[page_id, slot, kvh, None], self.d, tKsK[None, m, None],
                               crd[None, m, None])  # fmt: skip
                copy_row_async(gcopy, mV[page_id, slot, kvh, None], self.d, tVsV[None, m, None],
                               crd[None, m, None])  # fmt: skip

    def _row16(self, row, dtype):
        """An FP8 cache row (D bytes, 16-byte aligned) seen as D / 2 16-bit elements."""
        ptr = cute.make_ptr(dtype, row.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        return cute.make_tensor(ptr, cute.make_layout(self.d // 2))

    def _fp8_views(self, storage):
        """K's and V's byte tiles of an FP8 cache, 16-bit views (`fp8.byte_tiles`)."""
        layout = fp8.byte_tiles(TILE, self.d, self.stages)
        base = storage.kv.data_ptr()
        return cute.make_tensor(base, layout), cute.make_tensor(base + cute.cosize(layout), layout)

    @cute.jit
    def _load_query_fp8(self, mQ, sQ, tidx, q_off, sq, head0):
        """The query tile of an FP8 cache's pass: as `_load_query`, pair c of a row (dims 2c,
        2c + 1) into pair slot `fp8.q_pair_slots` (K's register order), cp.async of 4
        bytes."""
        atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), mQ.element_type,
            num_bits_per_copy=32,
        )  # fmt: skip
        pairs = self.d // 2
        slots = fp8.q_pair_slots(self.d)
        for j in cutlass.range_constexpr(self.rows * pairs // THREADS):
            p = tidx + j * THREADS
            r = p // pairs
            c = p - r * pairs
            token = r // self.h
            dst = cute.local_tile(sQ[r, None], (2,), (slots(c),))
            if r < self.g and token < sq:
                row = mQ[q_off + token, head0 + r % self.h, None]
                cute.copy(atom, cute.local_tile(row, (2,), (c,)), dst)
            else:
                dst.fill(0.0)

    def _real_rows(self, t: cute.Tensor, mode: int | None = 1) -> cute.Tensor:
        """With G <= 8 a warp's rows 8 .. 15 are padding: of an accumulator seen in WGMMA shape
        ((2, 2, N), M, 1) (mode 1: the row halves) or its (rows, cols) coordinates ((2, M),
        cols) (mode 0) or a per-row tensor (2,) (None), the first row half alone; else t."""
        if self.g > 8:
            return t
        lay = t.layout
        if mode is None:
            return cute.make_tensor(t.iterator, cute.make_layout(1))
        shape, stride = list(lay.shape), list(lay.stride)
        if mode == 1:
            shape[0] = (shape[0][0], 1, shape[0][2])
        else:
            shape[0] = (1, shape[0][1])
        return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))

    @cute.jit
    def _mask(self, s, coords, limits, first_key):
        """-inf on the scores of keys at or past their row's limit."""
        v = rows_cols(s)
        for r in cutlass.range_constexpr(cute.size(v, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(v, mode=[1])):
                if first_key + coords[r, c][1] >= limits[r]:
                    v[r, c] = -Float32.inf

    def _merge_views(self, storage):
        """(max, sum, O) of every warp's rows in shared memory: m, lsum (WARPS, G) fp32 and O
        (WARPS, G, D) fp32 over the K pipeline's buffer (16-bit: >= 2 stages of TILE x D x 2
        bytes; with 32 rows K's and V's, >= 4 stages) or K's and V's (FP8: 2 x >= 3 stages of
        TILE x D bytes), WARPS x rows x D x 4 bytes."""
        sm = storage.m.get_tensor(cute.make_layout((WARPS, self.rows)))
        sl = storage.lsum.get_tensor(cute.make_layout((WARPS, self.rows)))
        merge = storage.kv if const_expr(self.fp8) else storage.k
        o_ptr = cute.recast_ptr(merge.data_ptr(), dtype=Float32)
        so = cute.make_tensor(o_ptr, cute.make_layout((WARPS, self.rows, self.d), stride=(
            self.rows * self.d, self.d, 1)))  # fmt: skip
        return sm, sl, so

    @cute.jit
    def _stage_warp(self, storage, o_wide, row_max, row_sum, scale_log2, thr_mma, warp_idx):
        """This warp's rows < G: max (log2 units, -inf if no key), sum (over the quad) and the
        unnormalized O into `_merge_views`."""
        sm, sl, so = self._merge_views(storage)
        if const_expr(self.fp8):  # O's registers hold permuted columns (fp8.o_columns)
            so = cute.make_tensor(so.iterator, cute.make_layout(
                (WARPS, self.rows, fp8.o_columns(self.d).shape),
                stride=(self.rows * self.d, self.d, fp8.o_columns(self.d).stride)))  # fmt: skip
        crd = rows_cols(
            as_wide_acc(thr_mma.partition_C(cute.make_identity_tensor((self.rows, self.d))))
        )
        o = rows_cols(o_wide)
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            row = crd[r, 0][0]
            if row < self.g:
                if lane % 4 == 0:
                    m = row_max[r] * scale_log2
                    if row_max[r] == -Float32.inf:
                        m = -Float32.inf
                    sm[warp_idx, row] = m
                    sl[warp_idx, row] = total
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    so[warp_idx, row, crd[r, c][1]] = o[r, c]
