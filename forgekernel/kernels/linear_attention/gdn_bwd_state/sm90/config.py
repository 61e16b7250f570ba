"""Gated DeltaNet backward kernel 1 (the reverse state recurrence) configurations and fixed
geometry (DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk: the forward's
ROWS_PER_STATE_WG = 64  # value rows of dS^T a state warpgroup holds
STATE_WGS = 2  # V = 128
STAGES = 2  # chunks in flight in the TMA ring (72 KB a stage)
THREADS = (1 + STATE_WGS) * THREADS_PER_WG
# setmaxnreg split: the producer warpgroup (one TMA warp) and the two state warpgroups (dS^T:
# 64 fp32 accumulators, dU^T: 32, the 16-bit operands dS^T 32, dO^T 16, -dU^T 16)
PRODUCER_REGS = 40
STATE_REGS = 232
assert (PRODUCER_REGS + STATE_WGS * STATE_REGS) * THREADS_PER_WG <= REGISTERS_PER_SM
# the tiles of one chunk, in ring order: dO (C, V), P^T (C, C), K e^(G_C - G), Q e^G, W (C, K),
# and U (C, V) with dke
TILES = ("do", "pt", "ke", "qe", "w", "u")


def stage_bytes(
    k: int = 128,
    v: int = 128,
    elem_bytes: int = 2,
    dke: bool = False,
    channel_decay: bool = False,
    forward: bool = False,
    w_from_t: bool = False,
) -> int:
    """One ring stage: the five tiles (`forward`: three, P^T and Qe built in; `w_from_t`: v,
    T^T (C, C), k), U (C, V) with `dke`, e^(G_C) (K,) fp32 with `channel_decay` (the forward
    launch's too: Kimi Delta Attention's)."""
    if w_from_t:
        tiles = CHUNK * (v + CHUNK + k) * elem_bytes
    elif forward:
        tiles = CHUNK * (v + 2 * k) * elem_bytes
    else:
        tiles = CHUNK * (v + CHUNK + 3 * k + (v if dke else 0)) * elem_bytes
    return tiles + (4 * k if channel_decay else 0)


def smem_bytes(
    k: int = 128,
    v: int = 128,
    elem_bytes: int = 2,
    dke: bool = False,
    channel_decay: bool = False,
    forward: bool = False,
    w_from_t: bool = False,
) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): the
    ring, and with `dke` the chunk-end dS (K, V) in 16 bits that both state warpgroups read
    (`w_from_t`: -W (C, K) a stage, which the state warpgroups write)."""
    ds = k * v * elem_bytes if dke else 0
    w = STAGES * CHUNK * k * elem_bytes if w_from_t else 0
    ring = STAGES * stage_bytes(k, v, elem_bytes, dke, channel_decay, forward, w_from_t)
    return ring + ds + w + 2 * STAGES * 8 + 7 * 1024


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    d_final_state: bool = False,
    dke: bool = False,
    channel_decay: bool = False,
    out16: bool = False,
    forward: bool = False,
    varlen: bool = False,
    fused: bool = False,
    w_from_t: bool = False,
) -> tuple:
    """Compile key: the 16-bit dtype of the tiles, (K, V), whether a final-state gradient is
    read (without one, dS starts from zero), and the state-side output: dke = U dS^T per token
    (`dke`: U read, dS through shared memory, no dh written) or dh = dS^T per chunk (fp32 to
    HBM, 1 KB a token and head: the first form, what the later passes of the reference read).
    `channel_decay` (Kimi Delta Attention: e^(G_C) a (K,) vector per chunk, (B, NC, HV, K),
    scaling dS^T's columns) is in the key only when set: Gated DeltaNet's keys are unchanged.
    `out16` (dU and dS (K, V) a chunk in the tiles' 16-bit dtype, kernel 2's forms; not with
    dke) and `forward` (the forward launch: P^T = I and Qe = 0 compile-time forms, not read; the
    outputs at chunk NC - 1 - c, the forward's chunk order; needs out16) likewise only when
    set. `varlen` (N sequences in the forward's chunk slots, one CTA per (value head,
    sequence) walking its own slots: reverse_state.py's docstring) likewise. `fused` (with
    forward, not varlen: the fused route's forward launch, U not stored, k at its H heads and
    G read in place of Ke) likewise. `w_from_t` (with fused: W and u formed from kernel 0's
    T^T, v, k, beta and G, not read; reverse_state.py's docstring) likewise."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    if out16 and dke:
        raise ValueError("out16 writes dh in 16 bits: not with dke")
    if forward and not out16:
        raise ValueError("forward needs out16")
    if fused and (not forward or varlen):
        raise ValueError("fused needs forward, not varlen")
    if w_from_t and not fused:
        raise ValueError("w_from_t needs fused")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "d_final_state": d_final_state, "dke": dke}
    for name, on in (("channel_decay", channel_decay), ("out16", out16),
                     ("forward", forward), ("varlen", varlen), ("fused", fused),
                     ("w_from_t", w_from_t)):  # fmt: skip
        if on:
            key[name] = True
    return tuple(sorted(key.items()))
