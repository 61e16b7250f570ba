"""Gated delta rule decode / MTP step configurations (DSL-free)."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V): Qwen3-Next, Kimi Linear
K_SPLIT = 4  # threads per state column, each holding K / K_SPLIT entries of it
COLUMNS = 32  # state columns per CTA (128 threads)
THREADS = K_SPLIT * COLUMNS
WARPS = THREADS // 32
MAX_TOKENS = 4  # tokens per step (decode 1, MTP up to 4): the shared staging is sized for it
L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    per_channel: bool = False,
    k_last: bool = True,
    l2norm: bool = False,
    intermediate: bool = False,
    gating: bool = False,
    update_state: bool = True,
) -> tuple:
    """Compile key: the q / k / v dtype, (K, V), per-channel decay (Kimi Delta Attention),
    the state's layout (k_last: (N, HV, V, K), FlashInfer's; else (N, HV, K, V), fla's), the
    q / k l2norm, whether every token's state is also written out (MTP rollback), the
    projection gating computed in the kernel (FlashInfer-Bench's A_log / a / dt_bias / b) and
    whether the final state is stored (False: MTP verification). The last two enter the key
    only when they differ from the default (older keys stay valid)."""
    k, v = head_dims
    key = {
        "dtype": dtype, "k": k, "v": v, "per_channel": per_channel, "k_last": k_last,
        "l2norm": l2norm, "intermediate": intermediate,
    }  # fmt: skip
    if gating:
        key["gating"] = True
    if not update_state:
        key["update_state"] = False
    return tuple(sorted(key.items()))
