"""Attention backward postprocess (sm_90a): dQ = softmax_scale * dQaccum, fp32 -> input dtype.

Grid (ceil(Sq / tile_m), Hq, B), 256 threads. The main kernel stores each (tile_m, D) dQ tile of
the workspace in the order of its dQ MMA's accumulator fragments (`utils.dq_frag_offset`);
here the same tiled MMA (rebuilt, never executed) says which element each thread holds, the
thread reads its fragment (coalesced), scales, converts, stmatrix-es into a swizzled tile and
one TMA store writes it (rows past Sq clipped).

Varlen (static flag): dq (Tq, Hq, D), workspace (Hq, rows * D) with sequence b's tiles from row
`config.varlen_ws_row(cu_seqlens_q[b], b)`; grid (ceil(max_seqlen_q / tile_m), Hq, B). A tile
that ends inside its sequence is written from registers, rows < Sq only (a TMA box would write
the next sequence's rows); blocks past the sequence do nothing."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.bwd.sm90.config import NUM_MMA_WG, varlen_ws_row
from forgekernel.kernels.attention.bwd.sm90.utils import (
    dq_frag_offset,
    make_dq_mma,
    s_d_h_b,
    unit_batch,
)
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import packed_as_sdhb
from forgekernel.kernels.common.sm90.pipeline import smem_tensor

THREADS = NUM_MMA_WG * THREADS_PER_WG


class AttentionBwdPostSm90:
    def __init__(self, head_dim: int, tile_m: int, varlen: bool = False, halves: bool = False):
        self.varlen = varlen
        self.halves = halves  # the workspace order of a dq_split main kernel
        self.head_dim = head_dim
        self.tile_m = tile_m

    @cute.jit
    def __call__(
        self,
        mdQacc: cute.Tensor,
        mdQ: cute.Tensor,
        mCuQ: cute.Tensor | None,
        max_seqlen_q: Int32,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mdQacc (B, Hq, Sq_pad * D) fp32, mdQ (B, Sq, Hq, D); mCuQ None. Varlen: mdQacc
        (Hq, rows * D), mdQ (Tq, Hq, D), mCuQ int32 (B + 1,)."""
        self.dtype = mdQ.element_type
        tm, d = self.tile_m, self.head_dim
        mma = make_dq_mma(self.dtype, tm, d)
        if const_expr(d == 192):
            # each warpgroup's 96 columns must be whole swizzle atoms (stmatrix partition):
            # 64-byte swizzle, as the main kernel's K / dK buffer
            atom = sm90_utils.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, d // 2),
                self.dtype,
            )
            self.sdQ_layout = cute.tile_to_shape(atom, (tm, d, 1), order=(0, 1, 2))
        else:
            self.sdQ_layout = sm90_utils.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (tm, d, d), self.dtype, 1
            )
        if const_expr(self.varlen):
            mdQ = packed_as_sdhb(mdQ)
            mdQacc = unit_batch(mdQacc)
        else:
            mdQ = s_d_h_b(mdQ)
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
        if const_expr(self.varlen):
            grid = (cute.ceil_div(max_seqlen_q, tm), mdQ.shape[2], mCuQ.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mdQ.shape[0], tm), mdQ.shape[2], mdQ.shape[3])
        self.kernel(
            mdQacc,
            tma,
            tma_mdQ,
            mdQ if const_expr(self.varlen) else None,
            mCuQ,
            scale,
            mma,
            self.sdQ_layout,
        ).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mdQacc: cute.Tensor,
        tma: cute.CopyAtom,
        mdQ: cute.Tensor,
        mdQ_gmem: cute.Tensor | None,
        mCuQ: cute.Tensor | None,
        scale: Float32,
        mma: cute.TiledMma,
        sdQ_layout: cute.ComposedLayout,
    ):
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.varlen):
            q_off = mCuQ[batch]
            seqlen_q = mCuQ[batch + 1] - q_off
            ws = varlen_ws_row(q_off, batch)
            m0 = m_block * self.tile_m
            if m0 < seqlen_q:
                if m0 + self.tile_m > seqlen_q:
                    self._tile_rmem(mdQacc, mdQ_gmem, scale, mma, m_block, head,
                                    q_off, seqlen_q, ws)  # fmt: skip
                else:
                    self._tile(mdQacc, tma, mdQ, scale, mma, sdQ_layout, m_block, head, 0,
                               q_off, ws)  # fmt: skip
        else:
            self._tile(mdQacc, tma, mdQ, scale, mma, sdQ_layout, m_block, head, batch, 0, 0)

    @cute.jit
    def _load(self, mdQacc, scale, mma, m_block, head, batch, ws):
        """This thread's fragment of the (tile_m, D) tile, scaled and converted."""
        tidx, _, _ = cute.arch.thread_idx()
        tm, d = self.tile_m, self.head_dim
        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((tm, d)), Float32)
        tile = tm * d
        g = cute.make_tensor(
            mdQacc[batch, head, None].iterator + (ws * d + m_block * tile), cute.make_layout(tile)
        )
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = g[dq_frag_offset(tidx, i, cute.size(acc), self.halves)] * scale
        r = cute.make_rmem_tensor(acc.shape, self.dtype)
        r.store(acc.load().to(self.dtype))
        return r

    @cute.jit
    def _tile_rmem(self, mdQacc, mdQ, scale, mma, m_block, head, q_off, seqlen_q, ws):
        """Varlen tile ending inside its sequence: rows < Sq stored from registers."""
        tidx, _, _ = cute.arch.thread_idx()
        tm, d = self.tile_m, self.head_dim
        r = self._load(mdQacc, scale, mma, m_block, head, 0, ws)
        g = cute.local_tile(cute.domain_offset((q_off, 0), mdQ[None, None, head, 0]), (tm, d),
                            (m_block, 0))  # fmt: skip
        thr = mma.get_slice(tidx)
        tg = thr.partition_C(g)
        tc = thr.partition_C(cute.make_identity_tensor((tm, d)))
        m0 = m_block * tm
        for i in cutlass.range_constexpr(cute.size(r)):
            if m0 + tc[i][0] < seqlen_q:
                tg[i] = r[i]

    @cute.jit
    def _tile(self, mdQacc, tma, mdQ, scale, mma, sdQ_layout, m_block, head, batch, q_off, ws):
        """A whole tile: stmatrix into shared memory, one TMA store (rows past Sq clipped for
        fixed length; varlen tiles passed here end inside their sequence)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tm, d = self.tile_m, self.head_dim
        storage = SmemAllocator().allocate(self.shared_storage)
        sdQ = smem_tensor(storage.sdQ, sdQ_layout)

        r = self._load(mdQacc, scale, mma, m_block, head, batch, ws)
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma
        ).get_slice(tidx)
        cute.copy(r2s, r2s.retile(r), r2s.partition_D(sdQ[None, None, 0]))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        if warp_idx == 0:
            src = mdQ[None, None, head, batch]
            if const_expr(self.varlen):
                src = cute.domain_offset((q_off, 0), src)
            gdQ = cute.local_tile(src, (tm, d), (None, 0))
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
