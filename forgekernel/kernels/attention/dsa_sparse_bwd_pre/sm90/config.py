"""DSA sparse backward preprocess configurations (DSL-free): the compile key and the launch
geometry of kernel.py.

One warp per (token, head) row of out / dO (D_V = 512 16-bit columns: two 16-byte vectors a
lane of each, 2 KB a row), WARPS rows of one token a CTA: grid (tokens, ceil(H / WARPS)). Baked
in: the dtype, whether a sink is given (lse2 folds it in, the per-row d_sink terms are written)
and whether dLSE is given (Delta' subtracts its term)."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
D_V = 512  # out / dO columns: the latent width
VEC = 8  # 16-bit elements of one 16-byte load
LANES = 32
LOADS = D_V // (VEC * LANES)  # 16-byte vectors a lane loads of each row (2)
WARPS = 4  # rows (heads of one token) a CTA
THREADS = WARPS * LANES


def params_for(dtype: str, sink: bool, dlse: bool) -> tuple[tuple[str, object], ...]:
    """The compile key: dtype, sink given, dLSE given."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return (("dlse", bool(dlse)), ("dtype", dtype), ("sink", bool(sink)))


def grid(tokens: int, heads: int) -> tuple[int, int, int]:
    """(tokens, head blocks, 1): one CTA per WARPS heads of a token."""
    return (tokens, -(-heads // WARPS), 1)
