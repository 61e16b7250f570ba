"""Gated DeltaNet backward, kernel 2: pass 3 (the chunk-parallel gradients) for Hopper (sm_90a).
TMA + WGMMA, one CTA per (chunk, value head, sequence), every chunk at once
(reference/delta_rule_bwd.py `_output_grads` and, with `wy`, `_wy_grads`).

Per chunk of C = 64 tokens (q scaled, G the within-chunk cumulative log decay, S0 = h the
state at the chunk's start (K, V), dS = dh the state gradient at its end, U the forward's
corrected values, dU from kernel 1):

    dqe = dO h^T                 (C x K x V)   SS, both K-major
    S   = dO U^T                 (C x C x V)   SS, both K-major
    dPD = S o D                  D_ij = e^(G_i - G_j), j <= i, rows past T zero (registers)
    dq  = dqe e^G + dPD k        (C x K x C)   A = dPD from registers, B = k MN-major
    dke = U dh^T                 (C x K x V)   SS, both K-major
    dk  = dke e^(G_C - G) + dPD^T q            (C x K x C)   A = dPD^T from shared memory
                                               (transposed stmatrix), B = q MN-major
    dw  = -dU h^T                (C x K x V)   SS, both K-major
    dg  = dq.q - dk.k  per row   (the row / column sums of dPD o QK^T and the e^G, e^(G_C - G)
                                  factors' log-derivatives, folded: see the docstring of
                                  `reference.gdn_bwd_chunk`)
    te  = dke.(k e^(G_C - G)) per row   (its chunk sum enters dG at the chunk's last token)

and with `wy` the WY half from dw (16-bit in shared memory; T = L^-1 an input tile, `_wy`):

    [dkb dvb] = T^T [dw du]      (C x K x C) twice, A = T^T, B MN-major
    dv  = beta dvb;  dA = -(dkb w^T + dvb u^T)  (C x C x K) twice, A from registers
    dAe = dA o D (j < i), M = beta dAe;  K K^T  (C x C x K)
    dk += beta e^G dkb + M k + M^T k            (C x K x C) twice
    dbeta = dvb.v + e^G dkb.k + rowsum(dAe o KK^T)
    dg += beta e^G dkb.k + rowsum(M o KK^T) - (M^T k).k

then dG finished (`_finish_dg`): the last token's extra term (te's chunk sum + e^(G_C) <dh, h>,
the 16-bit state tiles) and the reverse cumsum within the chunk. Without `wy` the WY half is
torch's. h and dh arrive as 16-bit (K, V) tiles converted in torch.

Warp roles (2 warpgroups, 256 threads): warpgroup 0, warp 0: the TMA tiles of the chunk (7, 10
with `wy`), all issued at once on five mbarriers armed once (no ring: one chunk a CTA), one a
load group in the order the math consumes them (config.LOAD_GROUPS: dO + h, U, q + k, dh, dU
+ the WY tiles), so that the first products run while the later groups stream in; warps 1,
2: dG's finish, after the math warpgroup's rows (named barrier BAR_FINISH); warpgroup 1: every
product, 64 token rows, each load group waited just before its first product.
Registers: 163 without `wy`, 255 with (no spill: G staged in shared memory, dvb's products
before dkb's, the dG finish off the math warpgroup).

`fsplit` (dqk16 only; NOTES "two math warpgroups or two CTAs a SM?", option A'): 3 warpgroups,
384 threads, setmaxnreg config.FSPLIT_REGS (24 / 224 / 256): warpgroup 0 the TMA warp alone,
the tiles in config.FSPLIT_LOAD_GROUPS (the WY ones first: dU + h, T^T + u, w + k, dO + U, q,
dh); warpgroup 1 (`_math`) the output half (dq, dk's first half stashed in fp32 over sDO + sU,
its dG / te rows in sRed), then dG's finish (`_finish_dg_split`); warpgroup 2 (`_math_wy`) dw =
-dU h^T and `_wy`. They meet at 256-thread bar.syncs only: G staged (BAR_START), the stash
handed over (BAR_HANDOVER: warpgroup 2 adds it to its dk, stores dk, adds its dG rows), the
rows complete (BAR_FINISH, passed twice: `_rows_to_finish`). Same products in the same order:
the outputs bit for bit.

Constraints: K = V = 128, 16-bit tiles with unit last strides and 16-byte aligned outer strides
(TMA); G, beta fp32 (B, T, HV) unit last stride; the fp32 outputs unit last strides.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import (
    acc_to_operand_a,
    rows_cols,
    select,
    transposed,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.common.sm90.unaligned_barrier import unaligned_barrier
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.config import (
    CHUNK,
    FSPLIT_LOAD_GROUPS,
    FSPLIT_REGS,
    FSPLIT_THREADS,
    LOAD_GROUPS,
    STATE_GROUPS,
    STATE_TILES,
    THREADS,
    TOKEN_TILES,
    WY_TILES,
)

PRODUCER_WARP = 0
QUAD = 4
# BAR_FINISH, BAR_START and BAR_HANDOVER are waited on in two roles' code, each role at its own
# bar.sync of one phase: `unaligned_barrier` at every site of theirs (the aligned form's phase
# is one instruction: synccheck aborts the kernel, as it did the fused kernel's DS_READY,
# common/sm90/unaligned_barrier.py). The others: one waiting instruction a phase, `named_barrier`.
BAR_MATH = FIRST_FREE  # the math warpgroup: dPD^T in shared memory before its WGMMA
BAR_FINISH = FIRST_FREE + 1  # math warpgroup -> finish warps (both wait): the rows stashed
BAR_FINISH_WARPS = FIRST_FREE + 2  # the finish warps: <dh, h>'s partials
# `fsplit` (config.FSPLIT_*): the WY warpgroup's own BAR_MATH; both math warpgroups (256): G
# staged (BAR_START), dk's first half and the output rows stashed (BAR_HANDOVER), the WY rows
# added (BAR_FINISH, twice: `_rows_to_finish`)
BAR_MATH_WY = FIRST_FREE + 3
BAR_START = FIRST_FREE + 4
BAR_HANDOVER = FIRST_FREE + 5
FINISH_WARPS = 2  # warps 1, 2 of warpgroup 0 (idle otherwise): dG's finish, one token a thread
FINISH_THREADS = FINISH_WARPS * WARP_SIZE
# dqk16: a (C, K) fp32 accumulator, C * K / 128 values a thread, half over each of sDO, sU
STASH_COLS = CHUNK * 128 // THREADS_PER_WG // 2


def _new_groups(groups, steps) -> tuple:
    """For each step (a tuple of tile names, in the order a warpgroup reaches them) the load
    groups (indices into `groups`) holding its tiles not waited on at an earlier step."""
    seen, out = set(), []
    for names in steps:
        new = sorted({i for i, g in enumerate(groups) for n in names if n in g} - seen)
        seen.update(new)
        out.append(tuple(new))
    return tuple(out)


def _rows_to_finish() -> None:
    """`fsplit`: the WY rows (warpgroup 2's sRed read-modify-writes after BAR_HANDOVER) to the
    finish's loads (warpgroup 1): BAR_FINISH (256) passed twice by both math warpgroups. One
    bar.sync orders them on the hardware, but racecheck flagged sRed[0] (H100, 2026-12-06,
    mix5-t323-h2-hv4 block (2,0,0): thread 256's store +0xaa50, thread 128's load +0x12c80):
    both threads at 4 waits since bar 0 there (racecheck's rule: a load is ordered after
    another thread's store if its thread has waited at more bar.syncs, or, it seems, once the
    storing thread is seen past a later one, which a load right after the barrier can outrun
    where warpgroup 2 arrived first: a last chunk of 2 rows, its tail nearly empty). With the
    second wait the loads come at 5 waits after stores at 4, and after the storing thread has
    passed a wait (docs/linear_attention/NOTES.md "GDN fsplit race"). Cost: one bar.sync a CTA
    that completes at once (both warpgroups leave the first together)."""
    finish = unaligned_barrier(BAR_FINISH, 2 * THREADS_PER_WG)
    finish.arrive_and_wait()
    finish.arrive_and_wait()


# the output half's steps: dqe = dO h^T; S = dO U^T; dq += dPD k (and dq.q); dke = U dh^T; dw
OUTPUT_STEPS = (("do", "h"), ("u",), ("q", "k"), ("dh",), ("du", *WY_TILES))
# `fsplit`'s WY warpgroup: dw = -dU h^T; dvb = T^T du, dA = -dvb u^T; dkb = T^T dw, dkb w^T, k
WY_STEPS = (("du", "h"), ("tt", "uw"), ("w", "k"))


def _token_rows(tables, c):
    """`token_rows`: (first token, valid rows) of chunk c's outputs, read from the per-slot
    tables (mStarts, mLens) at each store group: not held across the products (the fsplit WY
    warpgroup runs at 256 registers, the 256-thread wy key at 254); None without tables: the
    chunk's own rows."""
    return None if tables is None else (tables[0][c], tables[1][c])


def _tdhb(t: cute.Tensor) -> cute.Tensor:
    """(B, T, H, D) as (T, D, H, B): the TMA view, the chunk's tokens and columns leading."""
    return select(t, [1, 3, 2, 0])


def _kvchb(t: cute.Tensor) -> cute.Tensor:
    """(B, NC, H, K, V) as (K, V, NC, H, B)."""
    return select(t, [3, 4, 1, 2, 0])


class GdnBwdChunkSm90:
    """One CTA per (chunk, value head, sequence): `_output_grads` of the chunk; see the module
    docstring."""

    # the TMA tiles' load groups, one mbarrier each (`_load_groups`; subclasses name their own)
    load_groups = LOAD_GROUPS

    def __init__(self, k: int, v: int, *, wy: bool = False, grouped: bool = False,
                 fsplit: bool = False, token_rows: bool = False):  # fmt: skip
        if (k, v) != (128, 128):
            raise ValueError(f"(K, V) must be (128, 128), got {(k, v)}")
        if fsplit and not wy:
            raise ValueError("fsplit needs wy")
        if token_rows and not wy:
            raise ValueError("token_rows needs wy (the op's outputs are the WY form's)")
        self.k, self.v = k, v
        self.wy = wy
        self.grouped = grouped
        self.fsplit = fsplit
        self.token_rows = token_rows
        if fsplit:  # two math warpgroups split by function: the WY tiles first
            self.load_groups = FSPLIT_LOAD_GROUPS

    def _setup(self):
        dt = self.dtype
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # dqe, dke, dw: (C, K) reduced over V, both operands K-major in shared memory
        self.mma_w = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, self.k)
        )
        # S = dO U^T: (C, C) reduced over V
        self.mma_s = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, CHUNK)
        )
        # dq += dPD k: A from registers, B k's transposed (MN-major) view
        self.mma_q = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (CHUNK, self.k), a_source=rmem
        )
        # dk += dPD^T q: A from shared memory (K-major), B q's transposed view
        self.mma_k = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (CHUNK, self.k)
        )
        # dA = -(dkb w^T + dvb u^T): (C, C) reduced over K / V, A from registers
        self.mma_da = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, CHUNK), a_source=rmem
        )
        row = LayoutEnum.ROW_MAJOR
        self.sT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.v), dt, 1)
        self.sH_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, self.k, self.v), dt, 1)
        self.sP_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), dt, 1)

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
        mTt: cute.Tensor | None,
        mW: cute.Tensor | None,
        mUw: cute.Tensor | None,
        mV: cute.Tensor | None,
        mBeta: cute.Tensor | None,
        mDV: cute.Tensor | None,
        mDB: cute.Tensor | None,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mDO, mU, mDU (B, T, HV, V), mQ (scaled), mK (B, T, HV, K), mH, mDH (B, NC, HV, K, V)
        16-bit; mG fp32 (B, T, HV); outputs fp32: mDQ, mDK, mDW (B, T, HV, K), mDG (B, T, HV:
        dG, the reverse cumsum within the chunk done). With wy: mTt (B, T, HV, C) (row j of a
        chunk: column j of T = L^-1), mW (B, T, HV, K), mUw, mV (B, T, HV, V) 16-bit, mBeta
        fp32 (B, T, HV); outputs mDV fp32 (B, T, HV, V), mDB (B, T, HV); mDW None (dw stays on
        chip), mDK and mDG take the WY half's terms too. Without wy: all of these None.
        mDQ, mDK in the tiles' 16-bit dtype (`dqk16`, wy only): rounded once, dq times `scale`
        (the op's q scale where no epilogue follows; else 1); fp32 outputs ignore `scale`.
        `token_rows`: mStarts, mLens int32 (NC,) the per-slot tables of the varlen slot layout
        (ops/_linattn_varlen.py `Slots`): the output rows of chunk c (dq, dk, dg, dv, dbeta: the
        op's token tensors, (B, T', ...) with T' their own token count) at token mStarts[c] +
        row for row < mLens[c]; the inputs stay at the chunk's own rows (the slot layout).
        Otherwise both None."""
        self.dtype = mDO.element_type
        if const_expr(self.token_rows != (mStarts is not None)):
            raise TypeError("mStarts, mLens: given with token_rows, and only then")
        self.dqk16 = mDQ.element_type != Float32
        if const_expr(self.fsplit and not self.dqk16):
            raise TypeError("fsplit needs 16-bit dq / dk (the warpgroups meet at dk's stash)")
        if const_expr(self.dqk16 and (not self.wy or mDK.element_type != self.dtype
                                      or mDQ.element_type != self.dtype)):  # fmt: skip
            raise TypeError("16-bit dq / dk need wy and the tiles' dtype")
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
        sP_tile = cute.slice_(self.sP_layout, (None, None, 0))
        t_bytes = cute.size_in_bytes(self.dtype, sT_tile)
        tile_bytes = dict.fromkeys(TOKEN_TILES + WY_TILES[1:], t_bytes)
        tile_bytes.update(dict.fromkeys(STATE_TILES, cute.size_in_bytes(self.dtype, sH_tile)))
        tile_bytes[WY_TILES[0]] = cute.size_in_bytes(self.dtype, sP_tile)
        # the bytes each load group's mbarrier expects (`_load_groups`)
        self.group_bytes = tuple(
            sum(tile_bytes[t] for t in group if self.wy or t not in WY_TILES)
            for group in self.load_groups
        )
        if const_expr(self.wy):
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(mTt), sP_tile, (CHUNK, CHUNK)))
            for m, d in ((mW, self.k), (mUw, self.v)):
                tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d)))
        else:
            tmas += [(None, None)] * 3
        t_elems = cute.cosize(self.sT_layout)
        h_elems = cute.cosize(self.sH_layout)
        p_elems = cute.cosize(self.sP_layout)
        w_t = t_elems if const_expr(self.wy) else 0
        w_p = p_elems if const_expr(self.wy) else 0

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, len(self.load_groups)]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK + 4], 16]
            sDO: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sDU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sDH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sTt: cute.struct.Align[cute.struct.MemRange[self.dtype, w_p], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[self.dtype, w_t], 1024]
            sUw: cute.struct.Align[cute.struct.MemRange[self.dtype, w_t], 1024]
            sDW: cute.struct.Align[cute.struct.MemRange[self.dtype, w_t], 1024]
            sM: cute.struct.Align[cute.struct.MemRange[self.dtype, w_p], 1024]

        self.shared_storage = SharedStorage
        atoms_and_views = [x for atom_view in tmas for x in atom_view]
        nc = (mDO.shape[1] + CHUNK - 1) // CHUNK
        self.kernel(
            *atoms_and_views, mG, mDQ, mDK, mDW, mDG, mV, mBeta, mDV, mDB, mStarts, mLens, scale,
            self.mma_w,
            self.mma_s, self.mma_q, self.mma_k, self.mma_da, self.sT_layout, self.sH_layout,
            self.sP_layout,
        ).launch(
            grid=(nc, mDO.shape[2], mDO.shape[0]),
            block=[FSPLIT_THREADS if self.fsplit else THREADS, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )  # fmt: skip

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
        tma_tt: cute.CopyAtom | None,
        mTt4: cute.Tensor | None,
        tma_w: cute.CopyAtom | None,
        mW4: cute.Tensor | None,
        tma_uw: cute.CopyAtom | None,
        mUw4: cute.Tensor | None,
        mG: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDW: cute.Tensor | None,
        mDG: cute.Tensor,
        mV: cute.Tensor | None,
        mBeta: cute.Tensor | None,
        mDV: cute.Tensor | None,
        mDB: cute.Tensor | None,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        mma_w: cute.TiledMma,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        mma_k: cute.TiledMma,
        mma_da: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sH_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = (tma_do, tma_u, tma_du, tma_q, tma_k, tma_h, tma_dh)
        if const_expr(self.wy):
            atoms = atoms + (tma_tt, tma_w, tma_uw)
        if warp_idx == PRODUCER_WARP:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()  # one mbarrier a load group, armed once (phase 0)
        if warp_idx == PRODUCER_WARP:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(len(self.load_groups)):
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
        sG = storage.sG.get_tensor(cute.make_layout(CHUNK))
        sRed = storage.sRed.get_tensor(cute.make_layout(2 * CHUNK + 4))
        wy_smem = None
        if const_expr(self.wy):
            wy_smem = (smem_tensor(storage.sTt, sP_layout), smem_tensor(storage.sW, sT_layout),
                       smem_tensor(storage.sUw, sT_layout), smem_tensor(storage.sDW, sT_layout),
                       smem_tensor(storage.sM, sP_layout))  # fmt: skip
        stash = None  # dqk16: dk's first half in fp32 over sDO, sU (free after dk's products)
        if const_expr(self.dqk16):
            stash = tuple(
                cute.make_tensor(cute.recast_ptr(x.data_ptr(), dtype=Float32),
                                 cute.make_layout((THREADS_PER_WG, STASH_COLS),
                                                  stride=(1, THREADS_PER_WG)))
                for x in (storage.sDO, storage.sU)
            )  # fmt: skip
        init_wait()

        c, hv, b = cute.arch.block_idx()
        seqlen = mDO4.shape[0]
        tables = (mStarts, mLens) if const_expr(self.token_rows) else None
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if const_expr(self.fsplit):
            if wg == 0:
                cute.arch.setmaxregister_decrease(FSPLIT_REGS[0])
                if warp_idx == PRODUCER_WARP:
                    self._produce(tma_do, mDO4, sDO, tma_u, mU4, sU, tma_du, mDU4, sDU, tma_q, mQ4,
                                  sQ, tma_k, mK4, sK, tma_h, mH5, sH, tma_dh, mDH5, sDH, tma_tt,
                                  mTt4, tma_w, mW4, tma_uw, mUw4, wy_smem, bars, c, hv,
                                  b)  # fmt: skip
            elif wg == 1:
                cute.arch.setmaxregister_increase(FSPLIT_REGS[1])
                self._math(
                    mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sDU, sQ, sK, sH, sDH, sP,
                    wy_smem, sG, sRed, mG, mDQ, mDK, mDW, mDG, mV, mBeta, mDV, mDB, bars, c, hv,
                    b, seqlen, scale, stash, tables,
                )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(FSPLIT_REGS[2])
                self._math_wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, sH, wy_smem, sG, sRed,
                              mG, mDK, mV, mBeta, mDV, mDB, bars, c, hv, b, seqlen,
                              stash, tables)  # fmt: skip
        elif wg == 0:
            if warp_idx == PRODUCER_WARP:
                hq = hv  # q / k head: hv // (HV / H) when grouped
                if const_expr(self.grouped):
                    hq = hv // (mDO4.shape[2] // mQ4.shape[2])
                tiles = {"do": (tma_do, mDO4, sDO, self.v, hv), "u": (tma_u, mU4, sU, self.v, hv),
                         "du": (tma_du, mDU4, sDU, self.v, hv),
                         "q": (tma_q, mQ4, sQ, self.k, hq), "k": (tma_k, mK4, sK, self.k, hq),
                         "h": (tma_h, mH5, sH), "dh": (tma_dh, mDH5, sDH)}  # fmt: skip
                if const_expr(self.wy):
                    tiles.update({"tt": (tma_tt, mTt4, wy_smem[0], CHUNK, hv),
                                  "w": (tma_w, mW4, wy_smem[1], self.k, hv),
                                  "uw": (tma_uw, mUw4, wy_smem[2], self.v, hv)})  # fmt: skip
                self._load_groups(tiles, bars, c, hv, b)
            elif warp_idx <= FINISH_WARPS:
                self._finish_dg(sH, sDH, sRed, sG, mDG, bars, b, hv, c, seqlen, tables)
        else:
            self._math(
                mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sDU, sQ, sK, sH, sDH, sP, wy_smem,
                sG, sRed, mG, mDQ, mDK, mDW, mDG, mV, mBeta, mDV, mDB, bars, c, hv, b, seqlen,
                scale, stash, tables,
            )  # fmt: skip

    @cute.jit
    def _produce(self, tma_do, mDO4, sDO, tma_u, mU4, sU, tma_du, mDU4, sDU, tma_q, mQ4, sQ,
                 tma_k, mK4, sK, tma_h, mH5, sH, tma_dh, mDH5, sDH, tma_tt, mTt4, tma_w, mW4,
                 tma_uw, mUw4, wy_smem, bars, c, hv, b):  # fmt: skip
        """`fsplit`'s producer warp (the WY tiles always there): the kernel's tiles dict and
        `_load_groups`."""
        hq = hv  # q / k head: hv // (HV / H) when grouped
        if const_expr(self.grouped):
            hq = hv // (mDO4.shape[2] // mQ4.shape[2])
        tiles = {"do": (tma_do, mDO4, sDO, self.v, hv), "u": (tma_u, mU4, sU, self.v, hv),
                 "du": (tma_du, mDU4, sDU, self.v, hv),
                 "q": (tma_q, mQ4, sQ, self.k, hq), "k": (tma_k, mK4, sK, self.k, hq),
                 "h": (tma_h, mH5, sH), "dh": (tma_dh, mDH5, sDH),
                 "tt": (tma_tt, mTt4, wy_smem[0], CHUNK, hv),
                 "w": (tma_w, mW4, wy_smem[1], self.k, hv),
                 "uw": (tma_uw, mUw4, wy_smem[2], self.v, hv)}  # fmt: skip
        self._load_groups(tiles, bars, c, hv, b)

    @cute.jit
    def _math_wy(self, mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, sH, wy_smem, sG, sRed, mG,
                 mDK, mV, mBeta, mDV, mDB, bars, c, hv, b, seqlen, stash, tables):  # fmt: skip
        """`fsplit`'s WY warpgroup (warpgroup 2): dw = -dU h^T into sDW, then `_wy` (its tiles'
        groups waited there), dk = the output warpgroup's stash + the WY terms (after
        BAR_HANDOVER), dG's WY rows onto the stashed rows, then `_rows_to_finish`: the output
        warpgroup finishes dG. The same code, in the same order, as `_math`'s tail: the same
        outputs bit for bit."""
        waits = _new_groups(self.load_groups, WY_STEPS)
        wg_w = mma_w.get_slice(0)
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sH))
        math = named_barrier(BAR_MATH_WY, THREADS_PER_WG)
        first = c * CHUNK
        unaligned_barrier(BAR_START, 2 * THREADS_PER_WG).arrive_and_wait()  # G staged (`_math`)
        tid = opaque_tid_x() % THREADS_PER_WG
        t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
        last = cutlass.min(first + CHUNK, seqlen) - 1
        e_g, _ = self._row_decays(mG, t0, row_w, first, seqlen, b, hv, sG[last - first])
        acc_k = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        for i in cutlass.range_constexpr(len(waits[0])):  # dU, h
            cute.arch.mbarrier_wait(bars + waits[0][i], 0)
        gemm(mma_w, acc_k, tArDU[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
        acc_k.store(-acc_k.load())
        self._store_tile(acc_k, mma_w, wy_smem[3], False)  # dw, 16-bit, for T^T dw
        math.arrive_and_wait()
        self._wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, wy_smem, sG, sRed, mDK, mV,
                 mBeta, mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c, stash,
                 bars, waits, tables)  # fmt: skip
        _rows_to_finish()  # the WY rows on the stash: waits on both sides (racecheck)

    @cute.jit
    def _h_dh_part(self, sH, sDH, tid):
        """dG's finish, thread tid < FINISH_THREADS: its share of <dh, h> on the 16-bit state
        tiles (two columns a thread), before the warp sum."""
        hh, dd = sH[None, None, 0], sDH[None, None, 0]
        part = Float32(0.0)
        for r in cutlass.range(self.k, unroll=8):
            part = part + Float32(hh[r, tid]) * Float32(dd[r, tid])
            part = part + Float32(hh[r, tid + CHUNK]) * Float32(dd[r, tid + CHUNK])
        return part

    @cute.jit
    def _stash_h_dh(self, part, sRed, tid):
        """`_h_dh_part`'s sums, one a warp, into sRed[2 CHUNK + warp] (read by `_dg_rows` after a
        barrier)."""
        part = cute.arch.warp_reduction_sum(part)
        if tid % WARP_SIZE == 0:
            sRed[2 * CHUNK + tid // WARP_SIZE] = part

    @cute.jit
    def _dg_rows(self, sRed, sG, mDG, b, hv, first, seqlen, tid, at=None):
        """dG of token `first + tid` (one a thread): the rows' dg (sRed[:CHUNK]) reverse-summed
        within the chunk, plus the last position's te sum (sRed[CHUNK:2 CHUNK]) and
        e^(G_C) <dh, h> (`_stash_h_dh`'s two warp sums); `at` (`_token_rows`): written at
        token at[0] + tid, tid < at[1], instead."""
        dhh = sRed[2 * CHUNK] + sRed[2 * CHUNK + 1]
        g_last = sG[cutlass.min(first + CHUNK, seqlen) - 1 - first]
        acc = cute.math.exp(g_last, fastmath=True) * dhh
        for j in cutlass.range(CHUNK, unroll=8):
            acc = acc + sRed[CHUNK + j]
            if j >= tid:
                acc = acc + sRed[j]
        if const_expr(at is None):
            if first + tid < seqlen:
                mDG[b, first + tid, hv] = acc
        else:
            if tid < at[1]:
                mDG[b, at[0] + tid, hv] = acc

    @cute.jit
    def _finish_dg_split(self, sH, sDH, sRed, sG, mDG, b, hv, c, seqlen, tid, tables=None):
        """`fsplit`: `_finish_dg` by the output warpgroup's first two warps (tid < 64, the
        same token a thread and the same sums): <dh, h>'s partials while the WY warpgroup
        ends, then `_rows_to_finish` (the WY rows added to sRed), then the reverse cumsum."""
        first = c * CHUNK
        if tid < FINISH_THREADS:
            self._stash_h_dh(self._h_dh_part(sH, sDH, tid), sRed, tid)
        _rows_to_finish()
        if tid < FINISH_THREADS:
            self._dg_rows(sRed, sG, mDG, b, hv, first, seqlen, tid, _token_rows(tables, c))

    @cute.jit
    def _load_groups(self, tiles, bars, c, hv, b):
        """The producer warp, whole: the chunk's TMA boxes, group by group in `load_groups`'
        order (the math warpgroup's), each group on its own mbarrier armed once by the elected
        lane with the group's bytes (`group_bytes`), all in flight together: the first products
        start when their operands land while the later groups still stream in. `tiles`: name
        -> (atom, global, smem) for a (K, V) state of chunk c (STATE_TILES' names), (atom,
        global, smem, columns, head) for the chunk's C token rows."""
        one = cute.make_layout(1)
        for i in cutlass.range_constexpr(len(self.load_groups)):
            bar = bars + i
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.group_bytes[i])
            for name in self.load_groups[i]:
                if const_expr(name in tiles):
                    tile = tiles[name]
                    if const_expr(name in STATE_TILES):  # (K, V) of chunk c
                        atom, m, s = tile
                        g = cute.local_tile(m[None, None, c, hv, b], (self.k, self.v), (0, 0))
                    else:  # the chunk's C token rows
                        atom, m, s, d, head = tile
                        g = cute.local_tile(m[None, None, head, b], (CHUNK, d), (c, 0))
                    ts, tg = cpasync.tma_partition(
                        atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
                    )
                    cute.copy(atom, tg, ts[(None, 0)], tma_bar_ptr=bar)

    @cute.jit
    def _math(
        self, mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sDU, sQ, sK, sH, sDH, sP, wy_smem,
        sG, sRed, mG, mDQ, mDK, mDW, mDG, mV, mBeta, mDV, mDB, bars, c, hv, b, seqlen, scale,
        stash, tables=None,
    ):  # fmt: skip
        wg_w = mma_w.get_slice(0)
        wg_s = mma_s.get_slice(0)
        wg_q = mma_q.get_slice(0)
        wg_k = mma_k.get_slice(0)
        tArDO = wg_w.make_fragment_A(wg_w.partition_A(sDO))
        tArU = wg_w.make_fragment_A(wg_w.partition_A(sU))
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sH))
        tBrDH = wg_w.make_fragment_B(wg_w.partition_B(sDH))
        tSrDO = wg_s.make_fragment_A(wg_s.partition_A(sDO))
        tSrU = wg_s.make_fragment_B(wg_s.partition_B(sU))
        tQrP = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
        tQrK = wg_q.make_fragment_B(wg_q.partition_B(transposed(sK)))
        tKrP = wg_k.make_fragment_A(wg_k.partition_A(sP))
        tKrQ = wg_k.make_fragment_B(wg_k.partition_B(transposed(sQ)))
        math = named_barrier(BAR_MATH, THREADS_PER_WG)
        waits = _new_groups(self.load_groups, OUTPUT_STEPS)
        first = c * CHUNK
        gtid = opaque_tid_x() % THREADS_PER_WG
        if gtid < CHUNK:  # the chunk's G in shared memory (the decay loops' column reads)
            g_t = Float32(0.0)
            if first + gtid < seqlen:
                g_t = mG[b, first + gtid, hv]
            sG[gtid] = g_t
        if const_expr(self.fsplit):  # the WY warpgroup reads G too
            unaligned_barrier(BAR_START, 2 * THREADS_PER_WG).arrive_and_wait()
        else:
            math.arrive_and_wait()

        # each load group's mbarrier waited just before its first product (LOAD_GROUPS)
        acc_q = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        acc_s = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        for i in cutlass.range_constexpr(len(waits[0])):  # dO, h
            cute.arch.mbarrier_wait(bars + waits[0][i], 0)
        gemm(mma_w, acc_q, tArDO[None, None, None, 0], tBrH[None, None, None, 0], True, -1)
        for i in cutlass.range_constexpr(len(waits[1])):  # U (dqe in flight)
            cute.arch.mbarrier_wait(bars + waits[1][i], 0)
        gemm(mma_s, acc_s, tSrDO[None, None, None, 0], tSrU[None, None, None, 0], True, 0)
        tid = opaque_tid_x() % THREADS_PER_WG
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
        last = cutlass.min(first + CHUNK, seqlen) - 1
        g_last = sG[last - first]
        s = rows_cols(acc_s)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            g_i = sG[i]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                d = Float32(0.0)
                if col <= i and first + i < seqlen:
                    d = cute.math.exp(g_i - sG[col], fastmath=True)
                s[r, j] = s[r, j] * d
        self._store_pt(acc_s, mma_s, sP)  # dPD^T for dk's product
        acc_to_operand_a(acc_s, tQrP)
        e_g, e_end = self._row_decays(mG, t0, row_w, first, seqlen, b, hv, g_last)
        qa = rows_cols(acc_q)
        for r in cutlass.range_constexpr(cute.size(qa, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(qa, mode=[1])):
                qa[r, j] = qa[r, j] * e_g[r]
        for i in cutlass.range_constexpr(len(waits[2])):  # q, k
            cute.arch.mbarrier_wait(bars + waits[2][i], 0)
        gemm(mma_q, acc_q, tQrP, tQrK[None, None, None, 0], False, 0)
        dg = self._row_dots(acc_q, mma_w, sQ, tid)
        self._store_rows(acc_q, mma_w, mDQ, tid, b, hv, c, seqlen, scale, _token_rows(tables, c))

        acc_k = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        for i in cutlass.range_constexpr(len(waits[3])):  # dh
            cute.arch.mbarrier_wait(bars + waits[3][i], 0)
        gemm(mma_w, acc_k, tArU[None, None, None, 0], tBrDH[None, None, None, 0], True, 0)
        ka = rows_cols(acc_k)
        for r in cutlass.range_constexpr(cute.size(ka, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(ka, mode=[1])):
                ka[r, j] = ka[r, j] * e_end[r]
        te = self._row_dots(acc_k, mma_w, sK, tid)
        math.arrive_and_wait()  # every thread's dPD^T in shared memory
        gemm(mma_k, acc_k, tKrP[None, None, None, 0], tKrQ[None, None, None, 0], False, 0)
        dk_k = self._row_dots(acc_k, mma_w, sK, tid)
        if const_expr(self.dqk16):  # kept in fp32 for the WY terms: dk rounded once, at the end
            for i in cutlass.range_constexpr(cute.size(acc_k)):
                stash[i // STASH_COLS][tid, i % STASH_COLS] = acc_k[i]
        else:
            self._store_rows(acc_k, mma_w, mDK, tid, b, hv, c, seqlen,
                             at=_token_rows(tables, c))  # fmt: skip
        for r in cutlass.range_constexpr(2):
            dg[r] = dg[r] - dk_k[r]
        self._stash_rows(dg, te, sRed, t0, row_w, tid, first, seqlen)  # frees them for the WY
        if const_expr(self.fsplit):  # dk's first half and the rows to the WY warpgroup
            unaligned_barrier(BAR_HANDOVER, 2 * THREADS_PER_WG).arrive_and_wait()
            self._finish_dg_split(sH, sDH, sRed, sG, mDG, b, hv, c, seqlen, tid, tables)
        else:
            for i in cutlass.range_constexpr(len(waits[4])):  # dU (and T^T, w, u with wy)
                cute.arch.mbarrier_wait(bars + waits[4][i], 0)
            gemm(mma_w, acc_k, tArDU[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
            acc_k.store(-acc_k.load())
            if const_expr(self.wy):
                self._store_tile(acc_k, mma_w, wy_smem[3], False)  # dw, 16-bit, for T^T dw
                math.arrive_and_wait()
                self._wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, wy_smem, sG, sRed, mDK, mV,
                         mBeta, mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c,
                         stash, tables=tables)  # fmt: skip
            else:
                self._store_rows(acc_k, mma_w, mDW, tid, b, hv, c, seqlen)
            # rows stashed: a wait (bar.sync), not bar.arrive. The arrive orders the stores on the
            # hardware already (PTX), but racecheck flagged every sRed[0, C) word of the WY rows'
            # read-modify-write (`_wy`'s tail, after the math warpgroup's last bar.sync) against the
            # finish warps' loads (2026-12-06, 57,024 RAW reports; the `_stash_rows` words, which
            # this warpgroup's later bar.syncs follow, were not). Here the finish warps wait from
            # the start: the 128 threads pass at once (docs/linear_attention/NOTES.md).
            unaligned_barrier(BAR_FINISH, THREADS_PER_WG + FINISH_THREADS).arrive_and_wait()

    @cute.jit
    def _stash_rows(self, dg, te, sRed, t0, row_w, tid, first, seqlen):
        """The rows' dg and te into shared memory (sRed[0, C), [C, 2C)) by the quads' first
        threads, zero past T."""
        if tid % QUAD == 0:
            for r in cutlass.range_constexpr(2):
                i = row_w + t0[r, 0][0]
                row_dg, row_te = Float32(0.0), Float32(0.0)
                if first + i < seqlen:
                    row_dg, row_te = dg[r], te[r]
                sRed[i] = row_dg
                sRed[CHUNK + i] = row_te

    @cute.jit
    def _finish_dg(self, sH, sDH, sRed, sG, mDG, bars, b, hv, c, seqlen, tables=None):
        """Warps 1, 2 of warpgroup 0, once the math warpgroup has stashed the rows: dG of every
        token of the chunk (one a thread): the rows' dg, the last position's term sum(te) +
        e^(G_C) <dh, h> (the 16-bit state tiles, two columns a thread), and the reverse
        cumulative sum within the chunk (G = cumsum(g)). Off the math warpgroup: at 255
        registers there, this tail spilled."""
        unaligned_barrier(BAR_FINISH, THREADS_PER_WG + FINISH_THREADS).arrive_and_wait()
        for i in cutlass.range_constexpr(len(STATE_GROUPS)):  # the TMA'd states, seen here too
            cute.arch.mbarrier_wait(bars + STATE_GROUPS[i], 0)
        tid = opaque_tid_x() - WARP_SIZE
        first = c * CHUNK
        self._stash_h_dh(self._h_dh_part(sH, sDH, tid), sRed, tid)
        named_barrier(BAR_FINISH_WARPS, FINISH_THREADS).arrive_and_wait()
        self._dg_rows(sRed, sG, mDG, b, hv, first, seqlen, tid, _token_rows(tables, c))

    @cute.jit
    def _wy(self, mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, wy_smem, sG, sRed, mDK, mV,
            mBeta, mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c,
            stash=None, bars=None, waits=None, tables=None):  # fmt: skip
        """The WY half (reference `_wy_grads`) from dw in shared memory: [dkb dvb] = T^T [dw du],
        dv = beta dvb, dA = -(dkb w^T + dvb u^T) strictly lower, dAe = dA o D, M = beta dAe,
        dk += beta e^G dkb + M k + M^T k, dbeta = dvb.v + e^G dkb.k + rowsum(dAe o KK^T), dG +=
        beta e^G dkb.k + rowsum(M o KK^T) - colsum(M o KK^T) (the column sums as (M^T k).k)."""
        sTt, sW, sUw, sDW, sM = wy_smem
        tid = opaque_tid_x() % THREADS_PER_WG
        if const_expr(bars is not None):  # `fsplit`: T^T, u (WY_STEPS' groups)
            for i in cutlass.range_constexpr(len(waits[1])):
                cute.arch.mbarrier_wait(bars + waits[1][i], 0)
        wg_k = mma_k.get_slice(0)
        wg_s = mma_s.get_slice(0)
        wg_q = mma_q.get_slice(0)
        wg_da = mma_da.get_slice(0)
        tArT = wg_k.make_fragment_A(wg_k.partition_A(sTt))
        tBrDW = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDW)))
        tBrDU = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDU)))
        shape = wg_k.partition_shape_C((CHUNK, self.k))
        beta = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            i = first + row_w + t0[r, 0][0]
            if i < seqlen:
                beta[r] = mBeta[b, i, hv]
        # dvb = T^T du: dv = beta dvb out, dvb.v, dvb as dA's 16-bit A operand
        acc_v = cute.make_rmem_tensor(shape, Float32)
        gemm(mma_k, acc_v, tArT[None, None, None, 0], tBrDU[None, None, None, 0], True, 0)
        tDArV = wg_da.make_fragment_A(wg_da.partition_shape_A((CHUNK, self.v)))
        acc_to_operand_a(acc_v, tDArV)
        tBrW = wg_da.make_fragment_B(wg_da.partition_B(sW))
        tBrUw = wg_da.make_fragment_B(wg_da.partition_B(sUw))
        acc_a = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(mma_da, acc_a, tDArV, tBrUw[None, None, None, 0], True, -1)
        dbeta = self._row_dots_global(acc_v, mma_k, mV, tid, b, hv, c, seqlen)
        va = rows_cols(acc_v)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(cute.size(va, mode=[1])):
                va[r, j] = va[r, j] * beta[r]
        self._store_rows(acc_v, mma_k, mDV, tid, b, hv, c, seqlen, at=_token_rows(tables, c))
        # dkb = T^T dw: dA's other A operand, then dk's accumulator (beta e^G dkb)
        if const_expr(bars is not None):  # `fsplit`: w, k
            for i in cutlass.range_constexpr(len(waits[2])):
                cute.arch.mbarrier_wait(bars + waits[2][i], 0)
        acc_b = cute.make_rmem_tensor(shape, Float32)
        gemm(mma_k, acc_b, tArT[None, None, None, 0], tBrDW[None, None, None, 0], True, 0)
        tDArB = wg_da.make_fragment_A(wg_da.partition_shape_A((CHUNK, self.k)))
        acc_to_operand_a(acc_b, tDArB)
        gemm(mma_da, acc_a, tDArB, tBrW[None, None, None, 0], False, -1)
        x = self._row_dots(acc_b, mma_k, sK, tid)  # dkb.k
        ba = rows_cols(acc_b)
        for r in cutlass.range_constexpr(2):
            dbeta[r] = dbeta[r] + e_g[r] * x[r]
            for j in cutlass.range_constexpr(cute.size(ba, mode=[1])):
                ba[r, j] = ba[r, j] * (beta[r] * e_g[r])
        warpgroup.wait_group(0)
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrKb = wg_s.make_fragment_B(wg_s.partition_B(sK))
        acc_kk = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(mma_s, acc_kk, tSrK[None, None, None, 0], tSrKb[None, None, None, 0], True, 0)
        # dA strictly lower, D, rows inside T; rowsum(dAe o KK^T); M = beta dAe
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        s, kk = rows_cols(acc_a), rows_cols(acc_kk)
        rkk = [Float32(0.0), Float32(0.0)]
        rmk = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            g_i = sG[i]
            beta_i = Float32(0.0)
            if first + i < seqlen:
                beta_i = mBeta[b, first + i, hv]
            part = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                d = Float32(0.0)
                if col < i and first + i < seqlen:
                    d = -cute.math.exp(g_i - sG[col], fastmath=True)
                s[r, j] = s[r, j] * d
                part = part + s[r, j] * kk[r, j]
            rkk[r] = cute.arch.warp_reduction_sum(part, threads_in_group=QUAD)
            rmk[r] = beta_i * rkk[r]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, j] = s[r, j] * beta_i
        self._store_tile(acc_a, mma_s, sM, True)  # M^T for M^T k
        tQrM = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
        acc_to_operand_a(acc_a, tQrM)
        tQrK = wg_q.make_fragment_B(wg_q.partition_B(transposed(sK)))
        gemm(mma_q, acc_b, tQrM, tQrK[None, None, None, 0], False, 0)
        before = self._row_dots(acc_b, mma_k, sK, tid)
        math.arrive_and_wait()  # every thread's M^T in shared memory
        tKrM = wg_k.make_fragment_A(wg_k.partition_A(sM))
        tKrK = wg_k.make_fragment_B(wg_k.partition_B(transposed(sK)))
        gemm(mma_k, acc_b, tKrM[None, None, None, 0], tKrK[None, None, None, 0], False, 0)
        after = self._row_dots(acc_b, mma_k, sK, tid)
        dg = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            dbeta[r] = dbeta[r] + rkk[r]
            dg[r] = beta[r] * e_g[r] * x[r] + rmk[r] - (after[r] - before[r])
        if const_expr(self.dqk16):  # dk = the stashed first half + the WY terms, rounded once
            if const_expr(self.fsplit):  # the output warpgroup's stash written (both wait)
                unaligned_barrier(BAR_HANDOVER, 2 * THREADS_PER_WG).arrive_and_wait()
                # the rows' coordinates afresh (tid re-read): not live across the products
                # (at 256 registers they spilled)
                tid = opaque_tid_x() % THREADS_PER_WG
                t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
            for i in cutlass.range_constexpr(cute.size(acc_b)):
                acc_b[i] = acc_b[i] + stash[i // STASH_COLS][tid, i % STASH_COLS]
            self._store_rows(acc_b, mma_k, mDK, tid, b, hv, c, seqlen, at=_token_rows(tables, c))
        else:
            self._add_rows(acc_b, mma_k, mDK, tid, b, hv, c, seqlen, _token_rows(tables, c))
        self._store_vec(dbeta, t0, row_w, tid, mDB, b, hv, first, seqlen, _token_rows(tables, c))
        if tid % QUAD == 0:  # dG's WY rows onto this thread's own stash (`_stash_rows`)
            for r in cutlass.range_constexpr(2):
                i = row_w + t0[r, 0][0]
                if first + i < seqlen:
                    sRed[i] = sRed[i] + dg[r]

    @cute.jit
    def _row_decays(self, mG, t0, row_w, first, seqlen, b, hv, g_last):
        """e^G and e^(G_C - G) of this thread's two rows (zero past T)."""
        e_g = [Float32(0.0), Float32(0.0)]
        e_end = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            i = first + row_w + t0[r, 0][0]
            if i < seqlen:
                g_i = mG[b, i, hv]
                e_g[r] = cute.math.exp(g_i, fastmath=True)
                e_end[r] = cute.math.exp(g_last - g_i, fastmath=True)
        return e_g, e_end

    @cute.jit
    def _row_dots(self, acc, mma, s_tile, tid):
        """Row dots of the (C, K) accumulator with the 16-bit (C, K) tile `s_tile` in shared
        memory (read in the accumulator's own partition), summed over the quad."""
        x = cute.make_rmem_tensor(acc.shape, Float32)
        x.store(mma.get_slice(tid).partition_C(s_tile[None, None, 0]).load().to(Float32))
        a, xv = rows_cols(acc), rows_cols(x)
        out = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            part = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                part = part + a[r, j] * xv[r, j]
            out[r] = cute.arch.warp_reduction_sum(part, threads_in_group=QUAD)
        return out

    @cute.jit
    def _store_pt(self, acc_s, mma_s, sP):
        """dPD (rows i, columns j), 16-bit, into sP as dPD^T (j, i) K-major."""
        self._store_tile(acc_s, mma_s, sP, True)

    @cute.jit
    def _store_tile(self, acc, mma, s_tile, transpose: cutlass.Constexpr[bool]):
        """An accumulator (rows i, columns j), 16-bit, into the K-major tile s_tile: as (j, i)
        by the transposed stmatrix (`transpose`) or as (i, j), fenced for the WGMMAs (async
        proxy)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose, 4), self.dtype), mma
        )
        thr = r2s.get_slice(tid)
        r_p = cute.make_rmem_tensor(acc.shape, self.dtype)
        r_p.store(acc.load().to(self.dtype))
        dst = s_tile[None, None, 0]
        if const_expr(transpose):
            dst = transposed(dst)
        cute.copy(r2s, thr.retile(r_p), thr.partition_D(dst))
        cute.arch.fence_view_async_shared()

    @cute.jit
    def _row_dots_global(self, acc, mma, mX, tid, b, hv, c, seqlen):
        """Row dots of the (C, D) accumulator with x[b, tokens of chunk c, hv, :] (16-bit,
        global, the rows inside T), summed over the quad."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.v))
        tile = cute.local_tile(mX[b, None, hv, None], (CHUNK, self.v), (c, 0))
        g = rows_cols(mma.get_slice(tid).partition_C(tile))
        a = rows_cols(acc)
        out = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            part = Float32(0.0)
            if c * CHUNK + row_base + t0[r, 0][0] < seqlen:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    part = part + a[r, j] * Float32(g[r, j])
            out[r] = cute.arch.warp_reduction_sum(part, threads_in_group=QUAD)
        return out

    def _out_rows(self, mma, mOut, tid, b, hv, c, seqlen, at):
        """Where a (C, K) accumulator's rows go, as thread `tid` holds them: (its (rows,
        columns) partition of the (C, K) tile of out[b, :, hv, :], its rows' coordinates t0 and
        row_base (`softmax.acc_coords`), the first row's index for the predicate, the bound):
        the tokens of chunk c, those inside T; or `at` (`_token_rows`) the tokens from at[0],
        the first at[1] rows. The one place `_store_rows` and `_add_rows` differ by kernel:
        KDA's (kda_bwd_chunk) is a math warpgroup's (C, 64) columns."""
        t0, row_base, _ = softmax.acc_coords(mma, tid, (CHUNK, self.k))
        if at is None:
            tile = cute.local_tile(mOut[b, None, hv, None], (CHUNK, self.k), (c, 0))
            first, bound = c * CHUNK, seqlen
        else:
            rows = cute.domain_offset((at[0], 0), mOut[b, None, hv, None])
            tile, first, bound = cute.local_tile(rows, (CHUNK, self.k), (0, 0)), 0, at[1]
        return rows_cols(mma.get_slice(tid).partition_C(tile)), t0, row_base, first, bound

    @cute.jit
    def _add_rows(self, acc, mma, mOut, tid, b, hv, c, seqlen, at=None):
        """out[b, tokens of chunk c, hv, :] += a (C, K) accumulator, the rows inside T (this
        thread's own earlier stores: `_store_rows` with the same partition); `at`: at the
        tokens `_out_rows` names."""
        g, t0, row_base, first, bound = self._out_rows(mma, mOut, tid, b, hv, c, seqlen, at)
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if first + row_base + t0[r, 0][0] < bound:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    g[r, j] = g[r, j] + a[r, j]

    @cute.jit
    def _store_rows(self, acc, mma, mOut, tid, b, hv, c, seqlen, scale=None, at=None):
        """A (C, K) accumulator to out[b, tokens of chunk c, hv, :], the rows inside T; a 16-bit
        out rounded once (times `scale` when given: dqk16's dq); `at`: at the tokens
        `_out_rows` names."""
        g, t0, row_base, first, bound = self._out_rows(mma, mOut, tid, b, hv, c, seqlen, at)
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if first + row_base + t0[r, 0][0] < bound:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    if const_expr(mOut.element_type != Float32 and scale is not None):
                        g[r, j] = (a[r, j] * scale).to(mOut.element_type)
                    elif const_expr(mOut.element_type != Float32):  # dv16, dqk16's dk
                        g[r, j] = a[r, j].to(mOut.element_type)
                    else:
                        g[r, j] = a[r, j]

    @cute.jit
    def _store_vec(self, vals, t0, row_w, tid, mOut, b, hv, first, seqlen, at=None):
        """One value a row (quad-reduced) to out[b, token, hv], by the quad's first thread;
        `at` (`_token_rows`): row i at token at[0] + i, i < at[1]."""
        if tid % QUAD == 0:
            for r in cutlass.range_constexpr(2):
                if const_expr(at is None):
                    i = first + row_w + t0[r, 0][0]
                    if i < seqlen:
                        mOut[b, i, hv] = vals[r]
                else:
                    i = row_w + t0[r, 0][0]
                    if i < at[1]:
                        mOut[b, at[0] + i, hv] = vals[r]
