"""GEMM configurations: the frozen config, the standard set built ahead of time, and the
analytical chooser. DSL-free, so the torch layer can pick a kernel without the compiler."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DTYPES = ("float16", "bfloat16")
NUM_SMS_H100_H200 = 132


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
    swizzle: int = 1  # raster group size, in clusters (L2 reuse)
    raster_along_m: bool = True

    @classmethod
    def from_params(cls, params: dict) -> GemmConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls)})


LARGE = GemmConfig()
SMALL = GemmConfig(tile_n=128, cluster_m=1)
STANDARD_CONFIGS = (LARGE, SMALL)
# Built with `forgekernel build --candidates` and timed by scripts/gemm_sweep.py (bf16, "nk").
CANDIDATES = (
    GemmConfig(cluster_m=1),
    GemmConfig(cluster_m=1, cluster_n=2),
    GemmConfig(swizzle=8),
    GemmConfig(swizzle=8, raster_along_m=False),
    GemmConfig(tile_n=128),
    GemmConfig(tile_n=192),
    GemmConfig(tile_m=64, tile_n=256, cluster_m=1),
)


def params_for(dtype: str, b_kn: bool, cfg: GemmConfig) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value)."""
    return tuple(sorted({"dtype": dtype, "b_kn": b_kn, **asdict(cfg)}.items()))


def choose_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200) -> GemmConfig:
    """Analytical default: the large tile unless it leaves most SMs idle."""
    tiles_large = -(-m // LARGE.tile_m) * -(-n // LARGE.tile_n)
    return LARGE if tiles_large >= num_sms // 2 else SMALL
