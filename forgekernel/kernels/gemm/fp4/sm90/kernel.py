"""Grouped GEMM with FP4 weights for MoE decode, sm_90a (docs/gemm/NOTES.md "FP4 weights"),
masked layout: out[e, t] = (A[e, t] x sa[e, t]) @ dequant(W[e])^T for t < count[e]; with
`contiguous` the contiguous layout: out[r] = (A[r] x sa[r]) @ dequant(W[m_indices[r]])^T for
the rows whose index is >= 0 (A, C, sa with one batch; `contiguous.py` has the walk).

A (max_m, K, E) float8_e4m3fn tokens with fp32 scales sa (max_m, K/128, E) per 1x128; W
(N, K/2, E) uint8, two e2m1 codes per byte (the even K element in the low nibble), with UE8M0
exponents per 1x32 of K packed four to an int32, mSW (N, K/128, E) stride 1 along N (byte i
of word (n, j): sub-block 4j + i; weight = code value x 2^(byte - 127)); C (max_m, N, E)
16-bit; counts int32 (E,), read on the device.

A and B swapped: the tile computes C^T, 128 weight rows (WGMMA's M, two consumer warpgroups
of 64) by h tokens (WGMMA's N). The weights are WGMMA's A from registers: each consumer thread
reads its fragment's packed codes from shared memory (16 bits per 32-bit fragment register:
four consecutive K values) and widens them to e4m3 (`widen.py`) with its sub-block's exponent
shift folded into the table; the tokens are WGMMA's B in shared memory (128B swizzle).

Warp roles: warp 0 of warpgroup 0 the TMA producer (setmaxnreg 40): per k-tile the packed
weight tile (128 x 64 B, 64B swizzle), its 128 exponent words (512 B) and the tokens' rows
(h x 128 B; clipped at max_m) into one stage of the ring. Warpgroups 1, 2 the consumers
(setmaxnreg 232): per k-tile widen, issue 4 WGMMA k32 steps (one scale sub-block each) into
a fresh fp32 fragment, and promote the previous k-tile's fragment into the accumulator with
the row's k-tile scale 2^(s - 127) and the token's activation scale (two fragments and two
A register sets alternate: k-tile j is issued before j - 1 is waited for). Every role walks
the same tile sequence (`MaskedWalk`: expert, then the 128-row weight tile, then the token
tile of h; or `ContiguousWalk`); a tile's tokens past its expert's count (padding rows) are
computed on whatever the stage holds and never stored. Stores from registers, 16-bit scalars.

Fragment maps (PTX ISA, wgmma register fragments; tests/test_gemm_fp4.py replays them): A,
8-bit, per k32 step: consumer thread t of warpgroup w (t in 0..127), warp q = t / 32, lane
g = (t % 32) / 4, c = t % 4: registers j = 0..3 hold row 64w + 16q + g + 8 (j % 2), K values
16 (j / 2) + 4c .. + 3. Accumulator: value 4i + j at row 64w + 16q + g + 8 (j / 2), token
column 8i + 2c + j % 2.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.gemm.dense.sm90.masked import MaskedWalk
from forgekernel.kernels.gemm.fp4.sm90.config import (
    TILE_K,
    TILE_W,
    TOKENS,
    ring_bytes,
    stage_bytes,
)
from forgekernel.kernels.gemm.fp4.sm90.contiguous import ContiguousWalk
from forgekernel.kernels.gemm.fp4.sm90.widen import fold, widen4

PACKED_ROW = TILE_K // 2  # bytes of one weight row's k-tile
SMEM_RESERVE = 4096
K_STEPS = TILE_K // 32  # WGMMA k32 steps per k-tile = scale sub-blocks per k-tile


class GemmFp4GroupedSm90:
    """See the module docstring. `tokens`: h, the tokens per tile (WGMMA's N)."""

    TILES = TOKENS  # the tokens per tile this form compiles

    def __init__(
        self, tokens: int, stages: int = 0, contiguous: bool = False, staged_sa: bool = False
    ):
        if tokens not in self.TILES:
            raise ValueError(f"tokens per tile must be one of {self.TILES}, got {tokens}")
        self.h = tokens
        # the contiguous layout (`contiguous.py`): A (M, K, 1), C (M, N, 1), sa (M, K/128, 1)
        # and mCount the rows' experts m_indices (M,) instead of the counts
        self.contiguous = contiguous
        # the tokens' activation scales of each k-tile cp.async'd by the producer lanes into
        # the stage (on its full barrier) instead of loaded by each consumer thread from global
        # memory: those loads' scoreboard held every other k-tile's promotion for an L2 round
        # trip (docs/gemm/NOTES.md "FP4 at 16-96 tokens")
        self.staged_sa = staged_sa
        self.num_mma_wg = TILE_W // 64
        self.num_mma_threads = self.num_mma_wg * THREADS_PER_WG
        self.threads_per_cta = (1 + self.num_mma_wg) * THREADS_PER_WG
        self.producer_regs = 40
        self.consumer_regs = 232
        # 4 KB held back: the stages' barriers, the buffers' 1024-byte alignment and the 1 KB
        # of static shared memory the compiled kernel reports (tests/test_gemm_fp4.py adds it up)
        fit = (SMEM_CAPACITY - SMEM_RESERVE) // ring_bytes(tokens, staged_sa)
        self.stages = stages or fit
        if not 2 <= self.stages <= fit:
            raise ValueError(
                f"{self.stages} stages of {ring_bytes(tokens, staged_sa)} B do not fit"
            )

    def _setup(self):
        fp8 = cutlass.Float8E4M3FN
        k_major = OperandMajorMode.K
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, Float32, (self.num_mma_wg, 1, 1), (64, self.h),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        self.sB_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (TILE_W, self.h, TILE_K), fp8, self.stages
        )
        # the packed weights as TMA writes them: 64-byte rows, 64B swizzle (byte bits 4..5
        # XOR bits 7..8: 16-byte chunk q of row r at q ^ ((r >> 1) & 3))
        self.sW_layout = cute.make_composed_layout(
            cute.make_swizzle(2, 4, 3),
            0,
            cute.make_layout(
                (TILE_W, PACKED_ROW, self.stages), stride=(PACKED_ROW, 1, TILE_W * PACKED_ROW)
            ),
        )
        self.sE_layout = cute.make_layout((TILE_W, 1, self.stages), stride=(1, TILE_W, TILE_W))

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mW: cute.Tensor,
        mSW: cute.Tensor,
        mC: cute.Tensor,
        mSFA: cute.Tensor,
        mCount: cute.Tensor,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        """See the module docstring; `ctas`: the persistent grid (at most one CTA per SM)."""
        self.c_dtype = mC.element_type
        self._setup()
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_w, tma_mW = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(self.sW_layout, (None, None, 0)), (TILE_W, PACKED_ROW)
        )
        tma_e, tma_mE = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mSW, cute.slice_(self.sE_layout, (None, None, 0)), (TILE_W, 1)
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(self.sB_layout, (None, None, 0)), (self.h, TILE_K)
        )

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sW_layout)], 1024
            ]
            sE: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(self.sE_layout)], 128]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sB_layout)], 1024
            ]

        @cute.struct
        class StagedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sW_layout)], 1024
            ]
            sE: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(self.sE_layout)], 128]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, self.h * self.stages], 128]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sB_layout)], 1024
            ]

        self.shared_storage = StagedStorage if self.staged_sa else SharedStorage
        self.kernel(
            (tma_w, tma_mW),
            (tma_e, tma_mE),
            (tma_b, tma_mB),
            mC,
            mSFA,
            mCount,
            self.tiled_mma,
            self.sW_layout,
            self.sE_layout,
            self.sB_layout,
        ).launch(
            grid=(1, 1, ctas),
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        load_w: tuple,
        load_e: tuple,
        load_b: tuple,
        mC: cute.Tensor,
        mSFA: cute.Tensor,
        mCount: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sW_layout: cute.ComposedLayout,
        sE_layout: cute.Layout,
        sB_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (load_w[0], load_e[0], load_b[0]):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        if cutlass.const_expr(self.staged_sa):
            # a full barrier also takes each producer lane's cp.async arrival (`_stage_sa`), an
            # empty one every consumer thread's (`_retire`)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.barriers.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + WARP_SIZE),
                consumer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, self.num_mma_threads
                ),
                tx_count=stage_bytes(self.h),
                defer_sync=True,
            )
        else:
            ab_pipe = tma_pipeline(
                storage.barriers, self.stages, stage_bytes(self.h), self.num_mma_threads // 32
            )
        init_arrive()
        sW = smem_tensor(storage.sW, sW_layout)
        sE = storage.sE.get_tensor(sE_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sSA = None
        if cutlass.const_expr(self.staged_sa):
            sSA = storage.sSA.get_tensor(cute.make_layout((self.h, self.stages)))
        k_tiles = load_b[1].shape[1] // TILE_K
        walk_args = (mCount, mC.shape[0], mC.shape[1] // TILE_W)
        if cutlass.const_expr(self.contiguous):
            walk_args = (mCount, mC.shape[1] // TILE_W)

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        init_wait()
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    (load_w, load_e, load_b), (sW, sE, sB), ab_pipe, walk_args, k_tiles,
                    (sSA, mSFA),
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            thr_mma = tiled_mma.get_slice((wg_idx - 1) * THREADS_PER_WG)
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            shape_a = thr_mma.partition_shape_A((TILE_W, TILE_K))
            regs_a = tuple(tiled_mma.make_fragment_A(shape_a) for _ in range(2))
            acc_shape = thr_mma.partition_shape_C((TILE_W, self.h))
            accs = tuple(cute.make_rmem_tensor(acc_shape, Float32) for _ in range(3))
            # the packed tile read as 16-bit words (4 codes: one fragment register)
            w16 = cute.make_tensor(
                cute.recast_ptr(sW.iterator, dtype=cutlass.Uint16),
                cute.make_layout(self.stages * TILE_W * PACKED_ROW // 2),
            )
            t = tidx - THREADS_PER_WG
            lane = t % 32
            row0 = t // 32 * 16 + lane // 4  # warp q of the two warpgroups: rows 16q ..
            mma = (tiled_mma, regs_a, tCrB, accs)
            smem = (w16, sE, sSA)
            out = (mC, mSFA, mCount)
            self._consume(mma, smem, ab_pipe, out, walk_args, k_tiles, (row0, lane % 4))

    def _walk(self, walk_args):
        """The layout's tile walk (every role walks the same)."""
        if cutlass.const_expr(self.contiguous):
            return ContiguousWalk(*walk_args, self.h)
        return MaskedWalk(*walk_args, self.h)

    def _batch(self, expert):
        """The index of the tile's slice of A, C and sa: its expert's (masked), else the one."""
        return 0 if cutlass.const_expr(self.contiguous) else expert

    @cute.jit
    def _produce(self, loads, smem, ab_pipe, walk_args, k_tiles, staged):
        """The producer warp: every k-tile of each tile's weights, exponents and tokens (and,
        with `staged_sa`, the tokens' activation scales: `staged` = (sSA, mSFA))."""
        (tma_w, mW), (tma_e, mE), (tma_b, mB) = loads
        sW, sE, sB = smem
        prod = producer_state(self.stages)
        walk = self._walk(walk_args)
        work, expert, before, rows = walk.first()
        while walk.valid(expert):
            tile_t, tile_n, tile_rows = walk.tile(work, before, rows)
            gW = cute.local_tile(mW[None, None, expert], (TILE_W, PACKED_ROW), (tile_n, None))
            gE = cute.local_tile(mE[None, None, expert], (TILE_W, 1), (tile_n, None))
            gB = cute.local_tile(
                mB[None, None, self._batch(expert)], (self.h, TILE_K), (tile_t, None)
            )
            parts = []
            for atom, s, g in ((tma_w, sW, gW), (tma_e, sE, gE), (tma_b, sB, gB)):
                ts, tg = cute.nvgpu.cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                    cute.group_modes(g, 0, 2),
                )  # fmt: skip
                parts.append((atom, ts, tg))
            for kt in range(k_tiles):
                ab_pipe.producer_acquire(prod)
                bar = ab_pipe.producer_get_barrier(prod)
                for atom, ts, tg in parts:
                    cute.copy(atom, tg[(None, kt)], ts[(None, prod.index)], tma_bar_ptr=bar)
                if cutlass.const_expr(self.staged_sa):
                    first = tile_t * self.h
                    sfa = staged[1][None, None, self._batch(expert)]
                    self._stage_sa(staged[0], sfa, (first, first + tile_rows - 1), kt, prod)
                    cute.arch.cp_async_mbarrier_arrive_noinc(bar)
                ab_pipe.producer_commit(prod)
                prod.advance()
            work, expert, before, rows = walk.next(work, expert, before, rows)
        ab_pipe.producer_tail(prod)

    @cute.jit
    def _stage_sa(self, sSA, sfa, tokens, kt, prod):
        """The tile's tokens' activation scales of k-tile `kt` into stage `prod`, one cp.async
        of 4 bytes per token: token lane + 32 i by lane (rows past the count read the last
        counted row's, as the consumers did). Each lane's cp.async arrival on the stage's full
        barrier follows (the barrier counts 1 + 32 arrivals)."""
        first, last = tokens
        lane = cute.arch.lane_idx()
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        for i in cutlass.range_constexpr((self.h + WARP_SIZE - 1) // WARP_SIZE):
            tok = lane + WARP_SIZE * i
            row = cutlass.min(first + tok, last)
            src = cute.make_tensor(
                sfa.iterator + cute.crd2idx((row, kt), sfa.layout), cute.make_layout(1)
            )
            dst = cute.make_tensor(
                sSA.iterator + cute.crd2idx((tok, prod.index), sSA.layout), cute.make_layout(1)
            )
            if cutlass.const_expr(self.h % WARP_SIZE == 0):
                cute.copy(atom, src, dst)
            else:
                if tok < self.h:  # h = 8, 16: lanes h .. 31 copy nothing
                    cute.copy(atom, src, dst)

    @cute.jit
    def _consume(self, mma, smem, ab_pipe, out, walk_args, k_tiles, who):
        """The consumer warpgroups: each tile's mainloop, then its counted tokens' stores."""
        mC, mSFA, mCount = out
        row0, quad = who
        read = consumer_state(self.stages)
        release = consumer_state(self.stages)
        tiled_mma, regs_a, tCrB, (acc, frag0, frag1) = mma
        walk = self._walk(walk_args)
        work, expert, before, rows = walk.first()
        while walk.valid(expert):
            tile_t, tile_n, tile_rows = walk.tile(work, before, rows)
            first = tile_t * self.h
            batch = self._batch(expert)
            tokens = (first, first + tile_rows - 1)
            src = (smem, mSFA[None, None, batch], tokens, row0, quad)
            read, release, tiled_mma = self._mainloop(
                k_tiles, (tiled_mma, regs_a, tCrB, acc, (frag0, frag1)), src, ab_pipe, read,
                release,
            )  # fmt: skip
            # which of this thread's token columns are stored: bit i for column 8 (i / 2) +
            # 2 quad + i % 2, inside the count (contiguous: and not padding, index < 0)
            keep = Int32(0)
            for i in cutlass.range_constexpr(self.h // 4):
                col = 8 * (i // 2) + 2 * quad + i % 2
                stored = col < tile_rows
                if cutlass.const_expr(self.contiguous):
                    stored = stored & (mCount[cutlass.min(first + col, tokens[1])] >= 0)
                keep = keep | (Int32(stored) << i)
            self._store(acc, mC[None, None, batch], (first, keep), tile_n, row0, quad)
            work, expert, before, rows = walk.next(work, expert, before, rows)

    @cute.jit
    def _mainloop(self, count, mma, src, ab_pipe, read, release):
        """acc = the sum over the tile's k-tiles of each k-tile's product (WGMMA into a fresh
        fragment) x its rows' k-tile scales and its tokens' scales. Fragments and A register
        sets alternate (k-tile 2i in the first, 2i + 1 in the second): k-tile j is issued
        before j - 1 is waited for, released and promoted. Returns the states."""
        tiled_mma, (ra0, ra1), tCrB, acc, (f0, f1) = mma
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        even = self._issue(tiled_mma, (ra0, tCrB), f0, ab_pipe, read, (src, 0))
        read.advance()
        for i in range((count - 1) // 2):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            odd = self._issue(tiled_mma, (ra1, tCrB), f1, ab_pipe, read, (src, 2 * i + 1))
            read.advance()
            self._retire(1, ab_pipe, release)
            release.advance()
            self._promote(acc, f0, even)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            even = self._issue(tiled_mma, (ra0, tCrB), f0, ab_pipe, read, (src, 2 * i + 2))
            read.advance()
            self._retire(1, ab_pipe, release)
            release.advance()
            self._promote(acc, f1, odd)
        if count % 2 == 0:
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            odd = self._issue(tiled_mma, (ra1, tCrB), f1, ab_pipe, read, (src, count - 1))
            read.advance()
            self._retire(1, ab_pipe, release)
            release.advance()
            self._promote(acc, f0, even)
            self._retire(0, ab_pipe, release)
            release.advance()
            self._promote(acc, f1, odd)
        else:
            self._retire(0, ab_pipe, release)
            release.advance()
            self._promote(acc, f0, even)
        return read, release, tiled_mma

    @cute.jit
    def _issue(self, tiled_mma, operands, frag, ab_pipe, read, at):
        """Wait for k-tile `at` = (sources, k-tile) in stage `read`; widen this thread's packed
        weights into the A registers, issue the k-tile's WGMMAs into `frag` (one commit group).
        Returns its scales as one flat tuple (the rows' k-tile scales, then the tokens'), used
        at its promotion one step later: a loop-carried value of the caller's loop."""
        ra, tCrB = operands
        ((w16, sE, sSA), sfa, (first, last), row0, quad), kt = at
        ab_pipe.consumer_wait(read)
        stage = read.index
        scale_lo, tabs_lo = fold(sE[row0, 0, stage])
        scale_hi, tabs_hi = fold(sE[row0 + 8, 0, stage])
        # this thread's token columns' activation scales (column 8 (i / 2) + 2 quad + i % 2):
        # rows past the count read the last counted row's (their columns are never stored)
        if cutlass.const_expr(self.staged_sa):
            sa = tuple(sSA[8 * (i // 2) + 2 * quad + i % 2, stage] for i in range(self.h // 4))
        else:
            sa = tuple(
                sfa[cutlass.min(first + 8 * (i // 2) + 2 * quad + i % 2, last), kt]
                for i in range(self.h // 4)
            )
        packed = cute.recast_tensor(ra, Int32)
        # 16-bit word of (row, step, half): byte row * 64 + 16 step + 8 half + 2 quad, its
        # 16-byte chunk (= step) swizzled by (row >> 1) & 3, the same for row0 and row0 + 8
        base = (stage * TILE_W * PACKED_ROW + row0 * PACKED_ROW) // 2 + quad
        swz = (row0 >> 1) & 3
        for step in cutlass.range_constexpr(K_STEPS):
            chunk = base + ((step ^ swz) << 3)
            for j in cutlass.range_constexpr(4):
                word = chunk + (j % 2) * (8 * PACKED_ROW // 2) + (j // 2) * 4
                table = (tabs_hi if j % 2 else tabs_lo)[step]
                packed[j + 4 * step] = widen4(Int32(w16[word]) & 0xFFFF, table)
        # the fragment's registers were last read by the promotion FFMAs
        warpgroup.fence()
        for step in cutlass.range_constexpr(K_STEPS):
            crd_a = (None, None, step)
            cute.gemm(tiled_mma, frag, ra[crd_a], tCrB[(None, None, step, stage)], frag)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return (scale_lo, scale_hi, *sa)

    @cute.jit
    def _retire(self, pending, ab_pipe, release):
        """Wait until at most `pending` WGMMA groups are in flight, then release the stage of
        the oldest k-tile still held (`staged_sa`: every consumer thread arrives, each one's
        reads of the staged scales released by its own arrive, as racecheck follows them; the
        FP8 kernel's staged scales, docs/gemm/NOTES.md "Racecheck's WAR on the staged
        scales")."""
        warpgroup.wait_group(pending)
        if cutlass.const_expr(self.staged_sa):
            cute.arch.mbarrier_arrive(ab_pipe.consumer_get_barrier(release))
        else:
            ab_pipe.consumer_release(release)

    @cute.jit
    def _promote(self, acc, frag, scales):
        """acc += frag x the row's k-tile scale x the token's: value 4i + j sits on row
        row0 + 8 (j / 2), token column 8i + 2 quad + j % 2."""
        lo, hi, *sa = scales
        for i in cutlass.range_constexpr(self.h // 8):
            for j in cutlass.range_constexpr(4):
                s = (hi if j // 2 else lo) * sa[2 * i + j % 2]
                acc[4 * i + j] = acc[4 * i + j] + frag[4 * i + j] * s
        return

    @cute.jit
    def _store(self, acc, gC, tokens, tile_n, row0, quad):
        """The tile's counted tokens' outputs from registers: gC (rows, N) the tile's slice of
        C; `tokens`: the tile's first row and the thread's columns to store (bit 2i + j % 2 for
        value 4i + j)."""
        first, keep = tokens
        col0 = tile_n * TILE_W + row0
        for i in cutlass.range_constexpr(self.h // 8):
            for j in cutlass.range_constexpr(4):
                col = 8 * i + 2 * quad + j % 2
                if (keep >> (2 * i + j % 2)) & 1:
                    gC[first + col, col0 + 8 * (j // 2)] = acc[4 * i + j].to(self.c_dtype)
