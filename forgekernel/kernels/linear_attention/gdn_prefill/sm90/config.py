"""Chunked Gated DeltaNet forward (prefill) configurations (DSL-free)."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V): Qwen3-Next, Kimi Linear
CHUNK = 64  # tokens per chunk: the WY system is CHUNK x CHUNK, lower-triangular
L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    k_last: bool = False,
    l2norm: bool = False,
    initial_state: bool = False,
) -> tuple:
    """Compile key: the q / k / v dtype, (K, V), the state's layout (k_last: (N, HV, V, K),
    FlashInfer's; else (N, HV, K, V), fla's), the q / k l2norm in the kernel, and whether an
    initial state is read (without one every sequence starts from zero). The final state is
    always written: 64 KB per (sequence, head), against the 64 KB per 128 tokens the inputs
    read, it is not worth a variant."""
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "k_last": k_last, "l2norm": l2norm,
           "initial_state": initial_state}  # fmt: skip
    return tuple(sorted(key.items()))
