"""Attention forward for Hopper (sm_90a): O = softmax(scale * Q K^T + mask) V, and the LSE.

Persistent: one CTA per SM walks the tiles (query-row block of tile_m rows, query head, batch)
in the order of `_tile` (the longest causal row blocks first; sections of heads whose K/V fit
in L2 when one wave would stream far more); fixed-length or varlen (packed sequences, offsets
from cu_seqlens, each sequence its own causal alignment and key bound).

Warp roles (one CTA = 1 + tile_m / 64 warpgroups):
- warp 0 of warpgroup 0 (producer, setmaxnreg down): per tile, the first key block's K and V
  tiles, then the Q tile (its one-stage pipeline frees when the consumers are done with the
  previous tile's Q), then K and V of the other key blocks, last to first, into two
  `stages`-deep rings (pipelines `k` and `v`, mbarrier full/empty, one stage index for both).
  Blocks entirely above the causal diagonal are never loaded. Warps 1-3 exit at once.
- consumer warpgroups (setmaxnreg up), 64 query rows each. Key block n_max - 1: S = Q K^T,
  mask, online softmax (fp32, exp2, running row max and sum; P stays in the S registers).
  Each later block: issue S_j = Q K_j^T (WGMMA, both operands in shared memory) and
  O += P V_prev (WGMMA, P from registers as the A operand, V an MN-major B operand) as two
  async groups -> wait for S_j -> release K -> mask (only blocks that cross the diagonal or
  the key bound) -> softmax -> wait for P V -> release V -> P to 16 bits -> O rescaled by
  exp2(old - new max). A last P V closes the tile. For D <= 128 the warpgroups take turns
  issuing their GEMMs (named barriers, ping-pong), so one's softmax runs under another's
  GEMMs. (`overlap=True` instead lands each step's P V at the top of the next step, so the
  softmax also runs under the warpgroup's own P V; measured slower, kept as a variant.)
- epilogue (consumers): O / rowsum -> 16 bits -> `stmatrix` into the O buffer (its own, or
  Q's when shared memory is short; the first consumer warp first waits for the previous
  tile's store to have read it) -> one TMA store of the (tile_m, Dv) tile, left in flight
  under the next tile; LSE = (rowmax * scale_log2 + log2(rowsum)) * ln 2 from the thread
  holding column 0 of each row. A varlen tile that ends inside its sequence is written from
  registers row by row (a TMA box would spill into the next sequence).

Constraints: one 16-bit dtype, last dims contiguous, other strides multiples of 8 elements,
16-byte aligned bases; fixed length q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
o (B, Sq, Hq, Dv), lse (B, Hq, Sq) fp32; varlen q (Tq, Hq, D) ... lse (Hq, Tq). Sizes dynamic
(Hq % Hkv == 0, query head h reads kv head h // (Hq // Hkv)); D, Dv multiples of 32 in
[64, 256] (static), tile_m 128 or 192, tile_n a multiple of 16 up to 256. Causal is
bottom-right aligned (query i sees key j iff j <= i + Sk - Sq); rows that see no key get
O = 0 and LSE = -inf. Ragged edges: TMA zero-fills loads (or reads the next sequence's rows,
masked) and clips the O store; score columns >= Sk are masked to -inf before the softmax.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.fwd.sm90.config import (
    SMEM_CAPACITY,
    AttnConfig,
    separate_o,
    smem_bytes,
)

THREADS_PER_WG = 128
EPILOGUE_BARRIER = 1  # named barrier of all consumer threads (0 is __syncthreads)
SCHED_BARRIER = 2  # named barriers 2, 3 (, 4): consumer warpgroup 0's, 1's (, 2's) turn to issue
LN2 = math.log(2.0)
# K and V bytes the concurrently running tiles may share from L2 (50 MiB on H100 / H200), and
# the K/V footprint of one wave of default-order tiles above which sections are used (KiB).
L2_KV_BUDGET = 24 * 2**20
WAVE_KV_LIMIT_KIB = 320 * 2**10


def _select(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


# 2^x on the FMA pipe, for x <= 0 (-inf included): x = j + f with j = floor(x) (the add with
# round-down against 1.5 * 2^23 leaves j in the low mantissa bits), 2^f from a degree-4
# polynomial on [0, 1) (relative error 2.6e-6, fitted here by iterated weighted least squares
# on Chebyshev nodes), and 2^j added straight into the exponent bits. x clamps at -127: the
# result is then a denormal, as good as 0 next to the row maximum's 1.
_EXP2_FMA_PTX = """{
.reg .f32 xc, r, jf, f, p;
.reg .b32 rb, pb, e;
max.ftz.f32 xc, $1, 0fC2FE0000;
add.rm.ftz.f32 r, xc, 0f4B400000;
sub.ftz.f32 jf, r, 0f4B400000;
sub.ftz.f32 f, xc, jf;
fma.rn.ftz.f32 p, f, 0f3C5DBE5F, 0f3D5509FE;
fma.rn.ftz.f32 p, p, f, 0f3E773CC4;
fma.rn.ftz.f32 p, p, f, 0f3F3168B3;
fma.rn.ftz.f32 p, p, f, 0f3F800016;
mov.b32 rb, r;
mov.b32 pb, p;
shl.b32 e, rb, 23;
add.s32 pb, pb, e;
mov.b32 $0, pb;
}"""


@dsl_user_op
def _exp2_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _EXP2_FMA_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def _cvt_pair(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one packed 16-bit pair (lo in the low half)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{'bf16x2' if bf16 else 'f16x2'}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _packed_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """A packed varlen tensor (T, H, D) as (T, D, H, 1): the fixed-length view with one batch."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (lay.shape[0], lay.shape[2], lay.shape[1], 1),
            stride=(lay.stride[0], lay.stride[2], lay.stride[1], 0),
        ),
    )


def _rows_cols(t: cute.Tensor) -> cute.Tensor:
    """A WGMMA accumulator partition ((2, 2, V), M, N) seen as (rows, cols) =
    ((2, M), (2, V, N)): each thread holds rows r and r + 8 of its warp's 16-row band, and in
    each row V pairs of adjacent columns, 8 apart."""
    shape = t.layout.shape
    flat = cute.make_layout(shape)  # index space of the original layout
    s = flat.stride
    mn = cute.make_layout(
        ((shape[0][1], shape[1]), (shape[0][0], shape[0][2], shape[2])),
        stride=((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def _acc_as_operand_a(t: cute.Tensor) -> cute.Tensor:
    """The S accumulator ((2, 2, V), M, N) as the A operand of the next WGMMA,
    ((2, 2, 2), M, (V / 2, N)): k-block kb of 16 columns is column pairs 2 kb and 2 kb + 1; the
    register layouts coincide for 16-bit A, so no data moves."""
    lay = cute.logical_divide(t.layout, ((None, None, 2), None, None))
    shape, stride = lay.shape, lay.stride
    a = cute.make_layout(
        ((shape[0][0], shape[0][1], shape[0][2][0]), shape[1], (shape[0][2][1], shape[2])),
        stride=(
            (stride[0][0], stride[0][1], stride[0][2][0]),
            stride[1],
            (stride[0][2][1], stride[2]),
        ),
    )
    return cute.make_tensor(t.iterator, a)


class AttentionFwdSm90:
    """Warp-specialized TMA + WGMMA flash attention forward; see the module docstring."""

    def __init__(
        self,
        head_dim: int,
        head_dim_v: int,
        causal: bool,
        config: AttnConfig,
        varlen: bool = False,
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
        need = smem_bytes(config, head_dim, head_dim_v)
        if need > SMEM_CAPACITY:
            raise ValueError(f"{config} needs {need} B of shared memory, > {SMEM_CAPACITY}")
        self.cfg = config
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.varlen = varlen
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
        self.overlap = config.overlap
        self.poly_exp = config.poly_exp
        self.cvt_asm = config.cvt_asm
        self.rescale_threshold = float(config.rescale_threshold)
        # Without ping-pong (D > 128) O's rescale waits for the next step's S GEMM to be issued
        # (FA3's RescaleOBeforeGemm): the multiplies then run under the GEMM instead of
        # delaying its issue. With ping-pong they would hold the GEMM turn instead.
        self.late_rescale = config.late_rescale and not self.pingpong and not self.overlap
        self.l2_sections = config.l2_sections

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
        stream: cuda.CUstream,
    ):
        """Fixed length: mQ (B, Sq, Hq, D), mK (B, Sk, Hkv, D), mV (B, Sk, Hkv, Dv),
        mO (B, Sq, Hq, Dv), mLSE (B, Hq, Sq) fp32; mCuQ, mCuK None. Varlen: mQ (Tq, Hq, D),
        mK (Tk, Hkv, D), mV (Tk, Hkv, Dv), mO (Tq, Hq, Dv), mLSE (Hq, Tq), mCuQ / mCuK int32
        (B + 1,) offsets, max_seqlen_q the longest query sequence. qgroup: query rows per query
        position (pack-GQA: the caller packs G query heads of one kv head as rows s * G + g of
        one head, so row r is query r // G for the causal mask; 1 otherwise). num_ctas: CTAs
        to launch (at most one per SM: the kernel is persistent)."""
        self.dtype = mQ.element_type
        for t in (mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"q, k, v, o must share one dtype, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError(f"lse must be float32, got {mLSE.element_type}")
        self._setup()

        # Everything as (S, D, H, B): TMA boxes over (S, D), coordinates for head and batch.
        # Varlen tensors get a unit batch mode; each sequence is a row offset into them.
        if const_expr(self.varlen):
            mQ, mK, mV, mO = (_packed_as_sdhb(t) for t in (mQ, mK, mV, mO))
            mLSE = cute.make_tensor(
                mLSE.iterator,
                cute.make_layout(
                    (1, mLSE.shape[0], mLSE.shape[1]), stride=(0, mLSE.stride[0], mLSE.stride[1])
                ),
            )
            num_batch = mCuQ.shape[0] - 1
            num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        else:
            mQ, mK, mV, mO = (_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO))
            num_batch = mQ.shape[3]
            num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
        # V as the B operand of O = P V: (Dv, Sk, Hkv, B), unit stride along Dv (MN-major).
        mVt = _select(mV, [1, 0, 2, 3])

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sQ_tile = cute.slice_(self.sQ_layout, (None, None, 0))
        sK_tile = cute.slice_(self.sK_layout, (None, None, 0))
        sV_tile = cute.slice_(self.sV_layout, (None, None, 0))
        sO_tile = cute.slice_(self.sO_layout, (None, None, 0))
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_tile, (self.tile_m, self.head_dim))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(g2s, mK, sK_tile, (self.tile_n, self.head_dim))
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
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # Consumers release a stage from lane 0 of each of their warps.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        q_pipe, k_pipe, v_pipe = (
            pipeline.PipelineTmaAsync.create(
                barrier_storage=bars.data_ptr(),
                num_stages=stages,
                producer_group=producer,
                consumer_group=consumers,
                tx_count=nbytes,
                defer_sync=True,
            )
            for bars, stages, nbytes in (
                (storage.q_barriers, 1, self.q_bytes),
                (storage.k_barriers, self.stages, self.k_bytes),
                (storage.v_barriers, self.stages, self.v_bytes),
            )
        )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.own_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:  # O reuses Q's buffer once every warpgroup is past its last QK^T
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        pipeline_init_wait(cluster_shape_mn=(1, 1))

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        tiles = (mQ, mK, mVt, mO_tma, mO, mLSE, mCuQ, mCuK, num_m_blocks, num_tiles, qgroup)
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    tma_q, tma_k, tma_v, sQ, sK, sV, q_pipe, k_pipe, v_pipe, tiles
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(
                tidx - THREADS_PER_WG, wg_idx - 1, warp_idx, mma_qk, mma_pv, sQ, sK, sV, sO,
                q_pipe, k_pipe, v_pipe, tma_o, scale_log2, tiles,
            )  # fmt: skip

    # ---------------------------------------------------------------- tile scheduling
    @cute.jit
    def _tile(self, t: Int32, tiles):
        """Tile t of the persistent schedule -> (valid, m_block, head, batch, q_off, k_off,
        seqlen_q, seqlen_k); batch indexes the tensors (0 for varlen, whose sequences are row
        offsets q_off / k_off). Tiles run in order of t, each CTA taking every grid-th one.

        Default order: the row block slowest over every batch and head, so with a causal mask
        the longest row blocks go first everywhere (longest-processing-time first), and the
        CTAs running at one time share whole GQA groups. When one wave of such tiles would
        touch more K and V than L2 holds many times over (long sequences with few query heads
        per kv head, e.g. MHA 192/128 at 8192: ~130 kv heads of 5 MB), fixed-length tiles go
        instead batch by batch in sections of heads whose K and V fit in L2 together, the row
        block slowest within a section."""
        mQ, mK, _, _, _, _, mCuQ, mCuK, num_m_blocks, _, _ = tiles
        num_heads = mQ.shape[2]
        group = num_heads // mK.shape[2]
        num_batch = mQ.shape[3] if const_expr(not self.varlen) else mCuQ.shape[0] - 1
        # Default (LPT) order.
        per_m = num_heads * num_batch
        m_rev = t // per_m
        rest = t - m_rev * per_m
        batch = rest // num_heads
        head = rest - batch * num_heads
        if const_expr(self.l2_sections and not self.varlen):
            seqlen_k = mK.shape[0]
            kv_bytes = cutlass.max(seqlen_k * ((self.head_dim + self.head_dim_v) * 2), 1)
            wave_kv_heads = cutlass.min(
                cute.arch.grid_dim()[0] // group + 1, num_batch * mK.shape[2]
            )
            if wave_kv_heads * (kv_bytes // 1024) > WAVE_KV_LIMIT_KIB:
                per_batch = num_heads * num_m_blocks
                batch = t // per_batch
                r = t - batch * per_batch
                section = cutlass.min(cutlass.max(L2_KV_BUDGET // kv_bytes, 1) * group, num_heads)
                first_head = (r // (section * num_m_blocks)) * section
                heads_here = cutlass.min(section, num_heads - first_head)
                idx = r - first_head * num_m_blocks
                m_rev = idx // heads_here
                head = first_head + idx - m_rev * heads_here
        q_off = Int32(0)
        k_off = Int32(0)
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        m_blocks = num_m_blocks
        if const_expr(self.varlen):
            q_off = mCuQ[batch]
            k_off = mCuK[batch]
            seqlen_q = mCuQ[batch + 1] - q_off
            seqlen_k = mCuK[batch + 1] - k_off
            m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
            batch = Int32(0)  # the packed tensors' unit batch mode; the sequence is an offset
        m_block = m_rev
        if const_expr(self.causal):
            m_block = m_blocks - 1 - m_rev
        return m_rev < m_blocks, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k

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
    def _produce(self, tma_q, tma_k, tma_v, sQ, sK, sV, q_pipe, k_pipe, v_pipe, tiles):
        """Warp 0: per tile, the first key block's K and V, then Q (its buffer frees when the
        consumers finish the previous tile), then the other key blocks last to first."""
        mQ, mK, mVt, _, _, _, _, _, _, num_tiles, qgroup = tiles
        one = cute.make_layout(1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        t = cute.arch.block_idx()[0]
        step = cute.arch.grid_dim()[0]
        while t < num_tiles:
            valid, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k = self._tile(t, tiles)
            if valid:
                head_kv = head // (mQ.shape[2] // mK.shape[2])
                n_block_max, _ = self._key_blocks(
                    m_block * self.tile_m, (seqlen_q, qgroup), seqlen_k
                )
                gQ = self._views(mQ, head, batch, q_off, (self.tile_m, self.head_dim), (None, 0))
                gK = self._views(mK, head_kv, batch, k_off, (self.tile_n, self.head_dim), (None, 0))
                gV = self._views(
                    mVt, head_kv, batch, k_off, (self.head_dim_v, self.tile_n), (0, None), 1
                )
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
                )
                tKsK, tKgK = cpasync.tma_partition(
                    tma_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
                )
                tVsV, tVgV = cpasync.tma_partition(
                    tma_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
                )
                for i in cutlass.range(n_block_max, unroll=1):
                    n = n_block_max - 1 - i
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
                        # Q after the first K and V: they may land while the consumers finish
                        # the previous tile. Q is loaded even when no key block is visible.
                        self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
                        q_state.advance()
                if n_block_max == 0:
                    self._load_q(tma_q, tQgQ, tQsQ, q_pipe, q_state, m_block)
                    q_state.advance()
            t += step

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
        tma_o, scale_log2, tiles,
    ):  # fmt: skip
        """Consumer warpgroup `wg` (rows 64 wg .. 64 wg + 63 of each tile); tidx counts the
        consumer threads from 0."""
        mQ, _, _, mO_tma, mO, mLSE, _, _, _, num_tiles, qgroup = tiles
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
        # Score coordinates as thread 0's (static offsets) plus this thread's base: the mask
        # compares registers with constants instead of holding a coordinate per element.
        ident = cute.make_identity_tensor((self.tile_m, self.tile_n))
        t0ScS = _rows_cols(mma_qk.get_slice(0).partition_C(ident))
        base = mma_qk.get_slice(tidx).partition_C(ident)[0]
        tScS = (t0ScS, base[0], base[1])
        rows = cute.size(t0ScS, mode=[0])
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)
        rescale = cute.make_rmem_tensor(rows, Float32)

        # Ping-pong: warpgroup wg issues its WGMMAs only after waiting on barrier
        # SCHED_BARRIER + wg, then passes the turn to the next warpgroup, so one's softmax runs
        # while another's GEMMs hold the tensor cores. Each barrier counts the waiting
        # warpgroup and the one handing over; warpgroup 0 starts with an arrival of its own.
        my_turn = pipeline.NamedBarrier(
            barrier_id=SCHED_BARRIER + wg, num_threads=2 * THREADS_PER_WG
        )
        their_turn = pipeline.NamedBarrier(
            barrier_id=SCHED_BARRIER + (wg + 1) % self.num_wg, num_threads=2 * THREADS_PER_WG
        )
        if const_expr(self.pingpong):
            if wg == 0:
                my_turn.arrive()
        epilogue = pipeline.NamedBarrier(
            barrier_id=EPILOGUE_BARRIER, num_threads=self.num_mma_threads
        )

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        step_args = (
            mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale,
            tScS, k_pipe, v_pipe, scale_log2, my_turn, their_turn,
        )  # fmt: skip
        t = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]
        while t < num_tiles:
            valid, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k = self._tile(t, tiles)
            if valid:
                m0 = m_block * self.tile_m
                n_block_max, n_unmasked = self._key_blocks(m0, (seqlen_q, qgroup), seqlen_k)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                acc_O.fill(0.0)
                q_pipe.consumer_wait(q_state)
                kv = self._mainloop(
                    kv, m0, (seqlen_q, qgroup), seqlen_k, n_block_max, n_unmasked, *step_args
                )
                row_lse = self._finalize(acc_O, row_max, row_sum, scale_log2)
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
            t += grid
        if warp_idx == THREADS_PER_WG // 32:
            # The CTA may not exit (freeing sO) before the last store has read it.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _mainloop(
        self, kv, m0, seqlen_q, seqlen_k, n_block_max, n_unmasked, mma_qk, mma_pv, tSrQ, tSrK,
        tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale, tScS, k_pipe, v_pipe,
        scale_log2, my_turn, their_turn,
    ):  # fmt: skip
        """Key blocks last to first (the masked ones, diagonal and key bound, come first).
        Block n_block_max - 1 is a first half step (S, mask, softmax); each later step first
        lands the previous one (wait for its P V, P to 16 bits, O rescaled), then issues S of
        its block and P V of the block before, and runs the softmax of its S while that P V
        is on the tensor cores. A last P V closes the loop. Returns the K/V pipeline state."""
        a = (
            mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum, rescale,
            tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k, my_turn, their_turn,
        )  # fmt: skip
        if n_block_max > 0:
            self._first_block(kv, n_block_max - 1, *a)
            if const_expr(not self.overlap):
                self._land(kv, False, tOrP, acc_S, acc_O, rescale, v_pipe)
            # The first step has no P V in flight: its kv_pv release is skipped (pending 0).
            kv_pv = kv.clone()
            pending = Int32(0)
            n_rest = n_block_max - 1
            n_rest_unmasked = cutlass.min(n_unmasked, n_rest)
            for i in cutlass.range(n_rest - n_rest_unmasked, unroll=1):
                kv, kv_pv = self._step(kv, kv_pv, pending, n_rest - 1 - i, *a, True)
                pending = Int32(1)
            for i in cutlass.range(n_rest_unmasked, unroll=1):
                kv, kv_pv = self._step(kv, kv_pv, pending, n_rest_unmasked - 1 - i, *a, False)
                pending = Int32(1)
            if const_expr(self.overlap):
                self._land(kv_pv, pending, tOrP, acc_S, acc_O, rescale, v_pipe)
            if const_expr(self.late_rescale):
                self._rescale_o(acc_O, rescale)
            v_pipe.consumer_wait(kv)
            self._gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv.index], False, 0)
            v_pipe.consumer_release(kv)
            kv.advance()
        return kv

    @cute.jit
    def _land(self, kv_pv, pending, tOrP, acc_S, acc_O, rescale, v_pipe):
        """Wait for the P V in flight (its V stage `kv_pv` released if `pending`), then P in
        acc_S to 16 bits as the next P V's A operand, and O rescaled to the new row maxima."""
        self._wait_pv(kv_pv, pending, v_pipe)
        self._to_operand(acc_S, tOrP)
        if const_expr(not self.late_rescale):
            self._rescale_o(acc_O, rescale)

    @cute.jit
    def _wait_pv(self, kv_pv, pending, v_pipe):
        warpgroup.wait_group(0)
        if const_expr(isinstance(pending, bool)):
            if const_expr(pending):
                v_pipe.consumer_release(kv_pv)
        else:
            if pending != 0:
                v_pipe.consumer_release(kv_pv)

    @cute.jit
    def _to_operand(self, acc_S, tOrP):
        """P (fp32, in acc_S) to 16 bits in tOrP, the next P V's A operand. `cvt_asm`: one
        packed cvt per pair as inline PTX (the assembler then leaves the conversion in the
        softmax instead of moving it past the next turn's barrier, ahead of the GEMM issue)."""
        if const_expr(self.cvt_asm):
            src = _acc_as_operand_a(acc_S)
            dst = cute.recast_tensor(tOrP, Int32)
            bf16 = self.dtype is cutlass.BFloat16
            for i in cutlass.range_constexpr(cute.size(dst)):
                dst[i] = _cvt_pair(src[2 * i], src[2 * i + 1], bf16)
        else:
            tOrP.store(_acc_as_operand_a(acc_S).load().to(self.dtype))

    @cute.jit
    def _gemm(
        self, tiled_mma, acc, tA, tB, zero_init: cutlass.Constexpr[bool],
        wg_wait: cutlass.Constexpr[int],
    ):  # fmt: skip
        """One warpgroup's acc (+)= A B over all k-blocks, committed as one group; then waits
        until at most `wg_wait` groups are in flight (no wait if negative)."""
        warpgroup.fence()
        # A fresh atom per call: its ACCUMULATE field is set inside a dynamic loop.
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        if const_expr(wg_wait >= 0):
            warpgroup.wait_group(wg_wait)

    @cute.jit
    def _first_block(
        self, kv, n, mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O, row_max, row_sum,
        rescale, tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k, my_turn, their_turn,
    ):  # fmt: skip
        """Key block n, first half: S = Q K^T, mask, softmax; P (fp32) stays in acc_S. O is
        still 0, so its rescale factor does not matter."""
        k_pipe.consumer_wait(kv)
        self._gemm(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], True, 0)
        k_pipe.consumer_release(kv)
        self._mask(acc_S, tScS, n, m0, seqlen_q, seqlen_k)
        self._online_softmax(acc_S, row_max, row_sum, rescale, scale_log2)

    @cute.jit
    def _step(
        self, kv, kv_pv, pending, n, mma_qk, mma_pv, tSrQ, tSrK, tOrP, tOrV, acc_S, acc_O,
        row_max, row_sum, rescale, tScS, k_pipe, v_pipe, scale_log2, m0, seqlen_q, seqlen_k,
        my_turn, their_turn, masked: cutlass.Constexpr[bool],
    ):  # fmt: skip
        """acc_S holds P of the block at state `kv` (its V not yet used); if `pending`, the
        P V of block `kv_pv` is in flight. Land it, then issue S = Q K_n^T and O += P V_kv,
        and run the softmax of S_n under that P V. The wait for the P V sits at the top of the
        step, after the loop's back edge, so the assembler cannot hoist it above the softmax.
        Returns (state of block n, state of the block whose P V is now in flight). Without
        `overlap` the step lands its own P V after the softmax instead (the assembler then
        hoists that wait above the softmax: FA3's order as compiled)."""
        if const_expr(self.overlap):
            self._land(kv_pv, pending, tOrP, acc_S, acc_O, rescale, v_pipe)
        kv_s = kv.clone()
        kv_s.advance()
        k_pipe.consumer_wait(kv_s)
        if const_expr(self.pingpong):
            my_turn.arrive_and_wait()
        self._gemm(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_s.index], True, -1)
        if const_expr(self.late_rescale):
            # O's rescale under the S GEMM, right before the P V that accumulates onto it.
            self._rescale_o(acc_O, rescale)
        v_pipe.consumer_wait(kv)
        self._gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv.index], False, -1)
        if const_expr(self.pingpong):
            their_turn.arrive()
        # Groups retire in order: with one left in flight, S (committed first) is complete.
        warpgroup.wait_group(1)
        k_pipe.consumer_release(kv_s)
        if const_expr(masked):
            self._mask(acc_S, tScS, n, m0, seqlen_q, seqlen_k)
        self._online_softmax(acc_S, row_max, row_sum, rescale, scale_log2)
        if const_expr(not self.overlap):
            self._land(kv, True, tOrP, acc_S, acc_O, rescale, v_pipe)
        return kv_s, kv

    @cute.jit
    def _mask(self, acc_S, tScS, n, m0, sq, seqlen_k):
        """-inf where the key is past Sk or (causal) past the row's diagonal; sq = (rows,
        qgroup), row r being query r // qgroup."""
        seqlen_q, qgroup = sq
        t0ScS, row_base, col_base = tScS
        s = _rows_cols(acc_S)
        col0 = n * self.tile_n + col_base
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            limit = seqlen_k - col0  # first masked column, relative to the thread's first
            if const_expr(self.causal):
                query = (m0 + row_base + t0ScS[r, 0][0]) // qgroup
                limit = cutlass.min(limit, query + seqlen_k - seqlen_q // qgroup + 1 - col0)
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                if t0ScS[r, c][1] >= limit:
                    s[r, c] = -Float32.inf

    @cute.jit
    def _online_softmax(self, acc_S, row_max, row_sum, rescale, scale_log2):
        """S -> P = exp2(S scale_log2 - max scale_log2) in place; the row sums stay per thread
        (the quad's partial sums are added in `_finalize`). Sets each row's O rescale,
        exp2((old max - new max) scale_log2), applied once the P V in flight is done."""
        s = _rows_cols(acc_S)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            prev = row_max[r]
            # Four independent max / sum chains instead of one 64-long dependency chain.
            part = [prev] * 4
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                part[c % 4] = cute.arch.fmax(part[c % 4], s[r, c])
            cur = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
            cur = cute.arch.warp_reduction_max(cur, threads_in_group=4)  # the row's 4 threads
            if const_expr(self.rescale_threshold > 0.0):
                # Keep the running max unless the new one exceeds it by more than the
                # threshold (log2 units): P then stays below 2^threshold and O's rescale is
                # skipped (see `_rescale_o`). prev = -inf always takes the new max.
                if (cur - prev) * scale_log2 <= self.rescale_threshold:
                    cur = prev
            row_max[r] = cur
            # A row with no visible key so far keeps max -inf: subtract 0 instead, so that
            # exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
            cur_scaled = cur * scale_log2
            if cur == -Float32.inf:
                cur_scaled = Float32(0.0)
            rescale[r] = cute.math.exp2(prev * scale_log2 - cur_scaled, fastmath=True)
            part = [Float32(0.0)] * 4
            for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
                x = s[r, c] * scale_log2 - cur_scaled
                # `poly_exp` of every 8 columns take the FMA pipe, the rest the MUFU.
                if const_expr(c % 8 < self.poly_exp):
                    p = _exp2_fma(x)
                else:
                    p = cute.math.exp2(x, fastmath=True)
                s[r, c] = p
                part[c % 4] = part[c % 4] + p
            total = (part[0] + part[1]) + (part[2] + part[3])
            row_sum[r] = row_sum[r] * rescale[r] + total

    @cute.jit
    def _rescale_o(self, acc_O, rescale):
        o = _rows_cols(acc_O)
        if const_expr(self.rescale_threshold > 0.0):
            # Only when some row of the warp moved its max (a warp-uniform branch).
            moved = rescale[0] != 1.0
            for r in cutlass.range_constexpr(1, cute.size(o, mode=[0])):
                moved = moved or rescale[r] != 1.0
            if cute.arch.vote_any_sync(moved):
                for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                        o[r, c] = o[r, c] * rescale[r]
        else:
            for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
                for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                    o[r, c] = o[r, c] * rescale[r]

    @cute.jit
    def _finalize(self, acc_O, row_max, row_sum, scale_log2):
        """O /= rowsum; returns the rows' natural-log LSE (-inf, O = 0 for rows that saw no
        key)."""
        o = _rows_cols(acc_O)
        row_lse = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            inv = Float32(1.0)
            lse = -Float32.inf
            if total > 0.0:
                inv = cute.arch.rcp_approx(total)
                lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
            row_lse[r] = lse
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * inv
        return row_lse

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
            storer = warp_idx == THREADS_PER_WG // 32  # the first consumer warp
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
        tOcO = _rows_cols(
            mma_pv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_m, self.head_dim_v))
            )
        )
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(row_lse)):
                row = m0 + tOcO[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, q_off + row] = row_lse[r]
