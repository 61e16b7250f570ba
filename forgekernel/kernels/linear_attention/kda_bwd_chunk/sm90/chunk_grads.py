"""Kimi Delta Attention backward, kernel 2: pass 3's output side for Hopper (sm_90a). TMA +
WGMMA, one CTA per (chunk, value head, sequence), every chunk at once (reference/kda_bwd.py
`_output_grads`, its per-channel dG reverse-cumsummed within the chunk; the CPU model is
`reference.kda_bwd_chunk`, whose docstring has the math).

Per chunk of C = 64 tokens (q scaled; G (C, K) the within-chunk cumulative log decay per key
channel; four sub-chunks of 16 rows, warp w of a math warpgroup holds sub-chunk w's rows, with
reference points r_I = G at row 16 I + 8 clamped inside T; h the state at the chunk's start, dh
the state gradient at its end):

    dw  = -dU h^T                      (C x K x V)  SS, tile dtype; out at once
    dqe = dO h^T,  S = dO U^T          (C x K x V), (C x C x V)  SS, tile dtype
    dP  = S, j < i, rows inside T      its diagonal dP_ii kept in fp32; dP^T to shared memory
                                       (transposed stmatrix), dP to a register A operand, bf16
    (k er), (q el)                     bf16 (C, K) B operands formed on chip, over dU's and
                                       dO's bytes (their products done)
    dq  = el o (e^(r_w) o dqe + sum_(J <= w) E_(w,J) o (dP[:, J] (k er)[J]))  + dP_ii k_i
                                       four 64 x 64 x 16 WGMMAs a warpgroup (A = dP's k-block J),
                                       each scaled per column by E_(w,J) = e^(r_w - r_J) <= 1
    dke = U dh^T                       (C x K x V)  SS, tile dtype
    dk  = er o (e^(G_C - r_w) o dke + sum_(I >= w) E_(I,w) o (dP^T[:, I] (q el)[I])) + dP_jj q_j
                                       four 64 x 64 x 16 WGMMAs a warpgroup (A = dP^T's k-block I)
    dG rows = q o dq - k o dk          without the diagonal's terms (they cancel exactly; in
                                       16-bit operands they would not: reference docstring)
    te  = sum_rows k o dke o e^(G_C - G)   quad shuffles, four warps' partials in a table
    dG  = reverse cumsum of the rows + te + e^(G_C) o rowsum(h o dh), one key channel a thread

el = e^(G - r_w), er = e^(r_w - G) <= e^(8 max|g|) (zero past T); no factor is e^(-G). The
block products run in bf16 for either tile dtype (er overflows fp16 at g = -5 a step, as in the
forward's first pass).

Two math warpgroups split by key channels (2026-12-06: 2.24x the one-math-warpgroup kernel of
256 threads it replaced, 3.584 -> 1.597 ms at 4 x 8192 HV16 on the H100, bit for bit its outputs;
docs/linear_attention/NOTES.md "KDA kernel 2 on two math warpgroups, built", "next/lin-losers"):
math warpgroup kh (warpgroups 1, 2 -> kh = 0, 1) owns key channels [64 kh, 64 kh + 64) of dw,
dqe, dq, dke, dk and dG: every product is (C, 64) (B the rows [64 kh, +64) of h / dh, the columns
[64 kh, +64) of (k er) / (q el): whole 8 KB SW128 atom columns, 1,024-byte aligned), and the
per-channel SIMT (tables, block operands, te, the dG rows and their reverse cumsum) is done on
its own 64 channels, 2 threads a channel where it is per channel. S = dO U^T (C x C, reduced
over V) is computed by both (8 m64n64k16 each, no exchange); warpgroup 1 alone writes dP^T and
dP's diagonal.

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: 137-139 registers a thread, under the
launch's 168): warpgroup 0, warp 0: the chunk's 7 TMA tiles, all issued at once on five
mbarriers armed once (no ring: one chunk a CTA), one a load group in the order the math consumes
them (config.LOAD_GROUPS: dU + h, dO, U, q + k, dh; Gated DeltaNet's `_load_groups`); warps 1,
2: rowsum(h o dh) per key channel from the 16-bit state tiles (named barrier BAR_HDH hands it,
and h's bytes for dG's rows, to the math warpgroups); warpgroups 1, 2: everything else, 64 token
rows, each load group waited just before its first product. G (C, K) fp32 is read by the math
warpgroups from global into shared memory (padded rows, `_gi`) while the boxes land.

Named barriers: BAR_HDH (320: both math warpgroups and the <h, dh> warps; every dq block of both
retired before dG's rows overwrite (k er)'s and h's bytes), BAR_BOTH (256: both math warpgroups'
dO / dU products retired and dP^T / dP_ii stored before (k er) / (q el) overwrite dU / dO),
BAR_WG + kh (128: warpgroup-local: G's rows, the tables, the block operands, dG's rows and te's
partials).

Constraints: K = V = 128, 16-bit tiles with unit last strides and 16-byte aligned outer strides
(TMA); G and the fp32 outputs (B, T, HV, K) unit last strides.
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
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import (
    GdnBwdChunkSm90,
    _kvchb,
    _tdhb,
    _token_rows,
)
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.config import STATE_TILES
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.config import (
    CHUNK,
    HDH_WARPS,
    LOAD_GROUPS,
    NS,
    SUB,
    THREADS,
)

PRODUCER_WARP = 0
QUAD = 4
# Ids from FIRST_FREE + 1: FIRST_FREE was the 256-thread kernel's math barrier (deleted
# 2026-12-06); these are the ids the H100's A/B and sanitizers ran (and the WY kernel's follow).
BAR_HDH = FIRST_FREE + 1  # the <h, dh> warps (arrive) -> both math warpgroups: rowsum(h o dh)
BAR_BOTH = BAR_HDH + 1  # both math warpgroups (256)
BAR_WG = BAR_HDH + 2  # + kh: one math warpgroup (128)
HDH_THREADS = HDH_WARPS * WARP_SIZE
MATH_THREADS = 2 * THREADS_PER_WG
PAIRS = NS * (NS - 1) // 2  # E_(I, J) of I > J
G_STRIDE = 128 + 8  # the fp32 (C, K) tiles' padded rows (`_gi`)


def _tiled_mma(dtype, b_major: OperandMajorMode, n: int, rmem: bool = False) -> cute.TiledMma:
    """One math warpgroup's (C, n) WGMMA: `dtype` operands, fp32 accumulator, A K-major from
    shared memory (from registers with `rmem`)."""
    source = warpgroup.OperandSource.RMEM if rmem else warpgroup.OperandSource.SMEM
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, b_major, Float32,
                                             (1, 1, 1), (CHUNK, n), a_source=source)  # fmt: skip


class _GroupWaits:
    """Trace-time bookkeeping of the load groups' mbarriers (armed once, phase 0): calling it
    with tile names waits on each group holding one of them that this thread has not waited on
    yet, so the math names what a product reads and LOAD_GROUPS alone decides the waits."""

    def __init__(self, bars, groups):
        self.bars, self.groups, self.done = bars, groups, set()

    def __call__(self, *names):
        for i, group in enumerate(self.groups):
            if i not in self.done and any(n in group for n in names):
                cute.arch.mbarrier_wait(self.bars + i, 0)
                self.done.add(i)


class KdaBwdChunkSm90(GdnBwdChunkSm90):
    """One CTA per (chunk, value head, sequence): `_output_grads` of the chunk with KDA's
    per-channel decays on two math warpgroups split by key channels; see the module docstring.
    Gated DeltaNet's kernel 2's grouped TMA loads (`_load_groups`) and its bounded row stores
    and adds (`_store_rows`, `_add_rows`, on this class's `_out_rows`) are used as they are."""

    load_groups = LOAD_GROUPS
    threads = THREADS

    def __init__(self, k: int, v: int, token_rows: bool = False):
        super().__init__(k, v, wy=False)
        self.token_rows = token_rows  # dq, dk, dG at the per-slot tables' rows (`_token_rows`)
        # the per-channel fp32 tables, (rows of K floats): r_I, e^(r_I), e^(G_C - r_J), E_(I, J)
        # (I > J), te's warp partials, rowsum(h o dh); then dP's diagonal (C floats)
        self.t_r, self.t_er, self.t_gr = 0, NS, 2 * NS
        self.t_e, self.t_te = 3 * NS, 3 * NS + PAIRS
        self.t_hdh = 4 * NS + PAIRS
        self.table = (4 * NS + PAIRS + 1) * k + CHUNK
        self.t_diag = self.table - CHUNK  # dP's diagonal (subclasses append after the table)
        self.half = k // 2  # a math warpgroup's key channels

    def _setup(self):
        """The tiled MMAs and shared layouts, the tiles' dtype known. mma_s, mma_q, mma_k and
        the token, P and block-operand layouts are the WY kernel's too (its dA, dx's and dy's
        blocks have their shapes); mma_w and the states' layout are kernel 2's own."""
        dt, bf = self.dtype, BFloat16
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        # dqe, dke, dw: (C, 64) reduced over V, both operands K-major in shared memory
        self.mma_w = _tiled_mma(dt, k_major, self.half)
        # S = dO U^T (WY: dA = dvb u^T + dkb w^T): (C, C) reduced over V (WY: V + K), both
        # operands K-major in shared memory, whole in each math warpgroup
        self.mma_s = _tiled_mma(dt, k_major, CHUNK)
        # dq's blocks (WY: dx's): A = dP (dA) from registers, bf16, B = (k er)'s transposed
        # (MN-major) view's half
        self.mma_q = _tiled_mma(bf, mn_major, self.half, rmem=True)
        # dk's blocks (WY: dy's): A = dP^T ((beta dA)^T) from shared memory (K-major), B = (q el)'s
        # ((k el)'s) transposed view's half
        self.mma_k = _tiled_mma(bf, mn_major, self.half)
        row = LayoutEnum.ROW_MAJOR
        self.sT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.v), dt, 1)
        self.sH_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, self.k, self.v), dt, 1)
        self.sP_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), bf, 1)
        self.sB_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), bf, 1)

    @cute.jit
    def __call__(
        self,
        mDO: cute.Tensor,
        mU: cute.Tensor,
        mDU: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mH: cute.Tensor,
        mDH: cute.Tensor,
        mG: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDW: cute.Tensor,
        mDG: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mDO, mU, mDU (B, T, HV, V), mQ (scaled; UNscaled with `dq16`), mK (B, T, HV, K),
        mH, mDH (B, NC, HV, K, V) 16-bit; mG fp32 (B, T, HV, K); outputs (B, T, HV, K) fp32:
        mDQ, mDK, mDG (dG, the reverse cumsum within the chunk done); mDW fp32 or the tiles'
        16-bit dtype (`dw16`: the WY kernel's operand, rounded once here by `_store_rows`).
        mDQ in the tiles' 16-bit dtype (`dq16`): q read unscaled, `scale` (the op's q scale)
        applied in registers to every product of q ((q el), dP_jj q_j, q o dq) and to dq
        before its one rounding: dq = scale dL/d(q scale), the op's dq itself; fp32 dq
        ignores `scale` (q comes scaled). `token_rows`: mStarts, mLens int32 (NC,) the per-slot
        tables: dq, dk, dG (B, T', ...) written at token mStarts[c] + row for row < mLens[c]
        (Gated DeltaNet kernel 2's `token_rows`), dw and the inputs at the slots; else None."""
        if const_expr(self.token_rows != (mStarts is not None)):
            raise TypeError("mStarts, mLens: given with token_rows, and only then")
        if const_expr(mDW.element_type != Float32 and mDW.element_type != mDO.element_type):
            raise TypeError(f"dw must be fp32 or the tiles' dtype, got {mDW.element_type}")
        if const_expr(mDQ.element_type != Float32 and mDQ.element_type != mDO.element_type):
            raise TypeError(f"dq must be fp32 or the tiles' dtype, got {mDQ.element_type}")
        self.dtype = mDO.element_type
        for t in (mU, mDU, mQ, mK, mH, mDH):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        sH_tile = cute.slice_(self.sH_layout, (None, None, 0))
        tmas = []
        for m, d in ((mDO, self.v), (mU, self.v), (mDU, self.v), (mQ, self.k), (mK, self.k)):
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d)))
        for m in (mH, mDH):
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _kvchb(m), sH_tile, (self.k, self.v)))
        # the bytes each load group's mbarrier expects (`_load_groups`)
        t_bytes, h_bytes = (cute.size_in_bytes(self.dtype, t) for t in (sT_tile, sH_tile))
        self.group_bytes = tuple(
            sum(h_bytes if t in STATE_TILES else t_bytes for t in group) for group in LOAD_GROUPS
        )
        t_elems = cute.cosize(self.sT_layout)
        h_elems = cute.cosize(self.sH_layout)
        p_elems = cute.cosize(self.sP_layout)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, len(LOAD_GROUPS)]
            sTab: cute.struct.Align[cute.struct.MemRange[Float32, self.table], 16]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * G_STRIDE], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sDU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sDH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, p_elems], 1024]

        self.shared_storage = SharedStorage
        atoms_and_views = [x for atom_view in tmas for x in atom_view]
        nc = (mDO.shape[1] + CHUNK - 1) // CHUNK
        mmas = (self.mma_w, self.mma_s, self.mma_q, self.mma_k)
        layouts = (self.sT_layout, self.sH_layout, self.sP_layout, self.sB_layout)
        self.kernel(
            *atoms_and_views, mG, mDQ, mDK, mDW, mDG, mStarts, mLens, scale, *mmas, *layouts
        ).launch(
            grid=(nc, mDO.shape[2], mDO.shape[0]),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_do: cute.CopyAtom,
        mDO4: cute.Tensor,
        tma_u: cute.CopyAtom,
        mU4: cute.Tensor,
        tma_du: cute.CopyAtom,
        mDU4: cute.Tensor,
        tma_q: cute.CopyAtom,
        mQ4: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_h: cute.CopyAtom,
        mH5: cute.Tensor,
        tma_dh: cute.CopyAtom,
        mDH5: cute.Tensor,
        mG: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDW: cute.Tensor,
        mDG: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        mma_w: cute.TiledMma,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        mma_k: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sH_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = (tma_do, tma_u, tma_du, tma_q, tma_k, tma_h, tma_dh)
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
        sDO = smem_tensor(storage.sDO, sT_layout)
        sU = smem_tensor(storage.sU, sT_layout)
        sDU = smem_tensor(storage.sDU, sT_layout)
        sQ = smem_tensor(storage.sQ, sT_layout)
        sK = smem_tensor(storage.sK, sT_layout)
        sH = smem_tensor(storage.sH, sH_layout)
        sDH = smem_tensor(storage.sDH, sH_layout)
        sP = smem_tensor(storage.sP, sP_layout)
        # (k er) over dU's bytes, (q el) over dO's: bf16 whatever the tiles' dtype
        sKr = cute.make_tensor(
            cute.recast_ptr(storage.sDU.data_ptr(), sB_layout.inner, BFloat16), sB_layout.outer
        )
        sQl = cute.make_tensor(
            cute.recast_ptr(storage.sDO.data_ptr(), sB_layout.inner, BFloat16), sB_layout.outer
        )
        flat = cute.make_layout(CHUNK * G_STRIDE)
        sG = storage.sG.get_tensor(flat)
        # dG's rows over (k er)'s and h's bytes (adjacent fields; free once dq's blocks and the
        # <h, dh> warps are done: BAR_HDH)
        sRows = cute.make_tensor(cute.recast_ptr(storage.sDU.data_ptr(), dtype=Float32), flat)
        sTab = storage.sTab.get_tensor(cute.make_layout(self.table))
        init_wait()

        c, hv, b = cute.arch.block_idx()
        seqlen = mDO4.shape[0]
        tables = (mStarts, mLens) if const_expr(self.token_rows) else None
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            if warp_idx == PRODUCER_WARP:
                tiles = {"do": (tma_do, mDO4, sDO, self.v, hv), "u": (tma_u, mU4, sU, self.v, hv),
                         "du": (tma_du, mDU4, sDU, self.v, hv),
                         "q": (tma_q, mQ4, sQ, self.k, hv), "k": (tma_k, mK4, sK, self.k, hv),
                         "h": (tma_h, mH5, sH), "dh": (tma_dh, mDH5, sDH)}  # fmt: skip
                self._load_groups(tiles, bars, c, hv, b)
            elif warp_idx <= HDH_WARPS:
                self._rowsum_hdh(sH, sDH, sTab, bars)
        else:
            self._math(
                mma_w, mma_s, mma_q, mma_k, sDO, sU, sDU, sQ, sK, sH, sDH, sP, sKr, sQl, sG,
                sRows, sTab, mG, mDQ, mDK, mDW, mDG, bars, c, hv, b, seqlen, scale, wg - 1,
                tables,
            )  # fmt: skip

    @cute.jit
    def _rowsum_hdh(self, sH, sDH, sTab, bars):
        """Warps 1, 2 of warpgroup 0: rowsum(h o dh) of key channels tid and tid + 64 over the
        16-bit state tiles, into the table; then BAR_HDH (h's bytes free for dG's rows)."""
        wait = _GroupWaits(bars, LOAD_GROUPS)
        wait("h", "dh")  # the TMA'd states, seen here too
        tid = opaque_tid_x() - WARP_SIZE
        hh, dd = sH[None, None, 0], sDH[None, None, 0]
        for half in cutlass.range_constexpr(2):
            row = tid + half * CHUNK
            part = Float32(0.0)
            for col in cutlass.range(self.v, unroll=8):
                part = part + Float32(hh[row, col]) * Float32(dd[row, col])
            sTab[self.t_hdh * self.k + row] = part
        named_barrier(BAR_HDH, MATH_THREADS + HDH_THREADS).arrive()

    @staticmethod
    def _kh():
        """This math warpgroup's key-channel half (warpgroups 1, 2 -> 0, 1), from the opaque
        thread index (its helpers' coordinates are re-derived per phase, as `_coords`')."""
        return opaque_tid_x() // THREADS_PER_WG - 1

    @cute.jit
    def _coords(self, mma):
        """This thread's coordinates (`softmax.acc_coords`) in its warpgroup's (C, 64)
        accumulator, columns moved to the warpgroup's key channels, from a fresh, opaque thread
        index: the shared-memory reads of G, q and k in each phase then have addresses of their
        own, so the compiler reloads them instead of keeping the values of an earlier phase live
        (it did in the one-warpgroup kernel: 30 of 64 spilled)."""
        t0, row_w, col_w = softmax.acc_coords(mma, opaque_tid_x() % THREADS_PER_WG,
                                              (CHUNK, self.half))  # fmt: skip
        return t0, row_w, col_w + self.half * self._kh()

    def _gi(self, row, col):
        """Index of (row, col) in a flat fp32 (C, K) tile with rows padded to G_STRIDE: an
        accumulator partition's 8 rows x 8 columns a warp reach 2-way bank conflicts at most
        (8-way unpadded; an XOR swizzle kept 32 column offsets live and spilled), a row's
        columns none, and every address is a thread base plus an immediate."""
        return row * G_STRIDE + col

    def _half(self, s_tile, kh):
        """Columns [64 kh, +64) of a staged (C, 128) shared tile, staged: (C, 64, 1)."""
        return cute.local_tile(s_tile, (CHUNK, self.half, 1), (0, kh, 0))

    def _half_t(self, s_tile, kh):
        """The transposed view's rows [64 kh, +64) of a staged (C, 128) shared tile: a B
        operand's half (MN-major), unstaged."""
        return cute.local_tile(transposed(s_tile)[None, None, 0], (self.half, CHUNK), (kh, 0))

    def _half_rows(self, mma, mX, tid, b, hv, c, kh, at=None):
        """This thread's (rows, columns) partition of x[b, tokens of chunk c, hv, channels
        [64 kh, +64)] (B, T, HV, K) global: a math warpgroup's (C, 64) accumulator's place;
        `at` (`_token_rows`): the tokens from at[0] instead."""
        if const_expr(at is None):
            tile = cute.local_tile(mX[b, None, hv, None], (CHUNK, self.half), (c, kh))
        else:
            rows = cute.domain_offset((at[0], 0), mX[b, None, hv, None])
            tile = cute.local_tile(rows, (CHUNK, self.half), (0, kh))
        return rows_cols(mma.get_slice(tid).partition_C(tile))

    def _out_rows(self, mma, mOut, tid, b, hv, c, seqlen, at):
        """Gated DeltaNet's `_out_rows` on this warpgroup's (C, 64) columns of out: its
        `_store_rows` (here) and `_add_rows` (the WY kernel's) store or add this warpgroup's
        (C, 64) accumulator there, the rows inside T; `at` (`_token_rows`): the first at[1]
        rows at the tokens from at[0]."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.half))
        g = self._half_rows(mma, mOut, tid, b, hv, c, self._kh(), at)
        first, bound = c * CHUNK, seqlen
        if const_expr(at is not None):
            first, bound = 0, at[1]
        return g, t0, row_base, first, bound

    @cute.jit
    def _tables(self, mG, sG, sTab, first, seqlen, b, hv, kh):
        """G's columns of this warpgroup's key channels into shared memory (zero past T) and
        the per-channel tables, 2 threads a channel: thread t, channel 64 kh + t % 64, loads
        G's rows [32 (t // 64), +32); after a warpgroup barrier the first of the pair writes r_I
        (G at row 16 I + 8 clamped to the last row inside T), e^(r_I), e^(G_C - r_J), the
        second the six E_(I, J) = e^(r_I - r_J) (I > J) (8 / 6 exps)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        col = tid % self.half + self.half * kh
        part = tid // self.half
        rows = CHUNK // 2
        for n in cutlass.range(rows, unroll=8):
            i = n + rows * part
            g_t = Float32(0.0)
            if first + i < seqlen:
                g_t = mG[b, first + i, hv, col]
            sG[self._gi(i, col)] = g_t
        named_barrier(BAR_WG + kh, THREADS_PER_WG).arrive_and_wait()
        last = cutlass.min(first + CHUNK, seqlen) - 1 - first
        r = [Float32(0.0)] * NS
        for j in cutlass.range_constexpr(NS):
            r[j] = sG[self._gi(cutlass.min(j * SUB + SUB // 2, last), col)]
        if part == 0:
            g_last = sG[self._gi(last, col)]
            for j in cutlass.range_constexpr(NS):
                sTab[(self.t_r + j) * self.k + col] = r[j]
                sTab[(self.t_er + j) * self.k + col] = cute.math.exp(r[j], fastmath=True)
                sTab[(self.t_gr + j) * self.k + col] = cute.math.exp(g_last - r[j], fastmath=True)
        else:
            for i in cutlass.range_constexpr(1, NS):
                for j in cutlass.range_constexpr(i):
                    pair = i * (i - 1) // 2 + j
                    e = cute.math.exp(r[i] - r[j], fastmath=True)
                    sTab[(self.t_e + pair) * self.k + col] = e

    @cute.jit
    def _block_operands(self, sQ, sK, sKr, sQl, sG, sTab, first, seqlen, kh, scale=None):
        """(k er) and (q el) (C, K) bf16 into their tiles on this warpgroup's key channels, zero
        past T (er = e^(r_w - G), el = e^(G - r_w), w the row's sub-chunk); q el times `scale`
        when given (dq16: q read unscaled); 2 threads a channel (rows [32 (t // 64), +32) each)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        col = tid % self.half + self.half * kh
        rows = CHUNK // 2
        base = rows * (tid // self.half)
        qq, kk = sQ[None, None, 0], sK[None, None, 0]
        kr, ql = sKr[None, None, 0], sQl[None, None, 0]
        for n in cutlass.range(rows, unroll=4):
            i = n + base
            a = sG[self._gi(i, col)] - sTab[(self.t_r + i // SUB) * self.k + col]
            el, er = Float32(0.0), Float32(0.0)
            if first + i < seqlen:
                el = cute.math.exp(a, fastmath=True)
                er = cute.math.exp(-a, fastmath=True)
                if const_expr(scale is not None):
                    el = el * scale
            kr[i, col] = BFloat16(Float32(kk[i, col]) * er)
            ql[i, col] = BFloat16(Float32(qq[i, col]) * el)

    @cute.jit
    def _gemm_block(self, tiled_mma, acc, tA, tB):
        """acc = A B over one k-block (16), one commit group, waited."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        cute.gemm(atom, acc, tA, tB, acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def _math(
        self, mma_w, mma_s, mma_q, mma_k, sDO, sU, sDU, sQ, sK, sH, sDH, sP, sKr, sQl, sG, sRows,
        sTab, mG, mDQ, mDK, mDW, mDG, bars, c, hv, b, seqlen, scale, kh, tables=None,
    ):  # fmt: skip
        """Math warpgroup kh's products and per-channel work on key channels [64 kh, +64) (kh
        warp-uniform); S whole in both."""
        qs = scale if const_expr(mDQ.element_type != Float32) else None
        hk = self.half
        wg_w = mma_w.get_slice(0)
        wg_s = mma_s.get_slice(0)
        wg_q = mma_q.get_slice(0)
        wg_k = mma_k.get_slice(0)
        # this warpgroup's B operands: h's / dh's rows, (k er)'s / (q el)'s columns [64 kh, +64)
        # (their transposed views' rows: `_half_t`)
        sHh = cute.local_tile(sH[None, None, 0], (hk, self.v), (kh, 0))
        sDHh = cute.local_tile(sDH[None, None, 0], (hk, self.v), (kh, 0))
        tArDO = wg_w.make_fragment_A(wg_w.partition_A(sDO))
        tArU = wg_w.make_fragment_A(wg_w.partition_A(sU))
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sHh))
        tBrDH = wg_w.make_fragment_B(wg_w.partition_B(sDHh))
        tSrDO = wg_s.make_fragment_A(wg_s.partition_A(sDO))
        tSrU = wg_s.make_fragment_B(wg_s.partition_B(sU))
        tQrP = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
        tQrKr = wg_q.make_fragment_B(wg_q.partition_B(self._half_t(sKr, kh)))
        tKrP = wg_k.make_fragment_A(wg_k.partition_A(sP))
        tKrQl = wg_k.make_fragment_B(wg_k.partition_B(self._half_t(sQl, kh)))
        mine = named_barrier(BAR_WG + kh, THREADS_PER_WG)
        both = named_barrier(BAR_BOTH, MATH_THREADS)
        first = c * CHUNK
        tid = opaque_tid_x() % THREADS_PER_WG
        w = tid // WARP_SIZE  # the warp's sub-chunk
        self._tables(mG, sG, sTab, first, seqlen, b, hv, kh)
        mine.arrive_and_wait()

        wait = _GroupWaits(bars, LOAD_GROUPS)
        # dw = -dU h^T, out at once
        acc = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, hk)), Float32)
        wait("du", "h")
        gemm(mma_w, acc, tArDU[None, None, None, 0], tBrH, True, 0)
        acc.store(-acc.load())
        self._store_rows(acc, mma_w, mDW, tid, b, hv, c, seqlen)
        # dqe = dO h^T, S = dO U^T (S whole in both warpgroups)
        wait("do")
        gemm(mma_w, acc, tArDO[None, None, None, 0], tBrH, True, -1)
        acc_s = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        wait("u")
        gemm(mma_s, acc_s, tSrDO[None, None, None, 0], tSrU[None, None, None, 0], True, 0)
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        t0, row_w, col_w = softmax.acc_coords(mma_w, tid, (CHUNK, hk))
        col_w = col_w + hk * kh
        diag = self.t_diag
        s = rows_cols(acc_s)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                if col == i and kh == 0:
                    sTab[diag + i] = s[r, j]
                if col >= i or first + i >= seqlen:
                    s[r, j] = Float32(0.0)
        if kh == 0:
            self._store_bf16(acc_s, mma_s, sP, True)  # dP^T for both warpgroups' dk blocks
        acc_to_operand_a(acc_s, tQrP)
        both.arrive_and_wait()  # both warpgroups' dO / dU products retired, dP^T stored
        wait("q", "k")
        self._block_operands(sQ, sK, sKr, sQl, sG, sTab, first, seqlen, kh, qs)
        cute.arch.fence_view_async_shared()
        mine.arrive_and_wait()

        # dq = el o (e^(r_w) o dqe + sum_(J <= w) E_(w,J) o blocks) + dP_ii k_i
        qa = rows_cols(acc)
        self._scale_cols(qa, sTab, self.t_er + w, t0, col_w)
        acc_b = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, hk)), Float32)
        ba = rows_cols(acc_b)
        for j in cutlass.range_constexpr(NS):
            self._gemm_block(mma_q, acc_b, tQrP[None, None, j], tQrKr[None, None, j])
            if w == j:
                qa.store(qa.load() + ba.load())
            elif w > j:
                self._add_scaled_cols(qa, ba, sTab, w, j, t0, col_w)
        self._scale_rows_g(qa, mma_w, sG, sTab, w, first, seqlen, True)
        # both warpgroups' dq blocks retired and the <h, dh> warps done: (k er)'s and h's bytes
        # free for dG's rows
        named_barrier(BAR_HDH, MATH_THREADS + HDH_THREADS).arrive_and_wait()
        self._rows_out(qa, mma_w, sQ, sK, sRows, sTab, diag, True, qs)
        self._store_rows(acc, mma_w, mDQ, tid, b, hv, c, seqlen, at=_token_rows(tables, c))

        # dk = er o (e^(G_C - r_w) o dke + sum_(I >= w) E_(I,w) o blocks) + dP_jj q_j
        wait("dh")
        gemm(mma_w, acc, tArU[None, None, None, 0], tBrDH, True, 0)
        self._te(qa, mma_w, sK, sG, sTab, w, first, seqlen)
        self._scale_cols(qa, sTab, self.t_gr + w, t0, col_w)
        for i in cutlass.range_constexpr(NS):
            self._gemm_block(mma_k, acc_b, tKrP[None, None, i, 0], tKrQl[None, None, i])
            if w == i:
                qa.store(qa.load() + ba.load())
            elif w < i:
                self._add_scaled_cols(qa, ba, sTab, i, w, t0, col_w)
        self._scale_rows_g(qa, mma_w, sG, sTab, w, first, seqlen, False)
        self._rows_out(qa, mma_w, sK, sQ, sRows, sTab, diag, False, qs)
        self._store_rows(acc, mma_w, mDK, tid, b, hv, c, seqlen, at=_token_rows(tables, c))
        mine.arrive_and_wait()  # this warpgroup's dG rows and te's partials in shared memory
        if tid < hk:  # one channel a thread (the chain of the one-warpgroup kernel it replaced)
            self._finish_dg(sG, sRows, sTab, mDG, first, seqlen, b, hv, tid + hk * kh,
                            _token_rows(tables, c))  # fmt: skip

    @cute.jit
    def _scale_cols(self, a, sTab, t_row, t0, col_w):
        """a (rows, cols) *= table row t_row's value of each column."""
        for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
            f = sTab[t_row * self.k + col_w + t0[0, j][1]]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, j] = a[r, j] * f

    @cute.jit
    def _add_scaled_cols(self, a, blk, sTab, i, j, t0, col_w):
        """a += E_(i, j) o blk per column (i > j; i, j compile-time or warp-uniform)."""
        pair = i * (i - 1) // 2 + j
        for n in cutlass.range_constexpr(cute.size(a, mode=[1])):
            f = sTab[(self.t_e + pair) * self.k + col_w + t0[0, n][1]]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, n] = a[r, n] + f * blk[r, n]

    @cute.jit
    def _scale_rows_g(self, a, mma, sG, sTab, w, first, seqlen, left: cutlass.Constexpr[bool]):
        """a *= el = e^(G - r_w) (left) or er = e^(r_w - G), zero past T."""
        t0, row_w, col_w = self._coords(mma)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            i = row_w + t0[r, 0][0]
            inside = first + i < seqlen
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                col = col_w + t0[0, j][1]
                x = sG[self._gi(i, col)] - sTab[(self.t_r + w) * self.k + col]
                if const_expr(not left):
                    x = -x
                f = cute.math.exp(x, fastmath=True)
                a[r, j] = a[r, j] * f
                if not inside:
                    a[r, j] = Float32(0.0)

    @cute.jit
    def _te(self, a, mma, sK, sG, sTab, w, first, seqlen):
        """te's partial column sums of this warp: sum over its 16 rows of k o dke o
        e^(G_C - G) (quad rows by butterfly shuffles over lanes 4, 8, 16), into the table."""
        t0, row_w, col_w = self._coords(mma)
        kk = sK[None, None, 0]
        lane = opaque_tid_x() % WARP_SIZE
        last = cutlass.min(first + CHUNK, seqlen) - 1 - first
        for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
            col = col_w + t0[0, j][1]
            g_last = sG[self._gi(last, col)]
            part = Float32(0.0)
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                i = row_w + t0[r, 0][0]
                if first + i < seqlen:
                    f = cute.math.exp(g_last - sG[self._gi(i, col)], fastmath=True)
                    part = part + a[r, j] * f * Float32(kk[i, col])
            for sh in cutlass.range_constexpr(2, 5):
                part = part + cute.arch.shuffle_sync_bfly(part, 1 << sh)
            if lane < QUAD:
                sTab[(self.t_te + w) * self.k + col] = part

    @cute.jit
    def _rows_out(self, a, mma, sX, sY, sRows, sTab, diag, first_half: cutlass.Constexpr[bool],
                  scale=None):  # fmt: skip
        """dG's rows: q o dq (first_half: stored) or -= k o dk (the thread's own earlier
        elements), before the diagonal's term; then a += dP_ii y_i (dq: y = k, dk: y = q; dP_ii
        at table offset `diag`, zero past T: S's rows are masked there). `scale` (dq16: q
        unscaled): dq (first_half) times it first, so q o (scale dq) = (q scale) o dq and dq
        the op's; dP_ii times it (dq's term: scale dq's; dk's: (q scale)_j)."""
        t0, row_w, col_w = self._coords(mma)
        xx, yy = sX[None, None, 0], sY[None, None, 0]
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            i = row_w + t0[r, 0][0]
            d = sTab[diag + i]
            if const_expr(scale is not None):
                d = d * scale
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                col = col_w + t0[0, j][1]
                n = self._gi(i, col)
                if const_expr(first_half and scale is not None):
                    a[r, j] = a[r, j] * scale
                if const_expr(first_half):
                    sRows[n] = Float32(xx[i, col]) * a[r, j]
                else:
                    sRows[n] = sRows[n] - Float32(xx[i, col]) * a[r, j]
                a[r, j] = a[r, j] + d * Float32(yy[i, col])

    @cute.jit
    def _finish_dg(self, sG, sRows, sTab, mDG, first, seqlen, b, hv, tid, at=None):
        """Math thread = key channel c: dG of every token of the chunk, the reverse cumulative
        sum of the rows from the last plus te + e^(G_C) rowsum(h o dh); `at` (`_token_rows`):
        row i at token at[0] + i, i < at[1]."""
        col = tid
        last = cutlass.min(first + CHUNK, seqlen) - 1 - first
        hdh = sTab[self.t_hdh * self.k + col]
        acc = cute.math.exp(sG[self._gi(last, col)], fastmath=True) * hdh
        for j in cutlass.range_constexpr(NS):
            acc = acc + sTab[(self.t_te + j) * self.k + col]
        for n in cutlass.range(CHUNK, unroll=8):
            i = CHUNK - 1 - n
            acc = acc + sRows[self._gi(i, col)]
            if const_expr(at is None):
                if first + i < seqlen:
                    mDG[b, first + i, hv, col] = acc
            else:
                if i < at[1]:
                    mDG[b, at[0] + i, hv, col] = acc

    @cute.jit
    def _store_bf16(self, acc, mma, s_tile, transpose: cutlass.Constexpr[bool]):
        """An accumulator (rows i, columns j), bf16, into the K-major tile s_tile as (j, i)
        (`transpose`: the transposed stmatrix) or (i, j), fenced for the WGMMAs."""
        tid = opaque_tid_x() % THREADS_PER_WG
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose, 4), BFloat16), mma
        )
        thr = r2s.get_slice(tid)
        r_p = cute.make_rmem_tensor(acc.shape, BFloat16)
        r_p.store(acc.load().to(BFloat16))
        dst = s_tile[None, None, 0]
        if const_expr(transpose):
            dst = transposed(dst)
        cute.copy(r2s, thr.retile(r_p), thr.partition_D(dst))
        cute.arch.fence_view_async_shared()
