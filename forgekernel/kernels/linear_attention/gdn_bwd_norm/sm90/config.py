"""Gated DeltaNet backward's q / k epilogue (the group sum over value heads and l2norm's
backward) configurations and fixed geometry (DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (128,)  # K
THREADS = 128
VEC = 8  # elements a thread and row: 16 bytes of x, 32 of each value head's fp32 gradient
ROWS = 64  # tokens a CTA (one q / k head, one sequence)
L2NORM_EPS = 1e-6  # reference/delta_rule.py's (the tests compare the two)


def params_for(dtype: str, k: int = 128, *, l2norm: bool = True, d16: bool = False) -> tuple:
    """Compile key: the 16-bit dtype of x and the gradient out, K, and `l2norm` (the
    normalization's backward, else the group sum times the scale only); `d16` (in the key only
    when set): the value heads' gradients in that 16-bit dtype too (the chunk kernel's `dqk16`;
    summed in fp32), else fp32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if k not in HEAD_DIMS:
        raise ValueError(f"K must be one of {HEAD_DIMS}, got {k}")
    key = {"dtype": dtype, "k": k, "l2norm": l2norm}
    if d16:
        key["d16"] = True
    return tuple(sorted(key.items()))
