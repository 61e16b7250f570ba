"""The strided data gradient of a convolution on Hopper (sm_90a) in one launch: every output
phase and its tiles, on the forward kernel's data-gradient mode (kernel.py), channels-last,
fp32 accumulation.

    dX[n, a + s j, c] = sum_{taps f of phase a, k} dY[n, j + e_f, k] W[k, f, c]    (per dim)

with strides s of 1 or 2 per dim (not all 1), phases a < s, e_f = (a + pad_lo - f dil) / s for
the taps f with f dil = a + pad_lo (mod s); a phase no tap reaches is zero. Every phase is a
stride-1 forward convolution of dY (geometry.py, "the fused data gradient"), and all of them
share one im2col walk of dY: one descriptor whose window for walk output j starts at j + L (L the
least e of any phase) and whose filter offsets e - L cover every phase's taps; the walk visits
J = ceil(I / s) outputs per dim, the longest phase's extent.

What differs from the forward kernel (whose roles, pipelines, mainloop, split protocol and
stmatrix staging it runs; see its docstring):
- the schedule's M axis holds every phase: slot by slot in the host's order (most taps first:
  the static round robin then starts the long units first), each phase's parts (a split phase
  of k k-tiles runs ceil(k / per_split) parts: units of about equal length), each part's M
  tiles of the walk (`phase_walk.PhaseWalk`); the N axis is dX's channel tiles;
- the producer walks a unit's k-tiles over its phase's taps: A at the walk's tap offsets, B in
  W (K, T, R, S, C) whole (N-major, as the data-gradient mode reads it) at the phase's taps
  reversed: one descriptor each for every phase, no filter copy;
- a unit of a phase with no tap runs no k-tile and stores zeros;
- the epilogue writes rows, not boxes: a phase's output is a strided view of dX (its rows jump
  by the stride along W and wrap onto other rows along H and D), which no TMA box of the tile's
  consecutive walk rows describes (a strided tensor map would store a box per row segment, a
  segment starting at any row of the swizzled tile: up to tile_m stores of one row each). The
  accumulator is staged through stmatrix into the epilogue ring (two buffers of tile_m x 64
  channels) and each consumer thread stores 16-byte chunks of rows (st.global.v4: eight threads
  a 128-byte row segment) at the row's address in dX, rows past the phase's extent or the
  batch and channels past C skipped. No scratch buffer and no copy.
- split: unit (row u of the M axis, N tile n) parks in workspace slot n x units_m + u; its
  tile's parts lie slot_tiles rows apart; the flag is the tile's (slot, M tile, N tile).
- the late trigger (`trigger` "late"): after the CTA's last unit's mainloop, or in its place for
  a unit of no tap.

Constraints: the forward kernel's (tile_k 64, C and K multiples of 8, 16-byte aligned rows),
padding of the walk >= 0 (the launcher crops dY), dX (N, D, H, W, C) any view with 16-byte
aligned rows (C a multiple of 8: the launcher pads through a scratch buffer otherwise).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from forgekernel.kernels.common.sm90 import pdl, splitk
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_wait,
    producer_state,
    smem_tensor,
)
from forgekernel.kernels.common.sm90.scheduler.static import StaticSchedule, StaticScheduler
from forgekernel.kernels.conv.sm90.config import ConvConfig
from forgekernel.kernels.conv.sm90.kernel import Bar, ConvFpropSm90, at_pixel, pixel_digits
from forgekernel.kernels.conv.sm90.phase_walk import PhaseWalk

CHUNK_BITS = 128  # one st.global.v4 of the row-addressed epilogue


class ConvDgradSm90(ConvFpropSm90):
    """Persistent, warp-specialized fused data gradient; see the module docstring."""

    def __init__(self, config: ConvConfig, pdl: bool = True, trigger: str = "top"):
        super().__init__(config, bias=False, dgrad=True, pdl=pdl, trigger=trigger)
        if config.epi_stages < 2:
            raise ValueError("the row-addressed epilogue alternates two buffers or more")

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,
        mW: cute.Tensor,
        mDx: cute.Tensor,
        mWork: cute.Tensor | None,
        mFlags: cute.Tensor | None,
        pad_lo_d: cutlass.Int32,
        pad_lo_h: cutlass.Int32,
        pad_lo_w: cutlass.Int32,
        pad_hi_d: cutlass.Int32,
        pad_hi_h: cutlass.Int32,
        pad_hi_w: cutlass.Int32,
        walk_d: cutlass.Int32,
        walk_h: cutlass.Int32,
        walk_w: cutlass.Int32,
        taps_d: cutlass.Int32,
        taps_h: cutlass.Int32,
        taps_w: cutlass.Int32,
        order: cutlass.Int32,
        per_split: cutlass.Int32,
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mDy (N, Z', P', Q', K) (the walk's input, cropped), mW (K, T, R, S, C), mDx (N, D, H,
        W, C); the walk's padding below / above, then the packed codes (geometry.FusedDgrad.
        kernel_args). Split (`config.split`): `per_split` k-tiles per part, mWork fp32 (>= a
        tile_m x tile_n slot per unit) and mFlags int32 (>= a flag per output tile) zero (left
        zero); otherwise None, None and any per_split."""
        self._setup(mDy.element_type)
        codes = (walk_d, walk_h, walk_w)
        walk_trs = tuple((c >> 16) & 0xFF for c in codes)
        one = cutlass.Int32(1)
        geometry = (
            (pad_lo_d, pad_lo_h, pad_lo_w),
            (pad_hi_d, pad_hi_h, pad_hi_w),
            (one, one, one),
            (one, one, one),
        )
        tma_a, tma_mA, tma_b, tma_mB, c_blocks = self._operands(mDy, mW, walk_trs, geometry)
        # the walk's outputs (the longest phase's, J = ceil(I / stride) per dim) x the batch
        m_rows = mDx.shape[0]
        for i in cutlass.range_constexpr(3):
            stride = codes[i] & 0xF
            m_rows *= (mDx.shape[1 + i] + stride - 1) // stride
        cm = self.cfg.cluster_m
        slot_tiles = cute.ceil_div(cute.ceil_div(m_rows, self.cfg.tile_m), cm) * cm
        if cutlass.const_expr(not self.cfg.split):
            per_split = c_blocks * walk_trs[0] * walk_trs[1] * walk_trs[2]  # >= any phase's
        walk = PhaseWalk(
            codes,
            (taps_d, taps_h, taps_w),
            order,
            c_blocks,
            per_split,
            slot_tiles,
            (mW.shape[1], mW.shape[2], mW.shape[3]),
            walk_trs,
            (mDx.shape[1], mDx.shape[2], mDx.shape[3]),
        )
        units_m = walk.units_m()
        tiles_n = cute.ceil_div(mDx.shape[4], self.cfg.tile_n)
        schedule = StaticSchedule(
            (units_m, tiles_n), self.cluster_shape_mn, self.cfg.swizzle, self.cfg.raster_along_m
        )
        self.shared_storage = self._shared_storage()
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            mDx,
            self.tiled_mma,
            self.cta_layout_mnk,
            self.sA_layout,
            self.sB_layout,
            self.sC_layout,
            schedule,
            walk,
            (units_m, mWork, mFlags),
        ).launch(
            grid=schedule.grid(max_active_clusters),
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.pdl,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mDx: cute.Tensor,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        schedule: StaticSchedule,
        walk: PhaseWalk,
        split_io: tuple,
    ):
        """`split_io`: (the schedule's M tiles, the split's workspace, flags) (None, None
        unsplit)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        cluster_coord, masks, storage, ab_pipe = self._ring(cta_layout_mnk)
        sA = smem_tensor(storage.sA, sA_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sC = smem_tensor(storage.sC, sC_layout)

        # (bM, bK, tiles_m, k-tiles ((C blocks), S, R, T)): the walk's; B: W's taps
        tiler_k = (self.cfg.tile_k,)
        gA = cute.local_tile(mA, (self.cfg.tile_m, tiler_k), (None, None))
        gB = cute.local_tile(mB, (self.cfg.tile_n, tiler_k), (None, None))

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma = tiled_mma.get_slice((wg_idx - 1) * THREADS_PER_WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tile = cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(tile).shape, self.acc_dtype)

        init_wait(self.cluster_shape_mn)
        # PDL: nothing above touched global memory (the GEMM's module docstring)
        pdl.wait(self.pdl)
        pdl.launch_dependents(self.pdl and not self.late_trigger)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                load_a, load_b = self._loads(
                    (tma_a, gA, sA), (tma_b, gB, sB), cluster_coord, cta_layout_mnk, masks
                )
                self._produce(load_a, load_b, ab_pipe, schedule, walk)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma = (tiled_mma, tCrA, tCrB, acc)
            split = (*split_io, storage.split_last.get_tensor(cute.make_layout(2)))
            self._consume(tidx, mma, ab_pipe, (sC, mDx), schedule, (walk, split))

    @cute.jit
    def _produce(self, load_a, load_b, ab_pipe, schedule, walk: PhaseWalk):
        """The producer warp: every unit's k-tiles of A (the walk at the phase's tap offsets)
        and B (W at the phase's taps, reversed) into the ring."""
        tma_a, tAgA, tAsA, a_mask = load_a
        tma_b, tBgB, tBsB, b_mask = load_b
        prod = producer_state(self.stages)
        sched = StaticScheduler(schedule)
        work = sched.first()
        while sched.valid(work):
            u, tile_n = sched.tile(work)
            slot, _, local, _, _, k0, count = walk.unit(u)
            _, counts, offsets, w_taps = walk.phase(slot)
            # the part's first k-tile as (channel block, tap), then an odometer: cb fastest,
            # then the taps along W, H, D
            cb, tap = walk.tap_of(k0, counts)
            it, ir, is_ = tap
            # A's tile's first pixel as (q, p, z, n): divisions once per unit, not per copy
            first = tAgA[(None, local, (0, 0, 0, 0))]
            qpzn = pixel_digits(first.layout.offset[0], first.layout.inner.shape[0])
            for _ in range(count):
                # coordinates (cb, s, r, t), not flat k-tiles: no division per k-tile
                kt_a, kt_b = walk.tiles_of(cb, (it, ir, is_), offsets, w_taps)
                ab_pipe.producer_acquire(prod)
                bar = ab_pipe.producer_get_barrier(prod)
                cute.copy(
                    tma_a,
                    at_pixel(tAgA[(None, local, kt_a)], qpzn),
                    tAsA[(None, prod.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=a_mask,
                )
                cute.copy(
                    tma_b,
                    tBgB[(None, tile_n, kt_b)],
                    tBsB[(None, prod.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mask,
                )
                ab_pipe.producer_commit(prod)
                prod.advance()
                cb += 1
                if cb == walk.c_blocks:
                    cb = cutlass.Int32(0)
                    is_ += 1
                    if is_ == counts[2]:
                        is_ = cutlass.Int32(0)
                        ir += 1
                        if ir == counts[1]:
                            ir = cutlass.Int32(0)
                            it += 1
            work = sched.next(work)
        ab_pipe.producer_tail(prod)

    @cute.jit
    def _consume(self, tidx, mma, ab_pipe, out, schedule, walk_split):
        """The consumer warpgroups: each unit's mainloop (none for a phase of no tap: zeros);
        split, the part parked and, by the tile's last part, all of them summed in part order;
        then the rows into dX. `out`: (sC, dX); `walk_split`: (the walk, (the schedule's M
        tiles, workspace, flags, the shared flag))."""
        tiled_mma, tCrA, tCrB, acc = mma
        sC, mDx = out
        walk, (units_m, mWork, mFlags, s_last) = walk_split
        epi_barrier = named_barrier(Bar.EPILOGUE, self.num_mma_threads)
        read = consumer_state(self.stages)
        release = consumer_state(self.stages)
        epi = (*self._staging(tidx, tiled_mma, sC, acc), epi_barrier)
        thread = tidx - THREADS_PER_WG
        threads = self.num_mma_threads
        tiles_done = cutlass.Int32(0)  # this CTA's tiles so far: the epilogue ring's position
        sched = StaticScheduler(schedule)
        work = sched.first()
        while sched.valid(work):
            u, tile_n = sched.tile(work)
            work = sched.next(work)
            slot, part, local, first, parts, _, count = walk.unit(u)
            if count > 0:
                read, release, tiled_mma = self._mainloop(
                    count, tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release
                )
            if cutlass.const_expr(self.late_trigger):
                # the CTA's last unit (`sched.valid`), its mainloop done or none (no tap)
                if work >= schedule.blocks:
                    pdl.launch_dependents(True)
            last = cutlass.Boolean(True)
            if cutlass.const_expr(self.cfg.split):
                if parts > 1:
                    flag = (tile_n * walk.slots() + slot) * walk.slot_tiles + local
                    where = (tile_n * units_m + u, flag, parts)
                    last = splitk.park(
                        acc, mWork, mFlags, where, threads, thread, epi_barrier, s_last
                    )
                    if last:
                        parked = (tile_n * units_m + first + local, walk.slot_tiles, parts)
                        splitk.sum_parts(acc, mWork, parked, threads, thread)
            if last:
                a, _, _, _ = walk.phase(slot)
                rows = self._rows(thread, (mDx, walk, a), local, tile_n)
                if count > 0:
                    self._store_rows(epi, sC, mDx, rows, tiles_done)
                    tiles_done += 1
                else:  # a phase of no tap: zeros, straight from registers (acc untouched)
                    self._store_zeros(mDx, rows)

    def _chunks(self):
        """The row-addressed epilogue's split of a (tile_m, epi_n) sub-tile over the consumer
        threads: (16-bit elements a chunk, chunks a row, rows a pass, passes)."""
        chunk = CHUNK_BITS // self.dtype.width
        per_row = self.cfg.epi_n // chunk
        rows_per_pass = self.num_mma_threads // per_row
        return chunk, per_row, rows_per_pass, self.cfg.tile_m // rows_per_pass

    @cute.jit
    def _rows(self, thread, where, local, tile_n):
        """This thread's rows of an output tile: (their element offsets in dX, whether each
        exists, its first channel, its chunk within a row, its row in the first pass).
        `where`: (dX, the walk, the phase)."""
        mDx, walk, a = where
        chunk, per_row, rows_per_pass, passes = self._chunks()
        offsets = cute.make_rmem_tensor((passes,), cutlass.Int64)
        inside = cute.make_rmem_tensor((passes,), cutlass.Boolean)
        for v in cutlass.range_constexpr(passes):
            m = local * self.cfg.tile_m + thread // per_row + v * rows_per_pass
            offsets[v], inside[v] = walk.row(m, a, mDx)
        col = tile_n * self.cfg.tile_n + thread % per_row * chunk
        return offsets, inside, col, thread % per_row, thread // per_row

    @cute.jit
    def _store_rows(self, epi, sC, mDx, rows, tiles_done):
        """acc -> dX, one (tile_m, epi_n) sub-tile at a time: stmatrix into the ring, then each
        thread's 16-byte chunks of rows (eight threads a 128-byte row segment, threads / 8 rows
        a pass) straight to the rows' addresses in dX. One barrier a sub-tile: a buffer is
        written again two sub-tiles later, after every thread has passed the barrier that
        follows its reads (the ring's position advances by one every staged sub-tile)."""
        epi_barrier = epi[5]
        offsets, inside, col0, part, row0 = rows
        chunk, _, rows_per_pass, passes = self._chunks()
        epi_count = self.cfg.tile_n // self.cfg.epi_n
        done_before = tiles_done * epi_count
        vec = cute.make_rmem_tensor((chunk,), self.dtype)
        for e in cutlass.range_constexpr(epi_count):
            buf = (done_before + e) % self.cfg.epi_stages
            self._stage(epi, e, buf)
            epi_barrier.arrive_and_wait()
            col = col0 + e * self.cfg.epi_n
            if col < mDx.shape[4]:
                for v in cutlass.range_constexpr(passes):
                    if inside[v]:
                        row = sC[(row0 + v * rows_per_pass, None, buf)]
                        cute.autovec_copy(cute.local_tile(row, (chunk,), (part,)), vec)
                        self._put(mDx, offsets[v] + col, vec)

    @cute.jit
    def _store_zeros(self, mDx, rows):
        """Zeros into this thread's chunks of a tile's rows (a phase no tap reaches)."""
        offsets, inside, col0, _, _ = rows
        chunk, _, _, passes = self._chunks()
        vec = cute.make_rmem_tensor((chunk,), self.dtype)
        vec.fill(0.0)
        for e in cutlass.range_constexpr(self.cfg.tile_n // self.cfg.epi_n):
            col = col0 + e * self.cfg.epi_n
            if col < mDx.shape[4]:
                for v in cutlass.range_constexpr(passes):
                    if inside[v]:
                        self._put(mDx, offsets[v] + col, vec)

    def _put(self, mDx, offset, vec):
        """One 16-byte chunk into dX at element `offset` (16-byte aligned: rows and strides of
        dX are 16-byte multiples, chunks start at multiples of 8 channels)."""
        dst = cute.make_ptr(
            self.dtype, (mDx.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=16
        )
        cute.autovec_copy(vec, cute.make_tensor(dst, cute.make_layout(cute.size(vec))))
