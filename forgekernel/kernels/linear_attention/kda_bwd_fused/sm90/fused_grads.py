"""Kimi Delta Attention backward, kernel 2 and the WY kernel in one kernel for Hopper (sm_90a):
one CTA per (chunk, value head, sequence) runs kernel 2's products (phase A,
`KdaBwdChunkSm90._math` as it is) and then the WY products (phase B, `KdaBwdWySm90._math` as it
is) on the same two math warpgroups, in the shared memory phase A leaves (docs/linear_attention/
kda_bwd_plan_2026-12-06.md item 3; NOTES "next/kda-fuse-wy"). The CPU model is
`reference.kda_bwd_fused` (kernel 2's model, then the WY kernel's on its dw).

What stays on chip that the two launches pass through HBM (a chunk-head): dw (16 KB written by
kernel 2 and read back by the WY kernel; here phase A's stmatrix into `sDW`, dw16's rounding),
k (16 KB: phase A's tile), G (32 KB fp32: phase A's `sG` and per-channel tables, identical for
both phases) and one launch. Still through global memory: dk and dG's partials (phase A stores
them as kernel 2 does, phase B adds onto them as the WY kernel does: the same thread's
read-modify-write of dk, the bulk reduce-adds onto dG), now L2-hot (the same CTA wrote them
microseconds before), and du (16 KB re-read: phase A's dU bytes hold (k er), then dG's rows).
With that the outputs are the two launches' bit for bit: every product, rounding and sum is the
same, in the same order.

Shared memory (bf16 tiles, 222,208 B of the 232,448 a CTA may hold): kernel 2's layout as it is
(tables, G, dO, U, q, k, dU, h, dh, dP^T) plus the WY kernel's row-dot partials after the tables,
dw (C, K) and phase B's mbarriers. Phase B's boxes go where phase A is done: du over U, u over
dO ((q el)), W over q, v and T^T over dh; its (k er) over dw (as the WY kernel), (k el) over
du's new place, (beta dA)^T over dP^T, its dG rows over phase A's (dU + h), each warpgroup its
own columns.

Warp roles (3 warpgroups, 384 threads, no setmaxnreg): warpgroup 0, warp 0: phase A's TMA
boxes on five mbarriers (kernel 2's groups), then phase B's on six more (the WY kernel's
groups; dw's and k's carry no bytes: on chip): T^T, du and v at BAR_FREE_U_DH (both math
warpgroups' dke retired: U's and dh's bytes free; they land under phase A's dk blocks and dG's
finish), u and W at BAR_FREE (both through phase A; first read by dA, after dvb, dv and dkb);
warps 1, 2: rowsum(h o dh) (kernel 2's); warpgroups 1, 2: phase A (arriving at BAR_FREE_U_DH
after dke), BAR_FREE (arrive only), phase B, each on its key / value channel half as the two
kernels split them.

Hand-overs between the phases: dw (phase A's stmatrix, fenced; read by the same warpgroup's
phase-B WGMMAs, its own half); G, the tables (read only); dk's partial (the same thread's
store, then read-modify-write); dG (phase A's plain stores, `fence.proxy.async.global`, then the
warpgroup's barriers, then phase B's bulk reduce-adds: the async proxy reading what the generic
one wrote); the bytes phase B's TMA overwrites (their generic writes fenced to the async proxy,
every reader past BAR_FREE).

Constraints: kernel 2's and the WY kernel's (K = V = 128, 16-bit tiles with unit last strides
and 16-byte aligned outer strides, fp32 G / beta / outputs with unit last strides).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.ptx import fence_proxy_async_global
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import _kvchb, _tdhb
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.config import STATE_TILES
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import (
    G_STRIDE,
    MATH_THREADS,
    PRODUCER_WARP,
    KdaBwdChunkSm90,
)
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.config import (
    A_GROUPS,
    B_GROUPS,
    CHUNK,
    HDH_WARPS,
    ON_CHIP,
    THREADS,
    group_bytes,
)
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import DOTS
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.wy_grads import BAR_DOTS, KdaBwdWySm90

# the math warpgroups (arrive) -> the TMA warp (waits): phase A done (q's, dO's bytes free)
BAR_FREE = BAR_DOTS + DOTS
# likewise, within phase A: dke retired in both (U's and dh's bytes free)
BAR_FREE_U_DH = BAR_FREE + 1
# phase B's groups (indices into B_GROUPS, as the WY kernel's `_math` waits on them) issued at
# BAR_FREE_U_DH: T^T + du (over U), v (over dh), dw (on chip); the rest at BAR_FREE: u (over
# dO), W (over q), k (on chip). The first three land under phase A's dk blocks and dG's finish;
# u and W are first read by dA, after dvb, dv and dkb.
EARLY_B = tuple(i for i, g in enumerate(B_GROUPS) if set(g) <= {"tt", "du", "v", "dw"})
LATE_B = tuple(i for i in range(len(B_GROUPS)) if i not in EARLY_B)
# where phase B's boxes land: (shared field, offset in (C, 128) 16-bit tiles), each in bytes no
# later phase-A step reads (tests/test_kda_bwd_fused_compile.py checks the plan on the struct)
B_PLACES = {"du": ("sU", 0), "u": ("sDO", 0), "w": ("sQ", 0), "v": ("sDH", 0), "tt": ("sDH", 1)}


class KdaBwdFusedSm90(KdaBwdWySm90):
    """One CTA per (chunk, value head, sequence): kernel 2's `_output_grads` products, then the
    WY kernel's `_wy_grads` products, on two math warpgroups; see the module docstring. Both
    phases are the two kernels' `_math` as they are (the WY kernel's class brings kernel 2's)."""

    threads = THREADS

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
        mTt: cute.Tensor,
        mW: cute.Tensor,
        mUw: cute.Tensor,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDG: cute.Tensor,
        mDV: cute.Tensor,
        mDB: cute.Tensor,
        mDKo: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """Kernel 2's inputs (mDO, mU, mDU (B, T, HV, V), mQ (scaled; unscaled with dq16), mK
        (B, T, HV, K), mH, mDH (B, NC, HV, K, V) 16-bit, mG fp32 (B, T, HV, K)), the WY
        kernel's others (mTt (B, T, HV, C), mW (B, T, HV, K), mUw (its u), mV (B, T, HV, V)
        16-bit, mBeta fp32 (B, T, HV)); outputs: mDQ (kernel 2's: fp32, or dq16's 16-bit dq
        times `scale`), mDK, mDG fp32 (B, T, HV, K) written (kernel 2's dk, dG, then the WY
        half added: with dk16 mDK ends as the WY kernel's scratch), mDV (fp32 or dv16's 16-bit),
        mDB (B, T, HV), mDKo (dk16: the final dk, 16-bit; else mDK itself, unused);
        `token_rows`: mStarts, mLens int32 (NC,) as both kernels take them, else None."""
        if const_expr(self.token_rows != (mStarts is not None)):
            raise TypeError("mStarts, mLens: given with token_rows, and only then")
        self.dtype = mDO.element_type
        for t in (mU, mDU, mQ, mK, mH, mDH, mTt, mW, mUw, mV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        for name, t in (("dq", mDQ), ("dv", mDV), ("the final dk", mDKo)):
            if const_expr(t.element_type != Float32 and t.element_type != self.dtype):
                raise TypeError(f"{name} must be fp32 or the tiles' dtype, got {t.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        sH_tile = cute.slice_(self.sH_layout, (None, None, 0))
        sTt_tile = cute.slice_(self.sTt_layout, (None, None, 0))
        tmas = []
        for m, d in ((mDO, self.v), (mU, self.v), (mDU, self.v), (mQ, self.k), (mK, self.k),
                     (mW, self.k), (mUw, self.v), (mV, self.v)):  # fmt: skip
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d)))
        for m in (mH, mDH):
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _kvchb(m), sH_tile, (self.k, self.v)))
        tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(mTt), sTt_tile, (CHUNK, CHUNK)))
        # the bytes each load group's mbarrier expects (`_load_groups`), per phase
        t_bytes, h_bytes, tt_bytes = (cute.size_in_bytes(self.dtype, t)
                                      for t in (sT_tile, sH_tile, sTt_tile))  # fmt: skip
        sizes = {n: h_bytes for n in STATE_TILES} | {"tt": tt_bytes}
        self.bytes_a = group_bytes(A_GROUPS, sizes, t_bytes)
        self.bytes_b = group_bytes(B_GROUPS, sizes, t_bytes, ON_CHIP)
        t_elems = cute.cosize(self.sT_layout)
        h_elems = cute.cosize(self.sH_layout)
        p_elems = cute.cosize(self.sP_layout)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, len(A_GROUPS) + len(B_GROUPS)]
            sTab: cute.struct.Align[cute.struct.MemRange[Float32, self.table], 16]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * G_STRIDE], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            # dU then h: phase A's dG rows (then phase B's) over both (adjacent fields)
            sDU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sDH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BFloat16, p_elems], 1024]
            sDW: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]

        self.shared_storage = SharedStorage
        atoms_and_views = [x for atom_view in tmas for x in atom_view]
        nc = (mDO.shape[1] + CHUNK - 1) // CHUNK
        mmas = (self.mma_w, self.mma_s, self.mma_q, self.mma_k, self.mma_t)
        layouts = (self.sT_layout, self.sH_layout, self.sP_layout, self.sB_layout,
                   self.sTt_layout)  # fmt: skip
        outs = (mDQ, mDK, mDG, mDV, mDB, mDKo, mStarts, mLens)
        self.kernel(*atoms_and_views, mG, mBeta, *outs, scale, *mmas, *layouts).launch(
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
        tma_w: cute.CopyAtom,
        mW4: cute.Tensor,
        tma_uw: cute.CopyAtom,
        mUw4: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV4: cute.Tensor,
        tma_h: cute.CopyAtom,
        mH5: cute.Tensor,
        tma_dh: cute.CopyAtom,
        mDH5: cute.Tensor,
        tma_tt: cute.CopyAtom,
        mTt4: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDG: cute.Tensor,
        mDV: cute.Tensor,
        mDB: cute.Tensor,
        mDKo: cute.Tensor,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        mma_w: cute.TiledMma,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        mma_k: cute.TiledMma,
        mma_t: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sH_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sTt_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = (tma_do, tma_u, tma_du, tma_q, tma_k, tma_w, tma_uw, tma_v, tma_h, tma_dh, tma_tt)
        if warp_idx == PRODUCER_WARP:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        bars = storage.barriers.data_ptr()  # phase A's groups, then phase B's; armed once
        bars_b = bars + len(A_GROUPS)
        if warp_idx == PRODUCER_WARP:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(len(A_GROUPS) + len(B_GROUPS)):
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
        sDW = smem_tensor(storage.sDW, sT_layout)
        t_elems = cute.cosize(sT_layout)

        def over(ptr, layout, dtype):
            return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype), layout.outer)

        # phase A (kernel 2's): (k er) over dU's bytes, (q el) over dO's
        sKr = over(storage.sDU.data_ptr(), sB_layout, BFloat16)
        sQl = over(storage.sDO.data_ptr(), sB_layout, BFloat16)

        def place(name):  # phase B's box `name` where phase A is done (B_PLACES)
            field, tiles_in = B_PLACES[name]
            return getattr(storage, field).data_ptr() + tiles_in * t_elems

        sDUb, sUb, sWb, sVb = (over(place(n), sT_layout, self.dtype) for n in ("du", "u", "w", "v"))
        sTt = over(place("tt"), sTt_layout, self.dtype)
        # phase B's (k er) over dw, (k el) over du's new place (the WY kernel's: over dw, du)
        sKrB = over(storage.sDW.data_ptr(), sB_layout, BFloat16)
        sKlB = over(place("du"), sB_layout, BFloat16)
        flat = cute.make_layout(CHUNK * G_STRIDE)
        sG = storage.sG.get_tensor(flat)
        # both phases' dG rows over dU's and h's bytes (kernel 2's place: BAR_HDH frees them)
        sRows = cute.make_tensor(cute.recast_ptr(storage.sDU.data_ptr(), dtype=Float32), flat)
        sTab = storage.sTab.get_tensor(cute.make_layout(self.table))
        init_wait()

        c, hv, b = cute.arch.block_idx()
        seqlen = mDO4.shape[0]
        tables = (mStarts, mLens) if const_expr(self.token_rows) else None
        free = named_barrier(BAR_FREE, MATH_THREADS + WARP_SIZE)
        free_u_dh = named_barrier(BAR_FREE_U_DH, MATH_THREADS + WARP_SIZE)
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            if warp_idx == PRODUCER_WARP:
                tiles = {"do": (tma_do, mDO4, sDO, self.v, hv), "u": (tma_u, mU4, sU, self.v, hv),
                         "du": (tma_du, mDU4, sDU, self.v, hv),
                         "q": (tma_q, mQ4, sQ, self.k, hv), "k": (tma_k, mK4, sK, self.k, hv),
                         "h": (tma_h, mH5, sH), "dh": (tma_dh, mDH5, sDH)}  # fmt: skip
                self._load_phase(A_GROUPS, self.bytes_a, tiles, bars, c, hv, b)
                tiles = {"tt": (tma_tt, mTt4, sTt, CHUNK, hv),
                         "du": (tma_du, mDU4, sDUb, self.v, hv),
                         "u": (tma_uw, mUw4, sUb, self.v, hv), "v": (tma_v, mV4, sVb, self.v, hv),
                         "w": (tma_w, mW4, sWb, self.k, hv)}  # fmt: skip
                free_u_dh.arrive_and_wait()  # dke retired in both math warpgroups
                for i in cutlass.range_constexpr(len(EARLY_B)):
                    self._load_b(EARLY_B[i], tiles, bars_b, c, hv, b)
                free.arrive_and_wait()  # both math warpgroups through phase A
                for i in cutlass.range_constexpr(len(LATE_B)):
                    self._load_b(LATE_B[i], tiles, bars_b, c, hv, b)
            elif warp_idx <= HDH_WARPS:
                self._rowsum_hdh(sH, sDH, sTab, bars)
        else:
            kh = wg - 1
            KdaBwdChunkSm90._math(
                self, mma_w, mma_s, mma_q, mma_k, sDO, sU, sDU, sQ, sK, sH, sDH, sP, sKr, sQl,
                sG, sRows, sTab, mG, mDQ, mDK, None, mDG, bars, c, hv, b, seqlen, scale, kh,
                tables, sDWo=sDW, done_u_dh=free_u_dh,
            )  # fmt: skip
            fence_proxy_async_global()  # dG's stores before phase B's bulk reduce-adds onto them
            cute.arch.fence_view_async_shared()  # (q el)'s stores before u's box over them
            free.arrive()
            KdaBwdWySm90._math(
                self, mma_t, mma_s, mma_q, mma_k, sDW, sDUb, sWb, sK, sUb, sVb, sTt, sP, sKrB,
                sKlB, sG, sRows, sTab, mBeta, mG, mDK, mDV, mDG, mDB, mDKo, bars_b, c, hv, b,
                seqlen, kh, tables, staged=True,
            )  # fmt: skip

    def _load_phase(self, groups, group_bytes, tiles, bars, c, hv, b):
        """Gated DeltaNet's `_load_groups` (the producer warp's boxes, one mbarrier a group) on
        these groups and bytes (it reads them from the object), the first on `bars`."""
        self.load_groups, self.group_bytes = groups, group_bytes
        self._load_groups(tiles, bars, c, hv, b)

    def _load_b(self, i, tiles, bars_b, c, hv, b):
        """Phase B's group i (B_GROUPS) on its mbarrier bars_b + i."""
        self._load_phase((B_GROUPS[i],), (self.bytes_b[i],), tiles, bars_b + i, c, hv, b)
