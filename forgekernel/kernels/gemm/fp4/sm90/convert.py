"""The FP4-weight grouped GEMM with a converter warpgroup (opt-in key field `converter`;
docs/gemm/NOTES.md "FP4 at 16-96 tokens"): the widening leaves the MMA warpgroups.

The standard kernel (`kernel.py`) widens in the MMA warpgroups' registers: per k-tile each of
the 256 MMA threads folds two rows' exponent words and widens 16 registers, two warps a
scheduler issuing ~220-320 instructions a k-tile each, ~115 of them on the integer pipe: the
k-tile costs ~640-730 issue cycles against ~518 of HBM time. Here one warpgroup (one warp a
scheduler) widens each k-tile once: thread t folds row t's word (one fold a row, not four) and
widens its 64 packed bytes (4 LDS.128) into the row's 128 e4m3 bytes of a 128B-swizzled K-major
buffer (8 STS.128), `widen8`: `widen4`'s bytes for both 16-bit halves of a word, then
fences the async proxy and arrives on the buffer's full barrier. The MMA warpgroups run WGMMA
with A from that buffer (SS), B the tokens as before, and promote exactly as the standard does
(same products, same order; the rows' k-tile scales come through shared memory from the fold).

Warp roles: warpgroup 0 warp 0 the TMA producer (setmaxnreg 40; the tokens' activation scales
staged by its lanes as `staged_sa`), warpgroups 1 .. C the converters (C = `converters`, 1 or
2: with 2, converter c widens sub-blocks 2c, 2c + 1 of each row, two converter warps a
scheduler hiding each other's latency), then the two MMA warpgroups (REGS[C] gives the three
roles' setmaxnreg). Rings: the TMA ring (full: 1 + 32 arrivals and the bytes; empty: the
converters' threads and the MMA warpgroups' 256), the widened ring of WIDE_SLOTS buffers (full:
the converters' threads; empty: the MMA's 256).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
)
from forgekernel.kernels.gemm.fp4.sm90.config import (
    CONVERTER_TOKENS,
    TILE_K,
    TILE_W,
    ring_bytes,
    stage_bytes,
)
from forgekernel.kernels.gemm.fp4.sm90.kernel import (
    K_STEPS,
    PACKED_ROW,
    SMEM_RESERVE,
    GemmFp4GroupedSm90,
)
from forgekernel.kernels.gemm.fp4.sm90.widen import fold, widen8

WIDE_SLOTS = 3  # widened buffers: the converter runs up to two k-tiles ahead of the MMA retire
WIDE_BYTES = TILE_W * TILE_K + 4 * TILE_W  # e4m3 rows + the rows' fp32 k-tile scales
CHUNK = 16  # bytes a shared-memory vector access
# (producer, converter, MMA) setmaxnreg by the number of converter warpgroups: 4 warpgroups
# start at 128 registers a thread (40 + 56 + 2 x 208 = 4 x 128), 5 at 96 (40 + 2 x 40 + 2 x 176
# = 472 <= 5 x 96; the converters' highest register R48 / R30-odd, the MMA's R201 at h = 96,
# R186 at 64 when given 208)
REGS = {1: (40, 56, 208), 2: (40, 56, 160)}


class GemmFp4ConvertSm90(GemmFp4GroupedSm90):
    """See the module docstring. `tokens`: h, the tokens per tile (WGMMA's N)."""

    TILES = CONVERTER_TOKENS

    def __init__(self, tokens: int, stages: int = 0, contiguous: bool = False, converters: int = 1):
        super().__init__(tokens, 2, contiguous, staged_sa=True)
        if converters not in REGS or (converters > 1 and tokens > 64):
            raise ValueError(f"{converters} converter warpgroups at {tokens} tokens a tile")
        self.converters = converters
        self.threads_per_cta = (1 + converters + self.num_mma_wg) * THREADS_PER_WG
        self.producer_regs, self.converter_regs, self.consumer_regs = REGS[converters]
        room = SMEM_CAPACITY - SMEM_RESERVE - WIDE_SLOTS * WIDE_BYTES
        fit = room // ring_bytes(tokens, True)
        self.stages = stages or fit
        if not 2 <= self.stages <= fit:
            raise ValueError(f"{self.stages} stages of {ring_bytes(tokens, True)} B do not fit")

    def _setup(self):
        super()._setup()
        fp8 = cutlass.Float8E4M3FN
        k_major = OperandMajorMode.K
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, Float32, (self.num_mma_wg, 1, 1), (64, self.h)
        )
        self.sA_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (TILE_W, self.h, TILE_K), fp8, WIDE_SLOTS
        )

    @cute.jit
    def __call__(self, mA, mW, mSW, mC, mSFA, mCount, ctas, stream):
        """See `GemmFp4GroupedSm90.__call__`."""
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
            wide_barriers: cute.struct.MemRange[cutlass.Int64, WIDE_SLOTS * 2]
            sW: cute.struct.Align[
                cute.struct.MemRange[cutlass.Uint8, cute.cosize(self.sW_layout)], 1024
            ]
            sE: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(self.sE_layout)], 128]
            sSA: cute.struct.Align[cute.struct.MemRange[Float32, self.h * self.stages], 128]
            sRow: cute.struct.Align[cute.struct.MemRange[Float32, TILE_W * WIDE_SLOTS], 128]
            sB: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sB_layout)], 1024
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(self.sA_layout)], 1024
            ]

        self.shared_storage = SharedStorage
        self.kernel(
            (tma_w, tma_mW),
            (tma_e, tma_mE),
            (tma_b, tma_mB),
            mC,
            mSFA,
            mCount,
            self.tiled_mma,
            (self.sW_layout, self.sE_layout, self.sB_layout, self.sA_layout),
        ).launch(
            grid=(1, 1, ctas),
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(self, load_w, load_e, load_b, mC, mSFA, mCount, tiled_mma, layouts):
        sW_layout, sE_layout, sB_layout, sA_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (load_w[0], load_e[0], load_b[0]):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        # TMA ring: the producer's expect-tx arrive and its 32 lanes' cp.async arrivals; freed
        # by every converter and MMA thread
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + WARP_SIZE),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.converters * THREADS_PER_WG + self.num_mma_threads
            ),
            tx_count=stage_bytes(self.h),
            defer_sync=True,
        )
        wide_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.wide_barriers.data_ptr(),
            num_stages=WIDE_SLOTS,
            producer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.converters * THREADS_PER_WG
            ),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            defer_sync=True,
        )
        init_arrive()
        sW = smem_tensor(storage.sW, sW_layout)
        sE = storage.sE.get_tensor(sE_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sA = smem_tensor(storage.sA, sA_layout)
        sSA = storage.sSA.get_tensor(cute.make_layout((self.h, self.stages)))
        sRow = storage.sRow.get_tensor(cute.make_layout((TILE_W, WIDE_SLOTS)))
        k_tiles = load_b[1].shape[1] // TILE_K
        walk_args = (mCount, mC.shape[0], mC.shape[1] // TILE_W)
        if cutlass.const_expr(self.contiguous):
            walk_args = (mCount, mC.shape[1] // TILE_W)

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        init_wait()
        mma_wg = 1 + self.converters  # the first MMA warpgroup
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    (load_w, load_e, load_b), (sW, sE, sB), ab_pipe, walk_args, k_tiles,
                    (sSA, mSFA),
                )  # fmt: skip
        elif wg_idx < mma_wg:
            cute.arch.setmaxregister_decrease(self.converter_regs)
            pipes = (ab_pipe, wide_pipe)
            c = tidx - THREADS_PER_WG
            who = (c % THREADS_PER_WG, cute.arch.make_warp_uniform(c // THREADS_PER_WG))
            bases = (storage.sW.data_ptr(), storage.sA.data_ptr())
            rings = (bases, (sW_layout, sA_layout), sE, sRow)
            self._convert(rings, pipes, walk_args, k_tiles, who)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            t = tidx - mma_wg * THREADS_PER_WG
            thr_mma = tiled_mma.get_slice((wg_idx - mma_wg) * THREADS_PER_WG)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc_shape = thr_mma.partition_shape_C((TILE_W, self.h))
            accs = tuple(cute.make_rmem_tensor(acc_shape, Float32) for _ in range(3))
            lane = t % 32
            row0 = t // 32 * 16 + lane // 4
            mma = (tiled_mma, tCrA, tCrB, accs)
            self._consume_ss(
                mma, (sSA, sRow), (ab_pipe, wide_pipe), (mC, mCount), walk_args, k_tiles,
                (row0, lane % 4),
            )  # fmt: skip

    @cute.jit
    def _convert(self, smem, pipes, walk_args, k_tiles, who):
        """Converter warpgroup `part`'s thread `row` (`who` = (row 0 .. 127, part)): for every
        k-tile of every tile, its row's exponent word folded (the k-tile scale into sRow, by
        part 0; the sub-blocks' tables), its packed bytes of its 4 / C sub-blocks (sub-block q:
        the 16-byte chunk q, at chunk q ^ ((row >> 1) & 3) of the 64B swizzle) widened by
        `widen8` eight codes at a time (`widen4`'s bytes of the low, then the high 16 bits of
        each word: K in order) into the widened buffer's row (sub-block q: chunks 2q, 2q + 1 of
        the 128B swizzle, through the layout), then the async-proxy fence, the buffer's full
        arrival and the stage's release (each thread its own)."""
        (w_base, a_base), (sW_layout, sA_layout), sE, sRow = smem
        ab_pipe, wide_pipe = pipes
        row, part = who
        blocks = K_STEPS // self.converters  # sub-blocks a converter thread widens
        # the row's chunks' swizzled byte offsets in stage / buffer 0, once: a stage (buffer)
        # lies a multiple of the swizzle's 512 (1024)-byte period further, so its offsets are
        # these plus its base (tests/test_gemm_fp4.py checks the layouts), and the loop adds
        # only that base (the per-k-tile swizzle arithmetic cost ~35 integer instructions)
        w_offs = tuple(cute.crd2idx((row, CHUNK * q, 0), sW_layout) for q in range(K_STEPS))
        a_offs = tuple(cute.crd2idx((row, CHUNK * c, 0), sA_layout) for c in range(2 * K_STEPS))
        read = consumer_state(self.stages)
        put = producer_state(WIDE_SLOTS)
        walk = self._walk(walk_args)
        work, expert, before, rows = walk.first()
        while walk.valid(expert):
            for _ in range(k_tiles):
                ab_pipe.consumer_wait(read)
                wide_pipe.producer_acquire(put)
                stage, slot = read.index, put.index
                packed = (w_base + stage * (TILE_W * PACKED_ROW), w_offs)
                wide = (a_base + slot * (TILE_W * TILE_K), a_offs)
                scale, tabs = fold(sE[row, 0, stage], eight=True)
                if cutlass.const_expr(self.converters == 1):
                    sRow[row, slot] = scale
                    self._widen_row(packed, wide, tabs, tuple(range(K_STEPS)))
                else:  # `part` is warpgroup-uniform: no divergence
                    if part == 0:
                        sRow[row, slot] = scale
                        self._widen_row(packed, wide, tabs, tuple(range(blocks)))
                    else:
                        self._widen_row(packed, wide, tabs, tuple(range(blocks, K_STEPS)))
                cute.arch.fence_view_async_shared()  # st.shared, then WGMMA reads
                wide_pipe.producer_commit(put)
                cute.arch.mbarrier_arrive(ab_pipe.consumer_get_barrier(read))
                read.advance()
                put.advance()
            work, expert, before, rows = walk.next(work, expert, before, rows)

    @cute.jit
    def _widen_row(self, packed, wide, tabs, blocks):
        """Sub-blocks `blocks` (static) of one row (`packed` / `wide`: the stage's / buffer's
        base and the row's chunk offsets): its packed chunks all loaded first (ptxas
        keeps a later LDS behind an earlier STS, it cannot tell the buffers apart: loads
        interleaved with the stores each wait a shared-memory round trip, 640 model cycles a
        k-tile against 527), then widened (`widen8`) and stored, two 16-byte chunks each."""
        (w_stage, w_offs), (a_slot, a_offs) = packed, wide
        raws = []
        for q in blocks:
            src = cute.make_ptr(
                Int32, (w_stage + w_offs[q]).toint(), cute.AddressSpace.smem, assumed_align=CHUNK
            )
            raws.append(cute.make_tensor(src, cute.make_layout(4)).load())
        for j, q in enumerate(blocks):
            words = raws[j]
            for half in cutlass.range_constexpr(2):
                out = cute.make_rmem_tensor(4, Int32)
                for i in cutlass.range_constexpr(2):
                    out[2 * i], out[2 * i + 1] = widen8(words[2 * half + i], tabs[q])
                c = 2 * q + half
                dst = cute.make_ptr(
                    Int32, (a_slot + a_offs[c]).toint(), cute.AddressSpace.smem, assumed_align=CHUNK
                )
                cute.make_tensor(dst, cute.make_layout(4)).store(out.load())

    @cute.jit
    def _consume_ss(self, mma, smem, pipes, out, walk_args, k_tiles, who):
        """The MMA warpgroups: each tile's mainloop (`_mainloop_ss`), then its counted tokens'
        stores (as `GemmFp4GroupedSm90._consume`)."""
        mC, mCount = out
        row0, quad = who
        states = tuple(consumer_state(n) for n in (self.stages, self.stages))
        wide = tuple(consumer_state(WIDE_SLOTS) for _ in range(2))
        tiled_mma, tCrA, tCrB, (acc, frag0, frag1) = mma
        walk = self._walk(walk_args)
        work, expert, before, rows = walk.first()
        while walk.valid(expert):
            tile_t, tile_n, tile_rows = walk.tile(work, before, rows)
            first = tile_t * self.h
            batch = self._batch(expert)
            src = (smem, row0, quad)
            states, wide, tiled_mma = self._mainloop_ss(
                k_tiles, (tiled_mma, tCrA, tCrB, acc, (frag0, frag1)), src, pipes, states, wide
            )
            keep = Int32(0)
            for i in cutlass.range_constexpr(self.h // 4):
                col = 8 * (i // 2) + 2 * quad + i % 2
                stored = col < tile_rows
                if cutlass.const_expr(self.contiguous):
                    stored = stored & (mCount[cutlass.min(first + col, first + tile_rows - 1)] >= 0)
                keep = keep | (Int32(stored) << i)
            self._store(acc, mC[None, None, batch], (first, keep), tile_n, row0, quad)
            work, expert, before, rows = walk.next(work, expert, before, rows)

    @cute.jit
    def _mainloop_ss(self, count, mma, src, pipes, states, wide):
        """`GemmFp4GroupedSm90._mainloop`'s schedule with A from the widened buffers: k-tile j
        issued before j - 1 is waited for, released (its stage and its buffer) and promoted.
        Returns the states."""
        tiled_mma, tCrA, tCrB, acc, (f0, f1) = mma
        read, release = states
        wread, wrelease = wide
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        even = self._issue_ss(tiled_mma, (tCrA, tCrB), f0, pipes, (read, wread), src)
        read.advance()
        wread.advance()
        for _ in range((count - 1) // 2):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            odd = self._issue_ss(tiled_mma, (tCrA, tCrB), f1, pipes, (read, wread), src)
            read.advance()
            wread.advance()
            self._retire_ss(1, pipes, (release, wrelease))
            release.advance()
            wrelease.advance()
            self._promote(acc, f0, even)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            even = self._issue_ss(tiled_mma, (tCrA, tCrB), f0, pipes, (read, wread), src)
            read.advance()
            wread.advance()
            self._retire_ss(1, pipes, (release, wrelease))
            release.advance()
            wrelease.advance()
            self._promote(acc, f1, odd)
        if count % 2 == 0:
            tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
            odd = self._issue_ss(tiled_mma, (tCrA, tCrB), f1, pipes, (read, wread), src)
            read.advance()
            wread.advance()
            self._retire_ss(1, pipes, (release, wrelease))
            release.advance()
            wrelease.advance()
            self._promote(acc, f0, even)
            self._retire_ss(0, pipes, (release, wrelease))
            release.advance()
            wrelease.advance()
            self._promote(acc, f1, odd)
        else:
            self._retire_ss(0, pipes, (release, wrelease))
            release.advance()
            wrelease.advance()
            self._promote(acc, f0, even)
        return (read, release), (wread, wrelease), tiled_mma

    @cute.jit
    def _issue_ss(self, tiled_mma, operands, frag, pipes, at, src):
        """Wait for the k-tile's stage (tokens, their scales) and its widened buffer; issue its
        4 WGMMA k32 steps (A and B from shared memory) into `frag`, one commit group. Returns
        its scales (the rows' k-tile scales, then the tokens'), as `_issue` does."""
        tCrA, tCrB = operands
        ab_pipe, wide_pipe = pipes
        read, wread = at
        (sSA, sRow), row0, quad = src
        ab_pipe.consumer_wait(read)
        wide_pipe.consumer_wait(wread)
        stage, slot = read.index, wread.index
        scale_lo, scale_hi = sRow[row0, slot], sRow[row0 + 8, slot]
        sa = tuple(sSA[8 * (i // 2) + 2 * quad + i % 2, stage] for i in range(self.h // 4))
        # the fragment's registers were last read by the promotion FFMAs
        warpgroup.fence()
        for step in cutlass.range_constexpr(K_STEPS):
            a = tCrA[(None, None, step, slot)]
            cute.gemm(tiled_mma, frag, a, tCrB[(None, None, step, stage)], frag)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        return (scale_lo, scale_hi, *sa)

    @cute.jit
    def _retire_ss(self, pending, pipes, at):
        """Wait until at most `pending` WGMMA groups are in flight; release the oldest held
        k-tile's stage and widened buffer (every thread its own arrivals)."""
        ab_pipe, wide_pipe = pipes
        release, wrelease = at
        warpgroup.wait_group(pending)
        cute.arch.mbarrier_arrive(ab_pipe.consumer_get_barrier(release))
        wide_pipe.consumer_release(wrelease)
