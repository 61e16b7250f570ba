"""Dense 16-bit GEMM for Hopper (sm_90a): C = A @ B^T, fp32 accumulation.

Warp roles (one CTA = 1 + W warpgroups, W = 2 cooperative consumers):
- warp 0 of warpgroup 0 (producer): walks the persistent tile schedule and issues TMA loads of
  A and B k-tiles into an `stages`-deep shared-memory ring guarded by mbarriers (full/empty).
  With a cluster, A is multicast along N and B along M. It keeps 40 registers (setmaxnreg).
- warpgroups 1..W (consumers): wait on the full barrier, issue WGMMA (SS) into fp32 registers,
  keep one WGMMA batch in flight and release the stage behind it; then the epilogue converts,
  stores through `stmatrix` into a small shared-memory ring and TMA-stores sub-tiles while the
  producer already streams the next tile's operands. They take 232 registers.

Constraints: A (M, K) K-major; B (N, K) K-major ("nk") or (K, N) N-major ("kn"); C (M, N)
row-major; every leading stride a multiple of 8 elements (16 bytes, TMA) and base addresses
16-byte aligned. M, N, K are dynamic; ragged edges are handled by TMA bounds (zero-filled
loads, clipped stores). tile_m in {64, 128}, tile_n in {64, 128, 192, 256}, tile_k = 64.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig

SMEM_CAPACITY = 232448  # sm_90 per-block opt-in maximum (227 KiB)
THREADS_PER_WG = 128


class GemmSm90:
    """Persistent, warp-specialized TMA + WGMMA GEMM; see the module docstring."""

    def __init__(self, config: GemmConfig, b_kn: bool = False):
        if config.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {config.tile_m}")
        if config.tile_n not in (64, 128, 192, 256):
            raise ValueError(f"tile_n must be 64/128/192/256, got {config.tile_n}")
        if config.tile_k != 64:
            raise ValueError(f"tile_k must be 64, got {config.tile_k}")
        if config.tile_n % config.epi_n or config.epi_n not in (32, 64):
            raise ValueError(f"epi_n must be 32 or 64 and divide tile_n, got {config.epi_n}")
        if config.cluster_m * config.cluster_n > 4:
            raise ValueError("a cluster holds at most 4 CTAs here")
        self.cfg = config
        self.b_kn = b_kn
        self.split_k = config.split_k
        self.acc_dtype = cutlass.Float32
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        # Cooperative: two consumer warpgroups split M of one tile (a single one would hold a
        # 128x256 fp32 accumulator in 256 registers/thread and spill). Ping-pong: each consumer
        # warpgroup owns every other tile, so one's epilogue overlaps the other's mainloop.
        self.pingpong = config.pingpong
        if self.pingpong and config.tile_m != 64:
            # 128-row tiles in one warpgroup gave wrong epilogues on the H200 (2026-11-30).
            raise ValueError("ping-pong takes tile_m = 64 (one 64-row tile per warpgroup)")
        cooperative = config.tile_m == 128 and not self.pingpong
        self.atom_layout_mnk = (2, 1, 1) if cooperative else (1, 1, 1)
        self.num_mma_wg = 2 if self.pingpong else math.prod(self.atom_layout_mnk)
        self.groups = 2 if self.pingpong else 1  # consumer groups, each with its own tiles
        self.num_mma_threads = self.num_mma_wg * THREADS_PER_WG
        self.group_threads = self.num_mma_threads // self.groups
        self.threads_per_cta = (1 + self.num_mma_wg) * THREADS_PER_WG
        self.producer_regs = 40
        self.consumer_regs = 232

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        cfg = self.cfg
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_major.sm90_mma_major_mode(),
            self.b_major.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, cfg.tile_n),
        )
        self.tile_mnk = (cfg.tile_m, cfg.tile_n, cfg.tile_k)
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        self.mcast_a = cfg.cluster_n  # CTAs sharing one A tile (same M row of the cluster)
        self.mcast_b = cfg.cluster_m
        self.epi_tile = (cfg.tile_m, cfg.epi_n)

        ab_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * self.a_dtype.width // 8
        epi_bytes = (
            self.groups * cfg.epi_stages * math.prod(self.epi_tile) * self.c_dtype.width // 8
        )
        fit = (SMEM_CAPACITY - 1024 - epi_bytes) // ab_bytes
        self.stages = cfg.stages or fit
        if self.stages > fit or self.stages < 2:
            raise ValueError(f"{self.stages} stages of {ab_bytes} B do not fit in shared memory")

        def staged(major, dtype, rows, stages):
            k_major = major.sm90_mma_major_mode() == cute.nvgpu.warpgroup.OperandMajorMode.K
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(major, dtype, cfg.tile_k if k_major else rows),
                dtype,
            )
            return cute.tile_to_shape(
                atom, (rows, cfg.tile_k, stages), order=(0, 1, 2) if k_major else (1, 0, 2)
            )

        self.sA_layout = staged(self.a_major, self.a_dtype, cfg.tile_m, self.stages)
        self.sB_layout = staged(self.b_major, self.b_dtype, cfg.tile_n, self.stages)
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.c_major, self.c_dtype, self.epi_tile[1]),
            self.c_dtype,
        )
        self.sC_layout = cute.tile_to_shape(
            c_atom, (*self.epi_tile, cfg.epi_stages * self.groups), order=(0, 1, 2)
        )

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mA (M, K); mB (N, K) or, N-major, its (K, N) transpose; mC (M, N)."""
        if cutlass.const_expr(self.b_kn):
            # (K, N) row-major seen as (N, K) with unit stride along N.
            mB = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 0]))
        if cutlass.const_expr(self.split_k > 1):
            # fp32 workspace (S, M, N) seen as (M, N, S): split s writes its partial sum to [s].
            mC = cute.make_tensor(mC.iterator, cute.select(mC.layout, mode=[1, 2, 0]))
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        self.a_major = utils.LayoutEnum.from_tensor(mA)
        self.b_major = utils.LayoutEnum.from_tensor(mB)
        self.c_major = utils.LayoutEnum.from_tensor(mC)
        self._setup()

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        g2s_mc = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mc if self.mcast_a > 1 else g2s,
            mA,
            cute.slice_(self.sA_layout, (None, None, 0)),
            (self.cfg.tile_m, self.cfg.tile_k),
            num_multicast=self.mcast_a,
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mc if self.mcast_b > 1 else g2s,
            mB,
            cute.slice_(self.sB_layout, (None, None, 0)),
            (self.cfg.tile_n, self.cfg.tile_k),
            num_multicast=self.mcast_b,
        )
        tma_c, tma_mC = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mC,
            cute.slice_(self.sC_layout, (None, None, 0)),
            self.epi_tile,
        )

        tiles_m = cute.ceil_div(mC.shape[0], self.cfg.tile_m)
        tiles_n = cute.ceil_div(mC.shape[1], self.cfg.tile_n)
        sched_params = utils.PersistentTileSchedulerParams(
            (tiles_m, tiles_n, self.split_k),
            (*self.cluster_shape_mn, 1),
            self.cfg.swizzle,
            self.cfg.raster_along_m,
        )
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched_params, max_active_clusters)

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
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
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_c,
            tma_mC,
            self.tiled_mma,
            self.cta_layout_mnk,
            self.sA_layout,
            self.sB_layout,
            self.sC_layout,
            sched_params,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        sched_params: utils.PersistentTileSchedulerParams,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mask = a_mask if self.mcast_a > 1 else 0
        b_mask = b_mask if self.mcast_b > 1 else 0

        stage_bytes = cute.size_in_bytes(
            self.a_dtype, cute.slice_(sA_layout, (None, None, 0))
        ) + cute.size_in_bytes(self.b_dtype, cute.slice_(sB_layout, (None, None, 0)))

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        # Each consumer warp releases a stage to every CTA that multicast into it.
        consumer_arrivals = (self.mcast_a + self.mcast_b - 1) * (self.group_threads // 32)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        pipeline_init_arrive(cluster_shape_mn=self.cluster_shape_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)

        # (bM, bK, tiles_m, tiles_k), (bN, bK, tiles_n, tiles_k), (bM, bN, tiles_m, tiles_n)
        gA = cute.local_tile(mA, (self.cfg.tile_m, self.cfg.tile_k), (None, None))
        gB = cute.local_tile(mB, (self.cfg.tile_n, self.cfg.tile_k), (None, None))
        if cutlass.const_expr(self.split_k > 1):
            gC = cute.local_tile(mC, (self.cfg.tile_m, self.cfg.tile_n), (None, None, None))
        else:
            gC = cute.local_tile(mC, (self.cfg.tile_m, self.cfg.tile_n), (None, None))
        k_tiles = cute.size(gA, mode=[3])

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            cluster_coord[1],
            cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            cluster_coord[0],
            cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma = tiled_mma.get_slice(0 if self.pingpong else (wg_idx - 1) * THREADS_PER_WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], self.acc_dtype)

        pipeline_init_wait(cluster_shape_mn=self.cluster_shape_mn)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                sched = utils.StaticPersistentTileScheduler.create(
                    sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
                )
                work = sched.initial_work_tile_info()
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                while work.is_valid_tile:
                    tile = work.tile_idx
                    tAgA_t = tAgA[(None, tile[0], None)]
                    tBgB_t = tBgB[(None, tile[1], None)]
                    k_first, k_count = self._k_range(tile, k_tiles)
                    for kt in range(k_first, k_first + k_count):
                        ab_pipe.producer_acquire(prod)
                        bar = ab_pipe.producer_get_barrier(prod)
                        cute.copy(
                            tma_a,
                            tAgA_t[(None, kt)],
                            tAsA[(None, prod.index)],
                            tma_bar_ptr=bar,
                            mcast_mask=a_mask,
                        )
                        cute.copy(
                            tma_b,
                            tBgB_t[(None, kt)],
                            tBsB[(None, prod.index)],
                            tma_bar_ptr=bar,
                            mcast_mask=b_mask,
                        )
                        ab_pipe.producer_commit(prod)
                        prod.advance()
                    sched.advance_to_next_work()
                    work = sched.get_current_work()
                ab_pipe.producer_tail(prod)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            args = (
                tidx,
                warp_idx,
                tiled_mma,
                tCrA,
                tCrB,
                acc,
                ab_pipe,
                sC,
                gC,
                tma_c,
                sched_params,
                k_tiles,
            )
            if cutlass.const_expr(self.pingpong):
                if wg_idx == 1:
                    self._consume(*args, 0)
                else:
                    self._consume(*args, 1)
            else:
                self._consume(*args, 0)

    @cute.jit
    def _k_range(self, tile, k_tiles):
        """First k-tile and count of this work unit: all of K, or split tile[2] of split_k.
        The op layer only splits when every split gets at least one k-tile."""
        k_first = cutlass.Int32(0)
        k_count = k_tiles
        if cutlass.const_expr(self.split_k > 1):
            per_split = (k_tiles + self.split_k - 1) // self.split_k
            k_first = tile[2] * per_split
            k_count = k_tiles - k_first
            if k_count > per_split:
                k_count = per_split
        return k_first, k_count

    @cute.jit
    def _consume(
        self,
        tidx,
        warp_idx,
        tiled_mma,
        tCrA,
        tCrB,
        acc,
        ab_pipe,
        sC,
        gC,
        tma_c,
        sched_params,
        k_tiles,
        group: cutlass.Constexpr[int],
    ):
        """Consumer group `group`: all consumer warpgroups (cooperative) or one (ping-pong,
        taking the CTA's tiles group, group + 2, ...); its own barrier and epilogue buffers."""
        epi_barrier = pipeline.NamedBarrier(barrier_id=1 + group, num_threads=self.group_threads)
        first_thread = THREADS_PER_WG * (1 + group)
        sched = utils.StaticPersistentTileScheduler.create(
            sched_params, cute.arch.block_idx(), cute.arch.grid_dim()
        )
        work = sched.initial_work_tile_info()
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        k_blocks = cute.size(tCrA, mode=[2])

        # Epilogue: registers -> stmatrix -> swizzled smem ring -> TMA store.
        r2s_atom = sm90_utils.sm90_get_smem_store_op(
            self.c_major, elem_ty_d=self.c_dtype, elem_ty_acc=self.acc_dtype
        )
        stm_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_major.is_m_major_c(), 4), self.c_dtype
        )
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
        thr_r2s = r2s.get_slice(tidx - first_thread)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = r2s.retile(acc)
        rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_rAcc = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
        tRS_rC = cute.make_rmem_tensor(rC_shape, self.c_dtype)
        frag = cute.size(tRS_rAcc)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.group_threads),
        )
        store_warp = first_thread // 32  # the group's first warp issues the TMA stores
        tile_no = cutlass.Int32(0)  # this CTA's work units so far
        my_tiles = cutlass.Int32(0)  # this group's share of them

        while work.is_valid_tile:
            tile = work.tile_idx
            _, k_count = self._k_range(tile, k_tiles)
            mine = cutlass.Int32(1)
            if cutlass.const_expr(self.groups > 1):
                if tile_no % self.groups != group:
                    mine = cutlass.Int32(0)
            # Another group's tile: step over the stages it consumes.
            for _ in range(k_count * (1 - mine)):
                read.advance()
                release.advance()
            # Advance now: whether a tile follows decides the mainloop hand-over (ping-pong).
            sched.advance_to_next_work()
            work = sched.get_current_work()
            has_next = work.is_valid_tile
            # A loop of one or zero trips (not an if) carries the pipeline states through.
            for _ in range(mine):
                read, release, tiled_mma = self._mma_and_store(
                    tile,
                    k_count,
                    tiled_mma,
                    tCrA,
                    tCrB,
                    acc,
                    ab_pipe,
                    read,
                    release,
                    k_blocks,
                    gC,
                    tma_c,
                    sC,
                    r2s,
                    tRS_sC,
                    tRS_acc,
                    tRS_rAcc,
                    tRS_rC,
                    frag,
                    store_pipe,
                    epi_barrier,
                    warp_idx,
                    store_warp,
                    my_tiles,
                    tile_no,
                    has_next,
                    group,
                )
                my_tiles += 1
            tile_no += 1
        store_pipe.producer_tail()

    @cute.jit
    def _mma_and_store(
        self,
        tile,
        k_count,
        tiled_mma,
        tCrA,
        tCrB,
        acc,
        ab_pipe,
        read,
        release,
        k_blocks,
        gC,
        tma_c,
        sC,
        r2s,
        tRS_sC,
        tRS_acc,
        tRS_rAcc,
        tRS_rC,
        frag,
        store_pipe,
        epi_barrier,
        warp_idx,
        store_warp,
        my_tiles,
        tile_no,
        has_next,
        group: cutlass.Constexpr[int],
    ):
        # Ping-pong: mainloops alternate strictly between the two warpgroups (tile t waits for
        # the owner of t - 1 to have waited on all its stages), so a warpgroup that stepped over
        # the other's stages never waits on a ring slot more than one phase ahead.
        if cutlass.const_expr(self.pingpong):
            if tile_no > 0:
                pipeline.NamedBarrier(
                    barrier_id=3 + group, num_threads=2 * THREADS_PER_WG
                ).arrive_and_wait()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        # Keep one WGMMA batch in flight; free the stage behind it.
        for kt in range(k_count):
            ab_pipe.consumer_wait(read)
            for kb in cutlass.range_constexpr(k_blocks):
                crd = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if kt > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipe.consumer_release(release)  # the op layer never launches with K == 0
        release.advance()
        if cutlass.const_expr(self.pingpong):
            if has_next:
                pipeline.NamedBarrier(barrier_id=4 - group, num_threads=2 * THREADS_PER_WG).arrive()

        if cutlass.const_expr(self.split_k > 1):
            gC_tile = gC[(None, None, tile[0], tile[1], tile[2])]
        else:
            gC_tile = gC[(None, None, tile[0], tile[1])]
        gC_t = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_t
        )
        epi_count = cute.size(gC_t, mode=[1])
        epi_grid = cute.make_layout(gC_t.shape[1], stride=(gC_t.shape[1][1], 1))
        done_before = my_tiles * epi_count
        for e in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(frag):
                tRS_rAcc[v] = tRS_acc[e * frag + v]
            tRS_rC.store(tRS_rAcc.load().to(self.c_dtype))
            buf = (done_before + e) % self.cfg.epi_stages + group * self.cfg.epi_stages
            cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
            # stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                gmem_crd = epi_grid.get_hier_coord(e)
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, gmem_crd)])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_barrier.arrive_and_wait()
        # Pipeline states are rebound in the caller: attribute updates made inside a helper
        # would not leave the caller's staged loop otherwise.
        return read, release, tiled_mma
