"""Gated DeltaNet backward, kernel 0: the chunk factors for Hopper (sm_90a). TMA + WGMMA, one
CTA per (chunk, value head, sequence), every chunk at once (reference/gdn_bwd_factors.py is
its CPU model; what kernel 1's two launches and kernel 2 read, formed here instead of by the
batched torch `_Factors` pass).

Per chunk of C = 64 tokens (q scaled and normalized by the caller; value head hv reads q / k
head hv // (HV / H); G = cumsum g within the chunk, G2 = log2(e) G for the forward's masks):

    K K^T -> A = beta_i d_ij (K K^T), j < i       SS, 8 x 64x64x16   (AuxWy._decay_mask)
    T = (I + A)^-1                                fp32 diagonal blocks, tf32 mma.sync merges
                                                  (the forward's inverse.py, inverse_mma.py)
    Q K^T -> P = d_ij (Q K^T), j <= i             SS, 8 x 64x64x16, warpgroup 2 (beside T)
    u = [T diag(beta)] V                          A = 16-bit registers, B = v MN-major,
    W = [T diag(beta e^G)] K                      4 x 64x128x16 each (AuxWy._scale_by_beta)
    Ke = K e^(G_C - G), Qe = Q e^G                the tiles' own rows, in shared memory

Outputs (16-bit, through shared memory by TMA stores; every chunk's 64 rows, the padded ones
zero as the zero-filled loads make them): W, u, P^T, Ke, Qe, T^T at chunk c (kernel 1's
forward launch reads u, W, Ke as they are, in chunk order, its signs in registers); e^(G_C) and
G fp32 by plain stores.

Variant `fused` (compile flag; the op's fused route, ops/gated_delta_rule_bwd.py `_fused_pass`,
FUSED_DIET): no Qe and no Ke tile (mQe, mKe None: no shared-memory boxes, no scaling, no
stores): the fused kernel folds both decays in registers, Qe into its state warpgroup's A
operand, and kernel 1's forward launch (its `fused` key) reads k and G in place of Ke (32 KB a
chunk-head not written; warpgroup 2's first store group holds P^T alone). Every other output
bit for bit the standard key's. Variant `w_from_t` (compile flag, with fused; ops/
gated_delta_rule_bwd.py FUSED_WFROMT, off): no W and no u either (kernel 1's forward launch and
the fused kernel form both from T^T, their `w_from_t` keys): the T-only form (gdn_t_pre_sm90's
analogue for the backward, P^T beside it): v not loaded (load groups k, q), warpgroup 1 the
gates, A, T and T^T, warpgroup 2 P^T alone (no BAR_T: nothing after the inverse reads T but
T^T's store); writes P^T, T^T, e^(G_C), G: 16 KB of tiles a chunk-head (48 with W, u), and
reads q, k only (v's 16 KB not).

Warp roles (3 warpgroups, 384 threads, no setmaxnreg: under the launch's 168 registers a
thread; NOTES "GDN backward factors kernel on two math warpgroups": 1.06x the one-math-warpgroup
kernel it replaced, bit for bit its outputs, next/fac-losers deleted that one): warpgroup 0,
warp 0: the three TMA loads, all issued at once, each on its own mbarrier armed once
(config.LOAD_GROUPS: k, q, v; Gated DeltaNet's chunk kernel's `_load_groups`; no ring, no empty
barrier: one chunk a CTA). Two math warpgroups split by independent products, each waiting on a
load group just before its first product on it:

    warpgroup 1: the gates (its warp 0: two tokens a lane, a warp scan as the forward's gate
                 warp), K K^T -> A -> T (the inverse), T^T, u = [T diag(beta)] V
    warpgroup 2: Q K^T -> P^T, Ke, Qe (under Q K^T), then W = [T diag(beta e^G)] K from T

T reaches warpgroup 2 through the inverse's fp32 scratch (sW, final after the merges' last
barrier; nothing writes it after): warpgroup 1 arrives at BAR_T, warpgroup 2 waits there and
reads T from sW as warpgroup 1 does. Each math warpgroup issues its own TMA stores (bulk groups
are the issuing thread's: warpgroup 1's first thread T^T, then u; warpgroup 2's P^T, Ke, Qe,
then W) and waits its own groups' shared-memory reads before the exit.

Named barriers: BAR_GATES (256: the gates in shared memory, every math warp waits at one
instruction, warpgroup 1's warp 0 after writing them: so warpgroup 1's four warps reach the
inverse's barriers having waited equally often, which racecheck needs; NOTES "next/fac-race"),
BAR_T (256: warpgroup 1 arrives, warpgroup 2 waits), BAR_INVERSE (warpgroup 1's merges),
BAR_MATH / BAR_MATH2 (128, each warpgroup's own: its tiles written before its stores). Every
phase is waited at one instruction (no unaligned-barrier case).

Constraints: K = V = 128, 16-bit q, k, v with unit last strides and 16-byte aligned outer
strides (TMA), likewise the output tiles; g, beta fp32 (B, T, HV) unit last stride.
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
from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, select, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import GdnBwdChunkSm90
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.config import (
    CHUNK,
    LOAD_GROUPS,
    THREADS,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.aux_wy import AuxWy
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    BLOCK,
    W_STRIDE,
    X_STRIDE,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma

PRODUCER_WARP = 0
BAR_MATH = FIRST_FREE  # warpgroup 1's own (128): its tiles written before its stores
BAR_INVERSE = FIRST_FREE + 1  # warpgroup 1 inside the inverse (its phases)
BAR_T = BAR_INVERSE + 1  # T final in sW: warpgroup 1 arrives, warpgroup 2 waits (256)
BAR_GATES = BAR_INVERSE + 2  # the gates in shared memory: warps 4..11 wait, 4 after writing
BAR_MATH2 = BAR_INVERSE + 3  # warpgroup 2's own (128): its tiles written before its stores
MATH_PAIR = 2 * THREADS_PER_WG
LEADER = (THREADS_PER_WG, 2 * THREADS_PER_WG)  # each math warpgroup's storing thread


def _tdhb(t: cute.Tensor) -> cute.Tensor:
    """(B, T, H, D) as (T, D, H, B): the TMA view, the chunk's tokens and columns leading."""
    return select(t, [1, 3, 2, 0])


class GdnBwdFactorsSm90(AuxWy):
    """One CTA per (chunk, value head, sequence): the chunk's factors; see the module
    docstring. The forward's aux-warpgroup masks (`AuxWy._decay_mask`, `_scale_by_beta`) and
    kernel 2's shared-memory tile store (`_store_tile`) and grouped TMA loads (`_load_groups`)
    are used as they are."""

    _store_tile = GdnBwdChunkSm90._store_tile
    _load_groups = GdnBwdChunkSm90._load_groups
    load_groups = LOAD_GROUPS  # the TMA tiles' load groups, one mbarrier each
    threads = THREADS

    def __init__(self, k: int, v: int, fused: bool = False, w_from_t: bool = False):
        if (k, v) != (128, 128):
            raise ValueError(f"(K, V) must be (128, 128), got {(k, v)}")
        if w_from_t and not fused:
            raise ValueError("w_from_t needs fused")
        self.k, self.v = k, v
        self.fused = fused  # no Qe, no Ke (the module docstring)
        self.w_from_t = w_from_t  # no W, no u, no v load (the module docstring)
        if w_from_t:
            self.load_groups = LOAD_GROUPS[:2]  # k, q
        self.l2norm = False  # q, k arrive normalized (AuxWy's masks read this)

    def _setup(self):
        dt = self.dtype
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # K K^T, Q K^T: (C, C) over K, both operands K-major in shared memory (the forward's)
        self.mma_aux = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, CHUNK)
        )
        # u, W: (C, V / K) over the chunk, A = T diag(.) from registers, B v / k MN-major
        self.mma_rs = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (CHUNK, self.k), a_source=rmem
        )
        row = LayoutEnum.ROW_MAJOR
        self.sT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.v), dt, 1)
        self.sP_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), dt, 1)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mW: cute.Tensor | None,
        mU: cute.Tensor | None,
        mPt: cute.Tensor,
        mKe: cute.Tensor | None,
        mQe: cute.Tensor | None,
        mTt: cute.Tensor,
        mElast: cute.Tensor,
        mBigG: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mQ (scaled, normalized), mK (B, T, H, K), mV (B, T, HV, V) 16-bit; mG, mBeta fp32
        (B, T, HV). Outputs in mQ's dtype, (B, NC C, HV, D): mW, mU, mPt (D = C), mKe, mQe,
        mTt (D = C) at chunk c (`fused`: mKe, mQe None, not written); fp32 mElast (B, NC, HV) =
        e^(G_C), mBigG (B, NC C, HV) = G (`w_from_t`: mW, mU None too)."""
        self.dtype = mQ.element_type
        outs = (mW, mU, mPt, mTt) if const_expr(self.fused) else (mW, mU, mPt, mKe, mQe, mTt)
        if const_expr(self.w_from_t):
            outs = (mPt, mTt)
        for t in (mK, mV, *outs):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        sP_tile = cute.slice_(self.sP_layout, (None, None, 0))
        loads = []
        for m, d in ((mQ, self.k), (mK, self.k), (mV, self.v)):
            loads.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d)))
        stores = []
        for m in (mW, mU, mKe, mQe):
            if const_expr(m is None):  # fused: no Ke, Qe (w_from_t: no W, u)
                stores.append((None, None))
            else:
                stores.append(cpasync.make_tiled_tma_atom(s2g, _tdhb(m), sT_tile, (CHUNK, self.k)))
        for m in (mPt, mTt):
            stores.append(cpasync.make_tiled_tma_atom(s2g, _tdhb(m), sP_tile, (CHUNK, CHUNK)))
        # the bytes each load group's mbarrier expects (`_load_groups`): (C, 128) 16-bit tiles
        t_bytes = cute.size_in_bytes(self.dtype, sT_tile)
        self.group_bytes = tuple(t_bytes * len(group) for group in self.load_groups)
        t_elems = cute.cosize(self.sT_layout)
        wu_elems = 0 if const_expr(self.w_from_t) else t_elems  # v, W, u
        p_elems = cute.cosize(self.sP_layout)
        e_elems = 0 if const_expr(self.fused) else t_elems  # Ke, Qe

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, len(self.load_groups)]
            sG2: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sBetaEg: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * W_STRIDE], 16]
            sX: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BLOCK * X_STRIDE], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, wu_elems], 1024]
            sOw: cute.struct.Align[cute.struct.MemRange[self.dtype, wu_elems], 1024]
            sOu: cute.struct.Align[cute.struct.MemRange[self.dtype, wu_elems], 1024]
            sOke: cute.struct.Align[cute.struct.MemRange[self.dtype, e_elems], 1024]
            sOqe: cute.struct.Align[cute.struct.MemRange[self.dtype, e_elems], 1024]
            sOpt: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sOtt: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]

        self.shared_storage = SharedStorage
        flat = [x for pair in (*loads, *stores) for x in pair]
        nc = (mQ.shape[1] + CHUNK - 1) // CHUNK
        args = (*flat, mG, mBeta, mElast, mBigG, self.mma_aux, self.mma_rs)
        self.kernel(*args, self.sT_layout, self.sP_layout).launch(
            grid=(nc, mV.shape[2], mV.shape[0]),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ4: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV4: cute.Tensor,
        tma_w: cute.CopyAtom | None,
        mW4: cute.Tensor | None,
        tma_u: cute.CopyAtom | None,
        mU4: cute.Tensor | None,
        tma_ke: cute.CopyAtom | None,
        mKe4: cute.Tensor | None,
        tma_qe: cute.CopyAtom | None,
        mQe4: cute.Tensor | None,
        tma_pt: cute.CopyAtom,
        mPt4: cute.Tensor,
        tma_tt: cute.CopyAtom,
        mTt4: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mElast: cute.Tensor,
        mBigG: cute.Tensor,
        mma_aux: cute.TiledMma,
        mma_rs: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == PRODUCER_WARP:
            for atom in (tma_q, tma_k) if const_expr(self.w_from_t) else (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()  # one mbarrier a load group, armed once (phase 0)
        if warp_idx == PRODUCER_WARP:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(len(self.load_groups)):
                    cute.arch.mbarrier_init(bars + i, 1)
        init_arrive()
        sQ = smem_tensor(storage.sQ, sT_layout)
        sK = smem_tensor(storage.sK, sT_layout)
        sV = None if const_expr(self.w_from_t) else smem_tensor(storage.sV, sT_layout)
        outs = [None if const_expr(self.w_from_t) else smem_tensor(f, sT_layout)
                for f in (storage.sOw, storage.sOu)]  # fmt: skip
        for f in (storage.sOke, storage.sOqe):  # fused: neither
            outs.append(None if const_expr(self.fused) else smem_tensor(f, sT_layout))
        sPt = smem_tensor(storage.sOpt, sP_layout)
        sTt = smem_tensor(storage.sOtt, sP_layout)
        gates = [f.get_tensor(cute.make_layout((CHUNK, 1)))
                 for f in (storage.sG2, storage.sBeta, storage.sBetaEg)]  # fmt: skip
        sW = storage.sW.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)))
        sX = storage.sX.get_tensor(cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1)))
        init_wait()

        c, hv, b = cute.arch.block_idx()
        hq = hv // (mV4.shape[2] // mQ4.shape[2])
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            if warp_idx == PRODUCER_WARP:
                tiles = {"q": (tma_q, mQ4, sQ, self.k, hq), "k": (tma_k, mK4, sK, self.k, hq),
                         "v": (tma_v, mV4, sV, self.v, hv)}  # fmt: skip
                if const_expr(self.w_from_t):
                    del tiles["v"]
                self._load_groups(tiles, bars, c, hv, b)
        else:
            # the output tiles' TMA stores: (atom, global view, shared tile, width) by name
            kd, vd, c_ = self.k, self.v, CHUNK
            tiles = {"w": (tma_w, mW4, outs[0], kd), "u": (tma_u, mU4, outs[1], vd),
                     "ke": (tma_ke, mKe4, outs[2], kd), "qe": (tma_qe, mQe4, outs[3], kd),
                     "pt": (tma_pt, mPt4, sPt, c_), "tt": (tma_tt, mTt4, sTt, c_)}  # fmt: skip
            if const_expr(self.fused):
                del tiles["ke"], tiles["qe"]
            if const_expr(self.w_from_t):
                del tiles["w"], tiles["u"]
            self._math_roles(mma_aux, mma_rs, sQ, sK, sV, outs, sPt, sTt, gates, sW, sX, mG,
                             mBeta, mElast, mBigG, bars, tiles, c, hv, b)  # fmt: skip

    @cute.jit
    def _math_roles(self, mma_aux, mma_rs, sQ, sK, sV, outs, sPt, sTt, gates, sW, sX, mG,
                    mBeta, mElast, mBigG, bars, tiles, c, hv, b):  # fmt: skip
        """Warpgroups 1 and 2 (the module docstring): the gates, then each its products."""
        if opaque_tid_x() < THREADS_PER_WG + WARP_SIZE:
            self._gates(gates, mG, mBeta, mElast, mBigG, c, hv, b)
        # every math warp waits, the gates' warp too: racecheck orders two threads' accesses by
        # the bar.syncs each has waited at (an arrive counts for nothing), and warpgroup 1's
        # warps hand blocks to each other at BAR_INVERSE (NOTES "next/fac-race")
        named_barrier(BAR_GATES, MATH_PAIR).arrive_and_wait()
        wg = cute.arch.make_warp_uniform(opaque_tid_x() // THREADS_PER_WG)
        if wg == 1:
            self._t_and_u(mma_aux, mma_rs, sK, sV, outs[1], sTt, gates, sW, sX, bars, tiles,
                          c, hv, b)  # fmt: skip
        else:
            self._p_and_w(mma_aux, mma_rs, sQ, sK, outs, sPt, gates, sW, bars, tiles, c, hv, b)

    @cute.jit
    def _t_and_u(self, mma_aux, mma_rs, sK, sV, s_u, sTt, gates, sW, sX, bars, tiles, c, hv,
                 b):  # fmt: skip
        """Warpgroup 1: A = beta_i d_ij (K K^T) -> T in sW (BAR_T after the merges), T^T out,
        u = [T diag(beta)] V out (`w_from_t`: T^T alone, no BAR_T)."""
        sG2, sBeta, _ = gates
        cute.arch.mbarrier_wait(bars + 0, 0)  # k
        wg_a = mma_aux.get_slice(0)
        tSrKa = wg_a.make_fragment_A(wg_a.partition_A(sK))
        tSrKb = wg_a.make_fragment_B(wg_a.partition_B(sK))
        acc_shape = wg_a.partition_shape_C((CHUNK, CHUNK))
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        gemm(mma_aux, acc, tSrKa[None, None, None, 0], tSrKb[None, None, None, 0], True, 0)
        atid = opaque_tid_x() - THREADS_PER_WG
        coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
        self._decay_mask(acc, coords, sG2, sBeta, sG2, 0, Float32(1.0), True)
        tWsW = mma_aux.get_slice(atid).partition_C(sW)
        tWsW.store(acc.load())
        cute.arch.sync_warp()
        invert_diagonal(sW, atid)
        invert_merge_mma(sW, sX, atid, named_barrier(BAR_INVERSE, THREADS_PER_WG))
        if const_expr(not self.w_from_t):  # T final in sW (the merges' last barrier)
            named_barrier(BAR_T, MATH_PAIR).arrive()
        acc.store(tWsW.load())
        self._store_tile(acc, mma_aux, sTt, True)  # T^T
        self._store_group((tiles["tt"],), c, hv, b, BAR_MATH, LEADER[0])
        if const_expr(not self.w_from_t):  # w_from_t: u formed where it is read
            wg_r = mma_rs.get_slice(0)
            self._scale_by_beta(acc, coords, sBeta, 0)
            tUrA = wg_r.make_fragment_A(wg_r.partition_shape_A((CHUNK, CHUNK)))
            acc_to_operand_a(acc, tUrA)
            acc_u = cute.make_rmem_tensor(wg_r.partition_shape_C((CHUNK, self.v)), Float32)
            tBrV = wg_r.make_fragment_B(wg_r.partition_B(transposed(sV)))
            cute.arch.mbarrier_wait(bars + 2, 0)  # v
            gemm(mma_rs, acc_u, tUrA, tBrV[None, None, None, 0], True, 0)
            self._store_tile(acc_u, mma_rs, s_u, False)
            self._store_group((tiles["u"],), c, hv, b, BAR_MATH, LEADER[0])
        if opaque_tid_x() == LEADER[0]:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _p_and_w(self, mma_aux, mma_rs, sQ, sK, outs, sPt, gates, sW, bars, tiles, c, hv, b):
        """Warpgroup 2: P = d_ij (Q K^T) with Ke, Qe under its WGMMAs, P^T, Ke, Qe out; after
        BAR_T, W = [T diag(beta e^G)] K (T from sW) out (`w_from_t`: P^T alone)."""
        sG2, sBeta, sBetaEg = gates
        s_w, _, s_ke, s_qe = outs
        cute.arch.mbarrier_wait(bars + 0, 0)  # k
        cute.arch.mbarrier_wait(bars + 1, 0)  # q
        wg_a = mma_aux.get_slice(0)
        tSrQ = wg_a.make_fragment_A(wg_a.partition_A(sQ))
        tSrKb = wg_a.make_fragment_B(wg_a.partition_B(sK))
        acc_shape = wg_a.partition_shape_C((CHUNK, CHUNK))
        acc_p = cute.make_rmem_tensor(acc_shape, Float32)
        gemm(mma_aux, acc_p, tSrQ[None, None, None, 0], tSrKb[None, None, None, 0], True, -1)
        atid = opaque_tid_x() - 2 * THREADS_PER_WG
        out_shape = mma_rs.get_slice(0).partition_shape_C((CHUNK, self.k))
        if const_expr(not self.fused):  # Ke, Qe: the loaded rows times their decays
            t0, row_base, _ = softmax.acc_coords(mma_rs, atid, (CHUNK, self.k))
            g_last = sG2[CHUNK - 1, 0]
            e_end, e_g = [], []
            for r in cutlass.range_constexpr(2):
                g_i = sG2[row_base + t0[r, 0][0], 0]
                e_end.append(cute.math.exp2(g_last - g_i, fastmath=True))
                e_g.append(cute.math.exp2(g_i, fastmath=True))
            self._scaled_rows(mma_rs, atid, sK, s_ke, e_end, out_shape)
            self._scaled_rows(mma_rs, atid, sQ, s_qe, e_g, out_shape)
            cute.arch.fence_view_async_shared()
        warpgroup.wait_group(0)
        coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
        self._decay_mask(acc_p, coords, sG2, sBeta, sG2, 0, Float32(1.0), False)
        self._store_tile(acc_p, mma_aux, sPt, True)  # P^T
        self._store_group((tiles["pt"], *self._last_stores(tiles)), c, hv, b, BAR_MATH2,
                          LEADER[1])  # fmt: skip
        if const_expr(not self.w_from_t):  # w_from_t: W formed where it is read
            named_barrier(BAR_T, MATH_PAIR).arrive_and_wait()  # T final in sW
            acc = cute.make_rmem_tensor(acc_shape, Float32)
            acc.store(mma_aux.get_slice(atid).partition_C(sW).load())
            self._scale_by_beta(acc, coords, sBetaEg, 0)
            wg_r = mma_rs.get_slice(0)
            tWrA = wg_r.make_fragment_A(wg_r.partition_shape_A((CHUNK, CHUNK)))
            acc_to_operand_a(acc, tWrA)
            acc_w = cute.make_rmem_tensor(out_shape, Float32)
            tBrK = wg_r.make_fragment_B(wg_r.partition_B(transposed(sK)))
            gemm(mma_rs, acc_w, tWrA, tBrK[None, None, None, 0], True, 0)
            self._store_tile(acc_w, mma_rs, s_w, False)
            self._store_group((tiles["w"],), c, hv, b, BAR_MATH2, LEADER[1])
        if opaque_tid_x() == LEADER[1]:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _last_stores(self, tiles) -> tuple:
        """The last store group's tiles: Ke, Qe (`fused`: none)."""
        return () if self.fused else (tiles["ke"], tiles["qe"])

    @cute.jit
    def _store_group(self, tiles, c, hv, b, bar: cutlass.Constexpr[int],
                     leader: cutlass.Constexpr[int]):  # fmt: skip
        """A math warpgroup, whole: once every thread's (fenced) writes of `tiles` are done
        (`bar`, the warpgroup's own), its thread `leader` issues their TMA stores ((C, width)
        each) as one bulk group."""
        named_barrier(bar, THREADS_PER_WG).arrive_and_wait()
        if opaque_tid_x() == leader:
            for atom, m, s, d in tiles:
                self._tma_store(atom, m, s, c, d, hv, b)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _tma_store(self, atom, m, s, slot, d, hv, b):
        """The (C, d) shared-memory tile s to rows [C slot, C slot + C) of m[., ., hv, b]."""
        g = cute.local_tile(m[None, None, hv, b], (CHUNK, d), (slot, 0))
        ts, tg = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )
        cute.copy(atom, ts[(None, 0)], tg)

    @cute.jit
    def _gates(self, gates, mG, mBeta, mElast, mBigG, c, hv, b):
        """Warp 0 of warpgroup 1, lane l tokens 2 l, 2 l + 1 (0 past T): G by a warp
        scan; sG2 = log2(e) G, sBeta, sBetaEg = beta e^G; G and e^(G_C) to global."""
        sG2, sBeta, sBetaEg = gates
        lane = cute.arch.lane_idx()
        seqlen = mG.shape[1]
        t0 = c * CHUNK + 2 * lane
        vals = []
        for e in cutlass.range_constexpr(2):
            t = cutlass.min(t0 + e, seqlen - 1)  # in bounds; masked below
            inside = t0 + e < seqlen
            g_t = cutlass.select_(inside, Float32(mG[b, t, hv]), Float32(0.0))
            vals.append((g_t, cutlass.select_(inside, Float32(mBeta[b, t, hv]), Float32(0.0))))
        pair = vals[0][0] + vals[1][0]
        incl = pair
        for i in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << i)
            incl = cutlass.select_(lane >= (1 << i), incl + up, incl)
        big = (incl - pair + vals[0][0], incl)
        for e in cutlass.range_constexpr(2):
            j = 2 * lane + e
            sG2[j, 0] = big[e] * LOG2E
            sBeta[j, 0] = vals[e][1]
            sBetaEg[j, 0] = vals[e][1] * cute.math.exp(big[e], fastmath=True)
            mBigG[b, t0 + e, hv] = big[e]
        if lane == WARP_SIZE - 1:
            mElast[b, c, hv] = cute.math.exp(incl, fastmath=True)

    @cute.jit
    def _scaled_rows(self, mma, tid, src, dst, scales, shape):
        """dst = diag(scales) src, this thread's rows in the (C, K) accumulator partition of
        `mma` (16-bit tiles in shared memory)."""
        thr = mma.get_slice(tid)
        x = cute.make_rmem_tensor(shape, Float32)
        x.store(thr.partition_C(src[None, None, 0]).load().to(Float32))
        xv = rows_cols(x)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(cute.size(xv, mode=[1])):
                xv[r, j] = xv[r, j] * scales[r]
        thr.partition_C(dst[None, None, 0]).store(x.load().to(self.dtype))
