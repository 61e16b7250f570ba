"""Attention-forward configurations: the frozen config, the per-head-dim defaults and the
standard set built ahead of time. DSL-free, so the torch layer can pick a kernel without the
compiler."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DTYPES = ("float16", "bfloat16")
# (head_dim, head_dim_v) pairs with a default config; others raise in `default_config`.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))
SMEM_CAPACITY = 232448  # sm_90 per-block opt-in maximum (227 KiB)


@dataclass(frozen=True)
class AttnConfig:
    """Everything baked into one compiled attention forward besides dtype, head dims, causal.

    tile_m query rows per tile (one consumer warpgroup per 64 rows: 128 or 192), tile_n keys
    per K/V tile, stages K and V tiles in flight (one ring each); overlap: a warpgroup's
    softmax runs under its own P V (else the step waits for it first: measured faster, see
    docs/attention/NOTES.md); l2_sections: when one wave of tiles would stream far more K/V
    than L2 holds, order tiles in sections of heads whose K/V fit (else always the global
    longest-first order); poly_exp: of every 8 score columns, how many take exp2 as an FMA-pipe
    polynomial instead of the MUFU (whose 16 results per clock per SM bound the softmax at
    small head dims); cvt_asm: P to 16 bits as inline-PTX packed converts (else the DSL's
    vector conversion, which the compiler sinks past the next GEMM turn's barrier, so the
    turn is held for the conversion and O's rescale before the first WGMMA issues: measured
    5-15% slower at D=128, see docs/attention/NOTES.md); late_rescale: without ping-pong
    (D > 128), O's rescale runs after the next S GEMM is issued, not before;
    rescale_threshold: > 0 keeps a row's running max until the new one exceeds it by more
    than this (log2 units; FA4 on Blackwell uses 8), and skips O's rescale when no row of
    the warp moved."""

    tile_m: int = 128
    tile_n: int = 128
    stages: int = 2
    overlap: bool = False
    l2_sections: bool = True
    poly_exp: int = 0
    cvt_asm: bool = True
    late_rescale: bool = True
    rescale_threshold: float = 0.0

    def tag(self) -> str:
        """Short name for tables: 128x128_s2 (plus _ov / _lpt for the non-default flags)."""
        tag = f"{self.tile_m}x{self.tile_n}_s{self.stages}"
        tag += ("_ov" if self.overlap else "") + ("" if self.l2_sections else "_lpt")
        tag += f"_pe{self.poly_exp}" if self.poly_exp else ""
        tag += "" if self.cvt_asm else "_dslcvt"
        tag += "" if self.late_rescale else "_early"
        return tag + (f"_rt{self.rescale_threshold:g}" if self.rescale_threshold else "")

    @classmethod
    def from_params(cls, params: dict) -> AttnConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls)})


def separate_o(cfg: AttnConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> bool:
    """Whether O gets its own shared-memory buffer (else it reuses Q's, and the next tile's Q
    load waits for the O store)."""
    return _smem(cfg, head_dim, head_dim_v, elem_bytes, True) <= SMEM_CAPACITY


def _smem(cfg, head_dim, head_dim_v, elem_bytes, own_o: bool) -> int:
    q = cfg.tile_m * head_dim * elem_bytes
    o = cfg.tile_m * head_dim_v * elem_bytes
    kv = cfg.stages * cfg.tile_n * (head_dim + head_dim_v) * elem_bytes
    return (q + o if own_o else max(q, o)) + kv + 1024


def smem_bytes(cfg: AttnConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q, O (its own buffer when it fits, else Q's), the K and V
    rings, mbarriers."""
    own_o = separate_o(cfg, head_dim, head_dim_v, elem_bytes)
    return _smem(cfg, head_dim, head_dim_v, elem_bytes, own_o)


# One CTA per SM (the consumer warpgroups take the whole register file), so shared memory
# only bounds stages. D=64: three consumer warpgroups (192-row tiles, FA3's choice), 3 stages;
# D=96 and D=128: two, 2 stages, O in its own buffer; D=256: 64-key tiles (80: 2% slower);
# D=192/Dv=128: O shares Q's buffer, O rescaled before the S GEMM issue (after it: 5% slower).
# Measured on the H200, 2026-11-30 (docs/attention/NOTES.md).
_DEFAULTS = {
    (64, 64): AttnConfig(tile_m=192, tile_n=128, stages=3),
    (96, 96): AttnConfig(tile_n=128, stages=2),
    (128, 128): AttnConfig(tile_n=128, stages=2),
    (256, 256): AttnConfig(tile_n=64, stages=2),
    (192, 128): AttnConfig(tile_n=128, stages=2, late_rescale=False),
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
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    cfg: AttnConfig | None = None,
    varlen: bool = False,
) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value)."""
    cfg = cfg or default_config(head_dim, head_dim_v)
    key = {
        "dtype": dtype,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "causal": bool(causal),
        "varlen": bool(varlen),
        **asdict(cfg),
    }
    return tuple(sorted(key.items()))
