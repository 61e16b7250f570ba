"""The frozen GEMM configuration (`GemmConfig`: everything baked into one compiled kernel
besides dtypes and operand majors) and the shared-memory ring it implies. The only part of the
configuration code that device code imports (kernel.py, compile.py, the FP8 and convolution
kernels on the same mainloop), so that the chooser (`config.py`, `plan.py`) can be refitted
without changing any kernel's source hash."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY

# Knobs measured and dropped (docs/gemm/NOTES.md) with the value that meant "off": a tuning
# record written before they left and turning one on names a kernel that no longer exists.
DROPPED_KNOBS = {"split_k": 1, "pingpong": False}


@dataclass(frozen=True)
class GemmConfig:
    """Everything baked into one compiled GEMM besides dtypes and operand majors."""

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 64
    cluster_m: int = 2
    cluster_n: int = 1
    stages: int = 0  # 0: as many as fit in shared memory
    epi_stages: int = 4
    epi_n: int = 32  # epilogue sub-tile = (tile_m, epi_n), staged through shared memory
    swizzle: int = 1  # raster group size, in clusters (L2 reuse)
    raster_along_m: bool = True
    stream_k: bool = False  # k-iterations cut evenly over one wave of CTAs (kernel.py)
    a_rows: int = 0  # rows of A each stage loads (0: tile_m); small M only (kernel.py)
    # Operands swapped (dense 16-bit, B "nk" only): the launcher computes C^T = B A^T, the
    # weight's N rows as the kernel's M, the tokens as its N, C written through its (N, M)
    # M-major view (launch.py `gemm`). In the compile key only when set.
    swap: bool = False
    # FP8: how many k-tiles ahead the producer loads the scales it stages (kernel.py `_load`).
    # In the compile key only when not 1 (a candidate, docs/gemm/NOTES.md "8192^3").
    scale_ahead: int = 1
    # FP8: A's scales read M-major, a (M, K/128) view with unit stride along M (the launcher
    # passes DeepGEMM's TMA-aligned layout as is, transposes any other): one vector load a lane
    # per k-tile (kernel.py `_fetch_scales`). In the compile key only when set (a candidate,
    # docs/gemm/NOTES.md "A's scales M-major").
    scale_mn_major: bool = False
    # FP8: the producer warpgroup's second warp loads and stages the scales, the first only
    # issues the TMA loads (kernel.py `_load`: no k-tile's TMA waits on a scale load). In the
    # compile key only when set (a candidate, docs/gemm/NOTES.md "next/fp8-narrow-scales").
    scale_warp: bool = False

    def fits(self, m: int) -> bool:
        """Whether this configuration computes M rows: a short A box (a_rows) covers one
        tile row of at most a_rows rows."""
        return not self.a_rows or m <= self.a_rows

    def key(self) -> dict:
        """The fields as a compile key's part: `swap`, `scale_mn_major` and `scale_warp` only
        when set, `scale_ahead` only when not 1 (older keys stay valid)."""
        fields_ = asdict(self)
        if not self.swap:
            del fields_["swap"]
        if self.scale_ahead == 1:
            del fields_["scale_ahead"]
        if not self.scale_mn_major:
            del fields_["scale_mn_major"]
        if not self.scale_warp:
            del fields_["scale_warp"]
        return fields_

    def tag(self) -> str:
        """Short name for tables: 128x256_c2x1_s0_e4x32_w1m."""
        return (
            f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}_s{self.stages}"
            f"_e{self.epi_stages}x{self.epi_n}_w{self.swizzle}{'m' if self.raster_along_m else 'n'}"
            + ("_sk" if self.stream_k else "")
            + (f"_a{self.a_rows}" if self.a_rows else "")
            + ("_swap" if self.swap else "")
            + (f"_f{self.scale_ahead}" if self.scale_ahead != 1 else "")
            + ("_mn" if self.scale_mn_major else "")
            + ("_sw" if self.scale_warp else "")
        )

    @classmethod
    def from_params(cls, params: dict) -> GemmConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})

    @classmethod
    def from_record(cls, record: dict) -> GemmConfig | None:
        """A recorded tuning winner's config; None if it turns on a dropped knob."""
        if any(record.get(name, off) != off for name, off in DROPPED_KNOBS.items()):
            return None
        return cls.from_params(record)


def straddles(tile_n: int) -> bool:
    """Whether a block-scaled (FP8) tile of `tile_n` columns may cover two 128-column blocks of
    B's scales: tile_n not dividing 128 (48, 80, 96, 112; kernel.py stages both blocks' products
    and selects one per 8-column group); a width dividing 128 keeps every tile in one block."""
    return 128 % tile_n != 0


def ring_stages(
    cfg: GemmConfig, elem_bytes: int = 2, c_bytes: int = 2, scale_bytes: int = 0
) -> int:
    """AB stages that fit in shared memory (the kernel's `stages` when cfg.stages is 0): A's
    ring holds a_rows rows a stage plus tile_m - a_rows once after the last (kernel.py
    `_compact_ring`), B's tile_n rounded up to 16 rows (kernel.py `_setup`), and `scale_bytes`
    of block scales (FP8: tile_m fp32); 1 KB for the barriers, the epilogue ring besides."""
    row = cfg.tile_k * elem_bytes
    a_rows = cfg.a_rows or cfg.tile_m
    epilogue = cfg.epi_stages * cfg.tile_m * cfg.epi_n * c_bytes
    free = SMEM_CAPACITY - 1024 - epilogue - (cfg.tile_m - a_rows) * row
    return free // ((a_rows + cfg.tile_n + cfg.tile_n % 16) * row + scale_bytes)
