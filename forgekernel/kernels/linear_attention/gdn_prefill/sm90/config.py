"""Chunked Gated DeltaNet forward (prefill) configurations and the kernel's fixed geometry
(DSL-free: the launcher, the tests and the CPU replay read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V): Qwen3-Next, Kimi Linear
CHUNK = 64  # tokens per chunk: the WY system is CHUNK x CHUNK, lower-triangular
BLOCK = 16  # the triangular inverse's diagonal blocks (4 per chunk, one per aux warp)
L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)

# Warpgroups: 0 producer (warp 0 TMA, warp 1 gates), 1 aux (scores, masks, inverse),
# 2 and 3 state (64 value rows of the state each).
STATE_WGS = 2
ROWS_PER_STATE_WG = 64
THREADS = (2 + STATE_WGS) * THREADS_PER_WG
# setmaxnreg split, multiples of 8, summing to at most the register file per CTA thread slot
PRODUCER_REGS = 24
AUX_REGS = 104
STATE_REGS = 192
assert (PRODUCER_REGS + AUX_REGS + STATE_WGS * STATE_REGS) * THREADS_PER_WG <= REGISTERS_PER_SM

# Ring depths (chunks in flight). q / k: 3, so that the aux warpgroup can load and work on
# chunk c + 2 while the state warpgroups are on chunk c (with 2 it could start chunk c + 1 only
# a TMA latency after they released chunk c - 1: its ~2000 cycles then barely fit); v: 2 (the
# state warpgroups' alone); the gate and aux rings: 2.
QK_STAGES = 3
V_STAGES = 2
STAGES = 2
W_STRIDE = CHUNK + 8  # fp32 words per row of the inverse's scratch (8-byte stores: 2 wavefronts)
X_STRIDE = 2 * BLOCK + 8  # the 32 x 32 scratch of the 32 -> 64 merge


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included)."""
    tiles = CHUNK * (QK_STAGES * 2 * k + V_STAGES * v) * elem_bytes  # q, k, v rings
    aux = 2 * STAGES * CHUNK * CHUNK * elem_bytes  # P and T diag(beta) rings
    out = STATE_WGS * 2 * CHUNK * ROWS_PER_STATE_WG * elem_bytes  # O tiles, double-buffered
    scratch = (CHUNK * W_STRIDE + 2 * BLOCK * X_STRIDE) * 4
    tables = (2 * STAGES * CHUNK + STAGES * 4 * CHUNK + STAGES * 3 * CHUNK) * 4
    barriers = 2 * (QK_STAGES + V_STAGES + 2 * STAGES) * 8
    return tiles + aux + out + scratch + tables + barriers + 1024 * 4


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
