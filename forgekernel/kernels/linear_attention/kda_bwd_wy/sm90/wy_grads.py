"""Kimi Delta Attention backward, the WY kernel: pass 3's WY half for Hopper (sm_90a). TMA +
WGMMA, one CTA per (chunk, value head, sequence), every chunk at once (reference/kda_bwd.py
`_wy_grads`, its per-channel dG reverse-cumsummed within the chunk; the CPU model is
`reference.kda_bwd_wy`, whose docstring has the math).

Per chunk of C = 64 tokens (T = L^-1 an input tile, row j of a chunk T's column j; dw from
kernel 2, du from kernel 1; G (C, K) the within-chunk cumulative log decay per key channel;
four sub-chunks of 16 rows, warp w of a math warpgroup holds sub-chunk w's rows, reference
points r_I = G at row 16 I + 8 clamped inside T):

    dvb = T^T du                       (C x V x C)  A = T^T K-major, B = du MN-major, tile dtype
    dv  = beta dvb;  rowsum(dvb o v)   out; dvb in the tile dtype over du's bytes
    dkb = T^T dw                       (C x K x C)  as dvb's, over dw's bytes
    dA  = dvb u^T + dkb w^T            (C x C x (V + K))  SS, whole in each math warpgroup
    z   = dkb o k o e^G                dk = beta e^G dkb out, dG's rows = beta z (shared
                                       memory, fp32), rowsum(z)
    dA  = -dA, j < i, rows inside T    to a bf16 register A operand; (beta dA)^T bf16 to shared
                                       memory (transposed stmatrix)
    (k er), (k el)                     bf16 (C, K) B operands formed on chip, over dw's and du's
                                       bytes (their products done)
    dx  = el o sum_(J <= w) E_(w,J) o (dA[:, J] (k er)[J])      four 64 x 64 x 16 WGMMAs
    dy  = er o sum_(I >= w) E_(I,w) o ((beta dA)^T[:, I] (k el)[I])    four more (a warpgroup)
    dbeta = rowsum(dvb o v) + rowsum(z) + rowsum(k o dx)
    dk += beta dx + dy;  dG's rows += k o (beta dx - dy)
    dG  = reverse cumsum of the rows, one key channel a thread

dk and dG are ADDED onto the output tensors' contents (kernel 2's dk and dG, same layout), this
CTA's own rows (2026-12-06; was a plain store and two torch adds after): dk's first term by a
read-modify-write of rows prefetched into L2 at the first load group's wait; dG's rows, reverse-
cumsummed in shared memory, by one bulk reduce-add a row (fp32 add in L2, nothing waited but
the shared memory read). The plain read-modify-write of dG (next/kda-wy-acc) kept each row's
load behind the previous row's store: 64 dependent DRAM round trips a thread, the WY kernel
1.93 -> 3.39 ms on the H100 (docs/linear_attention/NOTES.md "KDA backward regressions of
integration41").

el = e^(G - r_w), er = e^(r_w - G) <= e^(8 max|g|) (zero past T); no factor is e^(-G). The
score-gradient blocks run in bf16 for either tile dtype (kernel 2's reason). The per-channel
tables, (k er) / (k el), the block products and their column scalings, the tiled MMAs and
layouts but T^T's, the half tiles and the half-row places (`_out_rows`) are kernel 2's
(kernels/linear_attention/kda_bwd_chunk/sm90, `KdaBwdChunkSm90`, inherited); Gated DeltaNet's
kernel 2 brings the grouped loads, the tile stores (stmatrix), the bounded row stores and adds
(`_store_rows`, `_add_rows`) and dbeta's store.

Two math warpgroups split by value / key channels (2026-12-06: 1.20x the one-math-warpgroup
kernel of 256 threads it replaced, 2.043 -> 1.706 ms at 4 x 8192 HV16 on the H100, bit for bit
its outputs; docs/linear_attention/NOTES.md "KDA backward WY kernel on two math warpgroups",
"next/lin-losers"): math warpgroup kh (warpgroups 1, 2 -> kh = 0, 1) owns channels [64 kh, 64 kh
+ 64) of dvb, dv, dkb, dk, dx, dy and dG: every product but dA is (C, 64) (B the columns [64 kh,
+64) of du / dw / (k er) / (k el) through their transposed views: whole 8 KB SW128 atom columns,
1,024-byte aligned), and the per-channel SIMT (tables, block operands, the dG rows and their
reverse cumsum) is done on its own 64 channels, 2 threads a channel where kernel 2 does so.

dA = dvb u^T + dkb w^T (C x C) is reduced over all 128 value and key channels: each warpgroup
stores its dvb / dkb halves in the tiles' dtype over the du / dw columns its own products have
read (the rounding of a register A operand), and both then compute the whole dA from shared
memory (16 m64n64k16 each, V's k-blocks then K's). The three row dots of dbeta (over V or K)
keep one summation order over the 128 channels: warpgroup 1 sums its 16 columns a row first and
hands the partials over (shared memory, a named barrier it only arrives at), warpgroup 2
continues from them and stores dbeta.

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: 139-165 registers a thread, under the
launch's 168): warpgroup 0, warp 0: the chunk's 7 TMA tiles (13 64-column boxes), all issued at
once on six mbarriers armed once (no ring: one chunk a CTA), one a load group in the order the
math consumes them (config.LOAD_GROUPS: T^T + du, u, v, dw, w, k; Gated DeltaNet's
`_load_groups`); warpgroups 1, 2: everything else, 64 token rows, each load group waited just
before its first product. G (C, K) fp32 is read by the math warpgroups from global into shared
memory while the boxes land.

Named barriers: BAR_BOTH (256, twice: both halves of dvb and dkb stored before dA's products;
both dA's retired and (beta dA)^T stored before (k er) / (k el) overwrite dw / du's bytes),
BAR_DOTS + slot (256, once each: warpgroup 1 arrives, warpgroup 2 waits), BAR_WG + kh (128:
warpgroup-local: G's rows, the tables, each half's products retired before its bytes are
overwritten, the block operands, dG's rows).

Why a kernel of its own, not kernel 2's `wy` as Gated DeltaNet does: kernel 2 holds 198 KiB of
shared memory (202,752 B); the WY half adds T^T, w, u, v, dw (72 KiB at 16 bits) and dG's rows
stay: 270 KiB, past the 227 KiB a CTA may hold. Alone it needs 195 KiB (199,680 B compiled,
tests/test_kda_bwd_wy_compile.py; config.smem_bytes bounds it at 200,464 B). Run after kernel 2
in one CTA, its tiles over the bytes kernel 2 is done with and dw, k, G reused, the two fit in
222,208 B, and were built so: bit for bit the two launches', but 1.2-1.6x their time on the
H100 (2026-12-07), so deleted (docs/linear_attention/NOTES.md "next/kda-adopt").

Constraints: K = V = 128, 16-bit tiles with unit last strides and 16-byte aligned outer strides
(TMA); beta (B, T, HV), G and the fp32 outputs unit last strides.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.prefetch import bulk_prefetch_l2
from forgekernel.kernels.common.sm90.ptx import bulk_reduce_add_f32, opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import _tdhb, _token_rows
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import (
    BAR_BOTH,
    BAR_WG,
    G_STRIDE,
    MATH_THREADS,
    PRODUCER_WARP,
    QUAD,
    KdaBwdChunkSm90,
    _tiled_mma,
)
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import (
    CHUNK,
    DOTS,
    LOAD_GROUPS,
    NS,
    THREADS,
)

BAR_DOTS = BAR_WG + 2  # + slot: warpgroup 1's row-dot partials to warpgroup 2 (256)


class KdaBwdWySm90(KdaBwdChunkSm90):
    """One CTA per (chunk, value head, sequence): `_wy_grads` of the chunk with KDA's
    per-channel decays on two math warpgroups split by value / key channels; see the module
    docstring. Kernel 2's half coordinates, tables, block operands, block products and dv's
    half-row store are used as they are (its (q el) formed from k: (k el))."""

    load_groups = LOAD_GROUPS
    threads = THREADS

    def __init__(self, k: int, v: int, token_rows: bool = False):
        super().__init__(k, v, token_rows)
        # warpgroup 1's row-dot partials (a slot each: 2 rows x 128 threads) after the tables
        self.t_dots = self.table
        self.table += DOTS * 2 * THREADS_PER_WG

    def _setup(self):
        # kernel 2's: dA on its mma_s, dx's / dy's blocks on mma_q / mma_k, the token, P and
        # block-operand layouts
        super()._setup()
        # dvb, dkb's halves = T^T [du dw]'s: A = T^T (K-major), B the half's transposed
        # (MN-major) view
        self.mma_t = _tiled_mma(self.dtype, OperandMajorMode.MN, self.half)
        row = LayoutEnum.ROW_MAJOR
        self.sTt_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), self.dtype, 1)

    @cute.jit
    def __call__(
        self,
        mDW: cute.Tensor,
        mDU: cute.Tensor,
        mTt: cute.Tensor,
        mW: cute.Tensor,
        mK: cute.Tensor,
        mU: cute.Tensor,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mG: cute.Tensor,
        mDK: cute.Tensor,
        mDV: cute.Tensor,
        mDG: cute.Tensor,
        mDB: cute.Tensor,
        mDKo: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mDW, mW, mK (B, T, HV, K), mDU, mU, mV (B, T, HV, V), mTt (B, T, HV, C) 16-bit;
        mBeta fp32 (B, T, HV), mG fp32 (B, T, HV, K); outputs fp32: mDK, mDG (B, T, HV, K)
        read and written: the WY half's dk and dG (the reverse cumsum within the chunk done)
        ADDED onto what they hold (kernel 2's dk, dG: each CTA reads and writes only its own
        chunk's rows of its value head, grid (NC, HV, B) as kernel 2's, and kernel 2 has
        finished on the stream: no atomics); mDV (B, T, HV, V: fp32, or the tiles' 16-bit
        dtype with `dv16`, rounded once by `_store_rows`), mDB (B, T, HV) written. mDKo (B,
        T, HV, K): fp32 (without `dk16`: mDK itself, unused) or the tiles' 16-bit dtype
        (`dk16`): the final dk (kernel 2's + the WY half) written there, rounded once; mDK
        then holds kernel 2's dk plus the WY half's first two terms (scratch). `token_rows`:
        mStarts, mLens int32 (NC,) the per-slot tables: mDK, mDV, mDG, mDB, mDKo (B, T', ...)
        at token mStarts[c] + row for row < mLens[c] (kernel 2's `token_rows` wrote mDK, mDG
        so), the inputs at the slots; else None."""
        if const_expr(self.token_rows != (mStarts is not None)):
            raise TypeError("mStarts, mLens: given with token_rows, and only then")
        self.dtype = mDW.element_type
        if const_expr(mDKo.element_type != Float32 and mDKo.element_type != self.dtype):
            raise TypeError(f"the final dk must be fp32 or the tiles' dtype, got "
                            f"{mDKo.element_type}")  # fmt: skip
        if const_expr(mDV.element_type != Float32 and mDV.element_type != self.dtype):
            raise TypeError(f"dv must be fp32 or the tiles' dtype, got {mDV.element_type}")
        for t in (mDU, mTt, mW, mK, mU, mV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        sTt_tile = cute.slice_(self.sTt_layout, (None, None, 0))
        dims = (self.k, self.v, self.k, self.k, self.v, self.v)
        tmas = [cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d))
                for m, d in zip((mDW, mDU, mW, mK, mU, mV), dims)]  # fmt: skip
        tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(mTt), sTt_tile, (CHUNK, CHUNK)))
        # the bytes each load group's mbarrier expects (`_load_groups`)
        t_bytes, tt_bytes = (cute.size_in_bytes(self.dtype, t) for t in (sT_tile, sTt_tile))
        self.group_bytes = tuple(
            sum(tt_bytes if t == "tt" else t_bytes for t in group) for group in LOAD_GROUPS
        )
        t_elems = cute.cosize(self.sT_layout)
        tt_elems = cute.cosize(self.sTt_layout)
        p_elems = cute.cosize(self.sP_layout)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, len(LOAD_GROUPS)]
            sTab: cute.struct.Align[cute.struct.MemRange[Float32, self.table], 16]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * G_STRIDE], 1024]
            sRows: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * G_STRIDE], 1024]
            sDW: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sDU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sTt: cute.struct.Align[cute.struct.MemRange[self.dtype, tt_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, p_elems], 1024]

        self.shared_storage = SharedStorage
        atoms_and_views = [x for atom_view in tmas for x in atom_view]
        nc = (mDW.shape[1] + CHUNK - 1) // CHUNK
        mmas = (self.mma_t, self.mma_s, self.mma_q, self.mma_k)  # mma_da, mma_x, mma_y
        layouts = (self.sT_layout, self.sTt_layout, self.sP_layout, self.sB_layout)
        self.kernel(
            *atoms_and_views, mBeta, mG, mDK, mDV, mDG, mDB, mDKo, mStarts, mLens, *mmas, *layouts
        ).launch(  # fmt: skip
            grid=(nc, mDW.shape[2], mDW.shape[0]),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_dw: cute.CopyAtom,
        mDW4: cute.Tensor,
        tma_du: cute.CopyAtom,
        mDU4: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW4: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_u: cute.CopyAtom,
        mU4: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV4: cute.Tensor,
        tma_tt: cute.CopyAtom,
        mTt4: cute.Tensor,
        mBeta: cute.Tensor,
        mG: cute.Tensor,
        mDK: cute.Tensor,
        mDV: cute.Tensor,
        mDG: cute.Tensor,
        mDB: cute.Tensor,
        mDKo: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        mma_t: cute.TiledMma,
        mma_da: cute.TiledMma,
        mma_x: cute.TiledMma,
        mma_y: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sTt_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = (tma_dw, tma_du, tma_w, tma_k, tma_u, tma_v, tma_tt)
        if warp_idx == PRODUCER_WARP:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()  # one mbarrier a load group, armed once (phase 0)
        if warp_idx == PRODUCER_WARP:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(len(LOAD_GROUPS)):
                    cute.arch.mbarrier_init(bars + i, 1)
        init_arrive()
        sDW = smem_tensor(storage.sDW, sT_layout)
        sDU = smem_tensor(storage.sDU, sT_layout)
        sW = smem_tensor(storage.sW, sT_layout)
        sK = smem_tensor(storage.sK, sT_layout)
        sU = smem_tensor(storage.sU, sT_layout)
        sV = smem_tensor(storage.sV, sT_layout)
        sTt = smem_tensor(storage.sTt, sTt_layout)
        sP = smem_tensor(storage.sP, sP_layout)
        # (k er) over dw's bytes, (k el) over du's: bf16 whatever the tiles' dtype
        sKr = cute.make_tensor(
            cute.recast_ptr(storage.sDW.data_ptr(), sB_layout.inner, BFloat16), sB_layout.outer
        )
        sKl = cute.make_tensor(
            cute.recast_ptr(storage.sDU.data_ptr(), sB_layout.inner, BFloat16), sB_layout.outer
        )
        flat = cute.make_layout(CHUNK * G_STRIDE)
        sG = storage.sG.get_tensor(flat)
        sRows = storage.sRows.get_tensor(flat)
        sTab = storage.sTab.get_tensor(cute.make_layout(self.table))
        init_wait()

        c, hv, b = cute.arch.block_idx()
        seqlen = mDW4.shape[0]
        tables = (mStarts, mLens) if const_expr(self.token_rows) else None
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            if warp_idx == PRODUCER_WARP:
                tiles = {"dw": (tma_dw, mDW4, sDW, self.k, hv),
                         "du": (tma_du, mDU4, sDU, self.v, hv),
                         "w": (tma_w, mW4, sW, self.k, hv), "k": (tma_k, mK4, sK, self.k, hv),
                         "u": (tma_u, mU4, sU, self.v, hv), "v": (tma_v, mV4, sV, self.v, hv),
                         "tt": (tma_tt, mTt4, sTt, CHUNK, hv)}  # fmt: skip
                self._load_groups(tiles, bars, c, hv, b)
        else:
            self._math(
                mma_t, mma_da, mma_x, mma_y, sDW, sDU, sW, sK, sU, sV, sTt, sP, sKr, sKl, sG,
                sRows, sTab, mBeta, mG, mDK, mDV, mDG, mDB, mDKo, bars, c, hv, b, seqlen, wg - 1,
                tables,
            )  # fmt: skip

    @cute.jit
    def _math(
        self, mma_t, mma_da, mma_x, mma_y, sDW, sDU, sW, sK, sU, sV, sTt, sP, sKr, sKl, sG,
        sRows, sTab, mBeta, mG, mDK, mDV, mDG, mDB, mDKo, bars, c, hv, b, seqlen, kh,
        tables=None,
    ):  # fmt: skip
        """Math warpgroup kh's products and per-channel work on channels [64 kh, +64) (kh
        warp-uniform); dA whole in both."""
        hk = self.half
        wg_t = mma_t.get_slice(0)
        wg_da = mma_da.get_slice(0)
        wg_x = mma_x.get_slice(0)
        wg_y = mma_y.get_slice(0)
        tArT = wg_t.make_fragment_A(wg_t.partition_A(sTt))
        tBrDU = wg_t.make_fragment_B(wg_t.partition_B(self._half_t(sDU, kh)))
        tBrDW = wg_t.make_fragment_B(wg_t.partition_B(self._half_t(sDW, kh)))
        tDArV = wg_da.make_fragment_A(wg_da.partition_A(sDU))  # dvb, both halves
        tDArB = wg_da.make_fragment_A(wg_da.partition_A(sDW))  # dkb, both halves
        tDBrU = wg_da.make_fragment_B(wg_da.partition_B(sU))
        tDBrW = wg_da.make_fragment_B(wg_da.partition_B(sW))
        tXrA = wg_x.make_fragment_A(wg_x.partition_shape_A((CHUNK, CHUNK)))
        tXrKr = wg_x.make_fragment_B(wg_x.partition_B(self._half_t(sKr, kh)))
        tYrP = wg_y.make_fragment_A(wg_y.partition_A(sP))
        tYrKl = wg_y.make_fragment_B(wg_y.partition_B(self._half_t(sKl, kh)))
        mine = named_barrier(BAR_WG + kh, THREADS_PER_WG)
        both = named_barrier(BAR_BOTH, MATH_THREADS)
        first = c * CHUNK
        tid = opaque_tid_x() % THREADS_PER_WG
        w = tid // WARP_SIZE  # the warp's sub-chunk
        self._tables(mG, sG, sTab, first, seqlen, b, hv, kh)
        t0, row_w, col_w = softmax.acc_coords(mma_t, tid, (CHUNK, hk))
        col_w = col_w + hk * kh
        beta = [Float32(0.0), Float32(0.0)]  # zero past T: every row product there is zero
        for r in cutlass.range_constexpr(2):
            i = first + row_w + t0[r, 0][0]
            if i < seqlen:
                beta[r] = mBeta[b, i, hv]
        mine.arrive_and_wait()

        # dvb's half = T^T du's: over du's half (this warpgroup's reads of it retired), dv out
        acc = cute.make_rmem_tensor(wg_t.partition_shape_C((CHUNK, hk)), Float32)
        cute.arch.mbarrier_wait(bars + 0, 0)  # T^T, du
        if kh == 0:
            self._prefetch_rows(mDK, tid, b, hv, first, seqlen, _token_rows(tables, c))
        gemm(mma_t, acc, tArT[None, None, None, 0], tBrDU, True, 0)
        mine.arrive_and_wait()
        self._store_tile(acc, mma_t, self._half(sDU, kh), False)
        cute.arch.mbarrier_wait(bars + 2, 0)  # v
        dv_dot = self._dots_start(sTab, 0, kh, tid)
        dv_dot = self._dots_end(self._dots_from(acc, mma_t, self._half(sV, kh), tid, dv_dot),
                                sTab, 0, kh, tid)  # fmt: skip
        self._scale_rows(acc, beta)
        self._store_rows(acc, mma_t, mDV, tid, b, hv, c, seqlen, at=_token_rows(tables, c))
        # dkb's half = T^T dw's: over dw's half
        cute.arch.mbarrier_wait(bars + 3, 0)  # dw
        gemm(mma_t, acc, tArT[None, None, None, 0], tBrDW, True, 0)
        mine.arrive_and_wait()
        self._store_tile(acc, mma_t, self._half(sDW, kh), False)
        cute.arch.mbarrier_wait(bars + 1, 0)  # u
        cute.arch.mbarrier_wait(bars + 4, 0)  # w
        both.arrive_and_wait()  # both halves of dvb and dkb in shared memory
        # dA = dvb u^T + dkb w^T, whole in each warpgroup, in flight over z and dk's first term
        acc_a = cute.make_rmem_tensor(wg_da.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(mma_da, acc_a, tDArV[None, None, None, 0], tDBrU[None, None, None, 0], True, -1)
        gemm(mma_da, acc_a, tDArB[None, None, None, 0], tDBrW[None, None, None, 0], False, -1)
        cute.arch.mbarrier_wait(bars + 5, 0)  # k
        z = self._dots_start(sTab, 1, kh, tid)
        z = self._dots_end(self._kb_rows(acc, mma_t, sK, sG, sRows, beta, z), sTab, 1, kh, tid)
        # onto kernel 2's dk (at its token rows with `token_rows`)
        self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen, _token_rows(tables, c))
        warpgroup.wait_group(0)
        t0s, row_s, col_s = softmax.acc_coords(mma_da, tid, (CHUNK, CHUNK))
        s = rows_cols(acc_a)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                s[r, j] = -s[r, j]
                if col >= i or first + i >= seqlen:
                    s[r, j] = Float32(0.0)
        acc_to_operand_a(acc_a, tXrA)
        if kh == 0:
            self._scale_rows(acc_a, beta)
            self._store_bf16(acc_a, mma_da, sP, True)  # (beta dA)^T for both warpgroups' dy
        both.arrive_and_wait()  # both dA's retired (dvb's, dkb's bytes free), (beta dA)^T stored
        self._block_operands(sK, sK, sKr, sKl, sG, sTab, first, seqlen, kh)
        cute.arch.fence_view_async_shared()
        mine.arrive_and_wait()

        # dx = el o sum_(J <= w) E_(w,J) o blocks: rowsum(k o dx) into dbeta, then beta dx
        acc.fill(0.0)
        xa = rows_cols(acc)
        acc_b = cute.make_rmem_tensor(wg_t.partition_shape_C((CHUNK, hk)), Float32)
        ba = rows_cols(acc_b)
        for j in cutlass.range_constexpr(NS):
            self._gemm_block(mma_x, acc_b, tXrA[None, None, j], tXrKr[None, None, j])
            if w == j:
                xa.store(xa.load() + ba.load())
            elif w > j:
                self._add_scaled_cols(xa, ba, sTab, w, j, t0, col_w)
        self._scale_rows_g(xa, mma_t, sG, sTab, w, first, seqlen, True)
        kx = self._dots_start(sTab, 2, kh, tid)
        kx = self._dots_end(self._dots_from(acc, mma_t, self._half(sK, kh), tid, kx), sTab, 2,
                            kh, tid)  # fmt: skip
        dbeta = [dv_dot[r] + z[r] + kx[r] for r in range(2)]  # warpgroup 2's: the row sums
        if kh == 1:
            self._store_vec(dbeta, t0, row_w, tid, mDB, b, hv, first, seqlen,
                            _token_rows(tables, c))  # fmt: skip
        self._scale_rows(acc, beta)
        self._rows_add(xa, mma_t, sK, sRows, True)
        self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen, _token_rows(tables, c))

        # dy = er o sum_(I >= w) E_(I,w) o blocks
        acc.fill(0.0)
        for i in cutlass.range_constexpr(NS):
            self._gemm_block(mma_y, acc_b, tYrP[None, None, i, 0], tYrKl[None, None, i])
            if w == i:
                xa.store(xa.load() + ba.load())
            elif w < i:
                self._add_scaled_cols(xa, ba, sTab, i, w, t0, col_w)
        self._scale_rows_g(xa, mma_t, sG, sTab, w, first, seqlen, False)
        self._rows_add(xa, mma_t, sK, sRows, False)
        if const_expr(mDKo.element_type != Float32):  # dk16: the final dk, rounded once
            self._add_rows_to(acc, mma_t, mDK, mDKo, tid, b, hv, c, seqlen,
                              _token_rows(tables, c))  # fmt: skip
        else:
            self._add_rows(acc, mma_t, mDK, tid, b, hv, c, seqlen, _token_rows(tables, c))
        mine.arrive_and_wait()  # this warpgroup's dG rows in shared memory
        self._finish_rows(sRows, mDG, first, seqlen, b, hv, tid, kh, mine, _token_rows(tables, c))

    @cute.jit
    def _dots_from(self, acc, mma, s_tile, tid, start):
        """This thread's row dots of the (C, 64) accumulator with the 16-bit half tile `s_tile`
        (GDN's `_row_dots` order, its columns), from `start`, not quad reduced."""
        x = cute.make_rmem_tensor(acc.shape, Float32)
        x.store(mma.get_slice(tid).partition_C(s_tile[None, None, 0]).load().to(Float32))
        a, xv = rows_cols(acc), rows_cols(x)
        out = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            part = start[r]
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                part = part + a[r, j] * xv[r, j]
            out[r] = part
        return out

    @cute.jit
    def _dots_start(self, sTab, slot, kh, tid):
        """Where row dot `slot`'s sum starts: zero in warpgroup 1 (its 64 channels come first
        in the sum's order); warpgroup 1's partials in warpgroup 2, once handed over
        (`_dots_end`)."""
        s0, s1 = Float32(0.0), Float32(0.0)
        if kh == 1:
            named_barrier(BAR_DOTS + slot, MATH_THREADS).arrive_and_wait()
            n = self.t_dots + slot * 2 * THREADS_PER_WG + tid
            s0 = sTab[n]
            s1 = sTab[n + THREADS_PER_WG]
        return [s0, s1]

    @cute.jit
    def _dots_end(self, parts, sTab, slot, kh, tid):
        """Warpgroup 1: its partials to warpgroup 2 (stored; the barrier only arrived at: it
        never waits here), zeros returned; warpgroup 2: the row sums (quad reduced)."""
        o0, o1 = Float32(0.0), Float32(0.0)
        if kh == 0:
            n = self.t_dots + slot * 2 * THREADS_PER_WG + tid
            sTab[n] = parts[0]
            sTab[n + THREADS_PER_WG] = parts[1]
            named_barrier(BAR_DOTS + slot, MATH_THREADS).arrive()
        else:
            o0 = cute.arch.warp_reduction_sum(parts[0], threads_in_group=QUAD)
            o1 = cute.arch.warp_reduction_sum(parts[1], threads_in_group=QUAD)
        return [o0, o1]

    @cute.jit
    def _add_rows_to(self, acc, mma, mIn, mOut, tid, b, hv, c, seqlen, at=None):
        """out[b, tokens of chunk c, hv, this warpgroup's 64 columns] = in[...] + a (C, 64)
        accumulator in out's 16-bit dtype, rounded once; the rows inside T (`_add_rows`'
        partition: this thread's own earlier fp32 read-modify-writes of `in`). A row's 8 pairs
        are all loaded before the first store: out may alias in for the compiler, which
        otherwise keeps each load behind the previous pair's store (next/kda-final-outputs: 32
        dependent L2 round trips a thread in the one-warpgroup kernel). `at` as `_add_rows`'."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.half))
        kh = self._kh()
        gi = self._half_rows(mma, mIn, tid, b, hv, c, kh, at)
        go = self._half_rows(mma, mOut, tid, b, hv, c, kh, at)
        first, bound = c * CHUNK, seqlen
        if const_expr(at is not None):
            first, bound = 0, at[1]
        a = rows_cols(acc)
        n = cute.size(a, mode=[1])
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if first + row_base + t0[r, 0][0] < bound:
                x = [gi[r, j] for j in range(n)]
                for j in cutlass.range_constexpr(n):
                    go[r, j] = (x[j] + a[r, j]).to(mOut.element_type)

    @cute.jit
    def _scale_rows(self, acc, vals):
        """acc's rows *= vals (this thread's two rows)."""
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                a[r, j] = a[r, j] * vals[r]

    @cute.jit
    def _kb_rows(self, acc, mma, sK, sG, sRows, beta, start):
        """From dkb (the accumulator): z = dkb o k o e^G; dG's rows = beta z into sRows, acc =
        beta e^G dkb (dk's first term); returns this thread's sums of z over its columns of
        its two rows, from `start` (not quad reduced: `_dots_end`). Rows past T: beta and k
        zero there (TMA's fill), G zero."""
        t0, row_w, col_w = self._coords(mma)
        kk = sK[None, None, 0]
        a = rows_cols(acc)
        out = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            i = row_w + t0[r, 0][0]
            part = start[r]
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                col = col_w + t0[0, j][1]
                n = self._gi(i, col)
                x = a[r, j] * cute.math.exp(sG[n], fastmath=True)
                zz = x * Float32(kk[i, col])
                part = part + zz
                sRows[n] = beta[r] * zz
                a[r, j] = beta[r] * x
            out[r] = part
        return out

    @cute.jit
    def _rows_add(self, a, mma, sK, sRows, plus: cutlass.Constexpr[bool]):
        """dG's rows +=  k o a (plus) or -= k o a: this thread's own elements of `_kb_rows`."""
        t0, row_w, col_w = self._coords(mma)
        kk = sK[None, None, 0]
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            i = row_w + t0[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                col = col_w + t0[0, j][1]
                n = self._gi(i, col)
                if const_expr(plus):
                    sRows[n] = sRows[n] + Float32(kk[i, col]) * a[r, j]
                else:
                    sRows[n] = sRows[n] - Float32(kk[i, col]) * a[r, j]

    @cute.jit
    def _prefetch_rows(self, mX, tid, b, hv, first, seqlen, at=None):
        """Math threads 0..C-1: row `tid` of the chunk in mX (B, T, HV, K) fp32 (K * 4 bytes,
        contiguous) into L2, rows inside T; nothing waits on it. `at` (`_token_rows`): row
        at[0] + tid, tid < at[1]."""
        if tid < CHUNK:
            if const_expr(at is None):
                if first + tid < seqlen:
                    bulk_prefetch_l2(mX[b, first + tid, hv, None].iterator, self.k * 4)
            else:
                if tid < at[1]:
                    bulk_prefetch_l2(mX[b, at[0] + tid, hv, None].iterator, self.k * 4)

    @cute.jit
    def _finish_rows(self, sRows, mDG, first, seqlen, b, hv, tid, kh, mine, at=None):
        """dG on channels [64 kh, +64): thread t < 64 = channel 64 kh + t, the reverse
        cumulative sum of the rows from the last (rows past T zero), written over the rows in
        shared memory; then thread i < C adds row i's half (256 B) onto mDG (kernel 2's dG:
        this CTA's own rows) by one bulk reduce-add (fp32 add in L2, async: no load of kernel
        2's dG here; the plain read-modify-write of next/kda-wy-acc kept each row's load behind
        the previous row's store, 64 dependent DRAM round trips a thread). `at`
        (`_token_rows`): row tid onto token at[0] + tid, tid < at[1]."""
        col = tid + self.half * kh
        if tid < self.half:
            acc = Float32(0.0)
            for n in cutlass.range(CHUNK, unroll=8):
                i = CHUNK - 1 - n
                acc = acc + sRows[self._gi(i, col)]
                sRows[self._gi(i, col)] = acc
        cute.arch.fence_view_async_shared()  # the sums seen by the bulk reduce (async proxy)
        mine.arrive_and_wait()
        if tid < CHUNK:
            src = sRows.iterator + self._gi(tid, self.half * kh)
            if const_expr(at is None):
                if first + tid < seqlen:
                    bulk_reduce_add_f32(mDG[b, first + tid, hv, None].iterator + self.half * kh,
                                        src, self.half * 4)  # fmt: skip
            else:
                if tid < at[1]:
                    bulk_reduce_add_f32(mDG[b, at[0] + tid, hv, None].iterator + self.half * kh,
                                        src, self.half * 4)  # fmt: skip
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sRows read before the exit
