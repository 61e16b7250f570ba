"""Implicit-GEMM convolution forward for Hopper (sm_90a): channels-last 3-D convolution
(a 2-D one is D = T = 1), fp32 accumulation.

    Y[n, z, p, q, k] = sum_{t, r, s, c} X[n, z*sd - pd + t*dd, p*sh - ph + r*dh,
                                           q*sw - pw + s*dw, c] * W[k, t, r, s, c]  (+ bias[k])

with zero outside X. As a GEMM: M = N x Z x P x Q output pixels (rows of Y seen as (M, K)),
N_gemm = K output channels, and a reduction over C x T x R x S. A k-tile is `tile_k` channels
of one filter tap; the k-tiles run channel block fastest, then S, R, T (W's memory order, so
that B's k-tile kt and A's k-tile kt name the same (c block, tap)).

Loads:
- A (activations), TMA in im2col mode: one box = `tile_m` consecutive output pixels (in
  N, Z, P, Q order, wrapping across rows, planes and images) x `tile_k` channels, read at the
  tap's offset (s, r, t) x dilation from each pixel's window corner. The descriptor's bounding
  box (corners = -padding below, padding - (F - 1) x dilation above) and traversal stride are
  the convolution's, so padding and ragged edges are the TMA's zero fill: no predicate in the
  kernel. Descriptor limits (rank 5): corners in [-16, 15], (F - 1) x dilation <= 31, stride
  <= 8 (`geometry.check_descriptor`).
- A at stride 1 (compile key `rect` = 8 or 16; any padding and dilation; not the data-gradient
  mode): an output tile is a rectangle of `rect` columns x tile_m / rect rows of one (image,
  output plane), Q's rectangles fastest, then P's, Z, N (`rect_index`, geometry.rect_origin), and A
  is a TILED box of X seen as ((W, H, D, N), C) at the rectangle shifted by the tap, (q0 + s x
  dil_w - pad_w, p0 + r x dil_h - pad_h, z + t x dil_d - pad_d, n) (`cute.domain_offset` on
  the coordinate tensor; coordinates below 0 or past the extents are the TMA's zero fill: the
  padding): no im2col rate. The box's rows are the rectangle's pixels, Q fastest, in the im2col
  box's staged layout (the same bytes: printed at trace time, `((8192,1),(1,6)):((1,0),
  (0,8192))` on both), so the consumers are unchanged; Y is seen as ((Q, P, Z, N), K) and each
  epilogue sub-tile stored as (rectangle, epi_n) (`_epilogue_rect`), the rows past P or Q
  clipped by the TMA store.
- B (filter W (K, T, R, S, C) seen as (K, (C, S, R, T))): tiled TMA, box tile_n x tile_k.

Warp roles and pipelines are the dense GEMM's (kernels/gemm/dense/sm90/kernel.py): warpgroup 0
is the producer (one warp issues TMA; setmaxnreg 40), warpgroups 1..min(tile_m, 128)/64 are
WGMMA consumers splitting the tile's rows (setmaxnreg 232). The AB ring is a `PipelineTmaAsync`
`stages` deep; the epilogue converts (tile_m, epi_n) sub-tiles (bias added in fp32 first),
writes them with `stmatrix` into the epilogue ring and TMA-stores them into Y seen as (M, K).
Persistent over the static tile schedule (kernels/common/sm90/scheduler/static.py); a cluster
multicasts each W tile to the CTAs along M (cluster_m) and each im2col tile to those along N
(cluster_n).

Geometry (padding below / above, stride, dilation, per D, H, W) arrives as run-time Int32s:
only the TMA descriptor depends on it, so one compiled kernel serves every layer. The filter
extents come from W's shape.

PDL (`pdl`, as the dense GEMM's, kernels/gemm/dense/sm90/kernel.py): every thread waits after
the barrier setup; `trigger` "top" (every standard build) issues launch_dependents there too,
"late" (opt-in, key ("pdl", "late")) has the consumer warpgroups issue it once their CTA's last
unit's mainloop is done (its WGMMAs waited for), before that unit's park or epilogue: a CTA's
first issue counts, and one that never issues it counts at its exit.

Split over the reduction (`per_split` k-tiles per part, a run-time value; one part: the whole
reduction): a problem of few output tiles (3x3 on 7 x 7 maps, 1x1 with a long C: a third of the
chip busy) cuts each tile's k-tiles into parts, scheduled as tiles of their own (the static
schedule's N axis is (split, N tile), split slowest, so the CTAs of a cluster along M share
their part); each part parks its fp32 accumulator and the last of a tile's parts sums them in
part order and runs the epilogue (kernels/common/sm90/splitk.py: deterministic, no waiting).
Not with cluster_n > 1 (its CTAs would straddle parts).

Data-gradient mode (`dgrad`, docs/conv/NOTES.md): the same kernel computes a phase of the data
gradient, dX_phase = conv(dY, W flipped, channels swapped), reading W (K, T, R, S, C) itself (a
strided view that names the phase's taps), no filter copy: B is W seen as (C, (K, S, R, T)),
N-major (C contiguous; 16-bit WGMMA reads a transposed B), and B's k-tiles walk the taps in
reverse, k-tile kt of A (channel block cb of dY, tap j) pairing with B's (cb, taps - 1 - j):
reversing T, R and S at once reverses the linear tap index.

Constraints: padding >= 0 (the launcher turns a data-gradient phase's negative padding into a
crop of the input); X (N, D, H, W, C), W (K, T, R, S, C) and Y (M, K) with C and K multiples of 8
(16-byte rows) and 16-byte aligned bases; Y compact (M = N x Z x P x Q rows of K) on the im2col
walk, any TMA-ready (N, Z, P, Q, K) view on the rectangles; tile_k = 64
(a last channel block that C does not fill is zero-filled); M and K ragged edges are clipped
by the TMA store. tile_m in {64, 128, 256} (256: tile_n <= 128, unsplit, forward only; two
consumer warpgroups of 128 rows each), tile_n in {64, 128, 256}.
"""

from __future__ import annotations

import math
from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import pdl, splitk
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.common.sm90.scheduler.static import StaticSchedule, StaticScheduler
from forgekernel.kernels.conv.sm90.config import ConvConfig
from forgekernel.kernels.conv.sm90.geometry import rect_shape
from forgekernel.kernels.conv.sm90.im2col import im2col_atom


@cute.jit
def rect_index(index, rects):
    """Rectangle `index`'s (image, output plane, rectangle row, rectangle column) for `rects` =
    (rectangles along Q, along P, output planes): Q's rectangles fastest, then P's, Z, N
    (geometry.rect_origin). The forward's M tiles and the weight gradient's k-tiles walk them."""
    per_q, per_p, planes = rects
    qt = index % per_q
    rest = index // per_q
    pt = rest % per_p
    rest = rest // per_p
    return rest // planes, rest % planes, pt, qt


def pixel_digits(m, extents):
    """Flat output pixel m as (q, p, z, n) over `extents` (Q, P, Z, N), Q fastest: three run-time
    divisions."""
    q = m % extents[0]
    rest = m // extents[0]
    p = rest % extents[1]
    rest = rest // extents[1]
    return q, p, rest % extents[2], rest // extents[2]


def at_pixel(tile, qpzn):
    """The im2col TMA's coordinate tile `tile` (inner ((Q, P, Z, N), (C, S, R, T)) -> the TMA's
    coordinates, o offset (flat pixel m, (c, s, r, t)), o the box) with its pixel given as the
    tuple `qpzn` (`pixel_digits` of the offset's m) and the box's pixels along q: the copy's
    coordinates then need no division (a flat m is decomposed by three at every copy)."""
    at = tile.layout
    box = at.outer
    box_qpzn = cute.make_layout(box.shape, stride=(((cute.E([1, 0]), cute.E([0, 0])), 0),))
    return cute.make_tensor(
        tile.iterator, cute.make_composed_layout(at.inner, (qpzn, at.offset[1]), box_qpzn)
    )


def sub_tile_value(e: int, v: int, shape, total: int) -> int:
    """The accumulator's (retiled, flat) value that is value v of epilogue sub-tile e, whose
    fragment has `shape` (copy values, M repeats, N) and the accumulator `total` values. The
    accumulator runs (every sub-tile's copy values, N then sub-tile; M repeats): one repeat
    (a 128-row tile) takes sub-tile e's values at e x their count, e x frag + v; a 256-row
    tile's second repeat (rows 128+) lies a whole repeat further. Trace-time ints; checked
    against the copy's coordinates by tests/test_conv_tall.py."""
    copy, repeats = cute.size(shape, mode=[0]), cute.size(shape, mode=[1])
    frag = cute.size(shape)
    m, n = v // copy % repeats, v // (copy * repeats)
    return m * (total // repeats) + e * (frag // repeats) + n * copy + v % copy


class Bar(IntEnum):
    EPILOGUE = FIRST_FREE  # the consumer threads around each epilogue sub-tile's TMA store


class ConvFpropSm90:
    """Persistent, warp-specialized im2col-TMA + WGMMA convolution; see the module docstring."""

    def __init__(
        self,
        config: ConvConfig,
        bias: bool = False,
        dgrad: bool = False,
        rect: int = 0,
        pdl: bool = True,
        trigger: str = "top",
    ):
        if config.tile_m not in (64, 128, 256):
            raise ValueError(f"tile_m must be 64, 128 or 256, got {config.tile_m}")
        if config.tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n must be 64/128/256, got {config.tile_n}")
        if config.tile_m == 256 and (config.tile_n > 128 or config.split or dgrad):
            # 256 x 256 would hold 256 fp32 accumulators a thread (spills); the split and the
            # data-gradient mode are not built with 256 rows (the tile is the forward's)
            raise ValueError("tile_m 256: tile_n <= 128, unsplit, forward only")
        if config.tile_k != 64:
            raise ValueError(f"tile_k must be 64 (128 bytes of 16 bits), got {config.tile_k}")
        if config.tile_n % config.epi_n or config.epi_n not in (32, 64):
            raise ValueError(f"epi_n must be 32 or 64 and divide tile_n, got {config.epi_n}")
        if config.cluster_m * config.cluster_n > 4:
            raise ValueError("a cluster holds at most 4 CTAs here")
        if config.split and config.cluster_n > 1:
            raise ValueError("a split reduction runs without im2col multicast (cluster_n = 1)")
        if dgrad and bias:
            raise ValueError("the data-gradient mode takes no bias")
        if trigger not in ("top", "late"):
            raise ValueError(f"trigger must be 'top' or 'late', got {trigger!r}")
        if trigger == "late" and not pdl:
            raise ValueError("the late trigger: a PDL build")
        self.cfg = config
        self.bias = bias
        self.dgrad = dgrad
        # launched as a programmatic dependent (the GEMM's module docstring, "pdl")
        self.pdl = pdl
        # launch_dependents at the top (every standard build) or by the consumer warpgroups
        # after the CTA's last mainloop (module docstring, "PDL")
        self.late_trigger = pdl and trigger == "late"
        self.acc_dtype = cutlass.Float32
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        # Two consumer warpgroups split a 128-row tile: one alone would hold a 128x256 fp32
        # accumulator in 256 registers per thread and spill (as in the GEMM). A 256-row tile
        # keeps the two, each two m64 atoms (rows 0-63 / 128-191 and 64-127 / 192-255: the
        # tiled MMA's 128 rows repeated, MMA_M = 2), 128 accumulators a thread as 128x256's
        # (docs/conv/NOTES.md, "256 x 128 for the K = 128 conv3d layers").
        self.atom_layout_mnk = (min(config.tile_m, 128) // 64, 1, 1)
        self.num_mma_wg = math.prod(self.atom_layout_mnk)
        self.num_mma_threads = self.num_mma_wg * THREADS_PER_WG
        self.threads_per_cta = (1 + self.num_mma_wg) * THREADS_PER_WG
        self.producer_regs = 40
        self.consumer_regs = 232
        # Channels are the contiguous dim of X, W and Y: A and Y are K-major, and so is B
        # except in the data-gradient mode, where W's contiguous channels are B's N.
        self.major = LayoutEnum.ROW_MAJOR
        self.b_major = LayoutEnum.COL_MAJOR if dgrad else LayoutEnum.ROW_MAJOR
        # stride 1: an output tile is a rectangle of `rect` columns x tile_m / rect rows of one
        # (image, plane) (Q, P, Z, N extents), A a tiled box of X at the tap's offset; 0: im2col
        self.rect = rect
        self.rect_shape = rect_shape(config.tile_m, rect) if rect else None

    # ---------------------------------------------------------------- host-side setup
    def _setup(self, dtype):
        cfg = self.cfg
        self.dtype = dtype
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.major.sm90_mma_major_mode(),
            self.b_major.sm90_mma_major_mode(),
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=(64, cfg.tile_n),
        )
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        self.mcast_a = cfg.cluster_n  # CTAs sharing one activation tile (same M rows)
        self.mcast_b = cfg.cluster_m  # CTAs sharing one filter tile (same output channels)
        self.epi_tile = (cfg.tile_m, cfg.epi_n)

        ab_bytes = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * dtype.width // 8
        epi_bytes = cfg.epi_stages * math.prod(self.epi_tile) * dtype.width // 8
        fit = (SMEM_CAPACITY - 1024 - epi_bytes) // ab_bytes
        self.stages = cfg.stages or fit
        if self.stages > fit or self.stages < 2:
            raise ValueError(f"{self.stages} stages of {ab_bytes} B do not fit in shared memory")
        self.stage_bytes = ab_bytes

        def staged(major, rows):
            k_major = major == LayoutEnum.ROW_MAJOR
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(major, dtype, cfg.tile_k if k_major else rows),
                dtype,
            )
            return cute.tile_to_shape(
                atom, (rows, cfg.tile_k, self.stages), order=(0, 1, 2) if k_major else (1, 0, 2)
            )

        self.sA_layout = staged(self.major, cfg.tile_m)
        self.sB_layout = staged(self.b_major, cfg.tile_n)
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.major, dtype, self.epi_tile[1]), dtype
        )
        self.sC_layout = cute.tile_to_shape(
            c_atom, (*self.epi_tile, cfg.epi_stages), order=(0, 1, 2)
        )

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mY: cute.Tensor,
        mBias: cute.Tensor | None,
        mWork: cute.Tensor | None,
        mFlags: cute.Tensor | None,
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
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mX (N, D, H, W, C), mW (K, T, R, S, C), mY (N x Z x P x Q, K), mBias (K,) or None
        (as compiled). Padding below / above, stride and dilation per (D, H, W). Split
        (`config.split`): `per_split` k-tiles per part, mWork fp32 (>= parts x tiles x tile_m x
        tile_n,) and mFlags int32 (>= tiles,) zero (left zero); otherwise None, None and any
        per_split."""
        self._setup(mX.element_type)
        geometry = (
            (pad_lo_d, pad_lo_h, pad_lo_w),
            (pad_hi_d, pad_hi_h, pad_hi_w),
            (stride_d, stride_h, stride_w),
            (dil_d, dil_h, dil_w),
        )
        taps = (mW.shape[1], mW.shape[2], mW.shape[3])  # (T, R, S)
        tma_a, tma_mA, tma_b, tma_mB, c_blocks = self._operands(mX, mW, taps, geometry)
        mC = mY
        epi_box = self.epi_tile
        rects = (1, 1, 1)  # the rectangles' grid (per Q, per P, Z); the im2col walk: none
        if cutlass.const_expr(self.rect):
            # Y (N, Z, P, Q, K) as ((Q, P, Z, N), K): a sub-tile is one rectangle x epi_n
            # channels, its rows the rectangle's pixels Q fastest (A's box order); rows past
            # P or Q are clipped by the TMA store
            mC = cute.make_tensor(mY.iterator, cute.select(mY.layout, mode=[3, 2, 1, 0, 4]))
            mC = cute.group_modes(mC, 0, 4)
            epi_box = (self.rect_shape, self.cfg.epi_n)
            rects = (
                cute.ceil_div(mY.shape[3], self.rect_shape[0]),
                cute.ceil_div(mY.shape[2], self.rect_shape[1]),
                mY.shape[1],
            )
            tiles_m = rects[0] * rects[1] * rects[2] * mY.shape[0]
            tiles_n = cute.ceil_div(mY.shape[4], self.cfg.tile_n)
        else:
            tiles_m = cute.ceil_div(mY.shape[0], self.cfg.tile_m)
            tiles_n = cute.ceil_div(mY.shape[1], self.cfg.tile_n)
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            mC,
            cute.slice_(self.sC_layout, (None, None, 0)),
            epi_box,
        )
        k_tiles = c_blocks * taps[0] * taps[1] * taps[2]
        parts = cutlass.Int32(1)
        if cutlass.const_expr(self.cfg.split):
            parts = cute.ceil_div(k_tiles, per_split)
        else:
            per_split = k_tiles
        # the N axis of the schedule: (N tile, part), the part slowest
        schedule = StaticSchedule(
            (tiles_m, tiles_n * parts),
            self.cluster_shape_mn,
            self.cfg.swizzle,
            self.cfg.raster_along_m,
        )

        self.shared_storage = self._shared_storage()
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_c,
            tma_mC,
            mBias,
            self.tiled_mma,
            self.cta_layout_mnk,
            self.sA_layout,
            self.sB_layout,
            self.sC_layout,
            schedule,
            (c_blocks, per_split, parts),
            (mWork, mFlags),
            ((tiles_m, tiles_n), rects, (taps, geometry[0], geometry[3])),
        ).launch(
            grid=schedule.grid(max_active_clusters),
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.pdl,
        )

    def _operands(self, mX, mW, taps, geometry):
        """(A's im2col atom and coordinate tensor, B's tiled atom and coordinate tensor, B's
        channel blocks per tap) for activations mX, filter mW, the im2col walk's filter `taps`
        (T, R, S) and `geometry` (its padding below / above, stride, dilation). Rectangles
        (stride 1): A's atom is tiled over X (N, D, H, W, C) seen as ((W, H, D, N), C), a box one
        rectangle x tile_k channels in the im2col box's staged layout (the same smem bytes:
        pixels as rows, Q fastest, channels swizzled), moved per k-tile to the rectangle's
        corner shifted by the tap (`_produce`)."""
        if cutlass.const_expr(self.rect):
            mA = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[3, 2, 1, 0, 4]))
            mA = cute.group_modes(mA, 0, 4)
            tma_a, tma_mA = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SMulticastOp()
                if self.mcast_a > 1
                else cpasync.CopyBulkTensorTileG2SOp(),
                mA,
                cute.slice_(self.sA_layout, (None, None, 0)),
                (self.rect_shape, self.cfg.tile_k),
                num_multicast=self.mcast_a,
            )
        else:
            tma_a, tma_mA = im2col_atom(
                mX,
                taps,
                geometry,
                cute.slice_(self.sA_layout, (None, None, 0)),
                (self.cfg.tile_m, self.cfg.tile_k),
                self.mcast_a,
            )
        # W (K, T, R, S, C) as (K, (C, S, R, T)): the k-tiles' order, channel block fastest;
        # data gradient: as (C, (K, S, R, T)), C (B's N) contiguous.
        modes = [4, 0, 3, 2, 1] if cutlass.const_expr(self.dgrad) else [0, 4, 3, 2, 1]
        mB = cute.make_tensor(mW.iterator, cute.select(mW.layout, mode=modes))
        mB = cute.group_modes(mB, 1, 5)
        # B's k-tiles per tap (the reduction's channel blocks; dgrad: reversed tap order)
        c_blocks = cute.ceil_div(mB.shape[1][0], self.cfg.tile_k)
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if self.mcast_b > 1
            else cpasync.CopyBulkTensorTileG2SOp(),
            mB,
            cute.slice_(self.sB_layout, (None, None, 0)),
            (self.cfg.tile_n, (self.cfg.tile_k,)),
            num_multicast=self.mcast_b,
        )
        return tma_a, tma_mA, tma_b, tma_mB, c_blocks

    def _shared_storage(self):
        """The CTA's shared memory: the AB ring's barriers, the split's flag, the staged A and B
        tiles and the epilogue ring. (Its fields' types are given evaluated: this module's
        annotations are strings, which `cute.struct` does not resolve outside a traced
        function.)"""

        def staged(layout):
            return cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]

        fields = {
            "ab_barriers": cute.struct.MemRange[cutlass.Int64, self.stages * 2],
            "split_last": cute.struct.MemRange[cutlass.Int32, 2],
            "sA": staged(self.sA_layout),
            "sB": staged(self.sB_layout),
            "sC": staged(self.sC_layout),
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

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
        mBias: cute.Tensor | None,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        schedule: StaticSchedule,
        k_walk: tuple,
        split_io: tuple,
        walk: tuple,
    ):
        """`k_walk`: (channel blocks per tap, k-tiles per part, parts); `split_io`: the split's
        (workspace, flags) or (None, None); `walk`: ((M tiles, N tiles), the rectangles' grid
        (per Q, per P, Z), the taps' offsets ((T, R, S), padding below, dilation))."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        cluster_coord, masks, storage, ab_pipe = self._ring(cta_layout_mnk)
        sA = smem_tensor(storage.sA, sA_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sC = smem_tensor(storage.sC, sC_layout)

        # (bM, bK, tiles_m, k-tiles ((C blocks), S, R, T)), (bN, bK, tiles_n, k-tiles)
        tiler_k = (self.cfg.tile_k,)
        gB = cute.local_tile(mB, (self.cfg.tile_n, tiler_k), (None, None))
        k_tiles = cute.size(gB, mode=[3])
        tiles_mn, rects, offsets = walk
        if cutlass.const_expr(self.rect):
            # the coordinate tensors themselves: a box is placed per tile and k-tile
            gA, gC = mA, mC
        else:
            gA = cute.local_tile(mA, (self.cfg.tile_m, tiler_k), (None, None))
            gC = cute.local_tile(mC, (self.cfg.tile_m, self.cfg.tile_n), (None, None))
        c_blocks, per_split, parts = k_walk
        # (k-tiles, k-tiles per part, N tiles): a unit's part and its k-tiles (`_unit`)
        units = (k_tiles, per_split, tiles_mn[1])

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma = tiled_mma.get_slice((wg_idx - 1) * THREADS_PER_WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        tile_mn = cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(tile_mn).shape, self.acc_dtype)

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
                if cutlass.const_expr(self.rect):
                    # A's boxes are placed per k-tile (`_load_a_rect`)
                    load_a = (tma_a, mA, sA, masks[0], cluster_coord[1])
                self._produce(
                    load_a, load_b, ab_pipe, schedule, (units, c_blocks), (rects, offsets)
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma = (tiled_mma, tCrA, tCrB, acc)
            split = (*split_io, storage.split_last.get_tensor(cute.make_layout(2)), parts)
            out = (sC, gC, tma_c, mBias, tiles_mn[0], rects)
            self._consume(tidx, warp_idx, mma, ab_pipe, out, schedule, (units, split))

    def _ring(self, cta_layout_mnk):
        """Device side, every thread: (this CTA's coordinate in its cluster, the A and B
        multicast masks, the shared storage, the AB ring); `init_arrive` done (`init_wait`
        must follow before the ring is used)."""
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
        a_mask = a_mask if self.mcast_a > 1 else 0
        b_mask = b_mask if self.mcast_b > 1 else 0

        storage = SmemAllocator().allocate(self.shared_storage)
        # Each consumer warp releases a stage to every CTA that multicast into it.
        consumer_arrivals = (self.mcast_a + self.mcast_b - 1) * (self.num_mma_threads // 32)
        ab_pipe = tma_pipeline(
            storage.ab_barriers,
            self.stages,
            self.stage_bytes,
            consumer_arrivals,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
        )
        init_arrive(self.cluster_shape_mn)
        return cluster_coord, (a_mask, b_mask), storage, ab_pipe

    def _loads(self, a, b, cluster_coord, cta_layout_mnk, masks):
        """The producer warp's (atom, global tiles, smem stages, multicast mask) of A and B:
        `a`, `b` = (atom, gA / gB, sA / sB). Rectangles: A's (None: placed per k-tile)."""
        (tma_a, gA, sA), (tma_b, gB, sB) = a, b
        tAsA = tAgA = None
        if cutlass.const_expr(not self.rect):
            tAsA, tAgA = cpasync.tma_partition(
                tma_a,
                cluster_coord[1],
                cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
                cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
        tBsB, tBgB = cpasync.tma_partition(
            tma_b,
            cluster_coord[0],
            cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )
        return (tma_a, tAgA, tAsA, masks[0]), (tma_b, tBgB, tBsB, masks[1])

    @cute.jit
    def _unit(self, tile_ns, units):
        """A work unit's (N tile, part, first k-tile, k-tiles) from its schedule column
        `tile_ns` = part x N tiles + N tile."""
        k_tiles, per_split, tiles_n = units
        tile_n = tile_ns % tiles_n
        part = tile_ns // tiles_n
        k0 = part * per_split
        return tile_n, part, k0, cutlass.min(k0 + per_split, k_tiles) - k0

    @cute.jit
    def _produce(self, load_a, load_b, ab_pipe, schedule, k_walk, rect_walk):
        """The producer warp: every k-tile of A and B of each of the CTA's tiles into the ring.
        `k_walk`: (k-tiles, channel blocks per tap); `rect_walk`: (the rectangles' grid, the
        taps' offsets ((T, R, S), padding below, dilation)).

        A k-tile is named by its coordinate (channel block, s, r, t) in the k-tile mode of A's
        and B's coordinate tensors, kept by an odometer (channel block fastest, then S, R, T):
        a flat k-tile index there costs the producer thread a chain of run-time divisions per
        k-tile (the tensors' (C blocks, S, R, T) shapes are dynamic; ~270 instructions and
        seven I2F / MUFU.RCP / F2I divisions a k-tile in the 128x128 build), longer than a
        128x128 k-tile's multiply-adds (docs/conv/NOTES.md, "The producer's k-tile walk")."""
        tma_b, tBgB, tBsB, b_mask = load_b
        units, c_blocks = k_walk
        taps_t, taps_r, taps_s = rect_walk[1][0]
        prod = producer_state(self.stages)
        sched = StaticScheduler(schedule)
        work = sched.first()
        while sched.valid(work):
            tile_m, tile_ns = sched.tile(work)
            tile_n, _, k0, count = self._unit(tile_ns, units)
            corner = qpzn = None
            if cutlass.const_expr(self.rect):
                corner = self._rect(tile_m, rect_walk[0])
            else:
                # A's tile's first pixel as (q, p, z, n): divisions once per unit, not per copy
                first = load_a[1][(None, tile_m, (0, 0, 0, 0))]
                qpzn = pixel_digits(first.layout.offset[0], first.layout.inner.shape[0])
            # the part's first k-tile k0 as (cb, s, r, t): divisions once per unit
            cb = k0 % c_blocks
            j = k0 // c_blocks
            s_ = j % taps_s
            r_ = (j // taps_s) % taps_r
            t_ = j // (taps_s * taps_r)
            for _ in range(count):
                crd = (cb, s_, r_, t_)
                # B's k-tile: A's, or with the taps reversed (dgrad) the same channel block of
                # tap (taps - 1 - j): reversing T, R and S at once reverses the linear tap
                crd_b = crd
                if cutlass.const_expr(self.dgrad):
                    crd_b = (cb, taps_s - 1 - s_, taps_r - 1 - r_, taps_t - 1 - t_)
                ab_pipe.producer_acquire(prod)
                bar = ab_pipe.producer_get_barrier(prod)
                if cutlass.const_expr(self.rect):
                    self._load_a_rect(load_a, corner, crd, rect_walk[1], bar, prod)
                else:
                    tma_a, tAgA, tAsA, a_mask = load_a
                    cute.copy(
                        tma_a,
                        at_pixel(tAgA[(None, tile_m, crd)], qpzn),
                        tAsA[(None, prod.index)],
                        tma_bar_ptr=bar,
                        mcast_mask=a_mask,
                    )
                cute.copy(
                    tma_b,
                    tBgB[(None, tile_n, crd_b)],
                    tBsB[(None, prod.index)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mask,
                )
                ab_pipe.producer_commit(prod)
                prod.advance()
                cb += 1
                if cb == c_blocks:
                    cb = cutlass.Int32(0)
                    s_ += 1
                    if s_ == taps_s:
                        s_ = cutlass.Int32(0)
                        r_ += 1
                        if r_ == taps_r:
                            r_ = cutlass.Int32(0)
                            t_ += 1
            work = sched.next(work)
        ab_pipe.producer_tail(prod)

    def _load_a_rect(self, load_a, corner, crd, offsets, bar, prod):
        """A's k-tile `crd` = (channel block cb, tap (s, r, t)) of the rectangle at `corner`
        (n, z, p0, q0): the box of X ((W, H, D, N), C) at (q0 + s x dil_w - pad_w, p0 + r x
        dil_h - pad_h, z + t x dil_d - pad_d, n) and channel cb x tile_k, placed by
        `cute.domain_offset` on the coordinate tensor (coordinates below 0 or past the extents:
        the TMA's zero fill, the padding); a cluster's CTAs along N each load a slice,
        multicast to all."""
        tma_a, mA, sA, a_mask, rank = load_a
        cb, s_, r_, t_ = crd
        _, pad, dil = offsets
        n, z, p0, q0 = corner
        origin = (
            (q0 + s_ * dil[2] - pad[2], p0 + r_ * dil[1] - pad[1], z + t_ * dil[0] - pad[0], n),
            cb * self.cfg.tile_k,
        )
        gA = cute.local_tile(
            cute.domain_offset(origin, mA), (self.rect_shape, self.cfg.tile_k), (0, 0)
        )
        tAsA, tAgA = cpasync.tma_partition(
            tma_a,
            rank,
            cute.make_layout(self.mcast_a),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        cute.copy(tma_a, tAgA, tAsA[(None, prod.index)], tma_bar_ptr=bar, mcast_mask=a_mask)

    @cute.jit
    def _rect(self, tile, rects):
        """Rectangle `tile`'s (image, output plane, first row, first column) in pixels."""
        n, z, pt, qt = rect_index(tile, rects)
        return n, z, pt * self.rect_shape[1], qt * self.rect_shape[0]

    @cute.jit
    def _consume(self, tidx, warp_idx, mma, ab_pipe, out, schedule, k_split):
        """The consumer warpgroups: each unit's mainloop; split, the part parked and, by the
        tile's last part, all of them summed; then the bias and the epilogue. `out`: (sC, gC,
        the store atom, bias); `k_split`: (units, (workspace, flags, the shared flag, parts))."""
        tiled_mma, tCrA, tCrB, acc = mma
        sC, gC, tma_c, mBias, tiles_m, rects = out
        units, (mWork, mFlags, s_last, parts) = k_split
        # M tiles padded to whole clusters: the schedule's last cluster may hold a tile past M
        # (it loads zeros and stores nothing), whose split parts need a flag of their own
        cm = self.cfg.cluster_m
        tiles_m = cute.ceil_div(tiles_m, cm) * cm
        tiles = tiles_m * units[2]
        epi_barrier = named_barrier(Bar.EPILOGUE, self.num_mma_threads)
        read = consumer_state(self.stages)
        release = consumer_state(self.stages)

        # Epilogue: registers -> stmatrix -> swizzled smem ring -> TMA store.
        r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC = self._staging(tidx, tiled_mma, sC, acc)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        )
        epi = (r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC, store_pipe, epi_barrier)
        # This thread's accumulator columns within a tile (bias): the thread's own slice of the
        # MMA, not the warpgroup's `thr_mma` (whose C partition is its first thread's: the FP8
        # GEMM's scale rows were wrong that way, kernels/gemm/fp8/sm90/kernel.py).
        own = tiled_mma.get_slice(tidx - THREADS_PER_WG)
        cols = own.partition_C(cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n)))
        tiles_done = cutlass.Int32(0)  # this CTA's tiles so far: the epilogue ring's position
        sched = StaticScheduler(schedule)
        work = sched.first()
        while sched.valid(work):
            tile_m, tile_ns = sched.tile(work)
            work = sched.next(work)
            read, release, tiled_mma = self._mainloop(
                self._unit(tile_ns, units)[3], tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release
            )
            if cutlass.const_expr(self.late_trigger):
                if work >= schedule.blocks:  # the CTA's last unit (`sched.valid`)
                    pdl.launch_dependents(True)
            tile_n, part, _, _ = self._unit(tile_ns, units)
            last = cutlass.Boolean(True)
            if cutlass.const_expr(self.cfg.split):
                if parts > 1:
                    thread = tidx - THREADS_PER_WG
                    tile = tile_n * tiles_m + tile_m
                    where = (part * tiles + tile, tile, parts)
                    threads = self.num_mma_threads
                    last = splitk.park(
                        acc, mWork, mFlags, where, threads, thread, epi_barrier, s_last
                    )
                    if last:
                        splitk.sum_parts(acc, mWork, (tile, tiles, parts), threads, thread)
            if last:
                if cutlass.const_expr(self.bias):
                    self._add_bias(acc, cols, mBias, tile_n)
                if cutlass.const_expr(self.rect):
                    corner = self._rect(tile_m, rects)
                    self._epilogue_rect(gC, corner, tile_n, tma_c, sC, epi, warp_idx, tiles_done)
                else:
                    gC_tile = gC[(None, None, tile_m, tile_n)]
                    self._epilogue(gC_tile, tma_c, sC, epi, warp_idx, tiles_done)
                tiles_done += 1
        store_pipe.producer_tail()

    def _staging(self, tidx, tiled_mma, sC, acc):
        """The epilogue's stmatrix path: (the copy, this thread's epilogue-ring partition, the
        accumulator retiled to it, fp32 and 16-bit fragments of one sub-tile)."""
        r2s = self._r2s(tiled_mma)
        thr_r2s = r2s.get_slice(tidx - THREADS_PER_WG)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = r2s.retile(acc)
        rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_rAcc = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
        tRS_rC = cute.make_rmem_tensor(rC_shape, self.dtype)
        return r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC

    def _r2s(self, tiled_mma):
        """The epilogue's stmatrix copy of the accumulator into a (tile_m, epi_n) sub-tile."""
        r2s_atom = sm90_utils.sm90_get_smem_store_op(
            self.major, elem_ty_d=self.dtype, elem_ty_acc=self.acc_dtype
        )
        stm_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        return cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))

    def _stage(self, epi, e: int, buf):
        """Sub-tile e of the accumulator, converted, into epilogue-ring buffer `buf` (stmatrix;
        generic-proxy writes)."""
        r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC = epi[:5]
        frag = cute.size(tRS_rAcc)
        for v in range(frag):  # unrolled at trace time (a plain method: no preprocessor)
            tRS_rAcc[v] = tRS_acc[sub_tile_value(e, v, tRS_rAcc.shape, cute.size(tRS_acc))]
        tRS_rC.store(tRS_rAcc.load().to(self.dtype))
        cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])

    @cute.jit
    def _add_bias(self, acc, cols, mBias, tile_n):
        """acc[., j] += bias[j] for this thread's columns j of output-channel tile `tile_n`;
        columns past K (a ragged last tile, never stored) read bias[K - 1]."""
        n0 = tile_n * self.cfg.tile_n
        last = mBias.shape[0] - 1
        for v in cutlass.range_constexpr(cute.size(acc)):
            col = cutlass.min(n0 + cols[v][1], last)
            acc[v] = acc[v] + mBias[col].to(self.acc_dtype)

    @cute.jit
    def _mainloop(self, k_tiles, tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release):
        """acc = this tile's A W^T over all k-tiles, one WGMMA batch kept in flight and the stage
        behind it released. Returns the states (a helper's attribute updates would not leave the
        caller's dynamic loop otherwise). k_tiles >= 1: the launcher never runs C = 0."""
        k_blocks = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        for kt in range(k_tiles):
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
        ab_pipe.consumer_release(release)
        release.advance()
        return read, release, tiled_mma

    @cute.jit
    def _epilogue(self, gC_tile, tma_c, sC, epi, warp_idx, tiles_done):
        """acc -> Y, one (tile_m, epi_n) sub-tile at a time through the epilogue ring."""
        store_pipe, epi_barrier = epi[5:]
        gC_t = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sC, bSG_gC = cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_t
        )
        epi_count = cute.size(gC_t, mode=[1])
        epi_grid = cute.make_layout(gC_t.shape[1], stride=(gC_t.shape[1][1], 1))
        done_before = tiles_done * epi_count
        store_warp = THREADS_PER_WG // 32  # the first consumer warp issues the TMA stores
        for e in cutlass.range_constexpr(epi_count):
            buf = (done_before + e) % self.cfg.epi_stages
            self._stage(epi, e, buf)
            # stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                gmem_crd = epi_grid.get_hier_coord(e)
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, gmem_crd)])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_barrier.arrive_and_wait()

    @cute.jit
    def _epilogue_rect(self, mC, corner, tile_n, tma_c, sC, epi, warp_idx, tiles_done):
        """acc -> Y seen as ((Q, P, Z, N), K), one (rectangle, epi_n) sub-tile at a time through
        the epilogue ring: sub-tile e is channels tile_n x tile_n + e x epi_n.. of the rectangle
        at `corner` (n, z, p0, q0), its rows the rectangle's pixels Q fastest (the order A's box
        gave the accumulator's rows); rows past P or Q and channels past K clipped by the TMA."""
        store_pipe, epi_barrier = epi[5:]
        n, z, p0, q0 = corner
        epi_count = self.cfg.tile_n // self.cfg.epi_n
        done_before = tiles_done * epi_count
        store_warp = THREADS_PER_WG // 32  # the first consumer warp issues the TMA stores
        for e in cutlass.range_constexpr(epi_count):
            buf = (done_before + e) % self.cfg.epi_stages
            self._stage(epi, e, buf)
            # stmatrix writes are generic-proxy; the TMA store reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_barrier.arrive_and_wait()
            if warp_idx == store_warp:
                origin = ((q0, p0, z, n), tile_n * self.cfg.tile_n + e * self.cfg.epi_n)
                gSub = cute.local_tile(
                    cute.domain_offset(origin, mC), (self.rect_shape, self.cfg.epi_n), (0, 0)
                )
                bSG_sC, bSG_gC = cpasync.tma_partition(
                    tma_c,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sC, 0, 2),
                    cute.group_modes(gSub, 0, 2),
                )
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC)
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            epi_barrier.arrive_and_wait()
