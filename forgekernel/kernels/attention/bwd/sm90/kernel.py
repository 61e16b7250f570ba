"""Attention backward main kernel for Hopper (sm_90a): dK, dV and the fp32 dQ partial sums.

One CTA per (key block of tile_n keys, kv head, batch): grid (ceil(Sk / tile_n), Hkv, B).
The CTA keeps its K and V tiles in shared memory and its dK, dV accumulators in registers
while it walks every query head of its GQA group and, per head, every query block of tile_m
rows that sees one of its keys (ascending, or in the `walk_order` of the config); dK and dV
are written once at the end (no atomics).

Warp roles (3 warpgroups, 384 threads):
- warp 0 (producer, 24 registers): TMA loads K and V once, then per step the Q tile with its
  LSE row slice (one mbarrier ring) and the dO tile with its Dsum slice (a second ring).
- warp 1 (dQ writer, 24 registers): per step waits for the consumers' fp32 dQ tile in one of
  two shared-memory staging buffers and adds it to the global fp32 workspace with one
  `cp.reduce.async.bulk .add.f32` (a single bulk reduction of tile_m * D floats); with
  `deterministic` it first spins on a per-(query block, head, batch) counter until the key
  blocks before its own have added theirs, and bumps it (release) once its addition is
  complete, so every dQ element sums its key blocks in one fixed order (ascending; causal:
  descending, with the key blocks launched in descending order, see `_dq_turn`).
- warpgroups 1 and 2 (consumers, 240 registers), 64 keys each. Per step (query block m of
  query head h), everything computed transposed, keys along the rows:
    S^T = K Q^T and dP^T = V dO^T (WGMMA, operands in shared memory, two async groups);
    P^T = exp2(S^T scale log2e - LSE log2e) (masked to 0 on causal-diagonal and key-edge
    blocks); dS^T = P^T (dP^T - Dsum);
    dV += P^T dO and dK += dS^T Q (WGMMA, P^T and dS^T straight from registers: the
    accumulator of an M = keys product is the A operand of the next, K = queries);
    dS^T goes through shared memory (stmatrix) for dQ = dS K (WGMMA, both operands
    MN-major: transposed views of the dS and K buffers), which is staged to shared memory
    in its accumulator order for the dQ writer.
  Epilogue: dK * scale and dV converted to the input dtype, stmatrix into the K and V
  buffers, two TMA stores (rows past Sk clipped).

Persistent (static `persistent`, the D = 64 default): grid min(tiles, SMs); each CTA takes
(key block, kv head, batch) tiles in the launch order from a global counter (the producer
bumps it once a tile's loads are issued and hands the id to the other warps through a
two-slot mbarrier ring); the Q / dO ring and the dQ staging run on across tiles, a tile's
first Q / dO stage is loaded before its K / V, and K / V are released once the tile's dK / dV
have been stored.

Head split (static `head_split`, GQA at D = 128, chosen by shape in `config.choose_config`):
one CTA per (key block, query head, batch), FA4's layout; dK * scale and dV are added into
fp32 (B, Sk, Hkv, D) workspaces with `red.global.add.v2.f32` and converted by the launcher.
`head_split` 2 interleaves the grid's heads over the kv heads, so CTAs launched together add
into different dK / dV tiles.

Column split (static, tile_n = 64; the D = 192 / Dv = 128 config): both consumer warpgroups
see the CTA's 64 keys; S^T / dP^T are split by query columns (32 each), P^T and dS^T go to
shared memory (stmatrix) and are the shared-memory A operands of dV += P^T dO and
dK += dS^T Q, which are split by head-dim columns (dV 64, dK 96 per warpgroup); dQ as above.
Per thread: dK 48 + dV 32 + S^T 16 + dP^T 16 + dQ 48 fp32 registers (`_step_cs`).

Workspaces (from the preprocess kernel): LSE in log2 units, +inf for rows that saw no key and
for padding rows (so their P is 0), and Dsum = rowsum(dO * O), both (B, Hq, Sq_pad) fp32;
the dQ accumulator (B, Hq, Sq_pad * D) fp32, zeroed, tile-major in the dQ MMA's accumulator
order (see `utils.dq_frag_offset`); the postprocess kernel scales and converts it.

Causal is bottom-right aligned (query i sees key j iff j <= i + Sk - Sq); query blocks that
see none of the CTA's keys are skipped, blocks crossing the diagonal or the Sk edge masked.

Varlen (static flag `varlen`): packed q, do (Tq, Hq, *), k, v, dk, dv (Tk, Hkv, *) viewed with a
unit batch mode, int32 offsets cu_seqlens_q / cu_seqlens_k (B + 1,); grid
(ceil(max_seqlen_k / tile_n), Hkv, B), a CTA whose key block starts past its sequence's Sk
does nothing. Each sequence is a row offset into the TMA coordinate tensors
(`cute.domain_offset`): boxes that run past the sequence read the neighbour's rows (or TMA's
zero fill), which the per-sequence key-edge mask and the +inf LSE of padding rows zero out.
Workspaces (Hq, rows): sequence b's padded region from row ceil4(cu_q[b]) + b * (ROW_PAD + 4)
(`config.varlen_ws_row`), so a query block's LSE / Dsum loads and dQ reductions stay inside
its own sequence's region; semaphores one per workspace row. A key block that ends inside its
sequence stores dK and dV from registers, rows < Sk only (a TMA box would overwrite the next
sequence's rows).
"""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.bwd.sm90.config import (
    NUM_MMA_WG,
    BwdConfig,
    check_fits,
    swizzled_block,
    varlen_ws_row,
)
from forgekernel.kernels.attention.bwd.sm90.utils import (
    DQ_VEC,
    make_dq_mma,
    s_d_h_b,
    unit_batch,
)
from forgekernel.kernels.common.sm90 import pipeline as pipes
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import (
    acc_as_operand_a,
    acc_to_operand_a,
    packed_as_sdhb,
    rows_cols,
    transposed,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.ptx import (
    bulk_g2s,
    bulk_reduce_add_f32,
    fence_proxy_async_global,
    ld_acquire_gpu,
    opaque_tid_x,
    red_release_gpu_add,
)
from forgekernel.kernels.common.sm90.scheduler import atomic


class Bar(IntEnum):
    """Named barriers. The dQ hand-over: the consumers arrive on FULL once the staging buffer
    holds their tile (the writer waits), the writer arrives on EMPTY once it is drained (the
    consumers wait); 128 or 256 consumer threads + the writer warp."""

    CONSUMERS = FIRST_FREE  # the 256 consumer threads
    DQ_FULL = 2  # joint hand-over; dq_split: 2 + warpgroup (2, 3)
    DQ_EMPTY = 4  # joint hand-over
    DQ_EMPTY_SPLIT = 6  # dq_split: 6 + warpgroup (6, 7)


DQ_WRITER_WARP = 1
# setmaxnreg: 240 x 256 consumer threads + 24 x 128 producer / dQ-writer threads <= 64 K
CONSUMER_REGS = 240
PRODUCER_REGS = 24


class AttentionBwdSm90:
    """Warp-specialized TMA + WGMMA attention backward (dK, dV, dQ partials); see the module
    docstring."""

    def __init__(
        self,
        head_dim: int,
        head_dim_v: int,
        causal: bool,
        deterministic: bool,
        config: BwdConfig,
        varlen: bool = False,
    ):
        if config.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {config.tile_m}")
        # tile_n = 128: keys split over the warpgroups (64 each, dK / dV resident per key row).
        # tile_n = 64 ("column split"): both warpgroups share the 64 keys; S^T / dP^T split by
        # query columns, dK / dV by head-dim columns; P^T and dS^T via shared memory.
        self.col_split = config.tile_n == 64
        if config.tile_n != 64 * NUM_MMA_WG and not (self.col_split and config.tile_m == 64):
            raise ValueError(
                f"tile_n must be {64 * NUM_MMA_WG} (or 64 with tile_m 64), got {config.tile_n}"
            )
        if head_dim not in (64, 128, 192) or head_dim_v not in (64, 128):
            raise ValueError(
                f"head dims must be D in (64, 128, 192), Dv in (64, 128); got {head_dim}, "
                f"{head_dim_v}"
            )
        check_fits(config, head_dim, head_dim_v)
        _check_knobs(config, head_dim, deterministic, varlen)
        self.cfg = config
        self.varlen = varlen
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.deterministic = deterministic
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.stages = config.stages
        self.threads_per_cta = (1 + NUM_MMA_WG) * THREADS_PER_WG
        self.num_mma_threads = NUM_MMA_WG * THREADS_PER_WG
        self.q_halves = config.q_halves
        # the l2_swizzle launch order: causal fixed length only (non-causal CTAs all take the
        # same time; varlen keeps its per-sequence grid)
        self.l2_swizzle = config.l2_swizzle if causal and not varlen else 0
        # the column split's step loop is always rolled
        self.static_stage = config.static_stage and not self.col_split
        self.stats_early = config.stats_early
        self.dsum_early = config.dsum_early
        self.ds_store_first = config.ds_store_first
        self.p_early = config.p_early
        self.dv_before_ds = config.dv_before_ds
        # dq_split: per-warpgroup dQ hand-over and two dS (column split: dS and P) buffers
        # (the warpgroups are no longer in step at the dQ barriers, so one may write step
        # i + 1's dS while the other's GEMMs still read step i's).
        self.dq_split = config.dq_split
        self.persistent = config.persistent
        self.walk_order = config.walk_order
        self.exp_groups = config.exp_groups
        self.head_split = config.head_split

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        if const_expr(self.col_split):
            self._setup_col_split()
            return
        dt, tm, tn = self.dtype, self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        wgs = (NUM_MMA_WG, 1, 1)
        # S^T (tn, tm) = K Q^T and dP^T = V dO^T: keys split over the warpgroups (q_halves:
        # 32 query columns at a time).
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, wgs, (64, tm // 2 if self.q_halves else tm)
        )
        # dV (tn, dv) += P^T dO, dK (tn, d) += dS^T Q: A from registers, B MN-major views.
        rmem = warpgroup.OperandSource.RMEM
        self.mma_dv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, wgs, (64, dv), a_source=rmem
        )
        self.mma_dk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, wgs, (64, d), a_source=rmem
        )
        self.mma_dq = make_dq_mma(dt, tm, d)
        row, col = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
        # Q (tm, d) and dO (tm, dv): K-major B operands of S^T / dP^T (their transposed views
        # are the MN-major B operands of dK / dV). K (tn, d), V (tn, dv): K-major A operands.
        self.sQ_layout = sm90_utils.make_smem_layout_b(row, (tn, tm, d), dt, self.stages)
        self.sdO_layout = sm90_utils.make_smem_layout_b(row, (tn, tm, dv), dt, self.stages)
        # dQ's warpgroups each take D / 2 columns of K^T (MN-major): for D = 192 that is 96,
        # not a whole 128-byte swizzle atom (64 elements), so K gets 64-byte atoms then.
        k_atom = sm90_utils.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(row, dt, d // 2 if d == 192 else d), dt
        )
        self.sK_layout = cute.tile_to_shape(k_atom, (tn, d, 1), order=(0, 1, 2))
        self.sV_layout = sm90_utils.make_smem_layout_a(row, (tn, tm, dv), dt, 1)
        # dS (tm, tn), MN-major A of dQ = dS K; stored through its transposed view.
        self.sdS_layout = sm90_utils.make_smem_layout_a(
            col, (tm, d, tn), dt, 2 if self.dq_split else 1
        )

    def _setup_col_split(self):
        """tile_n = 64 keys shared by both warpgroups. S^T, dP^T (64 keys x tm queries): warpgroup
        w takes query columns [w tm / 2, (w + 1) tm / 2) (N = 32). dV (64, Dv) and dK (64, D):
        warpgroup w holds head-dim columns [w Dv / 2, ...) and [w D / 2, ...) (N = 64, 96), A
        operands P^T and dS^T read from shared memory (all 64 keys x tm queries). dQ as in the
        key-split layout (tile_m 64: columns split)."""
        dt, tm, tn = self.dtype, self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        cols = (1, NUM_MMA_WG, 1)
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, cols, (64, tm // NUM_MMA_WG)
        )
        self.mma_dv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, cols, (64, dv // NUM_MMA_WG)
        )
        self.mma_dk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, cols, (64, d // NUM_MMA_WG)
        )
        self.mma_dq = make_dq_mma(dt, tm, d)
        row, col = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR

        def split_atom(width: int):
            # a warpgroup's MN-major slice (width / 2 columns) must be whole swizzle atoms:
            # D = 192 -> 96 columns -> 64-byte swizzle.
            return sm90_utils.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(row, dt, width // NUM_MMA_WG), dt
            )

        # Q (tm, d), dO (tm, dv): K-major B of S^T / dP^T, transposed views the MN-major B of
        # dK / dV (split by columns); K (tn, d): K-major A of S^T, transposed the MN-major B
        # of dQ (split by columns); V (tn, dv): K-major A of dP^T.
        self.sQ_layout = cute.tile_to_shape(split_atom(d), (tm, d, self.stages), order=(0, 1, 2))
        self.sdO_layout = cute.tile_to_shape(split_atom(dv), (tm, dv, self.stages), order=(0, 1, 2))
        self.sK_layout = cute.tile_to_shape(split_atom(d), (tn, d, 1), order=(0, 1, 2))
        self.sV_layout = sm90_utils.make_smem_layout_a(row, (tn, tm, dv), dt, 1)
        # Two pairs (dq_split), b = step % 2: dS (tm, tn) at stage 2 b (MN-major A of dQ; its
        # transposed view the K-major A of dK), P (tm, tn) at stage 2 b + 1 (transposed: the
        # K-major A of dV).
        self.sdS_layout = sm90_utils.make_smem_layout_a(col, (tm, d, tn), dt, 4)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: cute.Tensor,
        mCuQ: cute.Tensor | None,
        mCuK: cute.Tensor | None,
        max_seqlen_k: Int32,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        stream: cuda.CUstream,
    ):
        """mQ (B, Sq, Hq, D), mK (B, Sk, Hkv, D), mV (B, Sk, Hkv, Dv), mdO (B, Sq, Hq, Dv),
        mLSE2 and mDsum (B, Hq, Sq_pad) fp32, mdQacc (B, Hq, Sq_pad * D) fp32,
        mdK (B, Sk, Hkv, D), mdV (B, Sk, Hkv, Dv), mSem (B, Hq, Sq_pad / tile_m) int32;
        mCuQ, mCuK None, max_seqlen_k unused. Varlen: q, do (Tq, Hq, *), k, v, dk, dv
        (Tk, Hkv, *), mLSE2, mDsum (Hq, rows), mdQacc (Hq, rows * D), mSem (Hq, rows),
        mCuQ / mCuK int32 (B + 1,), max_seqlen_k the longest key sequence."""
        self.dtype = mQ.element_type
        for t in (mK, mV, mdO) + (() if const_expr(self.head_split) else (mdK, mdV)):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"q, k, v, do, dk, dv must share one dtype, got {t.element_type}")
        self._setup()
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v

        # (B, S, H, D) -> (S, D, H, B): TMA boxes over (S, D), coordinates for head and batch.
        # Varlen: (T, H, D) -> (T, D, H, 1), (H, rows) workspaces -> (1, H, rows).
        if const_expr(self.varlen):
            mQ, mK, mV, mdO, mdK, mdV = (packed_as_sdhb(t) for t in (mQ, mK, mV, mdO, mdK, mdV))
            mLSE2, mDsum, mdQacc, mSem = (unit_batch(t) for t in (mLSE2, mDsum, mdQacc, mSem))
        else:
            mQ, mK, mV, mdO, mdK, mdV = (s_d_h_b(t) for t in (mQ, mK, mV, mdO, mdK, mdV))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        sQ_tile = cute.slice_(self.sQ_layout, (None, None, 0))
        sdO_tile = cute.slice_(self.sdO_layout, (None, None, 0))
        sK_tile = cute.slice_(self.sK_layout, (None, None, 0))
        sV_tile = cute.slice_(self.sV_layout, (None, None, 0))
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_tile, (tm, d))
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(g2s, mdO, sdO_tile, (tm, dv))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_tile, (tn, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(g2s, mV, sV_tile, (tn, dv))
        if const_expr(self.head_split):
            # fp32 dK / dV accumulators, added to from registers (mdK / mdV below); the TMA
            # store atoms are unused
            tma_dk, tma_mdK, tma_dv, tma_mdV = tma_k, tma_mK, tma_v, tma_mV
        else:
            tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(s2g, mdK, sK_tile, (tn, d))
            tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(s2g, mdV, sV_tile, (tn, dv))
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_tile) + tm * 4
        self.do_bytes = cute.size_in_bytes(self.dtype, sdO_tile) + tm * 4
        self.kv_bytes = cute.size_in_bytes(self.dtype, sK_tile) + cute.size_in_bytes(
            self.dtype, sV_tile
        )

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            do_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            kv_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            # persistent: the tile ring (producer -> consumer warps and the dQ writer)
            tile_barriers: cute.struct.MemRange[cutlass.Int64, 2 * atomic.STAGES]
            tile_ids: cute.struct.MemRange[Int32, atomic.STAGES]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.stages], 128]
            sDsum: cute.struct.Align[cute.struct.MemRange[Float32, tm * self.stages], 128]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sQ_layout)], 1024
            ]
            sdO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sdO_layout)], 1024
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024
            ]
            sdS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sdS_layout)], 1024
            ]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, tm * d], 128]

        self.shared_storage = SharedStorage
        if const_expr(self.varlen):
            grid = (cute.ceil_div(max_seqlen_k, tn), mK.shape[2], mCuK.shape[0] - 1)
        else:
            # head_split: one CTA per query head
            heads = mQ.shape[2] if const_expr(self.head_split) else mK.shape[2]
            grid = (cute.ceil_div(mK.shape[0], tn), heads, mK.shape[3])
        if const_expr(self.l2_swizzle):
            # one dimension, mapped to (key block, kv head, batch) by _tile_coords
            grid = (grid[0] * grid[1] * grid[2], 1, 1)
        if const_expr(self.persistent):
            # the launcher's CTA count (min(tiles, multiprocessors)) in the max_seqlen_k slot
            grid = (max_seqlen_k, 1, 1)
        self.kernel(
            tma_q,
            tma_mQ,
            tma_do,
            tma_mdO,
            tma_k,
            tma_mK,
            tma_v,
            tma_mV,
            tma_dk,
            tma_mdK,
            tma_dv,
            tma_mdV,
            mLSE2,
            mDsum,
            mdQacc,
            mSem,
            mCuQ,
            mCuK,
            mdK if const_expr(self.varlen or self.head_split) else None,
            mdV if const_expr(self.varlen or self.head_split) else None,
            softmax_scale,
            softmax_scale_log2,
            self.mma_sdp,
            self.mma_dv,
            self.mma_dk,
            self.mma_dq,
            self.sQ_layout,
            self.sdO_layout,
            self.sK_layout,
            self.sV_layout,
            self.sdS_layout,
        ).launch(  # fmt: skip
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_dk: cute.CopyAtom,
        mdK: cute.Tensor,
        tma_dv: cute.CopyAtom,
        mdV: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQacc: cute.Tensor,
        mSem: cute.Tensor,
        mCuQ: cute.Tensor | None,
        mCuK: cute.Tensor | None,
        mdK_gmem: cute.Tensor | None,
        mdV_gmem: cute.Tensor | None,
        scale: Float32,
        scale_log2: Float32,
        mma_sdp: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        consumer_warps = self.num_mma_threads // 32
        q_pipe, do_pipe, kv_pipe = (
            pipes.tma_pipeline(bars, stages, nbytes, consumer_warps)
            for bars, stages, nbytes in (
                (storage.q_barriers, self.stages, self.q_bytes),
                (storage.do_barriers, self.stages, self.do_bytes),
                (storage.kv_barriers, 1, self.kv_bytes),
            )
        )
        tiles = None
        if const_expr(self.persistent):
            # taken by each consumer warp and by the dQ writer
            tiles = atomic.TileRing(storage.tile_barriers, storage.tile_ids, consumer_warps + 1)
        pipes.init_arrive()

        sQ = pipes.smem_tensor(storage.sQ, sQ_layout)
        sdO = pipes.smem_tensor(storage.sdO, sdO_layout)
        sK = pipes.smem_tensor(storage.sK, sK_layout)
        sV = pipes.smem_tensor(storage.sV, sV_layout)
        sdS = pipes.smem_tensor(storage.sdS, sdS_layout)
        stats_layout = cute.make_layout((self.tile_m, self.stages))
        sLSE = storage.sLSE.get_tensor(stats_layout)
        sDsum = storage.sDsum.get_tensor(stats_layout)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.head_dim))

        n_block, head_kv, batch = cute.arch.block_idx()
        num_n = cute.arch.grid_dim()[0]
        if const_expr(self.persistent):
            pass  # tiles from the counter (_roles)
        elif const_expr(self.l2_swizzle):
            # the grid's heads: kv heads (head_split: query heads)
            heads = mQ.shape[2] if const_expr(self.head_split) else mK.shape[2]
            n_block, head_kv, batch = self._tile_coords(cute.arch.block_idx()[0], mK, heads)
            num_n = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        if const_expr(self.deterministic and self.causal):
            # Key blocks launched in descending order: each query block's dQ is summed from
            # its highest key block down (see _dq_turn), and a CTA only ever waits for CTAs
            # of higher key blocks, dispatched before it.
            n_block = num_n - 1 - n_block
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        # varlen: the sequence's first packed query / key row and first workspace row
        offs = (0, 0, 0)
        if const_expr(self.varlen):
            q_off = mCuQ[batch]
            k_off = mCuK[batch]
            seqlen_q = mCuQ[batch + 1] - q_off
            seqlen_k = mCuK[batch + 1] - k_off
            offs = (q_off, k_off, varlen_ws_row(q_off, batch))
            batch = Int32(0)  # the unit batch mode of the packed views

        pipes.init_wait()

        args = (
            tidx, warp_idx, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_dk, mdK, tma_dv,
            mdV, mLSE2, mDsum, mdQacc, mSem, mdK_gmem, mdV_gmem, scale, scale_log2,
            mma_sdp, mma_dv, mma_dk, mma_dq, sQ, sdO, sK, sV, sdS, sLSE, sDsum, sdQ,
            q_pipe, do_pipe, kv_pipe, n_block, head_kv, batch, seqlen_q, seqlen_k, offs,
        )  # fmt: skip
        if const_expr(self.persistent):
            self._roles(*args, tiles)
        elif const_expr(self.varlen):
            # key blocks past this sequence's keys: nothing to do (and nothing to store)
            if n_block * self.tile_n < seqlen_k:
                self._roles(*args)
        else:
            self._roles(*args)

    @cute.jit
    def _roles(
        self, tidx, warp_idx, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_dk, mdK, tma_dv,
        mdV, mLSE2, mDsum, mdQacc, mSem, mdK_gmem, mdV_gmem, scale, scale_log2,
        mma_sdp, mma_dv, mma_dk, mma_dq, sQ, sdO, sK, sV, sdS, sLSE, sDsum, sdQ,
        q_pipe, do_pipe, kv_pipe, n_block, head_kv, batch, seqlen_q, seqlen_k, offs,
        tiles=None,
    ):  # fmt: skip
        """The warp roles of one CTA: a key block with at least one key, or (persistent) the
        tiles (key block, kv head, batch) in the launch order, the first one the CTA index,
        then grid + a counter bumped by the producer near the end of each tile and passed to
        the other warps through the tile ring `tiles` (scheduler.atomic)."""
        group = mQ.shape[2] // mK.shape[2]
        persist = None
        if const_expr(self.persistent):
            # per tile, in the roles' loops
            num_tiles = (mK.shape[0] + self.tile_n - 1) // self.tile_n * mK.shape[2] * mK.shape[3]
            persist = (tiles, num_tiles, mK)
            hq0, m_begin, m_end = Int32(0), Int32(0), Int32(0)
            m_unmasked, num_steps = Int32(0), Int32(0)
        else:
            # the CTA's query heads: its kv head's group, hq0 .. hq0 + heads - 1 (head_split:
            # the grid's head is one query head, the grid's heads interleaved over the kv heads)
            hq0, heads = head_kv * group, group
            if const_expr(self.head_split):
                hkv = mK.shape[2]
                hq0, heads = head_kv % hkv * group + head_kv // hkv, 1
                head_kv = hq0 // group
            m_begin, m_end, m_unmasked = self._query_blocks(n_block, seqlen_q, seqlen_k)
            # CTA-uniform scalars: keep them in uniform registers, off the consumers' budget.
            m_begin = cute.arch.make_warp_uniform(m_begin)
            m_end = cute.arch.make_warp_uniform(m_end)
            m_unmasked = cute.arch.make_warp_uniform(m_unmasked)
            num_steps = heads * (m_end - m_begin)

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                if const_expr(self.persistent):
                    self._produce_persistent(
                        tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum, mSem,
                        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, tiles,
                        group, num_tiles, seqlen_q, seqlen_k, offs,
                    )  # fmt: skip
                else:
                    self._produce(
                        tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
                        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe,
                        n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
                    )  # fmt: skip
            if warp_idx == DQ_WRITER_WARP:
                if const_expr(self.persistent):
                    self._write_dq_persistent(
                        sdQ, mdQacc, mSem, mK, tiles, group, num_tiles, offs[2],
                        seqlen_q, seqlen_k,
                    )  # fmt: skip
                else:
                    self._write_dq(
                        sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end,
                        num_steps, offs[2], seqlen_q, seqlen_k,
                    )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self._consume(
                tidx - THREADS_PER_WG, wg_idx - 1, warp_idx,
                mma_sdp, mma_dv, mma_dk, mma_dq,
                sQ, sdO, sK, sV, sdS, sLSE, sDsum, sdQ,
                q_pipe, do_pipe, kv_pipe, tma_dk, mdK, tma_dv, mdV,
                scale, scale_log2, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
                m_begin, m_end, m_unmasked, num_steps, mdK_gmem, mdV_gmem, offs[1], persist,
            )  # fmt: skip

    @cute.jit
    def _produce_persistent(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum, mSem,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, tiles,
        group, num_tiles, seqlen_q, seqlen_k, offs,
    ):  # fmt: skip
        """Warp 0 of a persistent CTA: takes the tiles (mSem[0, 0, 0] is the counter),
        publishes each on the tile ring and issues its loads."""
        lane = cute.arch.lane_idx()
        n_ctas = cute.arch.grid_dim()[0]
        ctr = mSem[0, 0, None].iterator
        kv_state = pipes.producer_state(1)
        st = pipes.producer_state(self.stages)
        tstate = tiles.producer_state()
        tile = atomic.first_tile()
        while tile < num_tiles:
            tstate = atomic.publish(tiles, tstate, tile, lane)
            n_block, head_kv, batch, m_begin, m_end, _, num_steps = self._tile_work(
                tile, mK, group, seqlen_q, seqlen_k
            )
            kv_state, st = self._produce_tile(
                tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
                sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
                n_block, head_kv, batch, head_kv * group, m_begin, m_end, num_steps, offs,
            )  # fmt: skip
            # the next tile, taken once this one's loads are all issued (about the ring
            # depth before its consumers finish)
            tile = atomic.next_tile(ctr, lane, n_ctas)
        tstate = atomic.publish(tiles, tstate, num_tiles, lane)

    @cute.jit
    def _write_dq_persistent(
        self, sdQ, mdQacc, mSem, mK, tiles, group, num_tiles, ws, seqlen_q,
        seqlen_k,
    ):  # fmt: skip
        """Warp 1 of a persistent CTA: every tile's dQ tiles, the staging buffers and their
        barriers going round over all of the CTA's steps."""
        lane = cute.arch.lane_idx()
        tstate = tiles.consumer_state()
        self._dq_first_arrivals(None)
        gstep = Int32(0)
        tile, tstate = atomic.take(tiles, tstate, lane)
        while tile < num_tiles:
            n_block, head_kv, batch, m_begin, m_end, _, num_steps = self._tile_work(
                tile, mK, group, seqlen_q, seqlen_k
            )
            self._write_dq_tile(
                sdQ, mdQacc, mSem, n_block, head_kv, batch, head_kv * group, m_begin, m_end,
                num_steps, ws, seqlen_q, seqlen_k, gstep,
            )  # fmt: skip
            gstep += num_steps
            tile, tstate = atomic.take(tiles, tstate, lane)
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _tile_work(self, tile, mK: cute.Tensor, group, seqlen_q, seqlen_k):
        """A persistent tile's (key block, kv head, batch, m_begin, m_end, m_unmasked, steps):
        its kv head's whole query-head group over its query blocks (_query_blocks)."""
        n_block, head_kv, batch = self._tile_coords(tile, mK)
        m_begin, m_end, m_unmasked = self._query_blocks(n_block, seqlen_q, seqlen_k)
        m_begin = cute.arch.make_warp_uniform(m_begin)
        m_end = cute.arch.make_warp_uniform(m_end)
        m_unmasked = cute.arch.make_warp_uniform(m_unmasked)
        return n_block, head_kv, batch, m_begin, m_end, m_unmasked, group * (m_end - m_begin)

    @cute.jit
    def _tile_coords(self, tile, mK: cute.Tensor, heads=None):
        """(key block, head, batch) of tile `tile` in the launch order (l2_swizzle: the
        config.swizzled_block order) over `heads` heads (default the kv heads)."""
        num_n = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        hkv = mK.shape[2] if const_expr(heads is None) else heads
        if const_expr(self.l2_swizzle):
            n_block, pair = swizzled_block(
                tile, num_n, hkv * mK.shape[3], self.l2_swizzle, cutlass.min
            )
        else:
            pair = tile // num_n
            n_block = tile - pair * num_n
        batch = pair // hkv
        return n_block, pair - batch * hkv, batch

    @cute.jit
    def _query_blocks(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(m_begin, m_end, m_unmasked): query blocks [m_begin, m_end) hold a row that sees a
        key of this key block; from m_unmasked on (causal) every row sees every key of it."""
        m_end = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_begin = Int32(0)
        m_unmasked = Int32(0)
        if const_expr(self.causal):
            offset = seqlen_k - seqlen_q
            n0 = n_block * self.tile_n
            # Query i sees key j iff i >= j - offset: the block's first key n0 from row
            # n0 - offset on, its last key n0 + tile_n - 1 from row n0 + tile_n - 1 - offset.
            first_row = cutlass.max(n0 - offset, 0)
            m_begin = cutlass.min(first_row // self.tile_m, m_end)
            full_row = cutlass.max(n0 + self.tile_n - 1 - offset, 0)
            m_unmasked = (full_row + self.tile_m - 1) // self.tile_m
        return m_begin, m_end, m_unmasked

    @cute.jit
    def _produce(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe,
        n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
    ):  # fmt: skip
        """Warp 0: K and V once, then per step Q + LSE and dO + Dsum."""
        kv_state = pipes.producer_state(1)
        st = pipes.producer_state(self.stages)
        self._produce_tile(
            tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
            sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
            n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
        )  # fmt: skip

    @cute.jit
    def _load_kv(
        self, tma_k, tma_v, mK, mV, sK, sV, kv_pipe, kv_state, n_block, head_kv, batch, k_off
    ):  # fmt: skip
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        one = cute.make_layout(1)
        gK = cute.local_tile(self._seq(mK[None, None, head_kv, batch], k_off), (tn, d), (None, 0))
        gV = cute.local_tile(self._seq(mV[None, None, head_kv, batch], k_off), (tn, dv), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        kv_pipe.producer_acquire(kv_state)
        bar = kv_pipe.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK[(None, n_block)], tKsK[(None, 0)], tma_bar_ptr=bar)
        cute.copy(tma_v, tVgV[(None, n_block)], tVsV[(None, 0)], tma_bar_ptr=bar)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _produce_tile(
        self, tma_q, tma_do, tma_k, tma_v, mQ, mdO, mK, mV, mLSE2, mDsum,
        sQ, sdO, sK, sV, sLSE, sDsum, q_pipe, do_pipe, kv_pipe, kv_state, st,
        n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, offs,
    ):  # fmt: skip
        """One tile's loads: K and V, then per step Q + LSE and dO + Dsum (persistent: K and V
        after the first step's Q and dO, whose ring stage frees first)."""
        tm, d, dv = self.tile_m, self.head_dim, self.head_dim_v
        q_off, k_off, ws = offs
        one = cute.make_layout(1)
        kv_args = (tma_k, tma_v, mK, mV, sK, sV, kv_pipe)
        kv_coords = (n_block, head_kv, batch, k_off)
        if const_expr(not self.persistent):
            kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)

        num_m = m_end - m_begin
        for step in cutlass.range(num_steps, unroll=1):
            head, m = self._step_coords(step, hq0, m_begin, num_m)
            gQ = cute.local_tile(self._seq(mQ[None, None, head, batch], q_off), (tm, d), (None, 0))
            gdO = cute.local_tile(
                self._seq(mdO[None, None, head, batch], q_off), (tm, dv), (None, 0)
            )
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_do, 0, one, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
            )
            q_pipe.producer_acquire(st)
            bar_q = q_pipe.producer_get_barrier(st)
            cute.copy(tma_q, tQgQ[(None, m)], tQsQ[(None, st.index)], tma_bar_ptr=bar_q)
            with cute.arch.elect_one():
                bulk_g2s(
                    sLSE[None, st.index].iterator,
                    mLSE2[batch, head, None].iterator + (ws + m * tm),
                    tm * 4,
                    bar_q,
                )
            do_pipe.producer_acquire(st)
            bar_do = do_pipe.producer_get_barrier(st)
            cute.copy(tma_do, tdOgdO[(None, m)], tdOsdO[(None, st.index)], tma_bar_ptr=bar_do)
            with cute.arch.elect_one():
                bulk_g2s(
                    sDsum[None, st.index].iterator,
                    mDsum[batch, head, None].iterator + (ws + m * tm),
                    tm * 4,
                    bar_do,
                )
            st.advance()
            if const_expr(self.persistent):
                if step == 0:
                    kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)
        if const_expr(self.persistent):
            if num_steps == 0:
                kv_state = self._load_kv(*kv_args, kv_state, *kv_coords)
        return kv_state, st

    def _step_coords(self, step, hq0, m_begin, num_m):
        """(query head, query block) of a step: the heads one after another, each over the
        CTA's query blocks ascending (walk_order 0) or descending (2)."""
        if const_expr(self.walk_order == 2):
            return hq0 + step // num_m, m_begin + num_m - 1 - step % num_m
        return hq0 + step // num_m, m_begin + step % num_m

    def _first_m(self, m_begin, m_end):
        """The query block of a tile's first step (walk_order)."""
        return m_end - 1 if const_expr(self.walk_order == 2) else m_begin

    @cute.jit
    def _next_m(self, m, m_begin, m_end):
        """The query block of the step after one at m (walk_order; the next head starts over)."""
        if const_expr(self.walk_order == 2):
            m -= 1
            if m < m_begin:
                m = m_end - 1
        else:
            m += 1
            if m == m_end:
                m = m_begin
        return m

    def _dq_bar(self, full: bool, part):
        """(barrier id, threads) of the staging buffer's full or empty barrier for `part`:
        joint hand-over, both consumer warpgroups and the writer warp (part 0); dq_split,
        warpgroup `part` and the writer warp."""
        if const_expr(self.dq_split):
            base = Bar.DQ_FULL if full else Bar.DQ_EMPTY_SPLIT
            return base + part, THREADS_PER_WG + 32
        return Bar.DQ_FULL if full else Bar.DQ_EMPTY, self.num_mma_threads + 32

    @cute.jit
    def _write_dq(
        self, sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
        seqlen_q, seqlen_k,
    ):  # fmt: skip
        """Warp 1: drain the dQ staging buffer into the fp32 workspace (bulk reduce-add), one
        part per handing-over group (dq_split: each warpgroup's half, waited for, reduced and
        released on its own barriers; half 0 released while half 1 may still be read)."""
        self._dq_first_arrivals(num_steps)
        self._write_dq_tile(
            sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
            seqlen_q, seqlen_k, 0,
        )  # fmt: skip
        if cute.arch.lane_idx() == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _dq_first_arrivals(self, num_steps):
        """The staging buffer starts empty: one arrival per part, matched by the consumers'
        first waits (persistent: always; the consumers match the last one at the end)."""
        parts = NUM_MMA_WG if const_expr(self.dq_split) else 1
        for p in cutlass.range_constexpr(parts):
            bar, threads = self._dq_bar(False, p)
            if const_expr(self.persistent):
                cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)
            else:
                if num_steps > 0:
                    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _write_dq_tile(
        self, sdQ, mdQacc, mSem, n_block, head_kv, batch, hq0, m_begin, m_end, num_steps, ws,
        seqlen_q, seqlen_k, gstep,
    ):  # fmt: skip
        """One tile's steps of the dQ writer."""
        tile = self.tile_m * self.head_dim
        parts = NUM_MMA_WG if const_expr(self.dq_split) else 1
        part = tile // parts
        lane = cute.arch.lane_idx()
        num_m = m_end - m_begin
        for step in cutlass.range(num_steps, unroll=1):
            head, m = self._step_coords(step, hq0, m_begin, num_m)
            gdq = mdQacc[batch, head, None].iterator + (ws * self.head_dim + m * tile)
            if const_expr(self.deterministic):
                sem = mSem[batch, head, None].iterator + (ws + m)
            for p in cutlass.range_constexpr(parts):
                bar, threads = self._dq_bar(True, p)
                cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
                if lane == 0:
                    if const_expr(self.deterministic and p == 0):
                        # this key block's turn in query block m's fixed order (_dq_turn)
                        turn = self._dq_turn(n_block, m, seqlen_q, seqlen_k)
                        seen = ld_acquire_gpu(sem)
                        while seen != turn:
                            seen = ld_acquire_gpu(sem)
                        fence_proxy_async_global()
                    bulk_reduce_add_f32(gdq + p * part, sdQ.iterator + p * part, part * 4)
                    cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    fence_proxy_async_global()
                    red_release_gpu_add(sem, 1)
            for p in cutlass.range_constexpr(parts):
                if const_expr(not self.deterministic):
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(parts - 1 - p, read=True)
                cute.arch.sync_warp()
                bar, threads = self._dq_bar(False, p)
                if const_expr(self.persistent):
                    cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)
                else:
                    if step + 1 < num_steps:
                        cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _dq_turn(self, n_block, m, seqlen_q, seqlen_k):
        """How many key blocks add to query block m's dQ before key block n_block (the
        deterministic order). Non-causal: ascending key blocks (every one sees every query
        block). Causal: descending, from the highest key block query block m sees,
        n_max(m) - 1 with n_max(m) = ceil(((m + 1) tile_m + Sk - Sq) / tile_n) clipped to the
        key blocks (the inequality of _query_blocks: key block n reaches m iff
        max(n tile_n - (Sk - Sq), 0) < (m + 1) tile_m). Key block n's first query blocks then
        have it first in line, and it trails key block n + 1 by as many steps as it starts
        after it: no waiting in the steady state (FA3's order for deterministic causal)."""
        turn = n_block
        if const_expr(self.causal):
            tm, tn = self.tile_m, self.tile_n
            n_max = ((m + 1) * tm + seqlen_k - seqlen_q + tn - 1) // tn
            n_max = cutlass.min(n_max, (seqlen_k + tn - 1) // tn)
            turn = n_max - 1 - n_block
        return turn

    @cute.jit
    def _consume(
        self, tidx, wg, warp_idx, mma_sdp, mma_dv, mma_dk, mma_dq,
        sQ, sdO, sK, sV, sdS, sLSE, sDsum, sdQ,
        q_pipe, do_pipe, kv_pipe, tma_dk, mdK, tma_dv, mdV,
        scale, scale_log2, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
        m_begin, m_end, m_unmasked, num_steps, mdK_gmem, mdV_gmem, k_off, persist=None,
    ):  # fmt: skip
        """Consumer warpgroup `wg` (keys 64 wg .. 64 wg + 63 of the block); tidx in [0, 256).
        persist: (tile ring, its shared slots, tile count, mK) of a persistent CTA, whose tiles
        come from the ring (n_block .. num_steps unused then)."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        wg_sdp = mma_sdp.get_slice(wg * THREADS_PER_WG)
        wg_dv = mma_dv.get_slice(wg * THREADS_PER_WG)
        wg_dk = mma_dk.get_slice(wg * THREADS_PER_WG)
        wg_dq = mma_dq.get_slice(wg * THREADS_PER_WG)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdOt = wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sdO)))
        tKrQt = wg_dk.make_fragment_B(wg_dk.partition_B(transposed(sQ)))
        tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        if const_expr(not self.dq_split):
            tQrdS = tQrdS[None, None, None, 0]
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK)))[None, None, None, 0]
        if const_expr(self.col_split):
            # P^T (stages 1, 3) and dS^T (stages 0, 2) A operands from shared memory, K-major
            # views, indexed in the step
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_A(transposed(sdS)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_A(transposed(sdS)))
        else:
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((tn, tm)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((tn, tm)))
        s_cols = tm // 2 if const_expr(self.q_halves) else tm
        if const_expr(self.q_halves):
            # per 32-row half of the Q / dO stages: the B operands of S^T, dP^T, dK, dV
            hq = tm // 2
            sQh = [cute.local_tile(sQ, (hq, d, self.stages), (h, 0, 0)) for h in range(2)]
            sdOh = [cute.local_tile(sdO, (hq, dv, self.stages), (h, 0, 0)) for h in range(2)]
            tSrQ = [wg_sdp.make_fragment_B(wg_sdp.partition_B(t)) for t in sQh]
            tPrdO = [wg_sdp.make_fragment_B(wg_sdp.partition_B(t)) for t in sdOh]
            tVrdOt = [wg_dv.make_fragment_B(wg_dv.partition_B(transposed(t))) for t in sdOh]
            tKrQt = [wg_dk.make_fragment_B(wg_dk.partition_B(transposed(t))) for t in sQh]
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_shape_A((tn, hq)))
            tKrdS = wg_dk.make_fragment_A(wg_dk.partition_shape_A((tn, hq)))
        s_shape = wg_sdp.partition_shape_C((tn, s_cols))
        dq_shape = wg_dq.partition_shape_C((tm, d))
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((tn, dv)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dk.partition_shape_C((tn, d)), Float32)
        # (key, query) coordinates of this thread's S^T elements, within the tile
        tScS = rows_cols(
            mma_sdp.get_slice(tidx).partition_C(cute.make_identity_tensor((tn, s_cols)))
        )
        r2s_ds = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype), mma_sdp
        )
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        if const_expr(self.dq_split):
            tdSsdS = thr_r2s_ds.partition_D(transposed(sdS))  # both dS buffers
        elif const_expr(self.q_halves):
            tdSsdS = [
                thr_r2s_ds.partition_D(
                    cute.local_tile(transposed(sdS)[None, None, 0], (tn, tm // 2), (0, h))
                )
                for h in range(2)
            ]
        else:
            tdSsdS = thr_r2s_ds.partition_D(transposed(sdS)[None, None, 0])

        consumer_bar = named_barrier(Bar.CONSUMERS, self.num_mma_threads)
        kv_state = pipes.consumer_state(1)
        st = pipes.consumer_state(self.stages)
        frags = (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS,
        )  # fmt: skip
        tile_args = (
            warp_idx, sK, sV, sdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, kv_pipe, tma_dk, mdK,
            tma_dv, mdV, scale, scale_log2, seqlen_q, seqlen_k, mdK_gmem, mdV_gmem, k_off,
            consumer_bar,
        )  # fmt: skip
        if const_expr(self.persistent):
            tiles, num_tiles, mK = persist
            lane = cute.arch.lane_idx()
            tstate = tiles.consumer_state()
            gstep = Int32(0)
            tile, tstate = atomic.take(tiles, tstate, lane)
            while tile < num_tiles:
                n_block, head_kv, batch, m_begin, m_end, m_unmasked, num_steps = self._tile_work(
                    tile, mK, group, seqlen_q, seqlen_k
                )
                kv_state, st = self._consume_tile(
                    frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
                    m_unmasked, num_steps, gstep,
                )  # fmt: skip
                gstep += num_steps
                tile, tstate = atomic.take(tiles, tstate, lane)
            # the dQ writer's last arrival is matched here
            bar, threads = self._dq_bar(False, wg if const_expr(self.dq_split) else 0)
            cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
        else:
            self._consume_tile(
                frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
                m_unmasked, num_steps, 0,
            )  # fmt: skip

    @cute.jit
    def _consume_tile(
        self, frags, tile_args, kv_state, st, n_block, head_kv, batch, m_begin, m_end,
        m_unmasked, num_steps, gstep,
    ):  # fmt: skip
        """One key block's steps and its dK / dV (persistent: K / V released after the last
        step's GEMMs, dK / dV stored from registers). gstep: the CTA's steps before this tile,
        so that the ring stage, the dS and the dQ staging buffers follow all of them."""
        (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS,
        ) = frags  # fmt: skip
        (
            warp_idx, sK, sV, sdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, kv_pipe, tma_dk, mdK,
            tma_dv, mdV, scale, scale_log2, seqlen_q, seqlen_k, mdK_gmem, mdV_gmem, k_off,
            consumer_bar,
        ) = tile_args  # fmt: skip
        tn = self.tile_n
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        n0 = n_block * tn
        key_edge = n0 + tn > seqlen_k
        kv_pipe.consumer_wait(kv_state)
        step_args = (
            tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO, tVrdOt, tKrQt,
            tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
            r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
            scale_log2, n0, seqlen_q, seqlen_k,
        )  # fmt: skip
        # The steps; their query block m (_step_coords) carried instead of divided every step.
        step_fn, extra = self._step, ()
        if const_expr(self.col_split):
            step_fn, extra = self._step_cs, (tdSsdS,)  # P^T: the odd buffers of the four
        elif const_expr(self.q_halves):
            step_fn = self._step_qh
        m = self._first_m(m_begin, m_end)
        if const_expr(self.static_stage):
            # Unrolled by the ring depth: step0 + j sits in ring stage j (the ring starts at
            # stage 0 and advances once per step; not persistent, so one tile per CTA).
            for step0 in cutlass.range(0, num_steps, self.stages, unroll=1):
                for j in cutlass.range_constexpr(self.stages):
                    step = step0 + j
                    if step < num_steps:
                        self._run_step(step_fn, st, step, m, step_args, extra, key_edge,
                                       m_unmasked, j)  # fmt: skip
                        st.advance()
                        m = self._next_m(m, m_begin, m_end)
        else:
            for step in cutlass.range(num_steps, unroll=1):
                self._run_step(step_fn, st, gstep + step, m, step_args, extra, key_edge,
                               m_unmasked)  # fmt: skip
                st.advance()
                m = self._next_m(m, m_begin, m_end)

        if const_expr(self.head_split):
            self._reduce_dkv(
                tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK_gmem, mdV_gmem, scale, n_block,
                head_kv, batch, seqlen_k,
            )  # fmt: skip
        elif const_expr(self.persistent):
            # dK / dV through the K / V buffers; each warp releases them once past the
            # stores (the storing warp after the TMA has read them)
            self._store_dkv(
                tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
                scale, n_block, head_kv, batch, consumer_bar, 0,
            )  # fmt: skip
            kv_pipe.consumer_release(kv_state)
            kv_state.advance()
        elif const_expr(self.varlen):
            if key_edge:
                self._store_dkv_rows(
                    tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK_gmem, mdV_gmem, scale,
                    n_block, head_kv, seqlen_k, k_off,
                )  # fmt: skip
            else:
                self._store_dkv(
                    tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK,
                    tma_dv, mdV, scale, n_block, head_kv, batch, consumer_bar, k_off,
                )  # fmt: skip
        else:
            self._store_dkv(
                tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
                scale, n_block, head_kv, batch, consumer_bar, 0,
            )  # fmt: skip
        return kv_state, st

    @cute.jit
    def _run_step(
        self, step_fn, st, step, m, step_args, extra, key_edge, m_unmasked,
        stage: cutlass.Constexpr = None,
    ):  # fmt: skip
        """One step through `step_fn`, its masked body when the block crosses the key edge or
        (causal) the diagonal, else the unmasked one."""
        masked = key_edge
        if const_expr(self.causal):
            masked = masked or m < m_unmasked
        stage_arg = () if const_expr(stage is None) else (stage,)
        if masked:
            step_fn(st, step, m, *step_args, *extra, True, *stage_arg)
        else:
            step_fn(st, step, m, *step_args, *extra, False, *stage_arg)

    @cute.jit
    def _step(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k,
        masked: cutlass.Constexpr[bool], stage: cutlass.Constexpr = None,
    ):  # fmt: skip
        """One query block m (ring stage st) against this CTA's keys. `stage`: st.index as a
        compile-time constant (the loop unrolled by the ring depth), so that the shared-memory
        operand descriptors are constant offsets from loop-invariant bases."""
        si = st.index if const_expr(stage is None) else stage
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        # A thread's S^T element (r, c) sits at (row0 + ro[r], col0 + co[c]), ro, co static.
        ro, co = self._static_offsets(mma_sdp)
        q_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, si], True, -1)
        if const_expr(self.stats_early):
            # LSE read while S^T is on the tensor cores (after the wait it stalls the exp2)
            row0, col0 = tScS[0, 0]
            lse = self._col_stats(sLSE, si, col0, co)
        do_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, si], True, -1)
        if const_expr(self.dsum_early):
            # Dsum read while both GEMMs run: later its loads queue behind the exp2s (both
            # go through MIO) and the dS math waits for them
            dsum = self._col_stats(sDsum, si, col0, co)

        # P^T = exp2(S^T scale log2e - LSE log2e); rows are keys, columns queries.
        warpgroup.wait_group(1)
        s = rows_cols(acc_S)
        if const_expr(not self.stats_early):
            row0, col0 = tScS[0, 0]
        # visible iff key < Sk and (causal) key <= query + Sk - Sq, i.e.
        # ro[r] < edge and ro[r] - co[c] <= diag
        edge = seqlen_k - n0 - row0
        diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + col0 - row0
        if const_expr(masked):
            self._mask(s, ro, co, edge, diag)
        if const_expr(not self.stats_early):
            lse = self._col_stats(sLSE, si, col0, co)
        self._exp2(s, lse, scale_log2)
        if const_expr(self.stats_early and not self.dsum_early):
            # Dsum read before the dP^T wait
            dsum = self._col_stats(sDsum, si, col0, co)
        if const_expr(self.p_early):
            # P^T to the dV GEMM's 16-bit A operand before the dP^T wait (inline-PTX packed
            # converts, which the assembler leaves here); dS below still reads the fp32 P
            acc_to_operand_a(acc_S, tVrP)

        dv_args = (mma_dv, acc_dV, acc_S, tVrP, tVrdOt, si)
        if const_expr(self.dv_before_ds):
            self._issue_dv(*dv_args)
            warpgroup.wait_group(1)  # dP^T (issued before dV)
        else:
            warpgroup.wait_group(0)
        # dS^T = P^T (dP^T - Dsum)
        dp = rows_cols(acc_dP)
        if const_expr(not self.stats_early):
            dsum = self._col_stats(sDsum, si, col0, co)
        self._ds(dp, s, dsum)

        # dS^T -> shared memory, then dQ = dS K. One buffer: the previous step's dQ GEMMs
        # (both warpgroups) finished before that step's dQ-empty barrier. dq_split: buffer
        # step % 2, whose last readers (step - 2's dQ GEMMs) finished before the other
        # warpgroup reached step - 1's consumer barrier.
        if const_expr(self.dq_split):
            ds = step % 2
            if const_expr(stage is not None and self.stages % 2 == 0):
                ds = stage % 2
            tQrdS = tQrdS[None, None, None, ds]
            tdSsdS = tdSsdS[None, None, None, ds]
        # dV += P^T dO, dK += dS^T Q (A operands from registers). ds_store_first: dS^T to
        # shared memory before dV is issued, so the stores have landed by the fence.
        if const_expr(not self.ds_store_first and not self.dv_before_ds):
            self._issue_dv(*dv_args)
        rdS = cute.make_rmem_tensor(s_shape, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        tKrdS.store(acc_as_operand_a(rdS).load())
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS)
        if const_expr(self.ds_store_first):
            self._issue_dv(*dv_args)
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        # dQ, then dK: the dQ tile is staged below while dK is still on the tensor cores
        # (groups retire in order: one left in flight = dK). dK is waited for at the end of
        # the step, so no WGMMA crosses the loop's back edge.
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, -1)
        gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, si], False, 1)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)
        warpgroup.wait_group(0)
        q_pipe.consumer_release(st)

    @cute.jit
    def _issue_dv(self, mma_dv, acc_dV, acc_S, tVrP, tVrdOt, si):
        """dV += P^T dO (ring stage si), P^T the 16-bit register A operand (p_early: converted
        already)."""
        if const_expr(not self.p_early):
            tVrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, si], False, -1)

    @cute.jit
    def _step_qh(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k,
        masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """q_halves step: for each 32-query half h, S^T_h and dP^T_h (64 keys x 32 queries per
        warpgroup), P^T_h / dS^T_h, dS^T_h to its half of the dS buffer, dV and dK += over the
        half's 32 queries (A operands from registers); then dQ = dS K over the whole tile.
        Each half's dV / dK GEMMs retire at the next wait (groups retire in order)."""
        si = st.index
        hq = self.tile_m // 2
        ro, co = self._static_offsets(mma_sdp)
        row0, col0 = tScS[0, 0]
        edge = seqlen_k - n0 - row0
        q_pipe.consumer_wait(st)
        do_pipe.consumer_wait(st)
        for h in cutlass.range_constexpr(2):
            acc_S = cute.make_rmem_tensor(s_shape, Float32)
            acc_dP = cute.make_rmem_tensor(s_shape, Float32)
            gemm(mma_sdp, acc_S, tSrK, tSrQ[h][None, None, None, si], True, -1)
            gemm(mma_sdp, acc_dP, tPrV, tPrdO[h][None, None, None, si], True, -1)
            c0 = col0 + h * hq  # this half's first query column within the tile
            # the half's LSE and Dsum read while its GEMMs run (dsum_early, as in _step)
            lse = self._col_stats(sLSE, si, c0, co)
            dsum = self._col_stats(sDsum, si, c0, co)
            warpgroup.wait_group(1)
            s = rows_cols(acc_S)
            diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + c0 - row0
            if const_expr(masked):
                self._mask(s, ro, co, edge, diag)
            self._exp2(s, lse, scale_log2)
            warpgroup.wait_group(0)
            dp = rows_cols(acc_dP)
            self._ds(dp, s, dsum)
            rdS = cute.make_rmem_tensor(s_shape, self.dtype)
            rdS.store(acc_dP.load().to(self.dtype))
            cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS[h])
            tVrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            tKrdS.store(acc_as_operand_a(rdS).load())
            gemm(mma_dv, acc_dV, tVrP, tVrdOt[h][None, None, None, si], False, -1)
            gemm(mma_dk, acc_dK, tKrdS, tKrQt[h][None, None, None, si], False, 0)
        # both warpgroups' dS^T in shared memory (the previous step's dQ GEMMs finished before
        # that step's dQ-empty barrier), then dQ = dS K over the whole tile
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, 0)
        q_pipe.consumer_release(st)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)

    @cute.jit
    def _step_cs(
        self, st, step, m, tidx, wg, mma_sdp, mma_dv, mma_dk, mma_dq, tSrK, tSrQ, tPrV, tPrdO,
        tVrdOt, tKrQt, tQrdS, tQrKt, tVrP, tKrdS, s_shape, dq_shape, acc_dV, acc_dK, tScS,
        r2s_ds, thr_r2s_ds, tdSsdS, sLSE, sDsum, sdQ, q_pipe, do_pipe, consumer_bar,
        scale_log2, n0, seqlen_q, seqlen_k, tPsP,
        masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """Column-split step (tile_n = 64): this warpgroup's query columns of S^T, dP^T; P^T and
        dS^T (both halves) through shared memory; its head-dim columns of dV, dK and dQ."""
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        row0, col0 = tScS[0, 0]
        ro, co = self._static_offsets(mma_sdp)
        q_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, st.index], True, -1)
        lse = self._col_stats(sLSE, st.index, col0, co)  # stats_early
        do_pipe.consumer_wait(st)
        gemm(mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, st.index], True, -1)

        warpgroup.wait_group(1)
        s = rows_cols(acc_S)
        edge = seqlen_k - n0 - row0
        diag = m * self.tile_m + seqlen_k - seqlen_q - n0 + col0 - row0
        if const_expr(masked):
            self._mask(s, ro, co, edge, diag)
        self._exp2(s, lse, scale_log2)
        dsum = self._col_stats(sDsum, st.index, col0, co)
        warpgroup.wait_group(0)
        # dS^T = P^T (dP^T - Dsum), fp32 P
        dp = rows_cols(acc_dP)
        self._ds(dp, s, dsum)
        rP = cute.make_rmem_tensor(s_shape, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        rdS = cute.make_rmem_tensor(s_shape, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))

        # P^T, dS^T -> buffer pair step % 2 (dq_split): its last readers (step - 2's GEMMs,
        # each warpgroup waits for all of its groups) finished before the other warpgroup
        # reached step - 1's consumer barrier
        b = st.index * 2 if const_expr(self.stages == 2) else step % 2 * 2
        tdSsdS = tdSsdS[None, None, None, b]
        tPsP = tPsP[None, None, None, b + 1]
        tQrdS = tQrdS[None, None, None, b]
        tKrdS = tKrdS[None, None, None, b]
        tVrP = tVrP[None, None, None, b + 1]
        cute.copy(r2s_ds, thr_r2s_ds.retile(rP), tPsP)
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSsdS)
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        # dV, dK, then dQ (this warpgroup's columns), all waited for before the dQ staging:
        # dQ issued first and staged under dV / dK measured 0.987
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        gemm(mma_dv, acc_dV, tVrP, tVrdOt[None, None, None, st.index], False, -1)
        gemm(mma_dk, acc_dK, tKrdS, tKrQt[None, None, None, st.index], False, -1)
        gemm(mma_dq, acc_dQ, tQrdS, tQrKt, True, 0)
        q_pipe.consumer_release(st)
        do_pipe.consumer_release(st)
        self._stage_dq(acc_dQ, sdQ, tidx, wg)

    @cute.jit
    def _stage_dq(self, acc_dQ, sdQ, tidx, wg):
        """This thread's dQ fragment -> the staging buffer, in the workspace order
        (`utils.dq_frag_offset`, DQ_VEC elements per 16-byte store), between the buffer's
        empty and full barriers (`_dq_bar`; with dq_split warpgroup wg's own, warp-uniform)."""
        tile = self.tile_m * self.head_dim
        n = cute.size(acc_dQ)
        part = wg if const_expr(self.dq_split) else 0
        bar, threads = self._dq_bar(False, part)
        cute.arch.barrier(barrier_id=bar, number_of_threads=threads)
        off = sdQ.iterator + tidx * DQ_VEC
        stride = DQ_VEC * self.num_mma_threads
        if const_expr(self.dq_split):
            # warpgroup halves: wg * tile / 2 + (tidx % 128) * DQ_VEC (warpgroup term uniform)
            off = off + wg * (tile // 2 - THREADS_PER_WG * DQ_VEC)
            stride = DQ_VEC * THREADS_PER_WG
        base = cute.make_ptr(Float32, off.toint(), cute.AddressSpace.smem, assumed_align=4 * DQ_VEC)
        dst = cute.make_tensor(base, cute.make_layout((DQ_VEC, n // DQ_VEC), stride=(1, stride)))
        src = cute.make_tensor(acc_dQ.iterator, cute.make_layout((DQ_VEC, n // DQ_VEC)))
        dst.store(src.load())
        cute.arch.fence_view_async_shared()
        bar, threads = self._dq_bar(True, part)
        cute.arch.barrier_arrive(barrier_id=bar, number_of_threads=threads)

    @cute.jit
    def _mask(self, s, ro, co, edge, diag):
        """-inf into the thread's S^T elements whose key is not visible: key < Sk and (causal)
        key <= query + Sk - Sq, i.e. ro[r] < edge and ro[r] - co[c] <= diag (element (r, c) at
        static offsets ro[r], co[c] from the thread's first key / query)."""
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                visible = edge > ro[r]
                if const_expr(self.causal):
                    visible = visible and diag >= ro[r] - co[c]
                if not visible:
                    s[r, c] = -Float32.inf

    @cute.jit
    def _exp2(self, s, lse, scale_log2):
        """P^T = exp2(S^T scale log2e - LSE log2e) in place, LSE per query column. exp_groups
        g > 0: the columns in g groups, each group's scale taken as scale + 0 x (the previous
        group's first exp2), so that the assembler cannot issue all the arguments' FFMAs
        before the first MUFU (it does in the unmasked step: the MUFU queue then starts late)."""
        ncols = cute.size(s, mode=[1])
        groups = self.exp_groups if const_expr(self.exp_groups) else 1
        if const_expr(ncols % groups):
            raise ValueError(f"exp_groups {groups} does not divide the {ncols} columns")
        per = ncols // groups
        sc = scale_log2
        for g in cutlass.range_constexpr(groups):
            for c in cutlass.range_constexpr(g * per, (g + 1) * per):
                for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                    s[r, c] = cute.math.exp2(s[r, c] * sc - lse[c], fastmath=True)
            if const_expr(g + 1 < groups):
                sc = scale_log2 + s[0, g * per] * Float32(0.0)

    @cute.jit
    def _ds(self, dp, p, dsum):
        """dS^T = P^T (dP^T - Dsum) in place of dP^T, Dsum per query column."""
        for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                dp[r, c] = Float32(p[r, c]) * (dp[r, c] - dsum[c])

    def _col_stats(self, stats, stage, col0, co):
        """The per-query statistic (LSE or Dsum) of each of the thread's columns, read from
        the ring stage's shared-memory row; adjacent column pairs with one 8-byte load. Plain
        Python (unrolled while the caller is traced)."""
        row = stats[None, stage].iterator
        vals = [None] * len(co)
        for c in range(len(co)):
            if vals[c] is None:
                if c + 1 < len(co) and co[c + 1] == co[c] + 1 and co[c] % 2 == 0:
                    ptr = cute.make_ptr(
                        Float32, (row + col0 + co[c]).toint(), cute.AddressSpace.smem,
                        assumed_align=8,
                    )  # fmt: skip
                    pair = cute.make_tensor(ptr, cute.make_layout(2)).load()
                    vals[c], vals[c + 1] = pair[0], pair[1]
                else:
                    vals[c] = stats[col0 + co[c], stage]
        return vals

    def _static_offsets(self, mma_sdp):
        """Python ints: each element row's and column's offset from the thread's first one
        (the MMA's coordinate is thread part + value part; read off thread 0's slice)."""
        tn, tm = self.tile_n, self.tile_m // 2 if self.q_halves else self.tile_m
        ref = rows_cols(mma_sdp.get_slice(0).partition_C(cute.make_identity_tensor((tn, tm))))
        ro = [ref[r, 0][0] for r in range(cute.size(ref, mode=[0]))]
        co = [ref[0, c][1] for c in range(cute.size(ref, mode=[1]))]
        for v in ro + co:
            if not isinstance(v, int):
                raise TypeError("expected static coordinates for thread 0")
        return ro, co

    @cute.jit
    def _store_dkv(
        self, tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
        scale, n_block, head_kv, batch, consumer_bar, k_off,
    ):  # fmt: skip
        """dK * scale, dV -> input dtype -> stmatrix into the K, V buffers -> TMA stores."""
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        rdK = cute.make_rmem_tensor(acc_dK.shape, self.dtype)
        rdK.store((acc_dK.load() * scale).to(self.dtype))
        rdV = cute.make_rmem_tensor(acc_dV.shape, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        r2s_k = cute.make_tiled_copy_C(atom, mma_dk).get_slice(tidx)
        r2s_v = cute.make_tiled_copy_C(atom, mma_dv).get_slice(tidx)
        # Every WGMMA reading K or V (both warpgroups) is complete: each waited for its last.
        consumer_bar.arrive_and_wait()
        cute.copy(r2s_k, r2s_k.retile(rdK), r2s_k.partition_D(sK[None, None, 0]))
        cute.copy(r2s_v, r2s_v.retile(rdV), r2s_v.partition_D(sV[None, None, 0]))
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        if warp_idx == THREADS_PER_WG // 32:  # first consumer warp
            one = cute.make_layout(1)
            gdK = cute.local_tile(
                self._seq(mdK[None, None, head_kv, batch], k_off), (tn, d), (None, 0)
            )
            gdV = cute.local_tile(
                self._seq(mdV[None, None, head_kv, batch], k_off), (tn, dv), (None, 0)
            )
            tdKsK, tdKgdK = cpasync.tma_partition(
                tma_dk, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gdK, 0, 2)
            )
            tdVsV, tdVgdV = cpasync.tma_partition(
                tma_dv, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gdV, 0, 2)
            )
            cute.copy(tma_dk, tdKsK[(None, 0)], tdKgdK[(None, n_block)])
            cute.copy(tma_dv, tdVsV[(None, 0)], tdVgdV[(None, n_block)])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_dkv_rows(
        self, tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK, mdV, scale, n_block, head_kv,
        seqlen_k, k_off,
    ):  # fmt: skip
        """Varlen key block that ends inside its sequence: dK * scale and dV stored from
        registers, rows < Sk only (a TMA box would overwrite the next sequence's rows)."""
        # one at a time: the converted copy of dK is dead before dV's is made
        rdK = cute.make_rmem_tensor(acc_dK.shape, self.dtype)
        rdK.store((acc_dK.load() * scale).to(self.dtype))
        self._store_rows(tidx, mma_dk, rdK, mdK, self.head_dim, n_block, head_kv, k_off, seqlen_k)
        rdV = cute.make_rmem_tensor(acc_dV.shape, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        self._store_rows(tidx, mma_dv, rdV, mdV, self.head_dim_v, n_block, head_kv, k_off, seqlen_k)

    @cute.jit
    def _reduce_dkv(
        self, tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK, mdV, scale, n_block, head_kv, batch,
        seqlen_k,
    ):  # fmt: skip
        """head_split: dK * scale and dV added to the fp32 (S, D, H, B) accumulators, two
        adjacent columns per `red.global.add.v2.f32`, rows < Sk only."""
        tn = self.tile_n
        n0 = n_block * tn
        # the thread's coordinates re-derived here: computed before the step loop they stayed
        # live through it and spilled
        tidx = opaque_tid_x() - THREADS_PER_WG
        for k in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[k] = acc_dK[k] * scale
        for mma, r, m, width in (
            (mma_dk, acc_dK, mdK, self.head_dim),
            (mma_dv, acc_dV, mdV, self.head_dim_v),
        ):
            g = cute.local_tile(m[None, None, head_kv, batch], (tn, width), (n_block, 0))
            thr = mma.get_slice(tidx)
            tg = thr.partition_C(g)
            tc = thr.partition_C(cute.make_identity_tensor((tn, width)))
            for i in cutlass.range_constexpr(0, cute.size(r), 2):
                if n0 + tc[i][0] < seqlen_k:
                    pair = cute.make_tensor(r.iterator + i, cute.make_layout(2)).load()
                    cute.arch.red(
                        tg.iterator + tg.layout(i),
                        pair,
                        op="add",
                        dtype=Float32,
                        sem="relaxed",
                        scope="gpu",
                    )

    @cute.jit
    def _store_rows(self, tidx, mma, r, m, width: int, n_block, head_kv, k_off, seqlen_k):
        """r (this thread's fragment of a (tile_n, width) accumulator of `mma`) -> key block
        n_block of the packed (T, D, H, 1) view m from row k_off, rows < seqlen_k only."""
        tn = self.tile_n
        n0 = n_block * tn
        g = cute.local_tile(
            cute.domain_offset((k_off, 0), m[None, None, head_kv, 0]), (tn, width), (n_block, 0)
        )
        thr = mma.get_slice(tidx)
        tg = thr.partition_C(g)
        tc = thr.partition_C(cute.make_identity_tensor((tn, width)))
        for i in cutlass.range_constexpr(cute.size(r)):
            if n0 + tc[i][0] < seqlen_k:
                tg[i] = r[i]

    def _seq(self, t: cute.Tensor, off) -> cute.Tensor:
        """A (S, D) view shifted to its sequence's first row (varlen; identity otherwise)."""
        if const_expr(self.varlen):
            return cute.domain_offset((off, 0), t)
        return t


def _check_knobs(cfg: BwdConfig, head_dim: int, deterministic: bool, varlen: bool) -> None:
    """ValueError for a knob combination the kernel does not build (each knob's scope: the
    BwdConfig docstring)."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{cfg.tag()}: {what}")

    key_split_only = ("ds_store_first", "p_early", "dv_before_ds", "q_halves", "dsum_early")
    if cfg.tile_n == 64:
        need(cfg.dq_split and cfg.stats_early, "the column split needs dq_split and stats_early")
        for name in key_split_only:
            need(not getattr(cfg, name), f"{name}: key split (tile_n 128) only")
    else:
        need(head_dim <= 128 or cfg.q_halves, "the D = 192 key split needs q_halves")
    if cfg.q_halves:
        need(
            cfg.tile_m == 64 and not cfg.dq_split and not cfg.static_stage and cfg.dsum_early,
            "q_halves needs tile_m 64, the joint dQ hand-over, the rolled loop and dsum_early",
        )
        for name in ("ds_store_first", "p_early", "dv_before_ds"):
            need(not getattr(cfg, name), f"q_halves orders its step itself, not {name}")
    need(cfg.stats_early or not cfg.dsum_early, "dsum_early needs stats_early")
    need(not (cfg.dv_before_ds and cfg.ds_store_first), "dv_before_ds or ds_store_first")
    need(cfg.l2_swizzle >= 0, "l2_swizzle must be >= 0")
    need(cfg.walk_order in (0, 2), "walk_order must be 0 or 2")
    need(not (cfg.walk_order and deterministic), "walk_order 0 when deterministic")
    need(cfg.head_split in (0, 2), "head_split must be 0 or 2")
    if cfg.head_split:
        need(
            not (varlen or deterministic or cfg.persistent or cfg.tile_n == 64),
            "head_split: fixed length, not deterministic / persistent / column split",
        )
    if cfg.persistent:
        need(
            not (varlen or deterministic or cfg.static_stage),
            "persistent: fixed length, not deterministic, the rolled step loop",
        )
