"""Attention backward postprocess (sm_90a): dQ = softmax_scale * dQaccum, fp32 -> input dtype.

Grid (ceil(Sq / tile_m), Hq, B), 256 threads. The main kernel stores each (tile_m, D) dQ tile of
the workspace in the order of its dQ MMA's accumulator fragments (`utils.dq_frag_offset`);
here the same tiled MMA (rebuilt, never executed) says which element each thread holds, the
thread reads its fragment (coalesced), scales, converts, stmatrix-es into a swizzled tile and
one TMA store writes it (rows past Sq clipped)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.bwd.sm90.config import NUM_MMA_WG
from forgekernel.kernels.attention.bwd.sm90.utils import (
    THREADS_PER_WG,
    dq_frag_offset,
    make_dq_mma,
    select,
)

THREADS = NUM_MMA_WG * THREADS_PER_WG


class AttentionBwdPostSm90:
    def __init__(self, head_dim: int, tile_m: int):
        self.head_dim = head_dim
        self.tile_m = tile_m

    @cute.jit
    def __call__(
        self, mdQacc: cute.Tensor, mdQ: cute.Tensor, scale: Float32, stream: cuda.CUstream
    ):
        """mdQacc (B, Hq, Sq_pad * D) fp32, mdQ (B, Sq, Hq, D)."""
        self.dtype = mdQ.element_type
        tm, d = self.tile_m, self.head_dim
        mma = make_dq_mma(self.dtype, tm, d)
        self.sdQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (tm, d, d), self.dtype, 1
        )
        mdQ = select(mdQ, [1, 3, 2, 0])
        s_tile = cute.slice_(self.sdQ_layout, (None, None, 0))
        tma, tma_mdQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQ, s_tile, (tm, d)
        )

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sdQ_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        grid = (cute.ceil_div(mdQ.shape[0], tm), mdQ.shape[2], mdQ.shape[3])
        self.kernel(mdQacc, tma, tma_mdQ, scale, mma, self.sdQ_layout).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mdQacc: cute.Tensor,
        tma: cute.CopyAtom,
        mdQ: cute.Tensor,
        scale: Float32,
        mma: cute.TiledMma,
        sdQ_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        m_block, head, batch = cute.arch.block_idx()
        tm, d = self.tile_m, self.head_dim
        storage = SmemAllocator().allocate(self.shared_storage)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((tm, d)), Float32)
        tile = tm * d
        g = cute.make_tensor(
            mdQacc[batch, head, None].iterator + m_block * tile, cute.make_layout(tile)
        )
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = g[dq_frag_offset(tidx, i, THREADS)] * scale
        r = cute.make_rmem_tensor(acc.shape, self.dtype)
        r.store(acc.load().to(self.dtype))
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma
        ).get_slice(tidx)
        cute.copy(r2s, r2s.retile(r), r2s.partition_D(sdQ[None, None, 0]))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if warp_idx == 0:
            gdQ = cute.local_tile(mdQ[None, None, head, batch], (tm, d), (None, 0))
            tsdQ, tgdQ = cpasync.tma_partition(
                tma,
                0,
                cute.make_layout(1),
                cute.group_modes(sdQ, 0, 2),
                cute.group_modes(gdQ, 0, 2),
            )
            cute.copy(tma, tsdQ[(None, 0)], tgdQ[(None, m_block)])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
