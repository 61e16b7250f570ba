"""Attention-forward configurations: the frozen config, the per-head-dim defaults and the
standard set built ahead of time. DSL-free, so the torch layer can pick a kernel without the
compiler."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DTYPES = ("float16", "bfloat16")
# (head_dim, head_dim_v) pairs with a default config; others raise in `default_config`.
HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
SMEM_CAPACITY = 232448  # sm_90 per-block opt-in maximum (227 KiB)


@dataclass(frozen=True)
class AttnConfig:
    """Everything baked into one compiled attention forward besides dtype, head dims, causal.

    tile_m query rows per CTA (two consumer warpgroups of 64 rows), tile_n keys per K/V tile,
    stages K and V tiles in flight (one ring each)."""

    tile_m: int = 128
    tile_n: int = 128
    stages: int = 2

    def tag(self) -> str:
        """Short name for tables: 128x128_s2."""
        return f"{self.tile_m}x{self.tile_n}_s{self.stages}"

    @classmethod
    def from_params(cls, params: dict) -> AttnConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls)})


def smem_bytes(cfg: AttnConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q (reused for O), the K and V rings, mbarriers."""
    q = cfg.tile_m * max(head_dim, head_dim_v) * elem_bytes
    kv = cfg.stages * cfg.tile_n * (head_dim + head_dim_v) * elem_bytes
    return q + kv + 1024


# One CTA per SM (2 consumer warpgroups at 240 registers take the whole register file), so
# shared memory only bounds stages: D=64 3 stages (112 KiB), D=128 2 (160 KiB), D=256 64-key
# tiles x 2 (192 KiB), D=192/Dv=128 2 (208 KiB).
_DEFAULTS = {
    (64, 64): AttnConfig(tile_n=128, stages=3),
    (128, 128): AttnConfig(tile_n=128, stages=2),
    (256, 256): AttnConfig(tile_n=64, stages=2),
    (192, 128): AttnConfig(tile_n=128, stages=2),
}


def default_config(head_dim: int, head_dim_v: int) -> AttnConfig:
    """The analytical default for a head-dim pair (no tuning at call time)."""
    try:
        return _DEFAULTS[(head_dim, head_dim_v)]
    except KeyError:
        raise ValueError(
            f"head dims (D={head_dim}, Dv={head_dim_v}) unsupported; supported: {HEAD_DIMS}"
        ) from None


def params_for(
    dtype: str, head_dim: int, head_dim_v: int, causal: bool, cfg: AttnConfig | None = None
) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value)."""
    cfg = cfg or default_config(head_dim, head_dim_v)
    key = {
        "dtype": dtype,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "causal": bool(causal),
        **asdict(cfg),
    }
    return tuple(sorted(key.items()))
