"""Gated DeltaNet backward kernel 0 (the chunk factors) configurations and fixed geometry
(DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import BLOCK, W_STRIDE, X_STRIDE

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk (one CTA), the M of every product: one math warpgroup each
# warpgroup 0: the TMA warp; two math warpgroups by independent products (warpgroup 1: gates, A,
# T, T^T, u; warpgroup 2: P^T, Ke, Qe, W from T); no setmaxnreg (under 384 threads' 168)
THREADS = 3 * THREADS_PER_WG
REGISTERS = REGISTERS_PER_SM // THREADS // 8 * 8  # 168: the launch's cap a thread
# the 16-bit token tiles out, in the launcher's and `reference.gdn_bwd_factors.NAMES`' order
OUT_TILES = ("w", "u", "pt", "ke", "qe", "tt")
# the `fused` key's (the op's fused route): no Ke, Qe, which neither the fused kernel nor kernel
# 1's forward launch (its `fused` key: k and G in place of Ke) reads
FUSED_OUT_TILES = tuple(n for n in OUT_TILES if n not in ("ke", "qe"))
# the `w_from_t` key's (with fused): no W, u either, which kernel 1's forward launch and the
# fused kernel form from T^T (their `w_from_t` keys)
T_ONLY_OUT_TILES = tuple(n for n in FUSED_OUT_TILES if n not in ("w", "u"))
# The TMA boxes' mbarriers, one a group (all boxes issued at once, TMA order = group order); a
# math warpgroup waits on each just before its first product on it: k (A = K K^T, then the
# inverse; warpgroup 2's Q K^T), q (P = Q K^T, beside the inverse), v (u = [T diag(beta)] V)
LOAD_GROUPS = (("k",), ("q",), ("v",))


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): q, k,
    v in; W, u, Ke, Qe (C, K / V) and P^T, T^T (C, C) out; the inverse's fp32
    scratches (the forward's strides); one mbarrier a load group and the gate vectors."""
    tiles = CHUNK * (2 * k + v) + CHUNK * (3 * k + v) + 2 * CHUNK * CHUNK
    scratch = (CHUNK * W_STRIDE + 2 * BLOCK * X_STRIDE) * 4
    head = 8 * len(LOAD_GROUPS) + 3 * CHUNK * 4  # mbarriers, G2, beta, beta e^G (fp32)
    return tiles * elem_bytes + scratch + head + 1024


def out_tiles(fused: bool = False, w_from_t: bool = False) -> tuple[str, ...]:
    """The token tiles a key writes, in the kernel's argument order (`fused`: no Ke, Qe;
    `w_from_t`: no W, u either)."""
    if w_from_t:
        return T_ONLY_OUT_TILES
    return FUSED_OUT_TILES if fused else OUT_TILES


def params_for(dtype: str, head_dims: tuple[int, int] = (128, 128), fused: bool = False,
               w_from_t: bool = False) -> tuple:  # fmt: skip
    """Compile key: the 16-bit dtype of q, k, v and the tiles, (K, V); `fused` (in the key only
    when set): the op's fused route's tiles, no Ke, Qe (`FUSED_OUT_TILES`), the others bit for
    bit; `w_from_t` (with fused, likewise): no W, u, v not read (`T_ONLY_OUT_TILES`)."""
    if w_from_t and not fused:
        raise ValueError("w_from_t needs fused")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v}
    if fused:
        key["fused"] = True
    if w_from_t:
        key["w_from_t"] = True
    return tuple(sorted(key.items()))
