"""Attention forward (FlashAttention layout), sm_90a. DSL-free declaration; the kernel itself is
`kernel.py`.

Compiled function, fixed length: fn(q, k, v, o, lse, None, None, softmax_scale_log2, 0,
qgroup, num_ctas, None) with q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv),
o (B, Sq, Hq, Dv) in bf16/fp16 (last dim contiguous), lse (B, Hq, Sq) fp32 contiguous,
softmax_scale_log2 = softmax_scale * log2(e), qgroup the query rows per position (pack-GQA:
G query heads of a kv head packed as rows s * G + g of one head; else 1), num_ctas the
persistent grid (the launcher's `config.grid_ctas`: the SM count for fixed length, several
CTAs a SM for varlen). Varlen (params varlen=True): fn(q, k, v, o, lse,
cu_seqlens_q, cu_seqlens_k, softmax_scale_log2, max_seqlen_q, 1, num_ctas, None) with q
(Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), o (Tq, Hq, Dv), lse (Hq, Tq), int32 offsets
(B + 1,). Paged (params page_box > 0): fn(q, k_cache, v_cache, o, lse, cu_seqlens_q,
seqlens_k, softmax_scale_log2, max_seqlen_q, 1, num_ctas, page_table) with caches (pages,
page_size, Hkv, D / Dv) (page_box = min(page_size, tile_n), page_size a multiple of tile_n
when it is not below it: `config.page_box_for`), seqlens_k int32 (B,), page_table
int32 (B, max_pages), the rest as varlen; packed (params packed=True with view_group=G,
paged only; G in config.VIEW_GROUPS dividing tile_m): q, o (Tq, Hkv, G, D) and lse (Hkv, G,
Tq), views of the caller's (Tq, Hq, D) / (Hq, Tq) that the kernel reads as GQA-packed rows
(row t * G + g of kv head h: query head h * G + g of token t; no copy), cu_seqlens_q * G,
max_seqlen_q * G, qgroup G, every sequence run (none left to the paged decode). Dynamic
tiles (params dynamic=True: the D = 128 varlen default and the fixed-length rules that take
the counter, `config.FIXED_RULES`; not paged): the last argument is a zeroed int32 (1,) tile
counter instead of None, num_ctas one a SM. The stream is the TVM-FFI
environment stream.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

from forgekernel.kernels.attention.fwd.sm90.config import (
    DTYPES,
    FIXED_RULES,
    HEAD_DIMS,
    PAGE_BOXES,
    PAGED_HEAD_DIMS,
    VIEW_GROUPS,
    AttnConfig,
    default_config,
    params_for,
    rule_params,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.fwd.sm90.compile import compile_attention_fwd

    return compile_attention_fwd(dict(params), "sm_90a", extra_options)


# GQA packed by default in the fixed-length mode in these classes, (head_dim = head_dim_v,
# causal) (`launch.pack_group`): a call with G = Hq / Hkv > 1, G one of VIEW_GROUPS dividing
# the plan's tile_m, runs its G query heads of a kv head as G * Sq rows of one head through
# views of q / o / lse (the view_group compile), at any Sq. D = 64 causal (192-row tiles): b16
# hq32 hkv8 s1024 0.843x of the unpacked time on the H100 (2026-12-07 14:57; docs/attention/
# NOTES.md "next/attn-gqa-pack", "next/gqa-pack-wide", "next/gqa-pack-d64"): fewer masked key
# blocks. Non-causal D = 64 saves no step but reads a kv head's blocks once for its G heads'
# rows: b4 hq32 hkv8 s4096 0.925x (eager 0.936x) of the unpacked time (17:05; "next/gqa-pack-
# d64nc"). D = 128 ran 1.35-1.49x slower packed (s512). No FIXED_RULES rule takes a D = 64 GQA
# problem (rule 7 is MHA), so the default config's keys are the whole set.
PACK_CLASSES = ((64, True), (64, False))


@functools.cache
def pack_groups(head_dim: int, causal: bool) -> tuple[int, ...]:
    """The G > 1 of VIEW_GROUPS a fixed-length call at `head_dim` (= head_dim_v) runs packed
    by default: those dividing its default config's tile_m; () outside PACK_CLASSES."""
    if (head_dim, bool(causal)) not in PACK_CLASSES:
        return ()
    tile_m = default_config(head_dim, head_dim).tile_m
    return tuple(g for g in VIEW_GROUPS if g > 1 and tile_m % g == 0)


def _standard_params() -> list[Params]:
    """Every head-dim pair's default (both dtypes and masks, fixed length and varlen), each
    fixed-length rule's config (FIXED_RULES: the L2 sections and the tile counter where they
    were measured, both dtypes), the fixed-length GQA-packed compiles of PACK_CLASSES (each G
    of `pack_groups`, both dtypes) and the paged op's prefill kernels."""
    dense = [
        params_for(dtype, d, dv, causal, varlen=varlen)
        for dtype in DTYPES
        for d, dv in HEAD_DIMS
        for causal in (False, True)
        for varlen in (False, True)
    ]
    rules = [rule_params(dtype, i) for dtype in DTYPES for i in range(1, len(FIXED_RULES) + 1)]
    packs = [
        params_for(dtype, d, d, causal, view_group=g)
        for dtype in DTYPES
        for d, causal in PACK_CLASSES
        for g in pack_groups(d, causal)
    ]
    return dense + rules + packs + _paged_params()


def _paged_params() -> list[Params]:
    """The paged op's prefill kernels: its head dims, both masks, a box per page size 8 to
    128 (boxes up to the tile: a 128-row page under 64-key tiles loads as 64-row boxes), each
    as the split's (the decode rows skipped) and the packed form's for every G of VIEW_GROUPS
    dividing the tile's rows (the whole batch GQA-packed on views of q / o / lse:
    `launch.attention_paged_fwd(packed=True)`, the chunked-prefill default)."""
    found = []
    for dtype in DTYPES:
        for d in PAGED_HEAD_DIMS:
            cfg = default_config(d, d, paged=True)
            groups = [0] + [g for g in VIEW_GROUPS if cfg.tile_m % g == 0]
            boxes = [b for b in PAGE_BOXES if b <= cfg.tile_n]
            for causal in (False, True):
                for box in boxes:
                    for g in groups:
                        key = params_for(dtype, d, d, causal, varlen=True, page_box=box,
                                         packed=g > 0, view_group=g)  # fmt: skip
                        found.append(key)
    return found


# 192/128 against FA4's schedule (docs/attention/NOTES.md): what is still open after the
# 2026-12-05 adoption of the tile counter in sections (FIXED_RULES), bf16 causal fixed length,
# on the three long cases (already in sections there, so these keys' wave_kv_mib is moot):
# K a block ahead of V with the counter (0.957-0.998 of the counter alone in a noisy run) and
# the counter in 12 MiB sections (one or two heads; 0.952-1.014 of it). Measured and dropped
# or taken into the rule: docs/attention/NOTES.md "192/128 and the L2 rules adopted".
D192_CANDIDATES = (
    {"dynamic": True, "k_ahead": True},
    {"dynamic": True, "l2_kv_mib": 12},
)


# The L2 model's candidates on the cases FIXED_RULES left unmoved (docs/attention/NOTES.md,
# "The L2 model over every forward class", "192/128 and the L2 rules adopted"): D = 64 causal in
# sections alone (1.100) and with the counter (0.994: a tie, not taken). (head_dim, causal,
# knobs), bf16, fixed length, on the head dim's default config otherwise. D = 128 causal in
# sections at every size is `_candidate_params`' own (the GQA-4 causal control); D = 128 causal
# with the counter and D = 128 non-causal in sections are FIXED_RULES' (standard: rules 6 and 8,
# the latter also the non-causal GQA-4 controls' `wave0`). D = 128 non-causal in 12 MiB sections
# (`wave0_sec12`: 1.000 of 24 MiB, twice) dropped with rule 8.
L2_CANDIDATES = (
    (64, True, {"wave_kv_mib": 0}),
    (64, True, {"dynamic": True, "wave_kv_mib": 0}),
)

# D = 96 on three consumer warpgroups (192-row tiles: FA4's and FA3's shape for D <= 96, ours
# for D = 64; docs/attention/NOTES.md "next/attn-fwd-gap (2026-12-07)"): the suite's slowest
# case, b2 hq32 hkv8 s8192 D = 96 causal, runs 0.896x FA4 on 128-row tiles, compute-bound. With
# P in registers a 128-key tile spills at 160 registers a thread (96 bytes), so the keys a tile
# drop to 112 (2 or 3 stages) or 96 (3 stages); in sections (`wave_kv_mib` 0) for the two D = 96
# classes FIXED_RULES moves (rules 2 and 3). (head_dim, causal, knobs) as L2_CANDIDATES.
WG3_CANDIDATES = (
    (96, True, {"tile_m": 192, "tile_n": 112}),
    (96, True, {"tile_m": 192, "tile_n": 112, "stages": 3}),
    (96, True, {"tile_m": 192, "tile_n": 96, "stages": 3}),
    (96, True, {"tile_m": 192, "tile_n": 112, "wave_kv_mib": 0}),
    (96, False, {"tile_m": 192, "tile_n": 112, "wave_kv_mib": 0}),
)


# GQA packed in the fixed-length mode outside PACK_CLASSES (`launch.attention_fwd(
# pack_gqa=True)`, the bench's `gqa_pack`; docs/attention/NOTES.md "next/attn-gqa-pack
# (2026-12-07)"): the view_group compile of each such PACK_TIMED case's plan (the head dim's
# default: no FIXED_RULES rule takes them), bf16, (head_dim, causal, G). D = 64 is standard
# (PACK_CLASSES).
PACK_CANDIDATES = (
    (128, True, 4),
    (128, False, 4),
    (128, True, 8),
)


def _candidate_params() -> list[Params]:
    """The static deal of the D = 128 varlen launch (its default before the tile counter),
    bf16 causal: the bench's `static` variant (docs/attention/NOTES.md, "Measured 2026-12-04
    00:40-00:50"); the 192/128 schedule candidates (D192_CANDIDATES); D = 128 causal in L2
    sections at every size (non-causal: rule 8's standard key); the other head dims' L2
    candidates (L2_CANDIDATES); D = 96 on 192-row tiles (WG3_CANDIDATES); GQA packed in the
    fixed-length mode (PACK_CANDIDATES, on the PACK_TIMED cases' plans)."""
    static = replace(default_config(128, 128, varlen=True), dynamic=False)
    d192 = [replace(default_config(192, 128), **knobs) for knobs in D192_CANDIDATES]
    wave0 = replace(default_config(128, 128), wave_kv_mib=0)
    return (
        [params_for("bfloat16", 128, 128, True, static, varlen=True)]
        + [params_for("bfloat16", 192, 128, True, cfg) for cfg in d192]
        + [params_for("bfloat16", 128, 128, True, wave0)]
        + [
            params_for("bfloat16", d, d, causal, replace(default_config(d, d), **knobs))
            for d, causal, knobs in L2_CANDIDATES + WG3_CANDIDATES
        ]
        + [params_for("bfloat16", d, d, causal, view_group=g) for d, causal, g in PACK_CANDIDATES]
    )


SPEC = KernelSpec(
    name="attention_fwd_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = [
    "SPEC",
    "AttnConfig",
    "L2_CANDIDATES",
    "PACK_CANDIDATES",
    "PACK_CLASSES",
    "WG3_CANDIDATES",
    "default_config",
    "pack_groups",
    "params_for",
]
