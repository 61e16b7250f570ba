"""Kimi Delta Attention backward, kernel 2 and the WY kernel fused (one CTA per chunk-head does
both phases): configurations and fixed geometry (DSL-free: the launcher, the op's switch and the
tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import config as chunk
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import config as wy

DTYPES = chunk.DTYPES
HEAD_DIMS = chunk.HEAD_DIMS  # (K, V)
CHUNK = chunk.CHUNK
# warpgroup 0: the TMA warp and kernel 2's <h, dh> warps; warpgroups 1, 2: both phases' products
# on their key / value channel halves (kernel 2's and the WY kernel's split, unchanged)
THREADS = 3 * THREADS_PER_WG
REGISTERS = REGISTERS_PER_SM // THREADS // 8 * 8  # 168: the launch's cap a thread
# Phase A (kernel 2's products): kernel 2's load groups as they are. Phase B (the WY products):
# the WY kernel's groups with du re-read (phase A's dU bytes hold (k er), then dG's rows) and dw,
# k on chip (dw from phase A, k phase A's tile): their groups carry 0 bytes and complete when
# armed. Phase B's boxes land in bytes phase A has finished with: du over U, T^T and v over dh
# (issued once both math warpgroups' dke has retired), u over dO ((q el)), W over q (once both
# are through phase A; fused_grads.py EARLY_B / LATE_B).
A_GROUPS = chunk.LOAD_GROUPS
B_GROUPS = wy.LOAD_GROUPS
ON_CHIP = ("dw", "k")  # phase B's tiles already in shared memory
HDH_WARPS = chunk.HDH_WARPS
BULK_ALIGN = wy.BULK_ALIGN


def group_bytes(groups, sizes: dict[str, int], token: int, on_chip=()) -> tuple[int, ...]:
    """The bytes each load group's mbarrier is armed with: its tiles' boxes' (`sizes`: a
    tile's bytes by name, `token` a (C, 128) token tile's, the others), a tile in `on_chip`
    none (no box). Phase A's groups take it without `on_chip`: k is a box there and on chip in
    phase B only (one table for both armed phase A's q + k group with 16 of its 32 KB,
    next/kda-fuse-hang)."""
    return tuple(sum(0 if n in on_chip else sizes.get(n, token) for n in g) for g in groups)


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA: kernel 2's (its tiles, states, dP^T, G, tables), the WY
    kernel's row-dot partials after the tables, dw (C, K) in the tiles' dtype (phase A's
    product, phase B's operand) and phase B's six more mbarriers. Phase B's T^T, W, u, v and du
    reuse phase A's bytes; its dG rows are phase A's."""
    dots = wy.DOTS * 2 * THREADS_PER_WG * 4
    dw = CHUNK * k * elem_bytes
    return chunk.smem_bytes(k, v, elem_bytes) + dots + dw + 8 * len(B_GROUPS)


def params_for(dtype: str, head_dims: tuple[int, int] = (128, 128), *, dq16: bool = False,
               dv16: bool = False, dk16: bool = False,
               token_rows: bool = False) -> tuple:  # fmt: skip
    """Compile key: kernel 2's dtype and (K, V) with dw always in the tiles' dtype (its `dw16`:
    the WY phase's operand, now on chip), kernel 2's `dq16` and `token_rows`, the WY kernel's
    `dv16` and `dk16` (each in the key only when set; their meanings are the two kernels')."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v}
    for name, on in (("dq16", dq16), ("dv16", dv16), ("dk16", dk16), ("token_rows", token_rows)):
        if on:
            key[name] = True
    return tuple(sorted(key.items()))
