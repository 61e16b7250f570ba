"""Kimi Delta Attention backward WY kernel (the chunk-parallel WY half) configurations and
fixed geometry (DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk (one CTA), the M of every product: each math warpgroup
SUB = 16  # sub-chunk rows (one reference point each; a math warp's rows)
NS = CHUNK // SUB
# warpgroup 0: the TMA warp; warpgroups 1, 2: the products, each the value / key channels
# [64 kh, +64) of every product but dA (C x C, computed by both; wy_grads.py); no setmaxnreg
# (139-165 registers, under 384 threads' 168). The 256-thread form (one math warpgroup, 239-241
# registers) lost the H100's A/B 2.043 -> 1.706 ms and was deleted (NOTES "next/lin-losers").
THREADS = 3 * THREADS_PER_WG
REGISTERS = REGISTERS_PER_SM // THREADS // 8 * 8  # 168: the launch's cap a thread
# dbeta's row dots (rowsum(dvb o v), rowsum(z), rowsum(k o dx)) handed from warpgroup 1 to 2
DOTS = 3
# the tiles of one chunk: dw, w, k (C, K), du, u, v (C, V), T^T (C, C)
TOKEN_TILES = ("dw", "du", "w", "k", "u", "v")
# The TMA tiles' mbarriers, one a group, in the order the 256-thread kernel consumed them (it
# waited on each just before its first product): dvb = T^T du; dA = dvb u^T; rowsum(dvb o v);
# dkb = T^T dw; dA += dkb w^T; z = dkb o k o e^G. The math warpgroups wait on u and w after dkb
# (dA from shared memory once both halves are stored): T^T + du, v, dw, u, w, k; u's 16 KB could
# land after v's and dw's (NOTES "KDA backward WY kernel on two math warpgroups": reorder only
# if ncu shows the waits on v or dw stalled).
LOAD_GROUPS = (("tt", "du"), ("u",), ("v",), ("dw",), ("w",), ("k",))
# bytes: the start of dk and dG (B, T, HV, K) fp32 (their K * 4-byte rows keep it): the global
# address of the bulk reduce-adds onto dG's rows and of the bulk L2 prefetches of dk's
BULK_ALIGN = 16


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): the
    six token tiles, T^T and (beta dA)^T (C, C), G and dG's rows (C, K) fp32 with rows padded
    by 8, kernel 2's per-channel tables (`KdaBwdChunkSm90.table`) and warpgroup 1's row-dot
    partials (DOTS x 2 rows x 128 threads), one mbarrier a load group. (k er) and (k el), and
    dvb / dkb before them, reuse dw's and du's bytes."""
    tokens = CHUNK * (3 * k + 3 * v) * elem_bytes
    square = CHUNK * CHUNK * (elem_bytes + 2)
    rows = 2 * CHUNK * (k + 8) * 4
    tables = (4 * NS + NS * (NS - 1) // 2 + 1) * k * 4 + CHUNK * 4
    dots = DOTS * 2 * THREADS_PER_WG * 4
    return tokens + square + rows + tables + dots + 8 * len(LOAD_GROUPS) + 1024


def params_for(dtype: str, head_dims: tuple[int, int] = (128, 128), *, dv16: bool = False,
               dk16: bool = False, token_rows: bool = False) -> tuple:  # fmt: skip
    """Compile key: the 16-bit dtype of the tiles and (K, V) (the score-gradient blocks run in
    bf16 for both: e^(+-a) reaches e^(8 max|g|), past fp16's range); `dv16` (in the key only
    when set): dv written in the tiles' 16-bit dtype (v's, when the op's v is 16-bit: its cast
    moved in), else fp32; `dk16` (likewise): the final dk (kernel 2's fp32 dk plus the WY
    half) written in the tiles' 16-bit dtype into a tensor of its own (the op's dk where no
    l2norm or group sum follows: no epilogue); `token_rows` (likewise): the varlen slot
    layout's dk, dv, dG, dbeta at their token rows (the per-slot tables; kernel 2's flag of the
    name wrote dk, dG there)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v}
    if dv16:
        key["dv16"] = True
    if dk16:
        key["dk16"] = True
    if token_rows:
        key["token_rows"] = True
    return tuple(sorted(key.items()))
