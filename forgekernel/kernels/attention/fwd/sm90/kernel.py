"""Attention forward for Hopper (sm_90a): O = softmax(scale * Q K^T + mask) V, and the LSE.

Persistent: one CTA per SM walks the tiles (a block of tile_m query rows of one query head and
batch) in the toolkit's longest-first order (`scheduler.longest_first`); fixed length or
varlen (packed sequences, offsets from cu_seqlens, each sequence its own causal alignment and
key bound), or paged (varlen queries; keys and values in a paged cache, each sequence's pages
listed by its page-table row, its length from seqlens_k). CTA c takes tiles c, c + grid, ...
(a grid above the SM count queues CTAs for the SMs that free first: the launcher's varlen
grid); with `dynamic` (AttnConfig) tile c, then the ids a global counter hands out
(`scheduler.atomic`).

Warp roles (one CTA = 1 + tile_m / 64 warpgroups):
- producer, warp 0 of warpgroup 0 (setmaxnreg down; warps 1-3 exit at once). Per tile: the
  last key block's K and V, then the Q tile, then K and V of the other key blocks, last to
  first. Blocks entirely above the causal diagonal are never loaded. Paged: a K or V tile is
  tile_n / page_box TMA boxes of (page_box, D), one per page (page_box = min(page size,
  tile_n)), all on the tile's mbarrier; lane j of the producer warp reads box j's page id
  from the page table before the wait for a free stage; boxes past the sequence (or its
  table) get page -1, which TMA zero-fills while counting the box's bytes.
- consumer warpgroups (setmaxnreg up), 64 query rows each. Key block n_max - 1: S = Q K^T,
  mask, online softmax (fp32, exp2; P stays in the S registers). Each later block: issue
  S_j = Q K_j^T (both operands in shared memory) and O += P V_prev (P from registers as the
  A operand, V an MN-major B operand) as two async WGMMA groups -> wait for S_j -> release
  K -> mask (only blocks that cross the diagonal or the key bound) -> softmax -> wait for
  P V -> release V -> P to 16 bits -> O rescaled by exp2(old - new max). A last P V closes
  the tile. For D <= 128 the warpgroups take turns issuing their GEMMs (named barriers,
  ping-pong), so one's softmax runs under another's GEMMs.
- epilogue (the consumers): O / rowsum -> 16 bits -> `stmatrix` into the O buffer (its own,
  or Q's when shared memory is short) -> one TMA store of the (tile_m, Dv) tile, left in
  flight under the next tile; the LSE from the thread holding column 0 of each row. A varlen
  tile that ends inside its sequence is written from registers row by row (a TMA box would
  spill into the next sequence).

Pipelines (TMA producer -> consumer, mbarrier full / empty, released by one arrival per
consumer warp): `q` (1 stage: it frees when the consumers are done with the previous tile's
Q, so the next Q loads during the epilogue when O has its own buffer), `k` and `v` (`stages`
deep each, one stage index for both). Named barriers: `Bar`.

Constraints: one 16-bit dtype, last dims contiguous, other strides multiples of 8 elements,
16-byte aligned bases; fixed length q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
o (B, Sq, Hq, Dv), lse (B, Hq, Sq) fp32; varlen q (Tq, Hq, D) ... lse (Hq, Tq). Sizes dynamic
(Hq % Hkv == 0, query head h reads kv head h // (Hq // Hkv)); D, Dv multiples of 32 in
[64, 256] (static), tile_m 128 or 192, tile_n a multiple of 16 up to 256. Causal is
bottom-right aligned (query i sees key j iff j <= i + Sk - Sq); rows that see no key get
O = 0 and LSE = -inf. Ragged edges: TMA zero-fills loads (or reads the next sequence's rows,
masked) and clips the O store; score columns >= Sk are masked to -inf before the softmax.
Paged: the last page's slots past the sequence hold whatever the cache held; their scores are
masked and their V rows zeroed in shared memory by the consumers (`_clear_stale_v`), so that
no NaN or inf there reaches O through P = 0. Paged, packed (`packed`: the whole chunked-prefill
batch GQA-packed, decode rows included; `view_group`: through views of the caller's q / o /
lse, no copies): a consumer warpgroup none of whose rows is in its tile's sequence runs
`_idle_blocks` (the pipelines' and turns' protocol, no GEMM) instead of the mainloop. Fixed
length, GQA-packed (`view_group` G without `varlen`: a candidate): q / o / lse through the same
views, (B, Sq, Hkv, G, D), every tile G * Sq rows deep of one kv head.
Measured variants that left the kernel: docs/attention/NOTES.md ("Measured and dropped").
"""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.fwd.sm90.config import (
    PAGED_MIN_SEQLEN_Q,
    AttnConfig,
    separate_o,
    smem_bytes,
)
from forgekernel.kernels.attention.fwd.sm90.views import grouped_lse, grouped_rows_as_sdhb
from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import (
    acc_to_operand_a,
    packed_as_sdhb,
    rows_cols,
    select,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.common.sm90.scheduler import atomic
from forgekernel.kernels.common.sm90.scheduler.longest_first import LongestFirst, TileGrid


class Bar(IntEnum):
    """The kernel's named barriers (id 0 is __syncthreads)."""

    EPILOGUE = FIRST_FREE  # every consumer thread, around O's staging in shared memory
    TURN = FIRST_FREE + 1  # TURN + wg (2, 3, 4): consumer warpgroup wg's turn to issue GEMMs
    STALE = FIRST_FREE + 4  # paged: every consumer thread, after zeroing stale V rows


# The first consumer warp issues the O store and waits for it.
STORER_WARP = THREADS_PER_WG // WARP_SIZE


class AttentionFwdSm90:
    """Warp-specialized TMA + WGMMA flash attention forward; see the module docstring."""

    def __init__(
        self,
        head_dim: int,
        head_dim_v: int,
        causal: bool,
        config: AttnConfig,
        varlen: bool = False,
        page_box: int = 0,
        packed: bool = False,
        view_group: int = 0,
    ):
        if config.tile_m not in (128, 192):
            raise ValueError(
                f"tile_m must be 128 or 192 (64 rows a warpgroup), got {config.tile_m}"
            )
        if config.tile_n % 16 or not 16 <= config.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {config.tile_n}")
        for name, d in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if d % 32 or not 64 <= d <= 256:
                raise ValueError(f"{name} must be a multiple of 32 in [64, 256], got {d}")
        if config.stages < 1:
            raise ValueError(f"stages must be >= 1, got {config.stages}")
        if packed and not page_box:
            raise ValueError("packed is a form of the paged mode (page_box > 0)")
        if view_group and (varlen != packed or config.tile_m % view_group):
            raise ValueError(
                f"view_group ({view_group}) needs the packed paged form or fixed length, and "
                f"must divide tile_m ({config.tile_m})"
            )
        if page_box and (not varlen or page_box % 8 or config.tile_n % page_box):
            raise ValueError(
                f"page_box must be a multiple of 8 dividing tile_n ({config.tile_n}), with "
                f"varlen queries; got {page_box}"
            )
        need = smem_bytes(config, head_dim, head_dim_v)
        if need > SMEM_CAPACITY:
            raise ValueError(f"{config} needs {need} B of shared memory, > {SMEM_CAPACITY}")
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.varlen = varlen
        # Paged K / V: one TMA box of page_box rows (the page, or the tile's share of a page
        # longer than the tile) per page of a K or V tile.
        self.page_box = page_box
        self.paged = page_box > 0
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.stages = config.stages
        self.num_wg = config.tile_m // 64
        self.own_o = separate_o(config, head_dim, head_dim_v)
        self.threads_per_cta = (1 + self.num_wg) * THREADS_PER_WG
        self.num_mma_threads = self.num_wg * THREADS_PER_WG
        # Registers per thread, multiples of 8: producer 24 and consumers 240 with two consumer
        # warpgroups, 32 and 160 with three (all 64K of the register file).
        self.producer_regs = 24 if self.num_wg == 2 else 32
        self.consumer_regs = 240 if self.num_wg == 2 else 160
        # Warpgroup ping-pong pays when softmax and GEMM times are comparable; with D > 128 the
        # GEMMs dominate and the turn-taking only delays issue (FA3 makes the same split).
        self.pingpong = head_dim <= 128
        # Without ping-pong, O's rescale may wait for the next S GEMM's issue (see AttnConfig);
        # with ping-pong it would hold the GEMM turn instead.
        self.late_rescale = config.late_rescale and not self.pingpong
        # Tiles dealt to the CTAs in snake order (odd full rounds reversed: see AttnConfig);
        # the paged mode keeps its own walk (`LongestFirst.next_tile`).
        self.snake = config.snake and not self.paged
        # Tiles from a global counter (see AttnConfig.dynamic): the order is the same, the deal
        # dynamic; snake (a static deal's fix) is then off. Not with paged (its own walk).
        if config.dynamic and self.paged:
            raise ValueError("dynamic tiles are not for the paged mode")
        self.dynamic = config.dynamic
        if self.dynamic:
            self.snake = False
        # Paged, packed: the launcher packs every sequence's GQA group into rows (qgroup = G)
        # and this launch runs the whole batch, decode rows included; else the tiles skip the
        # sequences of fewer than PAGED_MIN_SEQLEN_Q query tokens (the paged decode's).
        self.packed = packed
        # Packed, zero-copy (view_group = G > 0): q and o come as (Tq, Hkv, G, D) views of the
        # caller's (Tq, Hq, D), lse as (Hkv, G, Tq), seen as the packed rows ((G, Tq)) they
        # hold (`grouped_rows_as_sdhb`): TMA boxes of ((G, tile_m / G), D), no pack copy.
        # Fixed length alike: (B, Sq, Hkv, G, D) and (B, Hkv, G, Sq), a head's tiles over its
        # kv head's G * Sq rows (the causal mask on row // G: qgroup = G).
        self.view_group = view_group
        skip_below = PAGED_MIN_SEQLEN_Q if self.paged and not packed else 0
        # K + V bytes of one key row (16-bit elements) decide the tile order's L2 sections.
        self.scheduler = LongestFirst(
            self.tile_m, causal, varlen, kv_row_bytes=(head_dim + head_dim_v) * 2,
            paged=self.paged, min_seqlen_q=skip_below, l2_kv_budget=config.l2_kv_mib * 2**20,
            wave_kv_limit_kib=config.wave_kv_mib * 2**10,
        )  # fmt: skip
        # K of the next key block before V of the current one (see AttnConfig.k_ahead).
        if config.k_ahead and self.paged:
            raise ValueError("k_ahead is not for the paged mode")
        self.k_ahead = config.k_ahead

    # ---------------------------------------------------------------- host-side setup
    def _setup(self):
        dt, tm, tn = self.dtype, self.tile_m, self.tile_n
        d, dv = self.head_dim, self.head_dim_v
        k_major = OperandMajorMode.K
        self.mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (self.num_wg, 1, 1), (64, tn)
        )
        self.mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            k_major,
            OperandMajorMode.MN,
            Float32,
            (self.num_wg, 1, 1),
            (64, dv),
            a_source=warpgroup.OperandSource.RMEM,
        )
        row = LayoutEnum.ROW_MAJOR
        # Q (tm, d) and K (tn, d) K-major; V^T (dv, tn) MN-major (V rows are keys); O (tm, dv).
        self.sQ_layout = sm90_utils.make_smem_layout_a(row, (tm, tn, d), dt, 1)
        self.sK_layout = sm90_utils.make_smem_layout_b(row, (tm, tn, d), dt, self.stages)
        self.sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (tm, dv, tn), dt, self.stages
        )
        self.sO_layout = sm90_utils.make_smem_layout_a(row, (tm, dv, dv), dt, 1)
        if self.paged:  # `_v_chunks` addresses V's stages as 128-byte key rows: check it
            lay = self.sV_layout.outer  # (Dv, tile_n, stages), elements, before the swizzle
            next_key, next_stage = cute.crd2idx((0, 1, 0), lay), cute.crd2idx((0, 0, 1), lay)
            next_block = cute.crd2idx((64, 0, 0), lay) if dv > 64 else 64 * tn
            if (next_key, next_block, next_stage) != (64, 64 * tn, tn * dv):
                raise ValueError(f"V's stages are not 128-byte key rows: {lay}")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuQ: cute.Tensor | None,
        mCuK: cute.Tensor | None,
        softmax_scale_log2: Float32,
        max_seqlen_q: Int32,
        qgroup: Int32,
        num_ctas: Int32,
        mPageTable: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """Fixed length: mQ (B, Sq, Hq, D), mK (B, Sk, Hkv, D), mV (B, Sk, Hkv, Dv),
        mO (B, Sq, Hq, Dv), mLSE (B, Hq, Sq) fp32; mCuQ, mCuK None. Varlen: mQ (Tq, Hq, D),
        mK (Tk, Hkv, D), mV (Tk, Hkv, Dv), mO (Tq, Hq, Dv), mLSE (Hq, Tq), mCuQ / mCuK int32
        (B + 1,) offsets, max_seqlen_q the longest query sequence. Paged (page_box > 0): as
        varlen, but mK / mV are caches (pages, page_size, Hkv, D / Dv), mCuK the int32 key
        lengths (B,) and mPageTable int32 (B, max_pages) (None otherwise); page_box =
        min(page_size, tile_n), page_size a multiple of tile_n when it is not below it (the
        page size itself is dynamic). qgroup: query rows per query
        position (pack-GQA: the caller packs G query heads of one kv head as rows s * G + g of
        one head, so row r is query r // G for the causal mask; 1 otherwise). num_ctas: CTAs
        to launch (one runs a SM at a time: the kernel is persistent; more queue for the SMs
        that free first; the launch takes min(num_ctas, tiles)). Dynamic (AttnConfig.dynamic):
        mPageTable is a zeroed int32 (1,) tile counter."""
        self.dtype = mQ.element_type
        for t in (mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"q, k, v, o must share one dtype, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError(f"lse must be float32, got {mLSE.element_type}")
        self._setup()

        # Everything as (S, D, H, B): TMA boxes over (S, D), coordinates for head and batch.
        # Varlen tensors get a unit batch mode; each sequence is a row offset into them.
        # Paged caches (pages, page_size, Hkv, D) become (page_size, D, Hkv, pages): a page is
        # a batch of the fixed-length view.
        if const_expr(self.paged):
            if const_expr(self.view_group > 0):
                mQ, mO = grouped_rows_as_sdhb(mQ), grouped_rows_as_sdhb(mO)
            else:
                mQ, mO = packed_as_sdhb(mQ), packed_as_sdhb(mO)
            mK, mV = select(mK, [1, 3, 2, 0]), select(mV, [1, 3, 2, 0])
        elif const_expr(self.varlen):
            mQ, mK, mV, mO = (packed_as_sdhb(t) for t in (mQ, mK, mV, mO))
        if const_expr(self.view_group > 0):
            mLSE = grouped_lse(mLSE)
        elif const_expr(self.varlen):
            mLSE = cute.make_tensor(
                mLSE.iterator,
                cute.make_layout(
                    (1, mLSE.shape[0], mLSE.shape[1]), stride=(0, mLSE.stride[0], mLSE.stride[1])
                ),
            )
        if const_expr(self.varlen):
            num_batch = mCuQ.shape[0] - 1
            num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        elif const_expr(self.view_group > 0):
            mQ, mO = grouped_rows_as_sdhb(mQ), grouped_rows_as_sdhb(mO)
            mK, mV = select(mK, [1, 3, 2, 0]), select(mV, [1, 3, 2, 0])
            num_batch = mQ.shape[3]
            num_m_blocks = (cute.size(mQ, mode=[0]) + self.tile_m - 1) // self.tile_m
        else:
            mQ, mK, mV, mO = (select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO))
            num_batch = mQ.shape[3]
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
        # V as the B operand of O = P V: (Dv, Sk, Hkv, B), unit stride along Dv (MN-major).
        mVt = select(mV, [1, 0, 2, 3])

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sQ_tile = cute.slice_(self.sQ_layout, (None, None, 0))
        sK_tile = cute.slice_(self.sK_layout, (None, None, 0))
        sV_tile = cute.slice_(self.sV_layout, (None, None, 0))
        sO_tile = cute.slice_(self.sO_layout, (None, None, 0))
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_tile, (self.tile_m, self.head_dim))
        if const_expr(self.paged):
            # One box: page_box rows of the tile (K), of the tile's columns (V^T).
            k_box, v_box = (self.page_box, self.head_dim), (self.head_dim_v, self.page_box)
            tma_k, tma_mK = cpasync.make_tiled_tma_atom(
                g2s, mK, cute.slice_(cute.zipped_divide(sK_tile, k_box), ((None, None), 0)), k_box
            )
            tma_v, tma_mV = cpasync.make_tiled_tma_atom(
                g2s, mVt, cute.slice_(cute.zipped_divide(sV_tile, v_box), ((None, None), 0)), v_box
            )
        else:
            tma_k, tma_mK = cpasync.make_tiled_tma_atom(
                g2s, mK, sK_tile, (self.tile_n, self.head_dim)
            )
            tma_v, tma_mV = cpasync.make_tiled_tma_atom(
                g2s, mVt, sV_tile, (self.head_dim_v, self.tile_n)
            )
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_tile, (self.tile_m, self.head_dim_v)
        )
        self.q_bytes = cute.size_in_bytes(self.dtype, sQ_tile)
        self.k_bytes = cute.size_in_bytes(self.dtype, sK_tile)
        self.v_bytes = cute.size_in_bytes(self.dtype, sV_tile)

        q_cosize = cute.cosize(self.sQ_layout)
        o_cosize = cute.cosize(self.sO_layout) if const_expr(self.own_o) else 1
        if const_expr(not self.own_o):
            q_cosize = max(q_cosize, cute.cosize(self.sO_layout))

        dynamic = self.dynamic

        @cute.struct
        class SharedStorage:
            q_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            k_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            v_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_cosize], 1024]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024
            ]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_cosize], 1024]
            if const_expr(dynamic):  # the tile ring (producer -> consumer warps), at the end
                tile_barriers: cute.struct.MemRange[cutlass.Int64, 2 * atomic.STAGES]
                tile_ids: cute.struct.MemRange[Int32, atomic.STAGES]

        self.shared_storage = SharedStorage
        num_heads = mQ.shape[2]
        num_tiles = num_m_blocks * num_heads * num_batch
        self.kernel(
            tma_q,
            tma_mQ,
            tma_k,
            tma_mK,
            tma_v,
            tma_mV,
            tma_o,
            tma_mO,
            mO,
            mLSE,
            mCuQ,
            mCuK,
            softmax_scale_log2,
            num_m_blocks,
            num_tiles,
            qgroup,
            self.mma_qk,
            self.mma_pv,
            self.sQ_layout,
            self.sK_layout,
            self.sV_layout,
            self.sO_layout,
            mPageTable,
        ).launch(
            grid=(cutlass.max(cutlass.min(num_ctas, num_tiles), 1), 1, 1),
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
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mVt: cute.Tensor,
        tma_o: cute.CopyAtom,
        mO_tma: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuQ: cute.Tensor | None,
        mCuK: cute.Tensor | None,
        scale_log2: Float32,
        num_m_blocks: Int32,
        num_tiles: Int32,
        qgroup: Int32,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        mPageTable: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        # Consumers release a stage from lane 0 of each of their warps.
        consumer_warps = self.num_mma_threads // WARP_SIZE
        q_pipe = tma_pipeline(storage.q_barriers, 1, self.q_bytes, consumer_warps)
        k_pipe = tma_pipeline(storage.k_barriers, self.stages, self.k_bytes, consumer_warps)
        v_pipe = tma_pipeline(storage.v_barriers, self.stages, self.v_bytes, consumer_warps)
        tiles = None
        if const_expr(self.dynamic):  # taken by every consumer warp
            tiles = atomic.TileRing(storage.tile_barriers, storage.tile_ids, consumer_warps)
        init_arrive()

        sQ = smem_tensor(storage.sQ, sQ_layout)
        sK = smem_tensor(storage.sK, sK_layout)
        sV = smem_tensor(storage.sV, sV_layout)
        if const_expr(self.own_o):
            sO = smem_tensor(storage.sO, sO_layout)
        else:  # O reuses Q's buffer once every warpgroup is past its last QK^T
            sO = smem_tensor(storage.sQ, sO_layout)

        init_wait()

        grid = TileGrid(num_m_blocks, mQ, mK, mCuQ, mCuK)
        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    tma_q, tma_k, tma_v, mQ, mK, mVt, sQ, sK, sV, q_pipe, k_pipe, v_pipe, grid,
                    num_tiles, qgroup, mPageTable, tiles,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            sV_chunks = None
            if const_expr(self.paged):
                sV_chunks = self._v_chunks(storage.sV.data_ptr())
            self._consume(
                tidx - THREADS_PER_WG, wg_idx - 1, warp_idx, mma_qk, mma_pv, sQ, sK, sV, sO,
                q_pipe, k_pipe, v_pipe, tma_o, mO_tma, mO, mLSE, scale_log2, grid, num_tiles,
                qgroup, sV_chunks, tiles,
            )  # fmt: skip

    # ---------------------------------------------------------------- tiles
    @cute.jit
    def _key_blocks(self, m0: Int32, sq, seqlen_k: Int32):
        """(n_block_max, n_unmasked): key blocks [0, n_block_max) hold a key some row of the
        tile sees; blocks [0, n_unmasked) are seen whole by every row (no mask needed).
        sq = (rows, qgroup): the tile's row count and the rows per query position."""
        seqlen_q, qgroup = sq
        n_block_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_unmasked = seqlen_k // self.tile_n
        if const_expr(self.causal):
            offset = seqlen_k - seqlen_q // qgroup
            # The tile's last real row is query q_last, which sees keys up to q_last + offset.
            # Division may truncate or floor: negative results are clamped to 0 below.
            q_last = (cutlass.min(m0 + self.tile_m, seqlen_q) - 1) // qgroup
            n_causal = (q_last + offset + self.tile_n) // self.tile_n
            n_block_max = cutlass.min(n_block_max, n_causal)
            # The first row, query m0 // qgroup, sees whole blocks up to that query + offset.
            n_unmasked = cutlass.min(n_unmasked, (m0 // qgroup + offset + 1) // self.tile_n)
        n_block_max = cutlass.max(n_block_max, 0)
        n_unmasked = cutlass.max(cutlass.min(n_unmasked, n_block_max), 0)
        return n_block_max, n_unmasked

    @cute.jit
    def _views(self, t: cute.Tensor, head, batch, off, tile, coord, seq_mode: int = 0):
        """This tile's head of a (S, D, H, B)-ordered tensor, its sequence mode shifted by
        `off` (varlen), tiled."""
        t = t[None, None, head, batch]
        if const_expr(self.varlen):
            t = cute.domain_offset((off, 0) if seq_mode == 0 else (0, off), t)
        return cute.local_tile(t, tile, coord)

    # ---------------------------------------------------------------- producer
    @cute.jit
    def _produce(
        self, tma_q, tma_k, tma_v, mQ, mK, mVt, sQ, sK, sV, q_pipe, k_pipe, v_pipe, grid,
        num_tiles, qgroup, mPageTable, tiles,
    ):  # fmt: skip
        """Warp 0: per tile, the last key block's K and V, then Q (its buffer frees when the
        consumers finish the previous tile), then the other key blocks last to first. Paged:
        each K / V tile is tile_n / page_box boxes, one per page (`_page_boxes`). Dynamic:
        mPageTable is the tile counter; each tile id goes to the consumers on the ring
        `tiles` before its loads, the next is taken once they are issued, and an id past
        the tiles ends the consumers' loop."""
        one = cute.make_layout(1)
        q_state = producer_state(1)
        kv = producer_state(self.stages)
        t = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        if const_expr(self.dynamic):
            lane = cute.arch.lane_idx()
            tstate = tiles.producer_state()
        while t < num_tiles:
            if const_expr(self.dynamic):
                tstate = atomic.publish(tiles, tstate, t, lane)
            tile_id = t
            if const_expr(self.snake):
                tile_id = self.scheduler.snake(t, step, num_tiles, grid)
            work = self.scheduler.tile(tile_id, grid)
            valid, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k, seq = work
            if const_expr(self.paged):  # live instead of t through the tile
                t_next = self.scheduler.next_tile(t, step, work, grid)
            if valid:
                head_kv = head // (mQ.shape[2] // mK.shape[2])
                n_block_max, _ = self._key_blocks(
                    m_block * self.tile_m, (seqlen_q, qgroup), seqlen_k
                )
                gQ = self._views(mQ, head, batch, q_off, (self.tile_m, self.head_dim), (None, 0))
                if const_expr(self.paged):
                    # Boxes: (page_box, D) of a page of this kv head: (row box, page) coordinates;
                    # (page_box, D) of the tile's stages: (box, stage).
                    k_box, v_box = (self.page_box, self.head_dim), (self.head_dim_v, self.page_box)
                    gK = cute.local_tile(mK[None, None, head_kv, None], k_box, (None, 0, None))
                    gV = cute.local_tile(mVt[None, None, head_kv, None], v_box, (0, None, None))
                    sK_ = cute.local_tile(sK, k_box, (None, 0, None))
                    sV_ = cute.local_tile(sV, v_box, (0, None, None))
                else:
                    gK = self._views(
                        mK, head_kv, batch, k_off, (self.tile_n, self.head_dim), (None, 0)
                    )
                    gV = self._views(
                        mVt, head_kv, batch, k_off, (self.head_dim_v, self.tile_n), (0, None), 1
                    )
                    sK_, sV_ = sK, sV
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                tKsK, tKgK = cpasync.tma_partition(
                    tma_k, 0, one, cute.group_modes(sK_, 0, 2), cute.group_modes(gK, 0, 2)
                )
                tVsV, tVgV = cpasync.tma_partition(
                    tma_v, 0, one, cute.group_modes(sV_, 0, 2), cute.group_modes(gV, 0, 2)
                )
                q_load = (tma_q, tQgQ, tQsQ, q_pipe, m_block)
                if const_expr(self.k_ahead):
                    kv = self._load_k_ahead(
                        tma_k, tma_v, tKgK, tKsK, tVgV, tVsV, k_pipe, v_pipe, kv, n_block_max,
                        q_load, q_state,
                    )  # fmt: skip
                    q_state.advance()
                else:
                    kv, q_state = self._load_blocks(
                        tma_k, tma_v, tKgK, tKsK, tVgV, tVsV, k_pipe, v_pipe, kv, n_block_max,
                        q_load, q_state, (mPageTable, mK.shape[0], seq, seqlen_k),
                    )  # fmt: skip
            if const_expr(self.paged):
                t = t_next
            elif const_expr(self.dynamic):
                t = atomic.next_tile(mPageTable.iterator, lane, step)
            else:
                t += step
        if const_expr(self.dynamic):
            tstate = atomic.publish(tiles, tstate, num_tiles, lane)

    @cute.jit
    def _load_blocks(
        self, tma_k, tma_v, tKgK, tKsK, tVgV, tVsV, k_pipe, v_pipe, kv, n_block_max, q_load,
        q_state, pages,
    ):  # fmt: skip
        """One tile's loads: K and V of each key block together, last block first, Q after
        the first pair (Q alone when no block is visible). q_load: (tma_q, tQgQ, tQsQ, q_pipe,
        m_block); pages (paged): (page table, page size, sequence, seqlen_k). Returns the K/V
        and Q pipeline states."""
        tma_q, tQgQ, tQsQ, q_pipe, m_block = q_load
        mPageTable, page_size, seq, seqlen_k = pages
        for i in cutlass.range(n_block_max, unroll=1):
            n = n_block_max - 1 - i
            if const_expr(self.paged):
                # Before the wait for a free stage: the page-table read lands under it.
                page, box = self._page_of_lane(mPageTable, page_size, seq, n, seqlen_k)
                k_pipe.producer_acquire(kv)
                self._page_boxes(
                    tma_k, tKgK, tKsK, kv.index, page, box, k_pipe.producer_get_barrier(kv)
                )
                v_pipe.producer_acquire(kv)
                self._page_boxes(
                    tma_v, tVgV, tVsV, kv.index, page, box, v_pipe.producer_get_barrier(kv)
                )
            else:
                k_pipe.producer_acquire(kv)
                cute.copy(
                    tma_k,
                    tKgK[(None, n)],
                    tKsK[(None, kv.index)],
                    tma_bar_ptr=k_pipe.producer_get_barrier(kv),
                )
                v_pipe.producer_acquire(kv)
                cute.copy(
                    tma_v,
                    tVgV[(None, n)],
                    tVsV[(None, kv.index)],
                    tma_bar_ptr=v_pipe.producer_get_barrier(kv),
                )
            kv.advance()
            if i == 0:
                # Q after the first K and V: they may land while the consumers finish the
                # previous tile. Q is loaded even when no key block is visible.
                self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
                q_state.advance()
        if n_block_max == 0:
            self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
            q_state.advance()
        return kv, q_state

    @cute.jit
    def _load_k_ahead(
        self, tma_k, tma_v, tKgK, tKsK, tVgV, tVsV, k_pipe, v_pipe, kv, n_block_max, q_load,
        q_state,
    ):  # fmt: skip
        """`k_ahead`'s order of one tile's loads: K of block n_block_max - 1, Q, then K of each
        next block before V of the one before it, V of block 0 last (Q alone when no block is
        visible). K's stages free as soon as their S GEMM is done, V's only once their P V is:
        issued first, K waits on neither V's stage nor the P V: about two steps ahead of its S
        GEMM instead of about 1.5. Each pipeline still fills its stages in the consumers' order.
        q_load: as `_load_blocks`'; q_state: Q's (the caller advances it). Returns the K/V
        pipeline state."""
        tma_q, tQgQ, tQsQ, q_pipe, m_block = q_load
        if n_block_max > 0:
            self._copy_kv(tma_k, tKgK, tKsK, k_pipe, kv, n_block_max - 1)
            self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
            for i in cutlass.range(n_block_max - 1, unroll=1):
                kv_v = kv.clone()
                kv.advance()
                self._copy_kv(tma_k, tKgK, tKsK, k_pipe, kv, n_block_max - 2 - i)
                self._copy_kv(tma_v, tVgV, tVsV, v_pipe, kv_v, n_block_max - 1 - i)
            self._copy_kv(tma_v, tVgV, tVsV, v_pipe, kv, 0)
            kv.advance()
        else:
            self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
        return kv

    @cute.jit
    def _copy_kv(self, tma, tXgX, tXsX, pipe, state, n):
        """Key block n of K or V (its TMA partitions) into the stage of `state`."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        cute.copy(tma, tXgX[(None, n)], tXsX[(None, state.index)], tma_bar_ptr=bar)

    @cute.jit
    def _page_of_lane(self, mPageTable, page_size, seq, n, seqlen_k):
        """(page, box) of key block n. Several boxes a tile (page_box < tile_n: the page is
        the box): lane j < tile_n / page_box holds the page of box j, page_table[seq, n *
        tile_n / page_box + j] (-1 past the sequence's last key: TMA zero-fills the box and
        still counts its bytes), box 0. One box a tile (page_box = tile_n divides the page):
        every lane holds the page and the tile's row box within it. A length past the table's
        width reads no entry past it (-1: zeros); a page id past the cache, none of the cache
        (TMA bounds every box by the cache's extent: zeros)."""
        if const_expr(self.page_box < self.tile_n):
            lane = cute.arch.lane_idx()
            col = n * (self.tile_n // self.page_box) + lane
            page = Int32(-1)
            in_table = col < mPageTable.shape[1]
            if lane < self.tile_n // self.page_box and col * self.page_box < seqlen_k and in_table:
                page = mPageTable[seq, col]
            return page, Int32(0)
        key = n * self.tile_n
        col = key // page_size
        page = Int32(-1)
        if col < mPageTable.shape[1]:
            page = mPageTable[seq, col]
        return page, (key - col * page_size) // self.tile_n

    @cute.jit
    def _page_boxes(self, tma, tXgX, tXsX, stage, page, box, bar):
        """The tile_n / page_box boxes of one K or V tile into `stage`, all on barrier `bar`
        (which expects the whole tile's bytes): box j from lane j's page."""
        if const_expr(self.page_box < self.tile_n):
            # A loop, not unrolled: one page id live at a time in the producer's 24 registers.
            for j in cutlass.range(self.tile_n // self.page_box, unroll=1):
                page_j = cute.arch.make_warp_uniform(cute.arch.shuffle_sync(page, j))
                cute.copy(tma, tXgX[(None, 0, page_j)], tXsX[(None, j, stage)], tma_bar_ptr=bar)
        else:
            cute.copy(tma, tXgX[(None, box, page)], tXsX[(None, 0, stage)], tma_bar_ptr=bar)

    @cute.jit
    def _load_q(self, tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block):
        q_pipe.producer_acquire(q_state)
        cute.copy(
            tma_q,
            tQgQ[(None, m_block)],
            tQsQ[(None, 0)],
            tma_bar_ptr=q_pipe.producer_get_barrier(q_state),
        )

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def _consume(
        self, tidx, wg, warp_idx, mma_qk, mma_pv, sQ, sK, sV, sO, q_pipe, k_pipe, v_pipe,
        tma_o, mO_tma, mO, mLSE, scale_log2, grid, num_tiles, qgroup, sV_chunks, tiles,
    ):  # fmt: skip
        """Consumer warpgroup `wg` (rows 64 wg .. 64 wg + 63 of each tile); tidx counts the
        consumer threads from 0. sV_chunks: paged, V's stages as 16-byte chunks
        (`_v_chunks`); else None. tiles: dynamic, the ring each warp takes its tile ids from
        (else None)."""
        # Operand fragments come from the warpgroup's slice (WGMMA descriptors), coordinates
        # from the thread's own slice.
        wg_qk = mma_qk.get_slice(wg * THREADS_PER_WG)
        wg_pv = mma_pv.get_slice(wg * THREADS_PER_WG)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))[None, None, None, 0]
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_S = cute.make_rmem_tensor(wg_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_O = cute.make_rmem_tensor(
            wg_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32
        )
        tScS = softmax.acc_coords(mma_qk, tidx, (self.tile_m, self.tile_n))
        rows = cute.size(tScS[0], mode=[0])
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)
        rescale = cute.make_rmem_tensor(rows, Float32)

        # Ping-pong: warpgroup wg issues its WGMMAs only after waiting on barrier TURN + wg,
        # then passes the turn to the next warpgroup, so one's softmax runs while another's
        # GEMMs hold the tensor cores. Each barrier counts the waiting warpgroup and the one
        # handing over; warpgroup 0 starts with an arrival of its own. (The ids are dynamic:
        # pipeline.NamedBarrier, not the toolkit's `named_barrier`, which takes static ones.)
        my_turn = pipeline.NamedBarrier(barrier_id=Bar.TURN + wg, num_threads=2 * THREADS_PER_WG)
        their_turn = pipeline.NamedBarrier(
            barrier_id=Bar.TURN + (wg + 1) % self.num_wg, num_threads=2 * THREADS_PER_WG
        )
        if const_expr(self.pingpong):
            if wg == 0:
                my_turn.arrive()
        epilogue = named_barrier(Bar.EPILOGUE, self.num_mma_threads)

        q_state = consumer_state(1)
        kv = consumer_state(self.stages)
        step_args = (
            mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale,
            tScS, k_pipe, v_pipe, scale_log2, my_turn, their_turn,
        )  # fmt: skip
        t = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        if const_expr(self.dynamic):
            lane = cute.arch.lane_idx()
            tstate = tiles.consumer_state()
            t, tstate = atomic.take(tiles, tstate, lane)
        while t < num_tiles:
            tile_id = t
            if const_expr(self.snake):
                tile_id = self.scheduler.snake(t, step, num_tiles, grid)
            work = self.scheduler.tile(tile_id, grid)
            valid, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k, _ = work
            if const_expr(self.paged):  # live instead of t through the tile
                t_next = self.scheduler.next_tile(t, step, work, grid)
            if valid:
                m0 = m_block * self.tile_m
                n_block_max, n_unmasked = self._key_blocks(m0, (seqlen_q, qgroup), seqlen_k)
                if const_expr(self.paged):
                    self._clear_stale_v(sV_chunks, v_pipe, kv, n_block_max, seqlen_k, wg)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                acc_O.fill(0.0)
                q_pipe.consumer_wait(q_state)
                if const_expr(self.packed):
                    # A warpgroup none of whose 64 rows is in the tile's sequence (a decode row's
                    # tile: n tokens x G rows, at most 32 at G 8) keeps the protocol, no GEMM.
                    if m0 + wg * 64 < seqlen_q:
                        kv = self._mainloop(
                            kv, m0, (seqlen_q, qgroup), seqlen_k, n_block_max, n_unmasked,
                            *step_args,
                        )  # fmt: skip
                    else:
                        kv = self._idle_blocks(kv, n_block_max, k_pipe, v_pipe, my_turn,
                                               their_turn)  # fmt: skip
                else:
                    kv = self._mainloop(
                        kv, m0, (seqlen_q, qgroup), seqlen_k, n_block_max, n_unmasked, *step_args
                    )
                row_lse = softmax.finalize(acc_O, row_max, row_sum, scale_log2)
                if const_expr(self.own_o):
                    # Every QK^T of this tile is done (the last P V was waited on): the
                    # producer may load the next tile's Q during this epilogue.
                    q_pipe.consumer_release(q_state)
                self._store_o(
                    tidx, warp_idx, mma_pv, acc_O, sO, tma_o, mO_tma, mO, epilogue,
                    m_block, head, batch, q_off, seqlen_q,
                )  # fmt: skip
                if const_expr(not self.own_o):
                    # O was read out of Q's buffer (the storing thread waited): Q may reload.
                    epilogue.arrive_and_wait()
                    q_pipe.consumer_release(q_state)
                q_state.advance()
                self._store_lse(tidx, mma_pv, row_lse, mLSE, m0, head, batch, q_off, seqlen_q)
            if const_expr(self.paged):
                t = t_next
            elif const_expr(self.dynamic):
                t, tstate = atomic.take(tiles, tstate, lane)
            else:
                t += step
        if warp_idx == STORER_WARP:
            # The CTA may not exit (freeing sO) before the last store has read it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _v_chunks(self, base) -> cute.Tensor:
        """V's stages as 16-byte chunks of 4 words, 8 chunks per 128-byte row (64 columns of
        V^T: 64 dims of one key): (word, chunk, key, dim block, stage). The swizzle permutes
        the chunks of one 128-byte row among themselves, so a key's whole row is the same
        bytes either way."""
        tn, blocks = self.tile_n, self.head_dim_v // 64
        return cute.make_tensor(
            cute.recast_ptr(base, dtype=Int32),
            cute.make_layout(
                (4, 8, tn, blocks, self.stages),
                stride=(1, 4, 32, 32 * tn, 32 * tn * blocks),
            ),
        )

    @cute.jit
    def _clear_stale_v(self, sV_chunks, v_pipe, kv, n_block_max, seqlen_k, wg):
        """Zero V's rows past the sequence in the last page of key block n_block_max - 1 (at
        stage kv): that page's slots past seqlen_k hold whatever the cache held (NaN or inf
        would survive P = 0 in P V; their scores are masked). Boxes wholly past the sequence
        came zero-filled. The consumer threads split the rows' 16-byte chunks (each chunk one
        writer: no write race for racecheck to flag), fence them for WGMMA's async-proxy reads
        and the next TMA's writes, and meet before any P V of the block: at most page_box - 1
        rows, a static number of predicated stores a thread."""
        n = n_block_max - 1
        first = seqlen_k - n * self.tile_n
        box_end = (seqlen_k + self.page_box - 1) // self.page_box * self.page_box
        end = cutlass.min(box_end - n * self.tile_n, self.tile_n)
        if n_block_max > 0 and first < end:
            v_pipe.consumer_wait(kv)
            # The thread index read here, not the consumers' tidx: with that one, ptxas moved
            # D 256's causal kernel off the uniform datapath (every producer TMA in a per-lane
            # loop, 8 bytes spilled); this form compiles as the others do.
            t = cute.arch.thread_idx()[0] % THREADS_PER_WG
            zero = cute.make_rmem_tensor(4, Int32)
            zero.fill(0)
            rows_per_wg = THREADS_PER_WG // 8
            rows_per_pass = rows_per_wg * self.num_wg
            row0 = first + wg * rows_per_wg + t // 8
            for c in cutlass.range_constexpr(self.head_dim_v // 64):
                for i in cutlass.range_constexpr(-(-self.page_box // rows_per_pass)):
                    r = row0 + i * rows_per_pass
                    if r < end:
                        cute.autovec_copy(zero, sV_chunks[None, t % 8, r, c, kv.index])
            cute.arch.fence_view_async_shared()
            named_barrier(Bar.STALE, self.num_mma_threads).arrive_and_wait()

    @cute.jit
    def _mainloop(
        self, kv, m0, seqlen_q, seqlen_k, n_block_max, n_unmasked, mma_qk, mma_pv, tSrQ, tSrK,
        tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale, tScS, k_pipe, v_pipe,
        scale_log2, my_turn, their_turn,
    ):  # fmt: skip
        """Key blocks last to first (the masked ones, diagonal and key bound, come first).
        Block n_block_max - 1 is a first half step (S, mask, softmax); each later step issues
        S of its block and P V of the block before, runs the softmax of its S while that P V
        is on the tensor cores, then lands the P V (wait, P to 16 bits, O rescaled). A last
        P V closes the loop. Returns the K/V pipeline state."""
        a = (
            mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale,
            tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k, my_turn, their_turn,
        )  # fmt: skip
        if n_block_max > 0:
            self._first_block(kv, n_block_max - 1, *a)
            self._land(None, tOrP, acc_S, acc_O, rescale, v_pipe)
            n_rest = n_block_max - 1
            n_rest_unmasked = cutlass.min(n_unmasked, n_rest)
            for i in cutlass.range(n_rest - n_rest_unmasked, unroll=1):
                kv = self._step(kv, n_rest - 1 - i, *a, True)
            for i in cutlass.range(n_rest_unmasked, unroll=1):
                kv = self._step(kv, n_rest_unmasked - 1 - i, *a, False)
            if const_expr(self.late_rescale):
                softmax.rescale_o(acc_O, rescale)
            v_pipe.consumer_wait(kv)
            gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv.index], False, 0)
            v_pipe.consumer_release(kv)
            kv.advance()
        return kv

    @cute.jit
    def _idle_blocks(self, kv, n_block_max, k_pipe, v_pipe, my_turn, their_turn):
        """`_mainloop`'s protocol without its work (the packed compile's warpgroups with no row
        in the tile's sequence): each K and V stage waited for and released, the GEMM turns
        taken and passed, in the mainloop's order, so that the producer's stages and the other
        warpgroups' turns advance as when it computes; its O and LSE rows are never stored.
        (A WGMMA skipped by a branch inside the mainloop instead made ptxas serialize every
        WGMMA of the kernel: 48 WARPGROUP.ARRIVE / DEPBAR against 6 / 7.) Returns the K/V
        pipeline state."""
        if n_block_max > 0:
            k_pipe.consumer_wait(kv)
            k_pipe.consumer_release(kv)
            for _ in cutlass.range(n_block_max - 1, unroll=1):
                kv_s = kv.clone()
                kv_s.advance()
                k_pipe.consumer_wait(kv_s)
                if const_expr(self.pingpong):
                    my_turn.arrive_and_wait()
                v_pipe.consumer_wait(kv)
                if const_expr(self.pingpong):
                    their_turn.arrive()
                k_pipe.consumer_release(kv_s)
                v_pipe.consumer_release(kv)
                kv = kv_s
            v_pipe.consumer_wait(kv)
            v_pipe.consumer_release(kv)
            kv.advance()
        return kv

    @cute.jit
    def _first_block(
        self, kv, n, mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum,
        rescale, tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k, my_turn, their_turn,
    ):  # fmt: skip
        """Key block n, first half: S = Q K^T, mask, softmax; P (fp32) stays in acc_S. O is
        still 0, so its rescale factor does not matter."""
        k_pipe.consumer_wait(kv)
        gemm(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], True, 0)
        k_pipe.consumer_release(kv)
        self._mask(acc_S, tScS, n, m0, seqlen_q, seqlen_k)
        softmax.online_softmax(acc_S, row_max, row_sum, rescale, scale_log2)

    @cute.jit
    def _step(
        self, kv, n, mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum,
        rescale, tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k, my_turn, their_turn,
        masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """acc_S holds P of the block at state `kv` (its V not yet used): issue S = Q K_n^T and
        O += P V_kv, run the softmax of S_n under that P V, then land it. Returns the state of
        block n. (The assembler hoists the P V wait above the softmax's exp2s: a warpgroup's
        softmax runs under the other warpgroup's GEMMs, not its own; see the notes.)"""
        kv_s = kv.clone()
        kv_s.advance()
        k_pipe.consumer_wait(kv_s)
        if const_expr(self.pingpong):
            my_turn.arrive_and_wait()
        gemm(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_s.index], True, -1)
        if const_expr(self.late_rescale):
            # O's rescale under the S GEMM, right before the P V that accumulates onto it.
            softmax.rescale_o(acc_O, rescale)
        v_pipe.consumer_wait(kv)
        gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv.index], False, -1)
        if const_expr(self.pingpong):
            their_turn.arrive()
        # Groups retire in order: with one left in flight, S (committed first) is complete.
        warpgroup.wait_group(1)
        k_pipe.consumer_release(kv_s)
        if const_expr(masked):
            self._mask(acc_S, tScS, n, m0, seqlen_q, seqlen_k)
        softmax.online_softmax(acc_S, row_max, row_sum, rescale, scale_log2)
        self._land(kv, tOrP, acc_S, acc_O, rescale, v_pipe)
        return kv_s

    @cute.jit
    def _land(self, kv_pv, tOrP, acc_S, acc_O, rescale, v_pipe):
        """Wait for the P V in flight and release its V stage `kv_pv` (None: nothing was in
        flight), then P in acc_S to 16 bits as the next P V's A operand (one inline-PTX packed
        convert per pair: the DSL's vector conversion is sunk past the next GEMM turn's
        barrier, 5-15% slower at D = 128), and O rescaled to the new row maxima."""
        warpgroup.wait_group(0)
        if const_expr(kv_pv is not None):
            v_pipe.consumer_release(kv_pv)
        acc_to_operand_a(acc_S, tOrP)
        if const_expr(not self.late_rescale):
            softmax.rescale_o(acc_O, rescale)

    @cute.jit
    def _mask(self, acc_S, tScS, n, m0, sq, seqlen_k):
        """-inf past Sk and (causal) past each row's diagonal; sq = (rows, qgroup)."""
        seqlen_q, qgroup = sq
        softmax.mask_scores(
            acc_S, tScS, m0, n * self.tile_n, seqlen_q, seqlen_k, qgroup, self.causal
        )

    @cute.jit
    def _store_o(
        self, tidx, warp_idx, mma_pv, acc_O, sO, tma_o, mO_tma, mO, epilogue, m_block, head,
        batch, q_off, seqlen_q,
    ):  # fmt: skip
        """O (fp32 registers) -> input dtype -> `stmatrix` into sO -> one TMA store (rows past
        Sq clipped). A varlen tile that ends inside its sequence's last row block is written
        from registers instead, row by row (a TMA box would spill into the next sequence)."""
        rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        m0 = m_block * self.tile_m
        partial = False
        if const_expr(self.varlen):
            partial = m0 + self.tile_m > seqlen_q
        if partial:
            gO = cute.local_tile(
                cute.domain_offset((q_off, 0), mO[None, None, head, batch]),
                (self.tile_m, self.head_dim_v),
                (m_block, 0),
            )
            thr = mma_pv.get_slice(tidx)
            tOgO = thr.partition_C(gO)
            tOcO = thr.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
            for i in cutlass.range_constexpr(cute.size(rO)):
                if m0 + tOcO[i][0] < seqlen_q:
                    tOgO[i] = rO[i]
        else:
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype),
                mma_pv,
            )
            thr_r2s = r2s.get_slice(tidx)
            sO_tile = sO[None, None, 0]
            storer = warp_idx == STORER_WARP
            if storer:
                # The previous tile's store must have read sO (own buffer), and
                # (shared buffer) every warpgroup's last QK^T must be done with sQ.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            epilogue.arrive_and_wait()
            cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO_tile))
            # stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
            cute.arch.fence_view_async_shared()
            epilogue.arrive_and_wait()
            if storer:
                gO = cute.local_tile(
                    cute.domain_offset((q_off, 0), mO_tma[None, None, head, batch])
                    if const_expr(self.varlen)
                    else mO_tma[None, None, head, batch],
                    (self.tile_m, self.head_dim_v),
                    (None, 0),
                )
                tOsO, tOgO = cpasync.tma_partition(
                    tma_o,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_o, tOsO[(None, 0)], tOgO[(None, m_block)])
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(not self.own_o):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_lse(self, tidx, mma_pv, row_lse, mLSE, m0, head, batch, q_off, seqlen_q):
        """The thread holding column 0 of a row writes its LSE, rows < Sq only."""
        tOcO = rows_cols(
            mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, self.head_dim_v))
            )
        )
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(row_lse)):
                row = m0 + tOcO[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, q_off + row] = row_lse[r]
