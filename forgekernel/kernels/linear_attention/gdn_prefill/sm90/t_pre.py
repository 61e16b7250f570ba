"""T precomputed for the chunked Gated DeltaNet forward (sm_90a): T diag(beta) of every (chunk,
value head) at once, in the 16-bit form the chunked kernel's state warpgroups read, so that its
`t_pre` form (`chunked_fwd.py`) loads T by TMA instead of forming it in its aux warpgroup
(docs/linear_attention/NOTES.md, "T precomputed").

Per (chunk, value head hv) of sequence n, from k (head hv // (HV / H)), g and beta alone, the
chunked kernel's aux arithmetic called as it is (bit for bit the same T diag(beta)):

    G2   = log2(e) cumsum(g)                    `gates.chunk_gates` (the gate warp's scan)
    rk   = 1 / |k_row| (l2norm)                 `AuxWy._k_norm`
    L    = beta_i rk_i rk_j 2^(G2_i - G2_j) (K K^T)_ij, j < i    SS WGMMA, `AuxWy._decay_mask`
    T    = (I + L)^-1                           fp32 scratch: `inverse.invert_diagonal`, the
                                                merges by mma.sync tf32 (`inverse_mma`)
    T diag(beta) -> 16 bits -> stmatrix -> one TMA store (64 x 64) to slot bos_n // C + n + c
                                                (`config.first_slot`)

The k box is loaded exactly as the chunked kernel loads it (64 rows from the sequence's start,
the next sequence's rows or TMA's zero fill past its end), so the accumulators are the same;
rows past the end have beta = 0, their rows and columns of T diag(beta) are 0.

Grid: (T // C + N slots, HV); a CTA finds its sequence by a binary search of cu_seqlens on
bos_n // C + n (strictly increasing); slots between sequences exit at once. One warpgroup a CTA
(128 threads, 42 KB of shared memory: five CTAs an SM): warp 0 issues the TMA load, then the
gate scan; all four the products, the inverse (its warp roles as in the aux) and the stores
(T diag(beta) over the k tile, read by then); thread 0 the TMA store, waited for whole before
the CTA exits (not only its shared-memory read).

Constraints: K = 128, 16-bit k (unit last stride, 16-byte aligned token stride), g, beta fp32
(T, HV), the T buffer (slots x C, HV, C) 16-bit, 16-byte aligned.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import packed_as_sdhb
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.aux_wy import AuxWy
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    BLOCK,
    CHUNK,
    W_STRIDE,
    X_STRIDE,
    first_slot,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.gates import chunk_gates
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import Bar

THREADS = THREADS_PER_WG


@cute.jit
def slot_owner(mCu: cute.Tensor, s: Int32) -> Int32:
    """The sequence n whose slots [first_slot(bos_n, n), first_slot(bos_n+1, n + 1)) hold s:
    a binary search (log2 N + 1 uniform loads of cu_seqlens, L1-resident after the first)."""
    lo = Int32(0)
    hi = Int32(mCu.shape[0] - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = first_slot(mCu[mid], mid) <= s
        lo = cutlass.select_(below, mid, lo)
        hi = cutlass.select_(below, hi, mid)
    return lo


class GdnTPreSm90(AuxWy):
    """One CTA per (chunk slot, value head): the chunk's T diag(beta); see the module
    docstring. The aux warpgroup's masks, norms and column scaling (`AuxWy`) as they are."""

    def __init__(self, k: int, *, l2norm: bool):
        if k != 128:
            raise ValueError(f"K must be 128, got {k}")
        self.k = k
        self.l2norm = l2norm  # AuxWy's masks read it

    def _setup(self):
        dt = self.dtype
        k_major = OperandMajorMode.K
        # K K^T: (C, C) over K, both operands K-major in shared memory (the aux's mma_aux)
        self.mma_aux = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, CHUNK)
        )
        row = LayoutEnum.ROW_MAJOR
        self.sK_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), dt, 1)
        # T diag(beta): (i, j) row-major, the chunked kernel's sPT_layout (one stage)
        self.sT_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), dt, 1)

    @cute.jit
    def __call__(
        self,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mT: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mK (T, H, K) 16-bit; mG, mBeta fp32 (T, HV); mCu int32 (N + 1,); mT (slots x C,
        HV, C) in mK's dtype, slots = T // C + N (`config.t_slots`)."""
        self.dtype = mK.element_type
        if const_expr(mT.element_type != self.dtype):
            raise TypeError(f"T must be in k's dtype, got {mT.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        sK_tile = cute.slice_(self.sK_layout, (None, None, 0))
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, packed_as_sdhb(mK), sK_tile,
                                                    (CHUNK, self.k))  # fmt: skip
        tma_t, tma_mT = cpasync.make_tiled_tma_atom(s2g, packed_as_sdhb(mT), sT_tile,
                                                    (CHUNK, CHUNK))  # fmt: skip
        self.k_bytes = cute.size_in_bytes(self.dtype, sK_tile)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sNorm: cute.struct.Align[cute.struct.MemRange[Float32, 3 * CHUNK], 16]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * W_STRIDE], 16]
            sX: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BLOCK * X_STRIDE], 16]
            # T diag(beta) overwrites the k tile (8 of its 16 KB) once K K^T is waited for: 42
            # KB a CTA, five an SM (with its own 8 KB: four)
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_k,
            tma_mK,
            tma_t,
            tma_mT,
            mG,
            mBeta,
            mCu,
            self.mma_aux,
            self.sK_layout,
            self.sT_layout,
        ).launch(  # fmt: skip
            grid=(mT.shape[0] // CHUNK, mT.shape[1], 1),
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_t: cute.CopyAtom,
        mT4: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mma_aux: cute.TiledMma,
        sK_layout: cute.ComposedLayout,
        sT_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        s, hv, _ = cute.arch.block_idx()
        n = slot_owner(mCu, s)
        bos = mCu[n]
        seqlen = mCu[n + 1] - bos
        c = s - first_slot(bos, n)
        if c * CHUNK < seqlen:  # else a slot between sequences: nothing to write
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_t)
            storage = SmemAllocator().allocate(self.shared_storage)
            ring = tma_pipeline(storage.barriers, 1, self.k_bytes, THREADS // WARP_SIZE)
            init_arrive()
            sK = smem_tensor(storage.sK, sK_layout)
            sT = smem_tensor(storage.sK, sT_layout)  # aliases k (SharedStorage says why)
            sG = storage.sG.get_tensor(cute.make_layout((CHUNK, 1)))
            sBeta = storage.sBeta.get_tensor(cute.make_layout((CHUNK, 1)))
            sNorm = storage.sNorm.get_tensor(cute.make_layout((CHUNK, 3, 1)))
            sW = storage.sW.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)))
            sX = storage.sX.get_tensor(
                cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1))
            )
            init_wait()
            head = hv // (mT4.shape[2] // mK4.shape[2])
            if warp_idx == 0:
                self._load_k(tma_k, mK4, sK, ring, head, bos, c)
                lane = cute.arch.lane_idx()
                before, incl, vals = chunk_gates(mG, mBeta, hv, bos, seqlen, c, lane)
                sG[2 * lane, 0] = (before + vals[0][0]) * LOG2E
                sG[2 * lane + 1, 0] = incl * LOG2E
                sBeta[2 * lane, 0] = vals[0][1]
                sBeta[2 * lane + 1, 0] = vals[1][1]
            self._t_diag_beta(mma_aux, sK, sT, sG, sBeta, sNorm, sW, sX, ring)
            if tidx == 0:
                g = cute.local_tile(mT4[None, None, hv, 0], (CHUNK, CHUNK), (s, 0))
                ts, tg = cpasync.tma_partition(
                    tma_t, 0, cute.make_layout(1), cute.group_modes(sT, 0, 2),
                    cute.group_modes(g, 0, 2),
                )  # fmt: skip
                cute.copy(tma_t, ts[(None, 0)], tg)
                cute.arch.cp_async_bulk_commit_group()
                # the whole store, not its read (.read): T is the chunked kernel's input; at
                # exit the read wait left its visibility to the grid's completion (a PDL
                # launch of the chunked kernel would not wait for it). SASS: + CCTL.IVALL
                cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def _load_k(self, tma_k, mK4, sK, ring, head, bos, c):
        """Warp 0: chunk c's (C, K) box of k from the sequence's first token (as the chunked
        kernel's producer loads it)."""
        g = cute.local_tile(
            cute.domain_offset((bos, 0), mK4[None, None, head, 0]), (CHUNK, self.k), (None, 0)
        )
        ts, tg = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(g, 0, 2)
        )
        st = producer_state(1)
        ring.producer_acquire(st)
        cute.copy(tma_k, tg[(None, c)], ts[(None, 0)], tma_bar_ptr=ring.producer_get_barrier(st))

    @cute.jit
    def _t_diag_beta(self, mma_aux, sK, sT, sG, sBeta, sNorm, sW, sX, ring):
        """The aux warpgroup's L, inverse and T diag(beta) (`AuxWy._aux`'s order), into sT."""
        atid = cute.arch.thread_idx()[0]
        bar = named_barrier(Bar.AUX, THREADS)
        wg_thr = mma_aux.get_slice(0)
        tSrKa = wg_thr.make_fragment_A(wg_thr.partition_A(sK))
        tSrKb = wg_thr.make_fragment_B(wg_thr.partition_B(sK))
        acc_shape = wg_thr.partition_shape_C((CHUNK, CHUNK))
        st = consumer_state(1)
        ring.consumer_wait(st)
        acc = cute.make_rmem_tensor(acc_shape, Float32)
        gemm(mma_aux, acc, tSrKa[None, None, None, 0], tSrKb[None, None, None, 0], True, -1)
        bar.arrive_and_wait()  # the gates are in shared memory
        if const_expr(self.l2norm):
            if atid >= CHUNK:
                self._k_norm(sK[None, None, 0], atid % CHUNK, sG, sNorm, 0)
            bar.arrive_and_wait()  # the norms too
        coords = softmax.acc_coords(mma_aux, atid, (CHUNK, CHUNK))
        warpgroup.wait_group(0)  # K K^T has read the k tile: sT may overwrite it from here
        self._decay_mask(acc, coords, sG, sBeta, sNorm, 0, Float32(1.0), True)
        tWsW = mma_aux.get_slice(atid).partition_C(sW)
        tWsW.store(acc.load())
        cute.arch.sync_warp()
        invert_diagonal(sW, atid)
        invert_merge_mma(sW, sX, atid, bar)
        acc.store(tWsW.load())
        self._scale_by_beta(acc, coords, sBeta, 0)
        r_t = cute.make_rmem_tensor(acc_shape, self.dtype)
        r_t.store(acc.load().to(self.dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype),
            mma_aux,
        )
        thr_r2s = r2s.get_slice(atid)
        cute.copy(r2s, thr_r2s.retile(r_t), thr_r2s.partition_D(sT[None, None, 0]))
        # stmatrix writes are generic-proxy, the TMA store reads async-proxy
        cute.arch.fence_view_async_shared()
        bar.arrive_and_wait()
