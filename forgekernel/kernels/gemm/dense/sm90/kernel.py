"""Dense 16-bit (and block-scaled FP8) GEMM for Hopper (sm_90a): C = A @ B^T, fp32
accumulation.

Persistent and warp-specialized; one CTA = 1 + W warpgroups, W = tile_m / 64 consumers that
split the M rows of each tile (cooperative). Every warpgroup walks the same static persistent
tile schedule (kernels/common/sm90/scheduler/static.py).

Warp roles:
- producer, warp 0 of warpgroup 0 (setmaxnreg 40; the group's other warps have no work): TMA
  loads of A and B k-tiles into the AB ring (FP8: and the k-tile's row scales, below; with
  `scale_warp` warp 1 stages the scales). With a
  cluster, each A tile is multicast to the cluster's CTAs along N (same M rows) and each B tile
  to those along M (same N columns).
- consumers, warpgroups 1..W (setmaxnreg 232): WGMMA (both operands from shared memory) into
  fp32 registers, one k-tile batch kept in flight and the stage behind it released; then the
  epilogue converts each (tile_m, epi_n) sub-tile, writes it with `stmatrix` into the epilogue
  ring and TMA-stores it, while the producer already streams the next tile's operands.

Pipelines:
- AB ring (`PipelineTmaAsync`, `stages` deep, as many as fit): full barriers count the TMA
  bytes of A + B (FP8: and one arrival per producer lane, `_load`); empty barriers take one
  arrival per consumer warp and CTA that multicast into the stage (FP8: and one per local
  consumer thread, `_retire`).
- epilogue ring (`PipelineTmaStore`, `epi_stages` deep): one TMA-store commit group per
  sub-tile. Named barrier `Bar.EPILOGUE` (all consumer threads), twice per sub-tile: the
  `stmatrix` writes are in shared memory before the store warp's TMA store reads them, and
  nobody writes the next buffer before the store warp has seen its last store read it.

Stream K (`stream_k`, plan.py): the work units are the static schedule's cluster blocks
(cluster_m x cluster_n tiles; 1x1: tiles), and a k-iteration is one k-tile of a block, which
every CTA of the cluster computes on its own tile of the block: the CTAs of a cluster load the
same k-tiles, so the multicast stays as in the tiled walk (a CTA whose tile lies past M or N
computes zeros, parks and stores nothing). The first `dp_blocks` blocks run whole, in the tiled
order (cluster z: blocks z, z + P, ... of a P-cluster grid); the k-iterations of the others,
block after block, are cut into equal ranges of `per_cta` (chosen by the launcher), one per
cluster; a CTA walks its range as units, each the part of one tile it covers. A unit that
covers its whole tile runs the epilogue directly. Otherwise it parks its fp32 accumulator in
the workspace (slot (2z) S + r for the first unit of cluster z's CTA of rank r, (2z + 1) S + r
for its last, S CTAs a cluster; register-fragment order: each thread writes, and the reducer's
same thread reads, its own 16-byte vectors) and counts itself in the tile's flag (fetch-add,
acquire-release); the unit that arrives last sums every part of the tile from the workspace in
k order (deterministic), clears the flag for the next launch and runs the epilogue. Nobody
waits on another CTA. Parking, counting and summing are the toolkit's split-K protocol
(kernels/common/sm90/splitk.py, the convolutions' too). For problems whose tiles do not fill
the chip in whole waves (decode: M <= 64 against a weight; prefill tiles that leave the last
wave mostly empty).

Ragged edges: the last tile row (column) of an M (N) that is no tile multiple starts at
M - tile_m (N - tile_n) instead, so that its TMA boxes stay in bounds (a box reaching past the
tensor, zero-filled, streams at about half speed); it recomputes rows (columns) of the tile
before it and writes them with the same values. Not for stream K (differently summed
overlaps), nor along N for FP8 (B's scale blocks stay aligned).

`a_rows` < tile_m: A's TMA box covers only the first a_rows rows of each stage (M <= a_rows,
decode); WGMMA still reads tile_m rows, the rest stale shared memory whose accumulator rows are
never stored. The box no longer reads past M (zero fill) and each stage moves fewer bytes.

Block-scaled FP8 (`forgekernel.gemm_fp8`, the `gemm_fp8_sm90` leaf): A and B float8_e4m3fn,
tile_k = 128 = the scale block; mSFA (M, K/128) fp32 per 1x128 group of A, mSFB
(ceil(N/128), K/128) per 128x128 block of B. Each k-tile's WGMMAs accumulate into a fresh fp32
fragment, which is added into the tile's accumulator times its rows' scales and its block of
B's (the tensor core's FP8 accumulation keeps ~14 bits: promoted every 128 of K). The producer
warp stages each k-tile's tile_m row scales (A's x B's, fp32) in shared memory with the stage,
published by the stage's full barrier (`_load`): the consumers read two of them per k-tile
(LDS) after their wait, no global load on their path. `scale_warp`: the producer warpgroup's
warp 1 loads and stages the scales and warp 0 issues only the TMA loads (the 16-bit producer's
loop), so that no k-tile's TMA waits on a scale load (with one warp a k-tile's TMA follows its
scales' LDG, which misses the L1 every 8 k-tiles K-major). mSFA is read K-major (any strides, a
lane's rows 32 apart) or, `scale_mn_major`, M-major (unit stride along M, the launcher's
contract: a lane's tile_m / 32 rows in one vector load). Two per-k-tile
fragments alternate: k-tile j's WGMMAs are issued before k-tile j - 1's fragment is waited for
and promoted, so every warpgroup keeps one WGMMA batch queued on the tensor pipe through its
promotion FFMAs (with one fragment the pipe idled through them: wait, promote, issue). Three
tile_n / 2 fp32 fragments per thread: tile_n <= 128 (its N edge is not moved back, the blocks
stay aligned). A tile_n dividing 128 keeps a tile inside one block of B's scales; any other
(48, 80, 96, 112: docs/gemm/NOTES.md "Narrow full-K FP8 tiles") may straddle two, so the
producer stages two products a row and k-tile (A's x each block's of B, the second block
clamped to N's last) and the promotion picks one per 8-column group: groups from 128 - the
tile's first column mod 128 on take the second (a per-tile bound, warp-uniform; the tiled walk
only). B "nk" only (8-bit WGMMA operands are K-major). Stream K as above (each unit's promoted
fp32 partial is what is parked and summed).

Masked grouped layout (`masked=True`, the `gemm_fp8_masked_sm90` kernel: MoE decode, DeepGEMM's
masked layout), FP8 only, no clusters: A (max_m, K, E), B (N, K, E), C (max_m, N, E) and the
scales (max_m, K/128, E), (N/128, K/128, E), mGroup int32 (E,) each expert's row count, read
on the device. Every role walks the same sequence of the counted tiles (`masked.py`: expert,
then n-tile, then m-tile of a_rows rows, else tile_m; CTA z takes tiles z, z + P, ...), so
tiles past a count are never loaded, computed or stored and the work is balanced whatever the
counts. A's TMA box clips at max_m (a short last expert reads zeros); a row's scale index is
clamped to the expert's last counted row. A tile of tile_m counted rows is stored through the
epilogue ring and TMA; any other from registers, its rows past the count skipped (each
thread's two-column bf16 pairs, one predicate per row): rows past a count are never written.

Programmatic dependent launch (`pdl`, on in every standard build: kernels/common/sm90/pdl.py
has the contract, runtime/pdl.py the switch and the keys): launched with the programmatic-
stream-serialization attribute, every thread waits (`griddepcontrol.wait`) after the barrier
setup and before its role starts, i.e. before any global access (the tensor-map prefetch and
the shared-memory setup run under the previous kernel's tail), and triggers its dependents
there: the next launch's CTAs take the SMs this grid's CTAs leave and run their own setup
while its last tiles finish. Built with pdl "off", the kernel as it was. `trigger` "late"
(opt-in, key ("pdl", "late"); the tiled and stream-K walks): the trigger moves to the consumer
warpgroups once their CTA's last unit's mainloop is done (its WGMMAs waited for), before that
tile's epilogue, as CUTLASS's sm90 kernels place it: the dependent's CTAs are scheduled only
once every CTA of this grid is in its last epilogue (a CTA's first launch_dependents counts, the
PTX ISA's griddepcontrol: the producer warp never issues one). The wait stays at the top.

Constraints: A (M, K) K-major; B (N, K) K-major ("nk") or (K, N) N-major ("kn"); C (M, N)
row-major, or M-major (the launcher's swap, C^T = B A^T: C the transpose of a row-major
output, written in 64 x epi_n boxes); every leading stride a multiple of 8 elements (16 bytes,
TMA) and base addresses 16-byte aligned. M, N, K are dynamic; ragged edges are handled by TMA
bounds (zero-filled loads, clipped stores); K > 0. tile_m in {64, 128, 192} (W = 1, 2, 3
consumer warpgroups; setmaxnreg gives them 232 registers a thread up to W = 2, 152 at 3),
tile_n a multiple of 8 from 16 to 256 (one off a multiple of 16: B "nk", unmasked, cluster_m 1;
FP8: up to 128, a width not dividing 128 over two blocks of B's scales, tile.py `straddles`),
epi_n 8, 16, 32 or 64 dividing tile_n, tile_k = 64 (FP8: 128).
"""

from __future__ import annotations

import math
from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import pdl, splitk
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
)
from forgekernel.kernels.common.sm90.scheduler.static import StaticSchedule, StaticScheduler
from forgekernel.kernels.gemm.dense.sm90.masked import MaskedWalk
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig, ring_stages, straddles


class Bar(IntEnum):
    EPILOGUE = FIRST_FREE  # the consumer threads around each epilogue sub-tile's TMA store


class GemmSm90:
    """Persistent, warp-specialized TMA + WGMMA GEMM; see the module docstring."""

    def __init__(
        self,
        config: GemmConfig,
        b_kn: bool = False,
        masked: bool = False,
        pdl: bool = True,
        trigger: str = "top",
    ):
        if config.tile_m not in (64, 128, 192):
            raise ValueError(f"tile_m must be 64, 128 or 192, got {config.tile_m}")
        if config.tile_n % 8 or not 16 <= config.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 8 from 16 to 256, got {config.tile_n}")
        if config.tile_n % 16 and (b_kn or masked or config.cluster_m > 1):
            # B's ring takes tile_n + 8 rows (`_setup`): K-major only, its box not split
            raise ValueError("tile_n past a multiple of 16 takes B 'nk', unmasked, cluster_m 1")
        if config.tile_k not in (64, 128):
            raise ValueError(f"tile_k must be 64 (16-bit) or 128 (8-bit), got {config.tile_k}")
        if config.tile_n % config.epi_n or config.epi_n not in (8, 16, 32, 64):
            raise ValueError(f"epi_n must be 8, 16, 32 or 64 and divide tile_n, got {config.epi_n}")
        if config.cluster_m * config.cluster_n > 4:
            raise ValueError("a cluster holds at most 4 CTAs here")
        if config.a_rows and (config.a_rows % 8 or config.a_rows > config.tile_m):
            raise ValueError(f"a_rows must be a multiple of 8 up to tile_m, got {config.a_rows}")
        if masked and (config.cluster_m * config.cluster_n != 1 or config.stream_k):
            raise ValueError("the masked layout runs without clusters or stream K")
        if trigger not in ("top", "late"):
            raise ValueError(f"trigger must be 'top' or 'late', got {trigger!r}")
        if trigger == "late" and (masked or not pdl):
            raise ValueError("the late trigger: a PDL build of the tiled or stream-K walk")
        self.cfg = config
        self.b_kn = b_kn
        self.pdl = pdl  # launched as a programmatic dependent (module docstring)
        # where launch_dependents is issued: at the top (every standard build) or after the
        # CTA's last mainloop (module docstring)
        self.late_trigger = pdl and trigger == "late"
        # The masked grouped layout (module docstring): operands (rows, cols, experts).
        self.masked = masked
        self.scaled = False  # block-scaled FP8: set from the scales by __call__
        # FP8: B's 128-column scale blocks a tile may touch: 2 where tile_n does not divide 128
        # (the straddling tiles, module docstring), set by __call__; 1 otherwise
        self.n_blocks = 1
        self.acc_dtype = cutlass.Float32
        self.cluster_shape_mn = (config.cluster_m, config.cluster_n)
        # Two consumer warpgroups split the M rows of a 128-row tile: one alone would hold a
        # 128x256 fp32 accumulator in 256 registers per thread and spill.
        self.atom_layout_mnk = (config.tile_m // 64, 1, 1)
        self.num_mma_wg = math.prod(self.atom_layout_mnk)
        self.num_mma_threads = self.num_mma_wg * THREADS_PER_WG
        self.threads_per_cta = (1 + self.num_mma_wg) * THREADS_PER_WG
        self.producer_regs = 40
        # What the register file leaves each consumer thread once the producer warpgroup holds
        # 40 (setmaxnreg takes multiples of 8): 232 up to two consumer warpgroups, 152 at three
        # (a 192-row tile: 232 would ask 40 x 128 + 232 x 384 = 94,208 of 65,536).
        budget = (REGISTERS_PER_SM - self.producer_regs * THREADS_PER_WG) // self.num_mma_threads
        self.consumer_regs = min(232, budget // 8 * 8)

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
        self.cta_layout_mnk = cute.make_layout((*self.cluster_shape_mn, 1))
        self.mcast_a = cfg.cluster_n  # CTAs sharing one A tile (same M row of the cluster)
        self.mcast_b = cfg.cluster_m
        self.epi_tile = (cfg.tile_m, cfg.epi_n)

        self.a_rows = cfg.a_rows or cfg.tile_m
        # A's stages lie a_rows rows apart (`_compact_ring`)
        # FP8: each stage also holds its k-tile's tile_m row scales a block of B's
        # (`_stage_scales`)
        scale_bytes = cfg.tile_m * 4 * self.n_blocks if self.scaled else 0
        fit = ring_stages(cfg, self.a_dtype.width // 8, self.c_dtype.width // 8, scale_bytes)
        self.stages = cfg.stages or fit
        if self.stages > fit or self.stages < 2:
            raise ValueError(f"{self.stages} AB stages do not fit in shared memory ({fit} do)")

        def staged(major, dtype, rows, stages):
            k_major = major.sm90_mma_major_mode() == OperandMajorMode.K
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(major, dtype, cfg.tile_k if k_major else rows),
                dtype,
            )
            return cute.tile_to_shape(
                atom, (rows, cfg.tile_k, stages), order=(0, 1, 2) if k_major else (1, 0, 2)
            )

        self.sA_layout = self._compact_ring(
            staged(self.a_major, self.a_dtype, cfg.tile_m, self.stages)
        )
        # What A's TMA writes: the first a_rows rows of each stage, at the full ring's offsets.
        self.sA_load_layout = cute.make_composed_layout(
            self.sA_layout.inner,
            0,
            cute.composition(
                self.sA_layout.outer,
                cute.make_layout(
                    (self.a_rows, cfg.tile_k, self.stages),
                    stride=(1, cfg.tile_m, cfg.tile_m * cfg.tile_k),
                ),
            ),
        )
        # B's ring in whole 16-row pairs of swizzle atoms: a TMA box of an odd count of 8-row
        # atoms does not build (the DSL aborts at tile_n 24, 40, 56, 72, 104), so a 72-column
        # tile loads 80 rows (8 of them the next tile's or zero-filled) and WGMMA reads 72.
        self.b_rows = cfg.tile_n + cfg.tile_n % 16
        self.sB_layout = staged(self.b_major, self.b_dtype, self.b_rows, self.stages)
        # The atom spans C's contiguous mode: epi_n columns of a row-major C; tile_m rows of an
        # M-major C (the swap), whose atoms of one 64-row band lie next to each other along N,
        # so that a sub-tile is tile_m / 64 whole 64 x epi_n TMA boxes (an atom sized by
        # epi_n = 16 and tiled along M first stored it in 8-element boxes: 64-208 a tile).
        contiguous = self.epi_tile[0] if self.c_major.is_m_major_c() else self.epi_tile[1]
        c_order = (1, 0, 2) if self.c_major.is_m_major_c() else (0, 1, 2)
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.c_major, self.c_dtype, contiguous),
            self.c_dtype,
        )
        if cutlass.const_expr(self.c_major.is_m_major_c() and cfg.epi_n % 16):
            # one 8-column atom along N: a swizzled one does not build as a TMA box (as B's
            # odd atom counts, above), so the sub-tile is plain, one tile_m x 8 box
            c_atom = cute.make_composed_layout(
                cute.make_swizzle(0, 4, 3),
                0,
                cute.make_layout((cfg.tile_m, cfg.epi_n), stride=(1, cfg.tile_m)),
            )
        self.sC_layout = cute.tile_to_shape(c_atom, (*self.epi_tile, cfg.epi_stages), order=c_order)

    def _first_rows(self, ring: cute.ComposedLayout, rows: int) -> cute.ComposedLayout:
        """The first `rows` rows of each stage of a K-major ring, at the ring's offsets."""
        held, k, stages = (cute.size(ring.outer, mode=[i]) for i in range(3))
        view = cute.make_layout((rows, k, stages), stride=(1, held, held * k))
        return cute.make_composed_layout(ring.inner, 0, cute.composition(ring.outer, view))

    def _compact_ring(self, ring: cute.ComposedLayout) -> cute.ComposedLayout:
        """A's ring with its stages a_rows rows apart instead of tile_m. WGMMA reads tile_m
        rows from a stage's base: rows a_rows .. tile_m - 1 are then the next stages' (or past
        the last stage, the tail) and land in accumulator rows that are never stored, as stale
        rows did before; TMA writes only each stage's a_rows. Shared memory per stage shrinks
        from (tile_m + tile_n) to (a_rows + tile_n) rows: at 64x64 with 8 rows, 22 stages
        (176 KB of B in flight) instead of 13 (104 KB). a_rows is a multiple of 8: every stage
        starts on a whole 8-row swizzle atom (1 KB)."""
        if self.a_rows == self.cfg.tile_m:
            return ring
        outer = ring.outer
        # the stage mode's stride, (0, tile_m x tile_k) as tile_to_shape nests it, scaled
        stage = tuple(d * self.a_rows // self.cfg.tile_m for d in outer.stride[2])
        stride = (*outer.stride[:2], stage)
        return cute.make_composed_layout(
            ring.inner, 0, cute.make_layout(outer.shape, stride=stride)
        )

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mWork: cute.Tensor | None,
        mFlags: cute.Tensor | None,
        per_cta: cutlass.Int32,
        mSFA: cute.Tensor | None,
        mSFB: cute.Tensor | None,
        mGroup: cute.Tensor | None,
        max_active_clusters: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mA (M, K); mB (N, K) or, N-major, its (K, N) transpose; mC (M, N). Stream K only:
        `per_cta` k-iterations per cluster (`_stream_grid`: the grid and the data-parallel
        blocks follow from it and max_active_clusters), mWork fp32 (>= 2 x CTAs x tile_m x
        tile_n,) 16-byte aligned, mFlags int32 (>= tiles,) zero (every launch leaves it zero);
        otherwise None, None, 0. FP8: mSFA, mSFB the block scales
        (module docstring); otherwise None, None. mGroup int32 (M,): the grouped (MoE,
        contiguous) layout, FP8 only (module docstring); otherwise None. The masked layout
        (`masked`): mA (max_m, K, E), mB (N, K, E), mC (max_m, N, E), mSFA (max_m, K/128, E),
        mSFB (N/128, K/128, E) and mGroup int32 (E,) the row counts."""
        if cutlass.const_expr(self.b_kn):
            # (K, N) row-major seen as (N, K) with unit stride along N.
            mB = cute.make_tensor(mB.iterator, cute.select(mB.layout, mode=[1, 0]))
        self.a_dtype = mA.element_type
        self.b_dtype = mB.element_type
        self.c_dtype = mC.element_type
        self.a_major = LayoutEnum.from_tensor(mA)
        self.b_major = LayoutEnum.from_tensor(mB)
        self.c_major = LayoutEnum.from_tensor(mC)
        self.scaled = mSFA is not None
        self.n_blocks = 2 if self.scaled and straddles(self.cfg.tile_n) else 1
        if cutlass.const_expr(self.cfg.tile_k * self.a_dtype.width != 128 * 8):
            raise ValueError(f"tile_k = {self.cfg.tile_k} is not 128 bytes of {self.a_dtype}")
        if cutlass.const_expr(self.scaled and self.cfg.tile_n > 128):
            raise ValueError(
                f"block-scaled FP8 takes tile_n <= 128 (three tile_n / 2 fp32 fragments per "
                f"thread), got {self.cfg.tile_n}"
            )
        if cutlass.const_expr(
            self.n_blocks == 2 and (self.cfg.stream_k or self.masked or mGroup is not None)
        ):
            raise ValueError(
                f"FP8 tile_n {self.cfg.tile_n} (a tile over two blocks of B's scales) takes the "
                "tiled walk, not stream K or the grouped layouts"
            )
        if cutlass.const_expr(
            self.cfg.scale_ahead != 1 and not (self.scaled and self.cfg.scale_ahead > 1)
        ):
            raise ValueError(f"scale_ahead {self.cfg.scale_ahead}: FP8's, at least 1")
        if cutlass.const_expr(self.cfg.scale_warp and not (
            self.scaled and not self.masked and not self.cfg.stream_k
        )):  # fmt: skip
            # (stream K's scale warp spills within the producer's 40 registers: 24 bytes; the
            # masked layout's walk is not the scale warp's, untested)
            raise ValueError("scale_warp: FP8's dense or grouped layout, tiled walk (not stream K)")
        if cutlass.const_expr(self.cfg.scale_mn_major):
            # one vector of tile_m / 32 rows a lane (`_fetch_scales`): 16 or 8 bytes
            if cutlass.const_expr(not self.scaled or self.masked or self.cfg.tile_m == 192):
                raise ValueError("scale_mn_major: FP8's, not masked, tile_m 64 or 128")
            if cutlass.const_expr(not (cute.is_static(mSFA.stride[0]) and mSFA.stride[0] == 1)):
                raise ValueError("scale_mn_major takes scale_a with unit stride along M")
        if cutlass.const_expr(mGroup is not None and self.cfg.stream_k):
            raise ValueError("the grouped layouts do not take stream K")
        if cutlass.const_expr(mGroup is not None and (not self.scaled or self.cfg.cluster_m > 1)):
            raise ValueError(
                "the grouped layout is FP8's, without B multicast (tiles of one "
                "cluster column may belong to different experts)"
            )
        if cutlass.const_expr(self.masked and mGroup is None):
            raise ValueError("the masked layout takes the experts' row counts (mGroup)")
        self._setup()

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        g2s_mc = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mc if self.mcast_a > 1 else g2s,
            mA,
            cute.slice_(self.sA_load_layout, (None, None, 0)),
            (self.a_rows, self.cfg.tile_k),
            num_multicast=self.mcast_a,
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s_mc if self.mcast_b > 1 else g2s,
            mB,
            cute.slice_(self.sB_layout, (None, None, 0)),
            (self.b_rows, self.cfg.tile_k),
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
        if cutlass.const_expr(self.masked):
            # every expert's tiles as if all its rows were counted: the grid's upper bound
            tiles_m = cute.ceil_div(mC.shape[0], self.a_rows) * mGroup.shape[0]
        schedule = StaticSchedule(
            (tiles_m, tiles_n), self.cluster_shape_mn, self.cfg.swizzle, self.cfg.raster_along_m
        )
        grid = schedule.grid(max_active_clusters)
        dp_blocks = cutlass.Int32(0)
        if cutlass.const_expr(self.cfg.stream_k):
            grid, dp_blocks = self._stream_grid(schedule, mA.shape[1], per_cta, max_active_clusters)

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
            # FP8: (tile_m, stages x n_blocks) products of A's row scales and B's block scale
            sSF: cute.struct.MemRange[
                cutlass.Float32, self.cfg.tile_m * self.stages * self.n_blocks if self.scaled else 1
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
            self.sA_load_layout,
            self.sB_layout,
            self.sC_layout,
            schedule,
            mWork,
            mFlags,
            (per_cta, dp_blocks),
            mSFA,
            mSFB,
            mGroup,
            mC if cutlass.const_expr(self.masked) else None,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.pdl,
        )

    def _stream_grid(self, schedule, k, per_cta, wave):
        """Stream K's grid and data-parallel blocks (plan.py `dp_rounds_of`, `stream_grid`):
        the whole blocks that `wave` clusters of per_cta k-iterations leave uncovered run
        first, in rounds of the whole wave; the rest are streamed, ceil(rest / per_cta)
        clusters (a whole wave where there are data-parallel rounds)."""
        k_tiles = cute.ceil_div(k, self.cfg.tile_k)
        total = schedule.blocks * k_tiles
        uncovered = cutlass.max(total - wave * per_cta, 0)
        dp_rounds = (uncovered + wave * k_tiles - 1) // (wave * k_tiles)
        streamed = total - dp_rounds * wave * k_tiles
        ranges = (streamed + per_cta - 1) // per_cta
        clusters = cutlass.max(ranges, wave * cutlass.min(dp_rounds, 1))
        return (*self.cluster_shape_mn, clusters), dp_rounds * wave

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
        sA_load_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        schedule: StaticSchedule,
        mWork: cute.Tensor | None,
        mFlags: cute.Tensor | None,
        stream: tuple,
        mSFA: cute.Tensor | None,
        mSFB: cute.Tensor | None,
        mGroup: cute.Tensor | None,
        mC_rows: cute.Tensor | None,
    ):
        """stream: stream K's (k-iterations per cluster, data-parallel blocks); mC_rows: the
        masked layout's C itself (row-predicated stores), else None."""
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

        stage_bytes = (self.a_rows + self.b_rows) * self.cfg.tile_k * self.a_dtype.width // 8

        storage = SmemAllocator().allocate(self.shared_storage)
        # Each consumer warp releases a stage to every CTA that multicast into it.
        consumer_arrivals = (self.mcast_a + self.mcast_b - 1) * (self.num_mma_threads // 32)
        if cutlass.const_expr(self.scaled):
            # FP8: every consumer thread arrives on its own CTA's (`_retire`); with a cluster,
            # the per-warp arrivals above as well
            peers = consumer_arrivals if self._clustered() else 0
            consumer_arrivals = self.num_mma_threads + peers
        # `tma_pipeline`'s ring, but for FP8 a full barrier takes an arrival from each producer
        # lane, after its own stores of the stage's scales (`_load`): one lane's arrive is all
        # the toolkit's helper counts (taking the count there would move the source hash of
        # every kernel that imports it). `scale_warp`: the scale warp's 32 and the TMA warp's
        # one (its expect_tx).
        producers = WARP_SIZE + int(self.cfg.scale_warp) if self.scaled else 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producers),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        init_arrive(self.cluster_shape_mn)

        sA = smem_tensor(storage.sA, sA_layout)
        sB = smem_tensor(storage.sB, sB_layout)
        sC = smem_tensor(storage.sC, sC_layout)
        # stage s's products in column s (straddling tiles: B's block h in column 2 s + h)
        sSF = storage.sSF.get_tensor(
            cute.make_layout((self.cfg.tile_m, self.stages * self.n_blocks))
        )

        # (bM, bK, tiles_m, tiles_k), (bM, bN, tiles_m, tiles_n)
        tiled_a, tiled_c = mA, mC
        if cutlass.const_expr(self.masked):
            tiled_a, tiled_c = mA[None, None, 0], mC[None, None, 0]  # one expert's
        gA = cute.local_tile(tiled_a, (self.cfg.tile_m, self.cfg.tile_k), (None, None))
        gC = cute.local_tile(tiled_c, (self.cfg.tile_m, self.cfg.tile_n), (None, None))
        k_tiles = cute.size(gA, mode=[3])
        tiles_m = cute.size(gC, mode=[2])
        per_cta, dp_blocks = stream
        total = schedule.blocks * k_tiles  # k-iterations of every block
        streamk = (per_cta, k_tiles, tiles_m, total, dp_blocks)

        if cutlass.const_expr(self.masked):
            # the walk's arguments: counts, rows per expert, column tiles (see masked.py)
            shift = None
            groups = (mGroup, mC.shape[0], cute.size(gC, mode=[3]))
        else:
            # A ragged last tile row / column is moved back to end at M / N (`_tail_shift`).
            shift = self._tail_pads(mC)
            # grouped layout: each tile row's expert (its first row's), and N (B: E x N rows)
            groups = None if cutlass.const_expr(mGroup is None) else (mGroup, mC.shape[1])
        a_src = (
            mA,
            cluster_coord[1],
            cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(smem_tensor(storage.sA, sA_load_layout), 0, 2),
        )
        b_src = (
            mB,
            cluster_coord[0],
            cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
        )

        wg_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        thr_mma = tiled_mma.get_slice((wg_idx - 1) * THREADS_PER_WG)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        sB_mma = sB
        if cutlass.const_expr(self.b_rows != self.cfg.tile_n):
            sB_mma = smem_tensor(storage.sB, self._first_rows(sB_layout, self.cfg.tile_n))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB_mma))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], self.acc_dtype)

        init_wait(self.cluster_shape_mn)
        # PDL: nothing above touched global memory (module docstring)
        pdl.wait(self.pdl)
        pdl.launch_dependents(self.pdl and not self.late_trigger)

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            scales = None
            if cutlass.const_expr(self.scaled):
                scales = (mSFA, mSFB, sSF, (mC.shape[0], mC.shape[1]))
            where = (shift, groups)
            if warp_idx == 0:
                load = ((tma_a, a_src, a_mask), (tma_b, b_src, b_mask))
                # `scale_warp`: TMA only, the 16-bit producer's loop (the scales are warp 1's)
                own = None if cutlass.const_expr(self.cfg.scale_warp) else scales
                self._produce(load, ab_pipe, schedule, streamk, where, own)
            if cutlass.const_expr(self.cfg.scale_warp):
                if warp_idx == 1:
                    self._produce(None, ab_pipe, schedule, streamk, where, scales)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            mma = (tiled_mma, tCrA, tCrB, acc)
            if cutlass.const_expr(self.scaled):
                # the two per-k-tile fragments and this thread's two rows of the tile
                rows = self._thread_coords(tiled_mma, tidx - THREADS_PER_WG)
                frags = tuple(
                    cute.make_rmem_tensor(acc.layout.shape, self.acc_dtype) for _ in range(2)
                )
                mma = (tiled_mma, tCrA, tCrB, acc, (frags, *self._scale_rows(rows), sSF))
            split_io = (mWork, mFlags, storage.split_last.get_tensor(cute.make_layout(2)))
            c_src = (mC, shift, groups)
            if cutlass.const_expr(self.masked):
                # partial tiles are stored from registers: C itself, each value's coordinates
                thr_c = tiled_mma.get_slice(tidx - THREADS_PER_WG)
                c_src = (mC, (mC_rows, thr_c, rows), groups)
            self._consume(
                tidx, warp_idx, mma, ab_pipe, sC, c_src, tma_c, schedule, streamk, split_io
            )

    @cute.jit
    def _cta_range(self, streamk):
        """Stream K: this cluster's k-iterations [begin, end) of all blocks' (the streamed part
        starts after the data-parallel blocks'; a range may be empty)."""
        per_cta, k_tiles, _, total, dp_blocks = streamk
        begin = dp_blocks * k_tiles + cute.arch.block_idx()[2] * per_cta
        return begin, cutlass.min(begin + per_cta, total)

    @cute.jit
    def _next_unit(self, work, it, end, streamk, sched):
        """Stream K: this cluster's next unit and its walk advanced past it: data-parallel
        block `work`, whole, while it is one (work moves on by the grid's clusters), then the
        streamed unit at k-iteration `it` of the range ending at `end` (it moves on past the
        unit). The unit: (this CTA's tile_m, tile_n of the block, first k-tile, k-tiles, the
        tile's index, its parts, (this part's cluster slot, the block's first cluster, its
        first streamed k-iteration)); a data-parallel block has one part."""
        per_cta, k_tiles, tiles_m, _, dp_blocks = streamk
        whole = work < dp_blocks
        block = cutlass.select_(whole, work, it // k_tiles)
        block_begin = block * k_tiles
        k0 = cutlass.select_(whole, cutlass.Int32(0), it - block_begin)
        count = cutlass.select_(whole, k_tiles, cutlass.min(end - it, k_tiles - k0))
        offset = block_begin - dp_blocks * k_tiles  # negative for a data-parallel block
        first = offset // per_cta
        parts = (offset + k_tiles - 1) // per_cta - first + 1
        parts = cutlass.select_(whole, cutlass.Int32(1), parts)
        cluster = cute.arch.block_idx()[2]
        slot = 2 * cluster + cutlass.Int32(cluster * per_cta < offset)
        tile_m, tile_n = sched.tile(block)
        unit = (tile_m, tile_n, k0, count, tile_m + tile_n * tiles_m, parts, (slot, first, offset))
        work = cutlass.select_(whole, sched.next(work), work)
        it = cutlass.select_(whole, it, it + count)
        return unit, work, it

    @cute.jit
    def _produce(self, load, ab_pipe, schedule, streamk, where, scales):
        """The producer warp: every k-tile of A and B of each unit into the AB ring (FP8: and
        its scales, `_stage_scales`). `load`: A's and B's (the TMA atom, its global and shared
        partitions, its multicast mask), or None for `scale_warp`'s scale warp (the scales
        only); `where`: the tail shift and the grouped layout's (mGroup, N) or None (masked
        layout: None and the walk's (counts, max_m, column tiles)); `scales`: FP8's (mSFA, mSFB,
        the staged scales' ring, C's (M, N)), else None (`scale_warp`'s TMA warp too)."""
        shift, groups = where
        prod = producer_state(self.stages)
        if cutlass.const_expr(self.masked):
            walk = MaskedWalk(*groups, self.a_rows)
            work, expert, before, rows = walk.first()
            while walk.valid(expert):
                tile_m, tile_n, tile_rows = walk.tile(work, before, rows)
                tile = (tile_m, tile_n, expert, None)
                src = None
                if cutlass.const_expr(scales is not None):
                    mSFA, mSFB, sSF, (_, n) = scales
                    first_row = tile_m * self.a_rows
                    blocks = (cutlass.Int32(0), cute.ceil_div(n, 128) - 1)
                    src = (mSFA[None, None, expert], mSFB[None, None, expert], sSF)
                    src = self._tile_scales(src, first_row, tile_n, first_row + tile_rows, blocks)
                prod = self._load(load, ab_pipe, prod, tile, 0, streamk[1], src)
                work, expert, before, rows = walk.next(work, expert, before, rows)
        elif cutlass.const_expr(self.cfg.stream_k):
            sched = StaticScheduler(schedule)
            work = sched.first()
            it, end = self._cta_range(streamk)
            while work < streamk[4] or it < end:
                unit, work, it = self._next_unit(work, it, end, streamk, sched)
                tile = (unit[0], unit[1], shift, groups)
                src = self._scales_of(scales, tile)
                prod = self._load(load, ab_pipe, prod, tile, unit[2], unit[3], src)
        else:
            sched = StaticScheduler(schedule)
            work = sched.first()
            while sched.valid(work):
                tile_m, tile_n = sched.tile(work)
                tile = (tile_m, tile_n, shift, groups)
                src = self._scales_of(scales, tile)
                prod = self._load(load, ab_pipe, prod, tile, 0, streamk[1], src)
                work = sched.next(work)
        if cutlass.const_expr(load is not None):  # the TMA warp: no arrive after exit
            ab_pipe.producer_tail(prod)

    @cute.jit
    def _scales_of(self, scales, tile):
        """The scale source of tile (tile_m, tile_n, the tail shift, groups) (`_tile_scales`;
        stream K's shift is none), or None without scales."""
        src = None
        if cutlass.const_expr(scales is not None):
            mSFA, mSFB, sSF, (m, n) = scales
            tile_m, tile_n, shift, groups = tile
            row0, _ = self._tail_shift(tile_m, tile_n, shift)
            first_row = row0 + tile_m * self.cfg.tile_m
            blocks = self._scale_blocks(n, groups, first_row)
            src = self._tile_scales((mSFA, mSFB, sSF), first_row, tile_n, m, blocks)
        return src

    @cute.jit
    def _tile_scales(self, scales, first_row, tile_n, rows_end, blocks):
        """What the producer stages for a tile at `first_row`, column tile `tile_n`: (mSFA,
        mSFB, the ring, first row, last row to read, B's block; a straddling tile also the next
        block, clamped to the last). Rows past `rows_end` (M, or the masked tile's counted rows)
        read the last one: never stored. A tile past N (a cluster's CTA past N) reads B's last
        block `blocks[1]`: never stored."""
        mSFA, mSFB, sSF = scales
        blk = cutlass.min(blocks[0] + tile_n * self.cfg.tile_n // 128, blocks[1])
        src = (mSFA, mSFB, sSF, first_row, rows_end - 1, blk)
        if cutlass.const_expr(self.n_blocks == 2):
            src = (*src, cutlass.min(blk + 1, blocks[1]))
        return src

    @cute.jit
    def _fetch_scales(self, src, kt, lane):
        """k-tile kt's scales for producer lane `lane`: A's of tile rows lane + 32 i, then the
        tile's block of B's (registers, stored `cfg.scale_ahead` k-tiles later by
        `_stage_scales`; a straddling tile's two blocks)."""
        mSFA, mSFB, _, first_row, last_row, blk = src[:6]
        rows = range(self.cfg.tile_m // 32)  # static
        if cutlass.const_expr(self.cfg.scale_mn_major):
            sa = self._fetch_mn_major(mSFA, first_row, last_row, kt, lane)
        else:
            sa = tuple(mSFA[cutlass.min(first_row + lane + 32 * i, last_row), kt] for i in rows)
        if cutlass.const_expr(self.n_blocks == 2):
            return (*sa, mSFB[blk, kt], mSFB[src[6], kt])
        return (*sa, mSFB[blk, kt])

    @cute.jit
    def _fetch_mn_major(self, mSFA, first_row, last_row, kt, lane):
        """`scale_mn_major`: A's scales of tile rows v lane .. v lane + v - 1 (v = tile_m / 32),
        one v x 4-byte vector load from mSFA's unit-stride M mode (one k-tile's tile_m scales
        are tile_m x 4 contiguous bytes, against tile_m lines K/128 x 4 bytes apart K-major).
        first_row is a multiple of v (`_tail_pads`) and the scale tensor's K/128 stride a
        multiple of 4 (the launcher's contract): every vector is aligned. A lane whose rows lie
        wholly past last_row reads the vector holding it instead (its rows are never stored),
        so nothing past the 4-padded M is read."""
        v = self.cfg.tile_m // 32
        vec = cutlass.min(first_row // v + lane, last_row // v)
        src = cute.local_tile(mSFA[None, kt], (v,), (vec,))
        frag = cute.make_rmem_tensor(v, cutlass.Float32)
        cute.autovec_copy(src, frag)
        return tuple(frag[i] for i in range(v))

    @cute.jit
    def _stage_scales(self, fetched, sSF, stage, lane):
        """The k-tile's row scales into the ring's `stage`: A's row scale x B's block scale
        (`_promote` multiplies by one number a row; a straddling tile's by one of two, block h
        in column 2 stage + h)."""
        if cutlass.const_expr(self.n_blocks == 2):
            for h in cutlass.range_constexpr(2):
                sa = (*fetched[:-2], fetched[len(fetched) - 2 + h])
                self._stage_products(sa, sSF, 2 * stage + h, lane)
        else:
            self._stage_products(fetched, sSF, stage, lane)

    @cute.jit
    def _stage_products(self, fetched, sSF, stage, lane):
        """A's row scales (`fetched` but its last) x B's block scale (its last) into column
        `stage` of the ring."""
        sb = fetched[-1]
        if cutlass.const_expr(self.cfg.scale_mn_major):
            # lane l holds rows v l .. v l + v - 1 (`_fetch_mn_major`)
            v = self.cfg.tile_m // 32
            for i in cutlass.range_constexpr(v):
                sSF[v * lane + i, stage] = fetched[i] * sb
        else:
            for i in cutlass.range_constexpr(self.cfg.tile_m // 32):
                sSF[lane + 32 * i, stage] = fetched[i] * sb

    @cute.jit
    def _load(self, load, ab_pipe, prod, tile, k0, count, scales):
        """k-tiles k0 .. k0 + count - 1 of tile (tile_m, tile_n) into the ring. `load`: A's and
        B's TMA atom, (its coordinate tensor, the CTA's rank among those sharing the tile, their
        layout, the shared-memory ring), the multicast mask; None: the scales only
        (`scale_warp`'s scale warp: each lane's plain arrive, the TMA warp's one arrive brings
        the stage's bytes). `tile`: (tile_m, tile_n, the tail shift, the grouped layout's groups
        or None), or with the masked layout (m-tile, n-tile, expert, None). `scales`: FP8's
        (`_tile_scales`), else None: the warp's lanes load each k-tile's scales
        `cfg.scale_ahead` k-tiles ahead (1 standard: the latency behind the next empty wait; 2
        a candidate) and store them into the stage after its empty wait; then each lane arrives
        on the full barrier (32 arrivals, each expecting 1/32 of the TMA bytes, in place of
        `producer_acquire`'s one), so that every store is released by its own thread's arrive:
        the consumers read them from shared memory once the stage is full. (One elected arrive
        after `sync_warp` is ordered too, but racecheck follows only the arriving thread's
        stores: RAW reports on lanes 1-31, H200 2026-12-02.)"""
        copies = None
        if cutlass.const_expr(load is not None):
            copies = self._tma_partitions(load, tile)
        lane = cute.arch.lane_idx()
        # FP8: the scales of the next `scale_ahead` k-tiles in registers, k-tile kt's first
        # (flat: `width` values a k-tile; past the unit's last k-tile its last one again)
        ahead = self.cfg.scale_ahead
        width = self.cfg.tile_m // 32 + self.n_blocks
        fetched = None
        if cutlass.const_expr(scales is not None):
            fetched = self._fetch_scales(scales, k0, lane)
            for j in cutlass.range_constexpr(1, ahead):
                kj = cutlass.min(k0 + j, k0 + count - 1)
                fetched = (*fetched, *self._fetch_scales(scales, kj, lane))
        for i in range(count):
            kt = k0 + i
            bar = ab_pipe.producer_get_barrier(prod)
            if cutlass.const_expr(scales is not None):
                ab_pipe.sync_object_empty.wait(prod.index, prod.phase)
                self._stage_scales(fetched[:width], scales[2], prod.index, lane)
                if cutlass.const_expr(load is None):
                    # `scale_warp`: the TMA warp's arrive expects the stage's bytes
                    cute.arch.mbarrier_arrive(bar)
                else:
                    # every lane releases its own stores and expects its share of the TMA
                    # bytes (a stage is a multiple of 128 bytes: tile_k = 128 FP8 bytes a row)
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        bar, ab_pipe.sync_object_full.tx_count // WARP_SIZE
                    )
            else:
                ab_pipe.producer_acquire(prod)
            if cutlass.const_expr(load is not None):
                tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask = copies
                stage = (None, prod.index)
                cute.copy(tma_a, tAgA[(None, kt)], tAsA[stage], tma_bar_ptr=bar, mcast_mask=a_mask)
                cute.copy(tma_b, tBgB[(None, kt)], tBsB[stage], tma_bar_ptr=bar, mcast_mask=b_mask)
            ab_pipe.producer_commit(prod)
            prod.advance()
            if cutlass.const_expr(scales is not None):
                # k-tile kt + scale_ahead's (the last one's again at the end: no branch)
                nxt = self._fetch_scales(scales, cutlass.min(kt + ahead, k0 + count - 1), lane)
                fetched = (*fetched[width:], *nxt)
        return prod

    @cute.jit
    def _tma_partitions(self, load, tile):
        """A's and B's TMA partitions of tile (`_load`'s `load` and `tile`): (atom, global
        k-tiles, shared stages, multicast mask) of A, then of B."""
        tile_m, tile_n, shift, groups = tile
        (tma_a, (mA, a_rank, a_ctas, sA), a_mask), (tma_b, (mB, b_rank, b_ctas, sB), b_mask) = load
        if cutlass.const_expr(self.masked):
            # the expert's slices (TMA clips A at its max_m rows); m-tiles of a_rows rows
            expert = tile[2]
            gA = cute.local_tile(
                mA[None, None, expert], (self.a_rows, self.cfg.tile_k), (tile_m, None)
            )
            gB = cute.local_tile(
                mB[None, None, expert], (self.cfg.tile_n, self.cfg.tile_k), (tile_n, None)
            )
        else:
            row0, col0 = self._tail_shift(tile_m, tile_n, shift)
            if cutlass.const_expr(groups is not None):
                # B is (experts x N, K): the tile row's expert's rows
                col0 = col0 + self._expert(groups, row0 + tile_m * self.cfg.tile_m) * groups[1]
            gA = cute.local_tile(
                cute.domain_offset((row0, 0), mA), (self.a_rows, self.cfg.tile_k), (tile_m, None)
            )
            if cutlass.const_expr(self.b_rows == self.cfg.tile_n):
                gB = cute.local_tile(
                    cute.domain_offset((col0, 0), mB),
                    (self.cfg.tile_n, self.cfg.tile_k),
                    (tile_n, None),
                )
            else:
                # b_rows rows from the tile's first (`_setup`)
                gB = cute.local_tile(
                    cute.domain_offset((col0 + tile_n * self.cfg.tile_n, 0), mB),
                    (self.b_rows, self.cfg.tile_k),
                    (0, None),
                )
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, a_rank, a_ctas, sA, cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, b_rank, b_ctas, sB, cute.group_modes(gB, 0, 2)
        )
        return tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask

    @cute.jit
    def _tail_pads(self, mC):
        """(M pad, N pad, tiles_m, tiles_n): how far the last tile row / column reaches past M /
        N, 0 where the problem is narrower than one tile (nothing to move back over) and for
        stream K (two tiles summed in different orders would write different values)."""
        m, n = mC.shape
        tiles_m = cute.ceil_div(m, self.cfg.tile_m)
        tiles_n = cute.ceil_div(n, self.cfg.tile_n)
        pad_m = cutlass.Int32(0)
        pad_n = cutlass.Int32(0)
        if cutlass.const_expr(not self.cfg.stream_k):
            if m >= self.cfg.tile_m:
                pad_m = tiles_m * self.cfg.tile_m - m
                if cutlass.const_expr(self.cfg.scale_mn_major):
                    # the last tile row starts on a whole vector of A's scales (`_fetch_scales`):
                    # it may reach up to 3 rows past M (A's box zero-fills them, C's clips them)
                    pad_m = pad_m - pad_m % (self.cfg.tile_m // 32)
            if cutlass.const_expr(not self.scaled):  # B's scales come in aligned 128 blocks
                if n >= self.cfg.tile_n:
                    pad_n = tiles_n * self.cfg.tile_n - n
        return pad_m, pad_n, tiles_m, tiles_n

    @cute.jit
    def _tail_shift(self, tile_m, tile_n, shift):
        """Row and column offsets of tile (tile_m, tile_n): the last tile row (column) of a
        ragged M (N) is moved back by its pad so that it ends at M (N): its loads stay in
        bounds (a TMA box reaching past the tensor, zero-filled, streams at half speed) and it
        recomputes rows of the tile before it, which both write with the same values."""
        pad_m, pad_n, tiles_m, tiles_n = shift
        row0 = cutlass.Int32(0) - pad_m * cutlass.Int32(tile_m == tiles_m - 1)
        col0 = cutlass.Int32(0) - pad_n * cutlass.Int32(tile_n == tiles_n - 1)
        return row0, col0

    @cute.jit
    def _consume(self, tidx, warp_idx, mma, ab_pipe, sC, c_src, tma_c, schedule, streamk, split_io):
        """The consumer warpgroups: each unit's mainloop, then the tile's epilogue (stream K:
        after the tile's parts are summed, by the last to arrive)."""
        tiled_mma, tCrA, tCrB, acc = mma[:4]
        epi_barrier = named_barrier(Bar.EPILOGUE, self.num_mma_threads)
        read = consumer_state(self.stages)
        release = consumer_state(self.stages)

        # Epilogue: registers -> stmatrix -> swizzled smem ring -> TMA store. A warp's stmatrix
        # x4 writes 16 rows x 16 columns; an 8-column sub-tile (epi_n 8: tiles 8 past a multiple
        # of 16, 192x72) takes x2, 16 x 8.
        stm_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(
                self.c_major.is_m_major_c(), 4 if self.cfg.epi_n % 16 == 0 else 2
            ),
            self.c_dtype,
        )
        r2s = cute.make_tiled_copy_S(stm_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
        thr_r2s = r2s.get_slice(tidx - THREADS_PER_WG)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = r2s.retile(acc)
        rC_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_rAcc = cute.make_rmem_tensor(rC_shape, self.acc_dtype)
        tRS_rC = cute.make_rmem_tensor(rC_shape, self.c_dtype)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
        )
        epi = (r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC, store_pipe, epi_barrier)
        tiles_done = cutlass.Int32(0)  # this CTA's tiles so far: the epilogue ring's position
        if cutlass.const_expr(self.masked):
            out = (tma_c, sC, epi)
            self._consume_masked(streamk[1], mma, ab_pipe, (read, release), c_src, out, warp_idx)
        elif cutlass.const_expr(self.cfg.stream_k):
            sched = StaticScheduler(schedule)
            work = sched.first()
            it, end = self._cta_range(streamk)
            while work < streamk[4] or it < end:
                unit, work, it = self._next_unit(work, it, end, streamk, sched)
                tile_m, tile_n, k0, count, tile, parts, where = unit
                read, release, tiled_mma = self._unit_mainloop(
                    count, (tiled_mma, *mma[1:]), ab_pipe, read, release
                )
                if cutlass.const_expr(self.late_trigger):
                    if work >= streamk[4] and it >= end:  # the CTA's last unit
                        pdl.launch_dependents(True)
                last = cutlass.Boolean(True)
                if parts > 1:
                    # a CTA whose tile lies past M or N (its cluster's block over the edge)
                    # parks nothing and stores nothing
                    last = cutlass.Boolean(False)
                    if self._tile_exists(tile_m, tile_n, c_src[0].shape):
                        last = self._reduce_parts(
                            acc, split_io, tile, parts, where, streamk, tidx, epi_barrier
                        )
                if last:
                    gC_tile = self._c_tile(c_src, tile_m, tile_n)
                    self._epilogue(gC_tile, tma_c, sC, epi, warp_idx, tiles_done)
                    tiles_done += 1
        else:
            sched = StaticScheduler(schedule)
            work = sched.first()
            while sched.valid(work):
                tile_m, tile_n = sched.tile(work)
                work = sched.next(work)
                if cutlass.const_expr(self.n_blocks == 2):
                    # a straddling tile: its first 8-column group on B's second block
                    scaled = (*mma[4], self._second_block_group(tile_n))
                    read, release, tiled_mma = self._mainloop_scaled(
                        streamk[1], (tiled_mma, *mma[1:4], scaled), ab_pipe, read, release
                    )
                elif cutlass.const_expr(self.scaled):
                    # the loop's own tiled_mma (the helper mutates it: not the one in `mma`)
                    read, release, tiled_mma = self._mainloop_scaled(
                        streamk[1], (tiled_mma, *mma[1:]), ab_pipe, read, release
                    )
                else:
                    read, release, tiled_mma = self._mainloop(
                        streamk[1], tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release
                    )
                if cutlass.const_expr(self.late_trigger):
                    if work >= schedule.blocks:  # the CTA's last tile (`sched.valid`)
                        pdl.launch_dependents(True)
                gC_tile = self._c_tile(c_src, tile_m, tile_n)
                self._epilogue(gC_tile, tma_c, sC, epi, warp_idx, tiles_done)
                tiles_done += 1
        store_pipe.producer_tail()

    @cute.jit
    def _consume_masked(self, k_tiles, mma, ab_pipe, states, c_src, out, warp_idx):
        """The masked layout's consumer loop (masked.py's walk): each tile's scaled mainloop
        on its expert's scales, then a tile of whole rows through the epilogue ring and TMA,
        a tile with rows past its expert's count from registers, those rows left alone."""
        tiled_mma, acc = mma[0], mma[3]
        mC, (mC_rows, thr_c, coords), groups = c_src
        tma_c, sC, epi = out
        read, release = states
        tiles_done = cutlass.Int32(0)  # the epilogue ring's position
        walk = MaskedWalk(*groups, self.a_rows)
        work, expert, before, rows = walk.first()
        while walk.valid(expert):
            tile_m, tile_n, tile_rows = walk.tile(work, before, rows)
            first_row = tile_m * self.a_rows
            read, release, tiled_mma = self._mainloop_scaled(
                k_tiles, (tiled_mma, *mma[1:]), ab_pipe, read, release
            )
            whole = cutlass.Boolean(False)
            if cutlass.const_expr(self.a_rows == self.cfg.tile_m):
                whole = tile_rows == self.cfg.tile_m
            if whole:
                gC_tile = cute.local_tile(
                    mC[None, None, expert], (self.cfg.tile_m, self.cfg.tile_n), (tile_m, tile_n)
                )
                self._epilogue(gC_tile, tma_c, sC, epi, warp_idx, tiles_done)
                tiles_done += 1
            else:
                gC_rows = cute.local_tile(
                    cute.domain_offset((first_row, 0), mC_rows[None, None, expert]),
                    (self.cfg.tile_m, self.cfg.tile_n),
                    (0, tile_n),
                )
                self._store_rows(acc, thr_c.partition_C(gC_rows), coords, tile_rows)
            work, expert, before, rows = walk.next(work, expert, before, rows)

    @cute.jit
    def _store_rows(self, acc, tCgC, coords, rows):
        """acc -> C from registers (`tCgC`: this thread's values of the tile in C, `coords`
        their tile coordinates), only the tile's first `rows` rows."""
        out = cute.make_rmem_tensor(acc.layout.shape, self.c_dtype)
        out.store(acc.load().to(self.c_dtype))
        # values 4g .. 4g + 3: two columns of one row, then of the row 8 below
        for g in cutlass.range_constexpr(cute.size(out) // 4):
            for j in cutlass.range_constexpr(4):
                if coords[4 * g + j][0] < rows:
                    tCgC[4 * g + j] = out[4 * g + j]

    @cute.jit
    def _c_tile(self, c_src, tile_m, tile_n):
        """The (tile_m, tile_n) output tile's coordinates, moved back at a ragged edge."""
        mC, shift, _ = c_src
        row0, col0 = self._tail_shift(tile_m, tile_n, shift)
        return cute.local_tile(
            cute.domain_offset((row0, col0), mC),
            (self.cfg.tile_m, self.cfg.tile_n),
            (tile_m, tile_n),
        )

    @cute.jit
    def _unit_mainloop(self, count, mma, ab_pipe, read, release):
        """Stream K: acc = the unit's `count` k-tiles (their stages, the scales staged with
        them), the block-scaled mainloop for FP8. `mma`: the loop's own tiled_mma first (the
        helpers mutate it: not the one the consumer started with). Returns the states
        (`_mainloop`)."""
        tiled_mma, tCrA, tCrB, acc = mma[:4]
        if cutlass.const_expr(self.scaled):
            read, release, tiled_mma = self._mainloop_scaled(count, mma, ab_pipe, read, release)
        else:
            read, release, tiled_mma = self._mainloop(
                count, tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release
            )
        return read, release, tiled_mma

    @cute.jit
    def _tile_exists(self, tile_m, tile_n, mn):
        """Whether tile (tile_m, tile_n) lies in C, (M, N) = `mn` (a cluster block over the
        edge of M or N holds CTAs whose tile does not: they load and compute with their
        cluster, whose multicast needs them, but own no flag and no output)."""
        m, n = mn
        return tile_m * self.cfg.tile_m < m and tile_n * self.cfg.tile_n < n

    @cute.jit
    def _reduce_parts(self, acc, split_io, tile, parts, where, streamk, tidx, epi_barrier):
        """Park this unit's partial and count it in the tile's flag; the last of the tile's
        parts to arrive sums all of them from the workspace in k order into `acc` and returns
        True (kernels/common/sm90/splitk.py; slots: `_part_slots`)."""
        mWork, mFlags, s_last = split_io
        slot, head, first, step = self._part_slots(where, streamk[0])
        thread = tidx - THREADS_PER_WG
        threads = self.num_mma_threads
        at = (slot, tile, parts)
        last = splitk.park(acc, mWork, mFlags, at, threads, thread, epi_barrier, s_last)
        if last:
            splitk.sum_parts(acc, mWork, (first, step, parts), threads, thread, head=head)
        return last

    @cute.jit
    def _part_slots(self, where, per_cta):
        """Workspace slots of a streamed unit `where` = (its cluster slot, its block's first
        cluster, the block's first streamed k-iteration): (this part's slot, part 0's, part 1's,
        the step to part p + 1's). Cluster slot s of the CTA of rank r is slot s S + r (S CTAs
        a cluster). Part p >= 1 is cluster first + p's first unit (cluster slot
        2 (first + p)); part 0 is cluster first's first unit where that cluster began at the
        block, else its last (2 first + 1)."""
        slot, first, offset = where
        size = self.cfg.cluster_m * self.cfg.cluster_n
        rank = self._cluster_rank()
        head = (2 * first + cutlass.Int32(first * per_cta < offset)) * size + rank
        return slot * size + rank, head, 2 * first * size + rank, 2 * size

    @cute.jit
    def _cluster_rank(self):
        """This CTA's rank in its cluster, M first (the grid's x and y: the rank's M and N
        coordinates, the static scheduler's `cta_mn`)."""
        cta_m, cta_n, _ = cute.arch.block_idx()
        return cute.arch.make_warp_uniform(cta_m + cta_n * self.cfg.cluster_m)

    @cute.jit
    def _mainloop(self, k_tiles, tiled_mma, tCrA, tCrB, acc, ab_pipe, read, release):
        """acc = this tile's A B^T over all k-tiles, one WGMMA batch kept in flight and the
        stage behind it released. Returns the states: attribute updates made inside a helper
        would not leave the caller's dynamic loop otherwise."""
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
        ab_pipe.consumer_release(release)  # the op layer never launches with K == 0
        release.advance()
        return read, release, tiled_mma

    @cute.jit
    def _mainloop_scaled(self, count, mma, ab_pipe, read, release):
        """Block-scaled FP8 over the next `count` k-tiles of the ring: acc = the sum of each
        k-tile's A B^T (WGMMA into a fresh fragment) x its rows' scales (A's 1x128 group x B's
        128x128 block, staged with the k-tile by the producer). The fragments alternate
        (k-tiles 2i in the first, 2i + 1 in the second): k-tile j is issued, then j - 1 is
        waited for (`wait_group(1)`: j stays in flight on the tensor pipe), its stage released
        and its fragment promoted. A k-tile's stage is released by the index it was read from
        (`read`'s, warp-uniform), not by a second state walked around the ring: every k-tile
        read here is released here, so `release` comes back as `read` (the states the caller
        hands on: see `_mainloop`)."""
        tiled_mma, tCrA, tCrB, acc, scaled = mma
        frags, r0, r1, sSF = scaled[:4]
        first, second = frags
        # this thread's rows of the staged ring, hoisted out of the loop: one LDS address
        # register, a k-tile's stage an offset (r1 = r0 + 8: an immediate); a straddling tile
        # also its first 8-column group on B's second block (`_consume`)
        src = (cute.domain_offset((r0, 0), sSF), r1 - r0)
        if cutlass.const_expr(self.n_blocks == 2):
            src = (*src, scaled[4])
        acc.fill(0.0)
        # Each step's calls on `read` and `tiled_mma` (ACCUMULATE cleared: the first WGMMA of a
        # k-tile overwrites its fragment) stay in the loop's and branches' own bodies: the DSL
        # carries objects mutated there out of the region in place.
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        even = self._issue_scaled(tiled_mma, (tCrA, tCrB), first, ab_pipe, read, src)
        even_stage = read.index
        read.advance()
        for _ in range((count - 1) // 2):
            # into `second`; the k-tile before is promoted from `first`
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            odd = self._issue_scaled(tiled_mma, (tCrA, tCrB), second, ab_pipe, read, src)
            odd_stage = read.index
            read.advance()
            self._retire(1, ab_pipe, even_stage)
            self._promote(acc, first, even)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            even = self._issue_scaled(tiled_mma, (tCrA, tCrB), first, ab_pipe, read, src)
            even_stage = read.index
            read.advance()
            self._retire(1, ab_pipe, odd_stage)
            self._promote(acc, second, odd)
        if count % 2 == 0:
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            odd = self._issue_scaled(tiled_mma, (tCrA, tCrB), second, ab_pipe, read, src)
            odd_stage = read.index
            read.advance()
            self._retire(1, ab_pipe, even_stage)
            self._promote(acc, first, even)
            self._retire(0, ab_pipe, odd_stage)
            self._promote(acc, second, odd)
        else:
            self._retire(0, ab_pipe, even_stage)
            self._promote(acc, first, even)
        return read, read.clone(), tiled_mma

    @cute.jit
    def _issue_scaled(self, tiled_mma, operands, frag, ab_pipe, read, src):
        """Wait for the k-tile in stage `read`, read its scales (`src`: the staged ring and
        this thread's two rows), then issue its WGMMAs into `frag` as one commit group
        (ACCUMULATE cleared by the caller: the first overwrites the fragment). Returns the
        scales, used at its promotion one step later."""
        tCrA, tCrB = operands
        ab_pipe.consumer_wait(read)
        scales = self._scales(src, read.index)
        # the fragment's registers were last read by the promotion FFMAs
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            crd = (None, None, kb, read.index)
            cute.gemm(tiled_mma, frag, tCrA[crd], tCrB[crd], frag)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        return scales

    @cute.jit
    def _retire(self, pending, ab_pipe, stage):
        """Wait until at most `pending` WGMMA groups are in flight, then release ring stage
        `stage` (the oldest k-tile's): every thread arrives on its CTA's empty barrier, so that
        each one's reads of the stage's scales (`_scales`) are released by its own arrive
        (racecheck follows only the arriving thread's accesses: the toolkit's one lane a warp
        left 18,432 WAR reports on the staged scales, H200 2026-12-02 15:48); with a cluster,
        also the toolkit's one lane a warp on each CTA that multicast into the stage."""
        cute.nvgpu.warpgroup.wait_group(pending)
        empty = ab_pipe.sync_object_empty
        cute.arch.mbarrier_arrive(empty.get_barrier(stage))
        if cutlass.const_expr(self._clustered()):
            if ab_pipe.is_signaling_thread:
                empty.arrive(stage, ab_pipe.consumer_mask)

    @cute.jit
    def _second_block_group(self, tile_n):
        """The first 8-column group of column tile `tile_n` in the next 128-column block of B's
        scales (tile_n / 8 or more: none; the N edge is not moved back for FP8)."""
        col0 = tile_n * self.cfg.tile_n
        return (128 - col0 % 128) // 8

    def _clustered(self) -> bool:
        return self.cfg.cluster_m * self.cfg.cluster_n > 1

    @cute.jit
    def _scales(self, src, stage):
        """The scales of this thread's two rows (A's x B's) staged in ring stage `stage`; `src`:
        the ring seen from the thread's first row, and the second row's offset from it. A
        straddling tile: both rows' products with each block, and the first group on the second
        block (`_promote`)."""
        if cutlass.const_expr(self.n_blocks == 2):
            sRows, r1, second = src
            lo, hi = sRows[0, 2 * stage], sRows[r1, 2 * stage]
            return lo, hi, sRows[0, 2 * stage + 1], sRows[r1, 2 * stage + 1], second
        sRows, r1 = src
        return sRows[0, stage], sRows[r1, stage]

    @cute.jit
    def _promote(self, acc, frag, scales):
        """acc += frag x the scales: values 4g + 0/1 sit on row r0, 4g + 2/3 on r0 + 8, all
        four in the tile's 8-column group g (a straddling tile: groups from `second` on take
        B's second block, DeepGEMM's per-group selection)."""
        if cutlass.const_expr(self.n_blocks == 2):
            lo0, hi0, lo1, hi1, second = scales
            for g in cutlass.range_constexpr(cute.size(acc) // 4):
                on = second <= g
                lo = cutlass.Float32(cutlass.select_(on, lo1, lo0))
                hi = cutlass.Float32(cutlass.select_(on, hi1, hi0))
                for j in cutlass.range_constexpr(4):
                    acc[4 * g + j] = acc[4 * g + j] + frag[4 * g + j] * (hi if j // 2 else lo)
        else:
            lo, hi = scales
            for g in cutlass.range_constexpr(cute.size(acc) // 4):
                for j in cutlass.range_constexpr(4):
                    acc[4 * g + j] = acc[4 * g + j] + frag[4 * g + j] * (hi if j // 2 else lo)

    def _thread_coords(self, tiled_mma, thread):
        """(row, column) in the tile of each accumulator value of consumer thread `thread`
        (0 .. num_mma_threads - 1: the tiled MMA's slice of the thread; thr_mma is its
        warpgroup's)."""
        return tiled_mma.get_slice(thread).partition_C(
            cute.make_identity_tensor((self.cfg.tile_m, self.cfg.tile_n))
        )

    @staticmethod
    def _scale_rows(coords):
        """The thread's two rows (`_thread_coords`): an SM90 fp32 fragment holds values 4g + 0/1
        on one row and 4g + 2/3 eight rows down, for every 8-column group g."""
        return coords[0][0], coords[2][0]

    @cute.jit
    def _expert(self, groups, row):
        """The grouped layout's expert of `row` (a padding row's -1 reads expert 0: its
        output rows are not the caller's)."""
        return cutlass.max(groups[0][row], 0)

    @cute.jit
    def _scale_blocks(self, n, groups, first_row):
        """(first, last) row of B's block scales for the tile row at `first_row` of a C with
        `n` columns: all of them, or with the grouped layout its expert's ceil(N / 128)."""
        first, last = cutlass.Int32(0), cutlass.Int32(0)
        if cutlass.const_expr(groups is None):
            last = cute.ceil_div(n, 128) - 1
        else:
            per = cute.ceil_div(groups[1], 128)
            first = self._expert(groups, first_row) * per
            last = first + per - 1
        return first, last

    @cute.jit
    def _epilogue(self, gC_tile, tma_c, sC, epi, warp_idx, tiles_done):
        """acc -> C, one (tile_m, epi_n) sub-tile at a time through the epilogue ring."""
        r2s, tRS_sC, tRS_acc, tRS_rAcc, tRS_rC, store_pipe, epi_barrier = epi
        gC_t = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_t
        )
        epi_count = cute.size(gC_t, mode=[1])
        epi_grid = cute.make_layout(gC_t.shape[1], stride=(gC_t.shape[1][1], 1))
        frag = cute.size(tRS_rAcc)
        done_before = tiles_done * epi_count
        store_warp = THREADS_PER_WG // 32  # the first consumer warp issues the TMA stores
        for e in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(frag):
                tRS_rAcc[v] = tRS_acc[e * frag + v]
            tRS_rC.store(tRS_rAcc.load().to(self.c_dtype))
            buf = (done_before + e) % self.cfg.epi_stages
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
