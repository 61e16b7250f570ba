"""Kimi Delta Attention backward kernel 2 (the chunk-parallel output-side gradients)
configurations and fixed geometry (DSL-free: the launcher and the tests read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk (one CTA), the M of every product: each math warpgroup
SUB = 16  # sub-chunk rows (one reference point each; a math warp's rows)
NS = CHUNK // SUB
# warpgroup 0: the TMA warp, the <h, dh> warps; warpgroups 1, 2: the products, each the key
# channels [64 kh, 64 kh + 64) of every product (S computed by both; chunk_grads.py). No
# setmaxnreg: the kernel compiles to 137-139 registers, under 384 threads' 168 (ptxas dropped a
# 40 / 232 pair as moot, 2026-12-06). The 256-thread form (one math warpgroup, 228 registers)
# lost the H100's A/B 3.584 -> 1.597 ms and was deleted (NOTES "next/lin-losers").
THREADS = 3 * THREADS_PER_WG
REGISTERS = REGISTERS_PER_SM // THREADS // 8 * 8  # 168: the launch's cap a thread
HDH_WARPS = 2  # warps 1, 2 of warpgroup 0: rowsum(h o dh) per key channel
# The TMA tiles' mbarriers, one a group, issued in this order; each math warpgroup waits on a
# group just before its first product reading it, the <h, dh> warps on the states' groups.
# (next/kda-chunk-pipe, 2026-12-06; the one barrier before it: ("do", "u", "du", "q", "k", "h",
# "dh"),), the GPU A/B of docs/linear_attention/NOTES.md "KDA backward regressions of
# integration41" a one-line change here.)
LOAD_GROUPS = (("du", "h"), ("do",), ("u",), ("q", "k"), ("dh",))
STATE_GROUPS = tuple(i for i, g in enumerate(LOAD_GROUPS) if "h" in g or "dh" in g)


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): the
    five token tiles, the two states, dP^T (C, C) bf16, G (C, K) fp32 with rows padded by 8,
    the per-channel tables (r, e^(r_I), e^(G_C - r_J), the six E_(I, J) of I > J, the te
    partials, rowsum(h o dh), dP's diagonal), one mbarrier a load group. (k er), (q el) and
    dG's rows reuse dU's, dO's and the states' bytes."""
    tokens = CHUNK * (3 * v + 2 * k) * elem_bytes
    tables = (3 * NS + 6 + NS + 1) * k * 4 + CHUNK * 4
    states, p_t, g = 2 * k * v * elem_bytes, CHUNK * CHUNK * 2, CHUNK * (k + 8) * 4
    return tokens + states + p_t + g + tables + 8 * len(LOAD_GROUPS) + 1024


def params_for(dtype: str, head_dims: tuple[int, int] = (128, 128), *, dw16: bool = False,
               dq16: bool = False, token_rows: bool = False) -> tuple:  # fmt: skip
    """Compile key: the 16-bit dtype of the tiles and (K, V) (the block products run in bf16
    for both: e^(+-a) reaches e^(8 max|g|), past fp16's range); `dw16` (in the key only when
    set): dw written in the tiles' 16-bit dtype (the WY kernel's operand dtype: the op's cast
    moved in), else fp32; `dq16` (likewise): q read unscaled, the runtime `scale` applied in
    registers, dq written times it in the tiles' 16-bit dtype (the op's dq: no epilogue);
    `token_rows` (likewise): the varlen slot layout's dq, dk, dG at their token rows (the
    per-slot tables, Gated DeltaNet kernel 2's flag of the name), dw at the slots."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v}
    if dw16:
        key["dw16"] = True
    if dq16:
        key["dq16"] = True
    if token_rows:
        key["token_rows"] = True
    return tuple(sorted(key.items()))
