"""Kimi Delta Attention forward (prefill), sm_90a: the recurrence kernel's configurations and
fixed geometry (DSL-free: the launcher, the tests and the CPU replay read it).

Two passes, as FlashKDA and fla split the work: a token-parallel first pass writes, per
64-token chunk and value head, everything that does not depend on the state
(`reference.kda_chunked.chunk_operands`: the per-channel decays folded into 16-bit operand
tiles Kg = K e^G, Qg = scale Q e^G, Kd = K e^(G_C - G), T diag(beta), P, and e^(G_C)); the
recurrence kernel (`recurrence.py`) then walks each sequence's chunks in order with the
state on chip. The first pass runs on its kernel (`intra.py`; `operands.py` is its torch model).
"""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")  # q / k / v / o; the chunk operands are bf16 always
HEAD_DIMS = ((128, 128),)  # (K, V): Kimi Linear
CHUNK = 64  # tokens per chunk

# Warpgroups: 0 producer (warp 0: TMA), 1 and 2 state (64 value rows of S^T each).
STATE_WGS = 2
ROWS_PER_STATE_WG = 64
THREADS = (1 + STATE_WGS) * THREADS_PER_WG  # without value_split; with it one state WG
SPLIT_THREADS = 2 * THREADS_PER_WG
LAUNCH_REGS = REGISTERS_PER_SM // THREADS // 8 * 8  # 168: what the launch may ask per thread
PRODUCER_REGS = 40
STATE_REGS = 232
assert (PRODUCER_REGS + STATE_WGS * STATE_REGS) * THREADS_PER_WG <= REGISTERS_PER_SM

# Ring depths (chunks in flight): Qg / Kg (read by X and O, released right after), v, and the
# aux ring (Kd, T diag(beta), P, e^(G_C): read until the state update).
QK_STAGES = 2
V_STAGES = 2
AUX_STAGES = 2


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included)."""
    qk = QK_STAGES * 2 * CHUNK * k * elem_bytes
    vv = V_STAGES * CHUNK * v * elem_bytes
    aux = AUX_STAGES * (CHUNK * k * elem_bytes + 2 * CHUNK * CHUNK * elem_bytes + k * 4)
    out = STATE_WGS * 2 * CHUNK * ROWS_PER_STATE_WG * elem_bytes
    barriers = 2 * (QK_STAGES + V_STAGES + AUX_STAGES) * 8
    return qk + vv + aux + out + barriers + 1024 * 8


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    initial_state: bool = False,
    value_split: bool = False,
    warmup: bool = False,
) -> tuple:
    """Compile key: the q / v / o dtype (the chunk operands are bf16), (K, V), whether an
    initial state is read (fla's (N, HV, K, V) layout; without one every sequence starts from
    zero), and value_split (two CTAs per (sequence, head), one state warpgroup each: chosen
    where sequences x heads leave SMs idle). The final state is always written. warmup
    (opt-in, named in the key only when on): sequence n walks mWarm[n] chunks before its first
    stored row (`launch._pieces`)."""
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "initial_state": initial_state,
           "value_split": value_split}  # fmt: skip
    if warmup:
        key["warmup"] = True
    return tuple(sorted(key.items()))
