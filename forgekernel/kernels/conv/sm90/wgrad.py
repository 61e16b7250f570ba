"""Implicit-GEMM weight gradient of a channels-last convolution for Hopper (sm_90a): fp32
accumulation, the long reduction split over CTAs and summed exactly and deterministically.

    dW[k, t, r, s, c] = sum_{n, z, p, q} dY[n, z, p, q, k]
                          * X[n, z*sd - pd + t*dd, p*sh - ph + r*dh, q*sw - pw + s*dw, c]

with zero outside X. As a GEMM: D (K, (C, S, R, T)) = A (K, M) B (M, (C, S, R, T)), M = N x Z x
P x Q output pixels the reduction (N32 56x56: 100352), D = W's gradient seen as (K, (C, S, R,
T)) (its memory order: a tile of D is tile_m output channels x tile_n input channels of one
tap). The dense GEMM's kernel (kernels/gemm/dense/sm90/kernel.py) with other operands:

- A = dY^T: dY (M, K) has K contiguous, so A is M-major (16-bit WGMMA reads it transposed);
  a tiled TMA box of tile_m channels x tile_k = 64 pixels, zero past K and past M.
- B = im2col(X): the forward kernel's im2col TMA (im2col.py) in another role: one box is 64
  pixels x 64 channels of one tap, its pixels walking the reduction; a tile of tile_n
  channels is tile_n / 64 boxes. B is N-major (channels contiguous): the box's (pixels,
  channels) K-major swizzled layout is, byte for byte, the N-major layout's 64-channel block
  (both `S<3,4,3> o (p, c) -> 64 p + c`, blocks 4096 elements apart), so the TMA writes the
  blocks and WGMMA reads the tile (transposed B). Channels past C and pixels past the batch are
  the TMA's zero fill (pixels past M meet zero rows of A anyway). A channel block past C (a
  tile_n wider than C) reloads the last one: its columns are never stored.
- D through the GEMM's epilogue (stmatrix, TMA store into W's 5-D gradient, clipped at K and
  C).

Stride 1 (compile key `rect` = 8 or 16; any padding and dilation): the pixel k-tiles are
rectangles of `rect` output columns x 64 / rect rows of one (image, output plane), Q's
rectangles fastest, then P's, Z, N (`kernel.rect_index`, geometry.rect_origin), and both
operands come through TILED TMAs, which have no im2col rate: A's box is dY (K, (Q, P, Z, N))
at (K tile, rectangle), B's X ((W, H, D, N), C) at the rectangle shifted by the tap, (q0 + s x
dil_w - pad_w, p0 + r x dil_h - pad_h, z + t x dil_d - pad_d, n) (`cute.domain_offset` on the TMA
coordinate tensors; coordinates below 0 or past the extents are the TMA's zero fill, which is
exactly the padding). A rectangle's pixels past P or Q are zero in dY (A), so they add nothing
whatever B holds there. The shared-memory layouts are the im2col path's (the same staged
layouts handed to the atoms; the box's rows are the rectangle's pixels, columns fastest, in A
and B alike), so the consumers are unchanged. A 2x1 cluster's CTA loads half of each B box
(rect x 32 / rect rows), multicast to both.

Split: the grid is (tiles, splits); CTA (tile, s) sums the pixel k-tiles [s x per, (s + 1) x
per) of its tile (`per` from the launcher, every split non-empty). With splits > 1 each part
parks its fp32 accumulator and the last of the tile's parts sums them in split order and stores
(kernels/common/sm90/splitk.py). blockIdx.x is the tile, so the CTAs running together share
their splits' pixel ranges: A's and B's boxes come from L2 for all the tiles (dY and X read
from HBM about once a wave, not once a tile). Compile key `reduce` (the reduce split, a bench
variant, not bitwise repeatable): each part stages its fp32 tile in A's ring and adds it with
one `cp.reduce.async.bulk .add.f32` into its tile's one slot of mWork (zero at launch), then
counts itself; the last part loads that slot alone, zeroes it and stores (`_reduce_part`,
splitk_reduce.take_sum): the tail is the parts' bytes through the L2's adders, not one L2 round trip
per part group on one SM.

B's rows per k-tile were taken for the bound of the im2col walk (config.IM2COL_ROWS_128: ~128
per 0.8 us an SM); the 18:47 figures put it on the producer thread's run-time divisions instead
(docs/conv/NOTES.md, "The weight gradient's worst cases, 18:47"; `_produce_wgrad` has none
now). A 2x1 cluster (cluster_m = 2) shares the rows: the two CTAs of a cluster are two K
tiles of one (tap, channel tile) and split, each loads half of every B box and multicasts it to
both (the GEMM's B multicast), so a CTA takes tile_n / 2 rows per k-tile. The grid's K tiles
are then padded to even: a CTA past K loads zero rows of A, stores nothing and parks a zero part
of a tile nobody stores.

Warp roles, pipelines and registers are the GEMM's (producer warp 0 of warpgroup 0, setmaxnreg
40; tile_m / 64 consumer warpgroups, 232). One tile per CTA. PDL as the GEMM's; its late
trigger (`trigger` "late") right after the CTA's one mainloop, before the part is parked or
reduced (a part that is not its tile's last then exits) or the tile stored.

Constraints: C and K multiples of 8, 16-byte aligned bases (the launcher pads); tile_n a
multiple of 64; dY (M, K) row-major with M = N x Z x P x Q in the im2col walk's order.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import pdl, splitk, splitk_reduce
from forgekernel.kernels.common.sm90.atomics import atom_add_acq_rel_gpu
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.common.sm90.ptx import bulk_reduce_add_f32, fence_proxy_async_global
from forgekernel.kernels.conv.sm90.geometry import RECT_PIXELS, RECT_WIDTHS
from forgekernel.kernels.conv.sm90.im2col import im2col_atom
from forgekernel.kernels.conv.sm90.kernel import rect_index
from forgekernel.kernels.gemm.dense.sm90.kernel import Bar, GemmSm90
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig

BOX_CHANNELS = 64  # channels per im2col box: one 128-byte swizzle row of 16-bit elements
# Floats a thread of the tile's last part loads ahead of its sum (`_sum_parts`): the fragments
# of SUM_AHEAD // fragment parts in flight at once. splitk.sum_parts waits one L2 round trip a
# part (SASS of 64x64: eight LDG.E.128 then their FADDs, a loop iteration a part), and a 1x1's
# single 64x64 tile sums 42 parts that way (n32-c64-56x56-k64-1x1: 21.0 us against cuDNN's
# 12.8; docs/conv/NOTES.md, "The weight gradient's floor after 03:50").
SUM_AHEAD = 128


class ConvWgradSm90(GemmSm90):
    """The weight gradient on the dense GEMM's kernel; see the module docstring."""

    def __init__(
        self,
        config: GemmConfig,
        rect: int = 0,
        reduce: bool = False,
        pdl: bool = True,
        trigger: str = "top",
    ):
        if config.cluster_m not in (1, 2) or config.cluster_n != 1:
            raise ValueError("the weight gradient's clusters are 1x1 or 2x1 (B multicast)")
        if config.stream_k or config.a_rows:
            raise ValueError("the weight gradient runs without stream K or a_rows")
        if config.tile_n % BOX_CHANNELS:
            raise ValueError(f"tile_n must be a multiple of {BOX_CHANNELS}, got {config.tile_n}")
        if rect and (rect not in RECT_WIDTHS):
            raise ValueError(f"rect must be 0 (im2col) or one of {RECT_WIDTHS}, got {rect}")
        # PDL and its trigger as the GEMM's (the wait and the trigger: `wgrad_kernel`)
        super().__init__(config, pdl=pdl, trigger=trigger)
        self.boxes = config.tile_n // BOX_CHANNELS  # B boxes per stage
        # stride 1: k-tiles are rectangles of (rect along Q, 64 / rect along P) output pixels of
        # one (image, plane), A and B through tiled TMAs; 0: im2col (any stride)
        self.rect = rect
        self.rect_shape = (rect, RECT_PIXELS // rect, 1, 1) if rect else None
        # split: each part bulk-reduce-adds its fp32 tile into its tile's sum slot (kept zero
        # between launches) instead of parking it for the last part to sum (`_reduce_part`)
        self.reduce = reduce

    @cute.jit
    def __call__(
        self,
        mDY: cute.Tensor,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mWork: cute.Tensor,
        mFlags: cute.Tensor,
        pad_lo_d: cutlass.Int32,
        pad_lo_h: cutlass.Int32,
        pad_lo_w: cutlass.Int32,
        pad_hi_d: cutlass.Int32,
        pad_hi_h: cutlass.Int32,
        pad_hi_w: cutlass.Int32,
        stride_d: cutlass.Int32,
        stride_h: cutlass.Int32,
        stride_w: cutlass.Int32,
        dil_d: cutlass.Int32,
        dil_h: cutlass.Int32,
        dil_w: cutlass.Int32,
        per_split: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mDY (M, K), mX (N, D, H, W, C), mW (K, T, R, S, C) the gradient written; mWork fp32
        (>= splits x tiles x tile_m x tile_n,) 16-byte aligned and mFlags int32 (>= tiles,)
        zero (every launch leaves it zero); `per_split` pixel k-tiles per split (the grid:
        ceil(k-tiles / per_split) splits). Padding below / above, stride and dilation per
        (D, H, W)."""
        self.a_dtype = mDY.element_type
        self.b_dtype = mX.element_type
        self.c_dtype = mW.element_type
        self.a_major = LayoutEnum.COL_MAJOR  # dY^T: output channels contiguous
        self.b_major = LayoutEnum.COL_MAJOR  # im2col(X): input channels contiguous
        self.c_major = LayoutEnum.ROW_MAJOR
        self.scaled = False
        self._setup()
        cfg = self.cfg
        # A's ring (stages x tile_m x tile_k 16-bit) stages the reduce split's fp32 tile
        if cutlass.const_expr(self.reduce and self.stages * cfg.tile_k < 2 * cfg.tile_n):
            raise ValueError(
                f"reduce: {self.stages} stages of A hold no fp32 {cfg.tile_n}-wide tile"
            )
        geometry = (
            (pad_lo_d, pad_lo_h, pad_lo_w),
            (pad_hi_d, pad_hi_h, pad_hi_w),
            (stride_d, stride_h, stride_w),
            (dil_d, dil_h, dil_w),
        )
        if cutlass.const_expr(self.rect):
            # A: dY (N, Z, P, Q, K) seen as (K, (Q, P, Z, N)), a box tile_m channels x one
            # rectangle (its pixels Q fastest: the B box's row order)
            mA = cute.make_tensor(mDY.iterator, cute.select(mDY.layout, mode=[4, 3, 2, 1, 0]))
            mA = cute.group_modes(mA, 1, 5)
            a_box = (cfg.tile_m, self.rect_shape)
            pixels = mDY.shape[0] * mDY.shape[1] * mDY.shape[2] * mDY.shape[3]
        else:
            # A: dY (M, K) seen as (K, M)
            mA = cute.make_tensor(mDY.iterator, cute.select(mDY.layout, mode=[1, 0]))
            a_box = (cfg.tile_m, cfg.tile_k)
            pixels = mDY.shape[0]
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(self.sA_load_layout, (None, None, 0)),
            a_box,
        )
        # B: im2col boxes (tile_k pixels, 64 channels), `boxes` of them per stage, in the
        # K-major layout that is the N-major stage's 64-channel blocks (module docstring)
        box_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.b_dtype, BOX_CHANNELS),
            self.b_dtype,
        )
        self.sB_box_layout = cute.tile_to_shape(
            box_atom, (cfg.tile_k, BOX_CHANNELS, self.boxes * self.stages), order=(0, 1, 2)
        )
        taps = (mW.shape[1], mW.shape[2], mW.shape[3])  # (T, R, S)
        if cutlass.const_expr(self.rect):
            # B: X (N, D, H, W, C) seen as ((W, H, D, N), C), a box one rectangle x 64
            # channels at the tap's offset (coordinates below 0 or past the extents: the TMA's
            # zero fill, the padding)
            mB = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 2, 1, 0, 4]))
            mB = cute.group_modes(mB, 0, 4)
            op = (
                cpasync.CopyBulkTensorTileG2SMulticastOp()
                if self.mcast_b > 1
                else cpasync.CopyBulkTensorTileG2SOp()
            )
            tma_b, tma_mB = cpasync.make_tiled_tma_atom(
                op,
                mB,
                cute.slice_(self.sB_box_layout, (None, None, 0)),
                (self.rect_shape, BOX_CHANNELS),
                num_multicast=self.mcast_b,
            )
        else:
            tma_b, tma_mB = im2col_atom(
                mX,
                taps,
                geometry,
                cute.slice_(self.sB_box_layout, (None, None, 0)),
                (cfg.tile_k, BOX_CHANNELS),
                self.mcast_b,
            )
        # D: W (K, T, R, S, C) as (K, (C, S, R, T)), a tile tile_n channels of one tap
        mC = cute.make_tensor(mW.iterator, cute.select(mW.layout, mode=[0, 4, 3, 2, 1]))
        mC = cute.group_modes(mC, 1, 5)
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            mC,
            cute.slice_(self.sC_layout, (None, None, 0)),
            (cfg.tile_m, (cfg.epi_n,)),
        )

        # K tiles, padded to whole clusters
        tiles_m = cute.ceil_div(mW.shape[0], cfg.tile_m * cfg.cluster_m) * cfg.cluster_m
        c_tiles = cute.ceil_div(mW.shape[4], cfg.tile_n)  # channel tiles per tap
        tiles = tiles_m * c_tiles * taps[0] * taps[1] * taps[2]
        # the rectangles' grid: (per Q, per P, Z) rectangles (the im2col walk: none)
        rects = (1, 1, 1)
        if cutlass.const_expr(self.rect):
            rects = (
                cute.ceil_div(mDY.shape[3], self.rect_shape[0]),
                cute.ceil_div(mDY.shape[2], self.rect_shape[1]),
                mDY.shape[1],
            )
            k_tiles = rects[0] * rects[1] * rects[2] * mDY.shape[0]
        else:
            k_tiles = cute.ceil_div(pixels, cfg.tile_k)
        splits = cute.ceil_div(k_tiles, per_split)
        walk = (tiles_m, c_tiles, cute.ceil_div(mW.shape[4], BOX_CHANNELS), k_tiles, per_split)
        # the tiled walk's tap offsets: (taps (T, R, S), padding below, dilation) per (D, H, W)
        offsets = (taps, geometry[0], geometry[3])

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            split_last: cute.struct.MemRange[cutlass.Int32, 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.sA_layout)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.sB_layout)], 1024
            ]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.sC_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        self.wgrad_kernel(
            (tma_a, tma_mA),
            (tma_b, tma_mB),
            (tma_c, tma_mC),
            self.tiled_mma,
            (self.sA_load_layout, self.sB_layout, self.sB_box_layout, self.sC_layout),
            walk,
            (rects, offsets),
            mWork,
            mFlags,
        ).launch(
            grid=(tiles, splits, 1),
            block=[self.threads_per_cta, 1, 1],
            cluster=(cfg.cluster_m, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.pdl,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def wgrad_kernel(
        self,
        load_a: tuple,
        load_b: tuple,
        store_c: tuple,
        tiled_mma: cute.TiledMma,
        layouts: tuple,
        walk: tuple,
        rect_walk: tuple,
        mWork: cute.Tensor,
        mFlags: cute.Tensor,
    ):
        """`walk`: (K tiles, channel tiles per tap, 64-channel blocks, pixel k-tiles, k-tiles
        per split); `rect_walk` (the tiled path's): ((rectangles per Q, per P, Z), ((T, R, S),
        padding below, dilation))."""
        tma_a, mA = load_a
        tma_b, mB = load_b
        tma_c, mC = store_c
        sA_layout, sB_layout, sB_box_layout, sC_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        # a 2x1 cluster: the CTAs of two K tiles, B multicast to both
        cluster = (self.cfg.cluster_m, 1)
        cta_layout_mnk = cute.make_layout((*cluster, 1))
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        b_mask = 0
        if cutlass.const_expr(self.mcast_b > 1):
            b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)

        storage = SmemAllocator().allocate(self.shared_storage)
        stage_bytes = (self.cfg.tile_m + self.cfg.tile_n) * self.cfg.tile_k * self.a_dtype.width
        # each consumer warp releases a stage to every CTA that multicast into it
        ab_pipe = tma_pipeline(
            storage.ab_barriers,
            self.stages,
            stage_bytes // 8,
            self.mcast_b * (self.num_mma_threads // 32),
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
        )
        init_arrive(cluster)

        sA = smem_tensor(storage.sA, sA_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sC = smem_tensor(storage.sC, sC_layout)

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma = tiled_mma.get_slice((wg_idx - 1) * THREADS_PER_WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        gC = cute.local_tile(mC, (self.cfg.tile_m, (self.cfg.tile_n,)), (None, None))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[None, None, 0, 0]).shape, self.acc_dtype)

        init_wait(cluster)
        # PDL: nothing above touched global memory (the GEMM's module docstring)
        pdl.wait(self.pdl)
        pdl.launch_dependents(self.pdl and not self.late_trigger)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if cutlass.const_expr(self.rect):
                if warp_idx == 0:
                    tile_m, tile_n, k0, count = self._unit(walk)
                    _, c_tiles, c_boxes, _, _ = walk
                    where = ((tile_m, tile_n % c_tiles, tile_n // c_tiles), c_boxes, (k0, count))
                    self._produce_rects(
                        (tma_a, mA, sA),
                        (tma_b, mB, smem_tensor(storage.sB, sB_box_layout), b_mask),
                        cluster_coord[0],
                        ab_pipe,
                        where,
                        rect_walk,
                    )
            elif warp_idx == 0:
                tile_m, tile_n, k0, count = self._unit(walk)
                gA = cute.local_tile(mA, (self.cfg.tile_m, self.cfg.tile_k), (tile_m, None))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_a,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sA, 0, 2),
                    cute.group_modes(gA, 0, 2),
                )
                # (pixels, channels, pixel k-tiles, (64-channel blocks, S, R, T))
                gB = cute.local_tile(mB, (self.cfg.tile_k, (BOX_CHANNELS,)), (None, None))
                # each CTA of a cluster loads its share of a box, multicast to both
                tBsB, tBgB = cpasync.tma_partition(
                    tma_b,
                    cluster_coord[0],
                    cute.make_layout(self.cfg.cluster_m),
                    cute.group_modes(smem_tensor(storage.sB, sB_box_layout), 0, 2),
                    cute.group_modes(gB, 0, 2),
                )
                # this tile's first box: block (channel tile x boxes) of its tap (s, r, t)
                _, c_tiles, c_boxes, _, _ = walk
                c_tile = tile_n % c_tiles
                tap = tile_n // c_tiles
                _, taps_r, taps_s = rect_walk[1][0]
                srt = (tap % taps_s, (tap // taps_s) % taps_r, tap // (taps_s * taps_r))
                where = (c_tile * self.boxes, c_boxes, srt, (k0, count))
                b_src = (tma_b, tBgB, tBsB, b_mask)
                self._produce_wgrad((tma_a, tAgA, tAsA), b_src, ab_pipe, where)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            read = consumer_state(self.stages)
            release = consumer_state(self.stages)
            read, release, tiled_mma = self._mainloop(
                self._unit(walk)[3], tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release
            )
            # late trigger: the CTA's one mainloop done, before its part is parked or reduced
            # (a split CTA that is not its tile's last exits after that) or its tile stored
            pdl.launch_dependents(self.late_trigger)
            # the unit's indices again: read after the mainloop, not kept live through it
            tile_m, tile_n, _, _ = self._unit(walk)
            tile, split, _ = cute.arch.block_idx()
            tiles, splits, _ = cute.arch.grid_dim()
            epi_barrier = named_barrier(Bar.EPILOGUE, self.num_mma_threads)
            thread = tidx - THREADS_PER_WG
            last = cutlass.Boolean(True)
            if splits > 1:
                s_last = storage.split_last.get_tensor(cute.make_layout(2))
                if cutlass.const_expr(self.reduce):
                    # A's ring, free once both warpgroups' WGMMAs are done: the fp32 staging
                    sWork = cute.make_tensor(
                        cute.recast_ptr(storage.sA.data_ptr(), dtype=cutlass.Float32),
                        cute.make_layout((cute.size(acc) * self.num_mma_threads,)),
                    )
                    where = (tile, splits, sWork)
                    last = _reduce_part(
                        acc, mWork, mFlags, where, self.num_mma_threads, thread, epi_barrier,
                        s_last,
                    )  # fmt: skip
                    if last:
                        splitk_reduce.take_sum(acc, mWork, tile, self.num_mma_threads, thread)
                else:
                    part = (split * tiles + tile, tile, splits)
                    last = splitk.park(
                        acc, mWork, mFlags, part, self.num_mma_threads, thread, epi_barrier,
                        s_last,
                    )  # fmt: skip
                    if last:
                        slots = (tile, tiles, splits)  # the tile's parts in split order
                        _sum_parts(acc, mWork, slots, self.num_mma_threads, thread)
            if last:
                epi = self._epilogue_parts(tidx, tiled_mma, acc, sC, epi_barrier)
                gC_tile = gC[(None, None, tile_m, tile_n)]
                self._epilogue(gC_tile, tma_c, sC, epi, warp_idx, cutlass.Int32(0))
                epi[5].producer_tail()

    @cute.jit
    def _unit(self, walk):
        """This CTA's (K tile, (channel tile, tap) tile, first pixel k-tile, k-tiles)."""
        tiles_m, _, _, k_tiles, per_split = walk
        tile, split, _ = cute.arch.block_idx()
        k0 = split * per_split
        count = cutlass.min(k0 + per_split, k_tiles) - k0
        return tile % tiles_m, tile // tiles_m, k0, count

    @cute.jit
    def _produce_wgrad(self, load_a, load_b, ab_pipe, where):
        """The producer warp: the split's k-tiles of A (one box) and B (`boxes` im2col boxes,
        channel blocks first_box.. of the tap, clamped to the last block) into the ring.
        `where`: (first box, 64-channel blocks, the tap (s, r, t), (first k-tile, k-tiles)).

        No run-time division per k-tile in the producer thread (docs/conv/NOTES.md, "The weight
        gradient's worst cases, 18:47": nine a k-tile on 128x128, ~340 SASS instructions, held
        the walk to ~0.9 us a k-tile): B's boxes are named by their coordinate (channel block,
        s, r, t), fixed for the CTA, and their pixel by (q, p, z, n), kept by an odometer and
        handed to the im2col TMA's coordinate layout as a tuple (a flat pixel index there is
        decomposed by three divisions at every copy)."""
        tma_a, tAgA, tAsA = load_a
        tma_b, tBgB, tBsB, b_mask = load_b
        first_box, c_boxes, (s_, r_, t_), (k0, count) = where
        blocks = [cutlass.min(first_box + j, c_boxes - 1) for j in range(self.boxes)]
        # each box's coordinate tensor at the part's first k-tile: inner (the im2col TMA's
        # ((Q, P, Z, N), (C, S, R, T)) -> coordinates) o offset (pixel m, (c, s, r, t)) o box
        first = [tBgB[(None, k0, (blocks[j], s_, r_, t_))] for j in range(self.boxes)]
        extents = first[0].layout.inner.shape[0]  # (Q, P, Z, N)
        # the first pixel (the cluster's share included) as (q, p, z, n) and the 64-pixel step
        # as mixed-radix digits: divisions once per CTA, then an odometer (one carry a digit)
        q, p, z, n = self._digits(first[0].layout.offset[0], extents)
        dq, dp, dz, dn = self._digits(cutlass.Int32(self.cfg.tile_k), extents)
        # the box with its pixel along q: the offset's pixel is then the tuple (q, p, z, n)
        box = first[0].layout.outer
        box_qpzn = cute.make_layout(box.shape, stride=(((cute.E([1, 0]), cute.E([0, 0])), 0),))
        prod = producer_state(self.stages)
        for i in range(count):
            kt = k0 + i
            ab_pipe.producer_acquire(prod)
            bar = ab_pipe.producer_get_barrier(prod)
            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
            for j in cutlass.range_constexpr(self.boxes):
                at = first[j].layout
                offset = ((q, p, z, n), at.offset[1])
                src = cute.make_tensor(
                    first[j].iterator, cute.make_composed_layout(at.inner, offset, box_qpzn)
                )
                cute.copy(
                    tma_b,
                    src,
                    tBsB[(None, prod.index * self.boxes + j)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mask,
                )
            ab_pipe.producer_commit(prod)
            prod.advance()
            q, p, z, n = q + dq, p + dp, z + dz, n + dn
            if q >= extents[0]:
                q = q - extents[0]
                p = p + 1
            if p >= extents[1]:
                p = p - extents[1]
                z = z + 1
            if z >= extents[2]:
                z = z - extents[2]
                n = n + 1
        ab_pipe.producer_tail(prod)

    @staticmethod
    def _digits(m, extents):
        """Pixel m (or a step of m pixels) as (q, p, z, n) over extents (Q, P, Z, N), Q fastest:
        three run-time divisions."""
        q = m % extents[0]
        rest = m // extents[0]
        p = rest % extents[1]
        rest = rest // extents[1]
        return q, p, rest % extents[2], rest // extents[2]

    @cute.jit
    def _produce_rects(self, load_a, load_b, cta, ab_pipe, where, rect_walk):
        """The producer warp of the stride-1 path: per k-tile, one rectangle of output pixels
        (`rect_index`): A's box at (K tile, rectangle) of dY, B's `boxes` boxes at the rectangle
        shifted by the tap's offset (s x dilation - padding per dim) in X, channel blocks
        first.. of the tile (clamped to the last); a 2x1 cluster's CTA `cta` loads its half of
        each B box, multicast to both. `where`: ((K tile, channel tile, tap), 64-channel blocks,
        (first k-tile, k-tiles))."""
        tma_a, mA, sA = load_a
        tma_b, mB, sB, b_mask = load_b
        (tile_m, c_tile, tap), c_boxes, (k0, count) = where
        rects, ((_, taps_r, taps_s), pad, dil) = rect_walk
        s_ = tap % taps_s
        r_ = (tap // taps_s) % taps_r
        t_ = tap // (taps_s * taps_r)
        # the tap's offset in X from the output pixel, per (W, H, D)
        off_w = s_ * dil[2] - pad[2]
        off_h = r_ * dil[1] - pad[1]
        off_d = t_ * dil[0] - pad[0]
        one = cute.make_layout(1)
        a_tile = (self.cfg.tile_m, self.rect_shape)
        b_tile = (self.rect_shape, BOX_CHANNELS)
        prod = producer_state(self.stages)
        # the part's first rectangle, then an odometer (Q's rectangles fastest, then P's, Z,
        # N): no run-time division per k-tile in the producer thread
        per_q, per_p, planes = rects
        n, z, pt, qt = rect_index(k0, rects)
        for _ in range(count):
            p0 = pt * self.rect_shape[1]
            q0 = qt * self.rect_shape[0]
            ab_pipe.producer_acquire(prod)
            bar = ab_pipe.producer_get_barrier(prod)
            gA = cute.local_tile(
                cute.domain_offset((tile_m * self.cfg.tile_m, (q0, p0, z, n)), mA),
                a_tile,
                (0, 0),
            )
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            cute.copy(tma_a, tAgA, tAsA[(None, prod.index)], tma_bar_ptr=bar)
            for j in cutlass.range_constexpr(self.boxes):
                block = cutlass.min(c_tile * self.boxes + j, c_boxes - 1)
                origin = ((q0 + off_w, p0 + off_h, z + off_d, n), block * BOX_CHANNELS)
                gB = cute.local_tile(cute.domain_offset(origin, mB), b_tile, (0, 0))
                tBsB, tBgB = cpasync.tma_partition(
                    tma_b,
                    cta,
                    cute.make_layout(self.cfg.cluster_m),
                    cute.group_modes(sB, 0, 2),
                    cute.group_modes(gB, 0, 2),
                )
                cute.copy(
                    tma_b,
                    tBgB,
                    tBsB[(None, prod.index * self.boxes + j)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mask,
                )
            ab_pipe.producer_commit(prod)
            prod.advance()
            qt += 1
            if qt == per_q:
                qt = cutlass.Int32(0)
                pt += 1
                if pt == per_p:
                    pt = cutlass.Int32(0)
                    z += 1
                    if z == planes:
                        z = cutlass.Int32(0)
                        n += 1
        ab_pipe.producer_tail(prod)

    def _epilogue_parts(self, tidx, tiled_mma, acc, sC, epi_barrier):
        """The GEMM epilogue's copies and ring (`GemmSm90._epilogue`'s `epi` tuple): registers
        -> stmatrix -> the swizzled shared-memory ring -> TMA store."""
        r2s_atom = sm90_utils.sm90_get_smem_store_op(
            self.c_major, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
        )
        stm_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype)
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
        thr_r2s = r2s.get_slice(tidx - THREADS_PER_WG)
        rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        )
        return (
            r2s,
            thr_r2s.partition_D(sC),
            r2s.retile(acc),
            cute.make_rmem_tensor(rC_shape, self.acc_dtype),
            cute.make_rmem_tensor(rC_shape, self.c_dtype),
            store_pipe,
            epi_barrier,
        )


@cute.jit
def _sum_parts(acc, mWork, slots, threads: cutlass.Constexpr, thread):
    """splitk.sum_parts (acc = the parts parked in slots first, first + step, ..., in that
    order, fp32) with the slots of `ahead` = SUM_AHEAD // fragment parts loaded before any of
    them is added (the last (parts - 1) % ahead too, predicated): one L2 round trip per `ahead`
    parts instead of per part. The additions are
    splitk.sum_parts's, in the same order (bitwise the same sum). A fragment of more than
    SUM_AHEAD / 2 floats (128x256: 128 a thread) takes splitk.sum_parts itself."""
    frag = cute.size(acc)
    ahead = SUM_AHEAD // frag
    if cutlass.const_expr(ahead < 2):
        splitk.sum_parts(acc, mWork, slots, threads, thread)
    else:
        first, step, parts = slots
        src = splitk.slot_view(mWork, frag, threads, first, thread)
        cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
        bufs = [cute.make_rmem_tensor(src.layout.shape, cutlass.Float32) for _ in range(ahead)]
        groups = (parts - 1) // ahead
        for g in range(groups):
            for u in cutlass.range_constexpr(ahead):
                slot = first + (1 + g * ahead + u) * step
                cute.autovec_copy(splitk.slot_view(mWork, frag, threads, slot, thread), bufs[u])
            for u in cutlass.range_constexpr(ahead):
                for v in cutlass.range_constexpr(frag):
                    acc[v] = acc[v] + bufs[u][v]
        # the last (parts - 1) % ahead parts, loaded together too (predicated)
        rest = 1 + groups * ahead
        for u in cutlass.range_constexpr(ahead - 1):
            if rest + u < parts:
                slot = first + (rest + u) * step
                cute.autovec_copy(splitk.slot_view(mWork, frag, threads, slot, thread), bufs[u])
        for u in cutlass.range_constexpr(ahead - 1):
            if rest + u < parts:
                for v in cutlass.range_constexpr(frag):
                    acc[v] = acc[v] + bufs[u][v]


@cute.jit
def _reduce_part(acc, mWork, mFlags, where, threads: cutlass.Constexpr, thread, barrier, s_last):
    """The reduce split's part: add this part's fp32 accumulator to its tile's sum slot (slot
    `tile` of mWork, splitk's slot layout, zero before the tile's first part) with one
    `cp.reduce.async.bulk .add.f32` from shared memory (`sWork`: the fragment staged in the
    slot's order), then count the part in the tile's flag; True in every thread for the tile's
    last part. `where`: (tile, parts, sWork). The additions land in the order the parts
    arrive: exact fp32 sums, not bitwise repeatable. Thread 0 issues the reduce, waits for it
    to complete (not only to read shared memory) and fences the async proxy before its
    release, so the last part's generic loads see every part (the attention backward's dQ
    protocol, dq_reduction.py)."""
    tile, parts, sWork = where
    frag = cute.size(acc)
    # both consumer warpgroups past their last WGMMA (A's ring is read no more)
    barrier.arrive_and_wait()
    stage = splitk.slot_view(sWork, frag, threads, 0, thread)
    cute.autovec_copy(cute.make_tensor(acc.iterator, stage.layout.shape), stage)
    cute.arch.fence_view_async_shared()
    barrier.arrive_and_wait()
    if thread == 0:
        bulk_reduce_add_f32(
            mWork.iterator + tile * frag * threads, sWork.iterator, frag * threads * 4
        )
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        fence_proxy_async_global()
        arrived = atom_add_acq_rel_gpu(mFlags.iterator + tile, 1)
        last = arrived == parts - 1
        if last:
            mFlags[tile] = 0
        s_last[0] = cutlass.Int32(last)
    barrier.arrive_and_wait()
    return s_last[0] != 0
