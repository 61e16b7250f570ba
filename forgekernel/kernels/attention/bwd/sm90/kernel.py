"""Attention backward main kernel for Hopper (sm_90a): dK, dV and the fp32 dQ partial sums.

One CTA per (key block of tile_n keys, kv head, batch): grid (ceil(Sk / tile_n), Hkv, B).
The CTA keeps its K and V tiles in shared memory and its dK, dV accumulators in registers
while it walks every query head of its GQA group and, per head, every query block of tile_m
rows that sees one of its keys (`walk.py`); dK and dV are written once at the end (no
atomics). This file: the class, its knob checks, the host setup (tiled MMAs, shared-memory
layouts, TMA atoms, grid) and the role dispatch; each role's device code is a mixin in its
own file.

Warp roles (3 warpgroups, 384 threads; ids, register split and named barriers in `roles.py`):
- warp 0, producer (24 registers; `producer.py`): TMA loads K and V once per tile, then per
  step the Q tile with its LSE row slice and the dO tile with its Dsum slice.
- warp 1, dQ writer (24 registers; `dq_reduction.py`): per step waits for the consumers'
  fp32 dQ tile in the shared-memory staging buffer and adds it to the global workspace with
  one `cp.reduce.async.bulk .add.f32`; deterministic: in a fixed key-block order per query
  block, through a per-(query block, head, batch) counter (`_dq_turn`).
- warpgroups 1 and 2, consumers (240 registers; `consumer.py` loops, `mma_step.py` the step,
  `epilogue.py` the dK / dV stores), 64 keys each (column split: all 64, split by columns).
  Per step, transposed (keys along the rows): S^T = K Q^T, dP^T = V dO^T; P^T = exp2(S^T
  scale log2e - LSE log2e) (masked on diagonal / key-edge blocks); dS^T = P^T (dP^T - Dsum);
  dV += P^T dO, dK += dS^T Q (register A operands); dS^T through shared memory for
  dQ = dS K, staged for the dQ writer.

Pipelines and hand-overs (shared memory):
- `q_pipe`, `do_pipe` (`stages`-deep mbarrier rings, TMA + 1-D bulk copies, producer ->
  the 8 consumer warps): Q + LSE, dO + Dsum.
- `kv_pipe` (one stage, producer -> consumers): K, V; released after the tile's dK / dV have
  been stored through the same buffers.
- the dS buffer(s) (consumer warpgroups -> each other's dQ GEMM): the CONSUMERS named
  barrier; dq_split: two buffers, step parity.
- the dQ staging buffer (consumers -> dQ writer): DQ_FULL / DQ_EMPTY named barriers
  (dq_split: one pair per warpgroup half).
- persistent: the tile ring (`scheduler.atomic`, producer -> consumer warps and dQ writer).

Persistent (static `persistent`, the D = 64 default): grid min(tiles, SMs); each CTA takes
(key block, kv head, batch) tiles in the launch order from a global counter
(`scheduler.atomic`: the producer takes the next one once a tile's loads are issued and hands
the id to the other warps through a two-slot tile ring); the Q / dO ring and the dQ staging
run on across tiles, a tile's first Q / dO stage is loaded before its K / V, and K / V are
released once the tile's dK / dV have been stored.

Head split (static `head_split`, GQA at D = 128, chosen by shape in `config.choose_config`):
one CTA per (key block, query head, batch), FA4's layout; dK * scale and dV are added into
fp32 (B, Sk, Hkv, D) workspaces with `red.global.add.v2.f32` and converted by the launcher.
The grid's heads are interleaved over the kv heads, so CTAs launched together add into
different dK / dV tiles.

Column split (static, tile_n = 64; the varlen D = 192 / Dv = 128 config): both warpgroups
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
    varlen_ws_row,
)
from forgekernel.kernels.attention.bwd.sm90.consumer import Consumer
from forgekernel.kernels.attention.bwd.sm90.dq_reduction import DqReduction
from forgekernel.kernels.attention.bwd.sm90.epilogue import Epilogue
from forgekernel.kernels.attention.bwd.sm90.mma_step import MmaStep
from forgekernel.kernels.attention.bwd.sm90.producer import Producer
from forgekernel.kernels.attention.bwd.sm90.roles import (
    CONSUMER_REGS,
    DQ_WRITER_WARP,
    PRODUCER_REGS,
    PRODUCER_WARP,
)
from forgekernel.kernels.attention.bwd.sm90.utils import make_dq_mma, s_d_h_b, unit_batch
from forgekernel.kernels.attention.bwd.sm90.walk import Walk
from forgekernel.kernels.common.sm90 import pipeline as pipes
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import packed_as_sdhb
from forgekernel.kernels.common.sm90.scheduler import atomic


class AttentionBwdSm90(Walk, Producer, DqReduction, Consumer, MmaStep, Epilogue):
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
            if warp_idx == PRODUCER_WARP:
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
