"""Gated delta rule decode / MTP step configurations (DSL-free)."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V): Qwen3-Next, Kimi Linear
K_SPLIT = 4  # threads per state column, each holding K / K_SPLIT entries of it
COLUMNS = 32  # state columns per CTA (128 threads)
THREADS = K_SPLIT * COLUMNS
WARPS = THREADS // 32
MAX_TOKENS = 4  # tokens per step (decode 1, MTP up to 4): the shared staging is sized for it
# The k-last kernel (step_rows.py): a warp streams whole 512-byte rows of the (V, K) state, lane
# l holding entries 4l .. 4l + 3 of each of ROWS_PER_WARP rows; ROW_WARPS warps per CTA.
ROWS_PER_WARP = 8
ROW_WARPS = 4
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
    tokens: int | None = None,
    pool: bool = True,
) -> tuple:
    """Compile key: the q / k / v dtype, (K, V), per-channel decay (Kimi Delta Attention),
    the state's layout (k_last: (N, HV, V, K), FlashInfer's; else (N, HV, K, V), fla's), the
    q / k l2norm, whether every token's state is also written out (MTP rollback), the
    projection gating computed in the kernel (FlashInfer-Bench's A_log / a / dt_bias / b) and
    whether the final state is stored (False: MTP verification), the number of tokens T when
    the kernel bakes it in (the k-last kernel: every token's loads hoisted ahead of the state's
    use) and whether the state rows come from an index tensor (pool; False: row b for
    sequence b, no index load ahead of the state's). The last four enter the key only when they
    differ from the default (older keys stay valid)."""
    k, v = head_dims
    key = {
        "dtype": dtype, "k": k, "v": v, "per_channel": per_channel, "k_last": k_last,
        "l2norm": l2norm, "intermediate": intermediate,
    }  # fmt: skip
    if gating:
        key["gating"] = True
    if not update_state:
        key["update_state"] = False
    if tokens is not None:
        key["tokens"] = tokens
    if not pool:
        key["pool"] = False
    return tuple(sorted(key.items()))
