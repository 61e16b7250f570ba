"""Gated DeltaNet backward kernel 2 (the chunk-parallel output-side gradients) configurations
and fixed geometry (DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk (one CTA), the M of every product: one math warpgroup
THREADS = 2 * THREADS_PER_WG  # warpgroup 0: the TMA warp; warpgroup 1: every product
# the tiles of one chunk: dO, U, dU (C, V), q (scaled), k (C, K), h, dh (K, V)
TOKEN_TILES = ("do", "u", "du", "q", "k")
STATE_TILES = ("h", "dh")
WY_TILES = ("tt", "w", "uw")  # with `wy`: T^T (C, C), w (C, K), u (C, V)
# The TMA boxes' mbarriers, one a group, in the order the math warpgroup consumes them (it waits
# on each just before its first product): dqe = dO h^T; S = dO U^T; dq += dPD k (and dq.q);
# dke = U dh^T; dw = -dU h^T and the WY half. The WY tiles join the last group (`wy` only).
LOAD_GROUPS = (("do", "h"), ("u",), ("q", "k"), ("dh",), ("du", *WY_TILES))
STATE_GROUPS = (0, 3)  # the groups of h, dh: the finish warps wait on these
# `fsplit` (NOTES "two math warpgroups or two CTAs a SM?", option A'): two math warpgroups split
# by function, warpgroup 1 the output half (dq, dk's first half, then dG's finish), warpgroup 2
# the WY half (dw = -dU h^T and `_wy`); they meet once at dk's fp32 stash. The WY chain is the
# longer one: its tiles first (dU + h, T^T + u, w + k), then dO + U, q, dh.
FSPLIT_THREADS = 3 * THREADS_PER_WG
FSPLIT_LOAD_GROUPS = (("du", "h"), ("tt", "uw"), ("w", "k"), ("do", "u"), ("q",), ("dh",))
FSPLIT_STATE_GROUPS = (0, 5)
# setmaxnreg: the producer warpgroup (the TMA warp only), the output warpgroup, the WY one
FSPLIT_REGS = (24, 224, 256)
assert sum(FSPLIT_REGS) * THREADS_PER_WG <= REGISTERS_PER_SM


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2, wy: bool = False,
               fsplit: bool = False) -> int:  # fmt: skip
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): the
    five token tiles, the two states, dPD^T (C, C) 16-bit, one mbarrier a load group, G; with
    `wy` also T^T, M^T (C, C), w, u (C, K / V) and dw (C, K); `fsplit`: one mbarrier more."""
    tokens = CHUNK * (3 * v + 2 * k) * elem_bytes
    extra = (2 * CHUNK * CHUNK + CHUNK * (2 * k + v)) * elem_bytes if wy else 0
    groups = FSPLIT_LOAD_GROUPS if fsplit else LOAD_GROUPS
    head = 8 * len(groups) + CHUNK * 4  # mbarriers, G (fp32), before the aligned tiles
    return tokens + 2 * k * v * elem_bytes + CHUNK * CHUNK * elem_bytes + extra + head + 1024


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    wy: bool = False,
    grouped: bool = False,
    dv16: bool = False,
    dqk16: bool = False,
    fsplit: bool = False,
    token_rows: bool = False,
) -> tuple:
    """Compile key: the 16-bit dtype of the tiles, (K, V) and `wy`: the WY half (`_wy_grads`)
    in the kernel too (dw stays on chip; dv, dbeta out) or `_output_grads` only (dw out);
    `grouped` (in the key only when set): q, k (B, T, H, K) with H < HV, value head hv reading
    q / k head hv // (HV / H) (no HV-repeated copies); `dv16` (wy only, in the key only when
    set): dv written in the tiles' 16-bit dtype (the op's cast to v's dtype moved in); `dqk16`
    (wy only, in the key only when set): dq, dk written in the tiles' 16-bit dtype, rounded
    once from the fp32 accumulators (dk's first half kept in fp32 in shared memory for the WY
    half's terms), dq times the kernel's runtime `scale` argument; `fsplit` (dqk16 only, in the
    key only when set): two math warpgroups split by function (FSPLIT_*), same outputs bit for
    bit; `token_rows` (wy only, in the key only when set): the varlen slot layout's outputs at
    their token rows (the per-slot tables' first token + row, rows below the slot's valid
    count: ops/_linattn_varlen.py `NATIVE_STORES`), the inputs at the slots."""
    if dv16 and not wy:
        raise ValueError("dv16 needs wy (dv is the WY half's output)")
    if dqk16 and not wy:
        raise ValueError("dqk16 needs wy (without it dk takes torch's WY terms in fp32)")
    if token_rows and not wy:
        raise ValueError("token_rows needs wy (the op's outputs are the WY form's)")
    if fsplit and not dqk16:
        raise ValueError("fsplit needs dqk16 (the warpgroups meet at dk's fp32 stash)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "wy": wy}
    if grouped:
        key["grouped"] = True
    if dv16:
        key["dv16"] = True
    if dqk16:
        key["dqk16"] = True
    if fsplit:
        key["fsplit"] = True
    if token_rows:
        key["token_rows"] = True
    return tuple(sorted(key.items()))
