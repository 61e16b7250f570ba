"""Attention forward suite: O = softmax(scale * Q K^T + mask) V and LSE, FlashAttention layout.

Outputs compared: (o, lse). Rows that see no key have LSE = -inf in the reference; `compare`
counts a non-finite reference value as reproduced only when ours is the same value, so such
rows must be exactly -inf in ours too (NaN or a finite value there fails).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from forgekernel.bench.suite import Case, Inputs, OpSuite, with_dispatch
from forgekernel.kernels.attention.fwd.sm90 import PACK_CLASSES, SPEC, WG3_CANDIDATES


def _case(
    b: int,
    hq: int,
    hkv: int,
    sq: int,
    d: int,
    causal: bool = True,
    *,
    sk: int | None = None,
    dv: int | None = None,
    scale: float | None = None,
    group: str = "",
) -> Case:
    sk, dv = sq if sk is None else sk, d if dv is None else dv
    seqs = f"s{sq}" if sq == sk else f"sq{sq}-sk{sk}"
    name = f"b{b}-hq{hq}-hkv{hkv}-{seqs}-d{d}" + (f"-dv{dv}" if dv != d else "")
    name += ("-causal" if causal else "") + (f"-scale{scale:g}" if scale is not None else "")
    params = {"b": b, "hq": hq, "hkv": hkv, "sq": sq, "sk": sk, "d": d, "dv": dv}
    return Case(name, {**params, "causal": causal, "softmax_scale": scale}, group)


def _varlen_case(
    lens_q: tuple[int, ...],
    lens_k: tuple[int, ...] | None = None,
    hq: int = 64,
    hkv: int = 4,
    d: int = 128,
    causal: bool = True,
    *,
    dv: int | None = None,
    tag: str = "",
    group: str = "",
) -> Case:
    lens_k, dv = lens_q if lens_k is None else lens_k, d if dv is None else dv
    seqs = tag or ("s" + "-".join(map(str, lens_q)) + ("" if lens_k == lens_q else "-k"))
    name = f"varlen{len(lens_q)}-hq{hq}-hkv{hkv}-{seqs}-d{d}" + (f"-dv{dv}" if dv != d else "")
    name += "-causal" if causal else ""
    params = {"lens_q": tuple(lens_q), "lens_k": tuple(lens_k), "hq": hq, "hkv": hkv, "d": d}
    flags = {"dv": dv, "causal": causal, "softmax_scale": None, "varlen": True}
    return Case(name, {**params, **flags}, group)


def _varlen_lengths(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(lo, hi + 1, (n,), generator=gen).tolist())


def _chunked_lengths(n: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Chunked prefill per sequence: a chunk of 256..2048 queries after a cached prefix of
    0..16384 keys (Sk = prefix + chunk), fixed draw."""
    chunk = _varlen_lengths(n, 256, 2048, seed)
    prefix = _varlen_lengths(n, 0, 16384, seed + 1)
    return chunk, tuple(c + p for c, p in zip(chunk, prefix))


# The suite before issue 17 (OPS.md, bf16, causal unless noted, plus the anchor shape of the FA4
# and cuDNN figures: b4 hq32 hkv2 s8192 d128 causal, FA4 655 TFLOP/s, cuDNN 559 on the H200; the
# varlen case packs 16 sequences of 256..8192 tokens, fixed draw, seed 0), each in its class.
LEGACY_BENCH_CASES = (
    *(
        _case(b, 64, 4, s, 128, group="gqa16")
        for b, s in ((16, 2048), (8, 4096), (4, 8192), (2, 16384))
    ),
    _case(1, 64, 4, 32768, 128, group="gqa16"),
    _case(8, 64, 4, 4096, 128, causal=False, group="non-causal"),
    _case(8, 32, 32, 4096, 64, group="d64"),
    _case(4, 16, 16, 4096, 256, group="d256"),
    _case(2, 128, 128, 8192, 192, dv=128, group="d192-128"),
    _case(4, 32, 2, 8192, 128, group="gqa16"),
    _varlen_case(_varlen_lengths(16, 256, 8192, seed=0), tag="s256to8192", group="varlen"),
)
# The shapes users send, by class, bf16: 512..32k tokens per sequence, 16k or 32k query tokens
# per fixed-length case (chunked: 512..2048 queries against 8k..32k keys).
# Head counts from model configs: Llama-3 8B / Mistral 32:8, Llama-3 70B 64:8, Qwen-2.5 7B 28:4
# and 32B 40:8, Phi-3 mini D = 96 (32 heads), Gemma D = 256 (16:16, Gemma-2 9B 16:8, Gemma-3 4B
# 8:4), DeepSeek-V2/V3 MLA prefill 192/128 (128 heads). GQA ratios 1, 4, 5, 7, 8, 16.
CLASS_BENCH_CASES = (
    _case(32, 64, 4, 512, 128, group="gqa16"),
    _case(32, 32, 8, 512, 128, group="causal-d128"),
    _case(16, 32, 32, 1024, 128, group="causal-d128"),
    _case(4, 28, 4, 4096, 128, group="causal-d128"),
    _case(4, 64, 8, 8192, 128, group="causal-d128"),
    _case(2, 40, 8, 16384, 128, group="causal-d128"),
    _case(1, 32, 8, 32768, 128, group="causal-d128"),
    _case(32, 32, 8, 512, 128, causal=False, group="non-causal"),
    _case(8, 32, 32, 2048, 128, causal=False, group="non-causal"),
    _case(4, 32, 8, 8192, 128, causal=False, group="non-causal"),
    _case(1, 32, 8, 32768, 128, causal=False, group="non-causal"),
    _case(32, 16, 16, 512, 64, causal=False, group="d64"),
    _case(16, 32, 8, 1024, 64, group="d64"),
    _case(2, 32, 32, 16384, 64, causal=False, group="d64"),
    # Llama-3.2 1B (32:8, D = 64): GQA at D = 64 beside the short causal row above
    _case(8, 32, 8, 2048, 64, group="d64"),
    _case(4, 32, 8, 4096, 64, causal=False, group="d64"),
    _case(16, 32, 8, 1024, 64, causal=False, group="d64"),
    _case(8, 32, 32, 2048, 96, group="d96"),
    _case(16, 32, 32, 1024, 96, causal=False, group="d96"),
    _case(2, 32, 8, 8192, 96, group="d96"),
    _case(8, 16, 8, 2048, 256, group="d256"),
    _case(16, 8, 4, 1024, 256, causal=False, group="d256"),
    _case(1, 16, 8, 16384, 256, group="d256"),
    _case(8, 128, 128, 2048, 192, dv=128, group="d192-128"),
    _case(1, 128, 128, 16384, 192, dv=128, group="d192-128"),
    # chunked prefill: a chunk of queries against the cached keys, causal bottom-right
    _case(1, 32, 8, 2048, 128, sk=8192, group="chunked"),
    _case(2, 64, 8, 1024, 128, sk=16384, group="chunked"),
    _case(1, 64, 4, 512, 128, sk=32768, group="chunked"),
    _case(1, 128, 128, 2048, 192, dv=128, sk=16384, group="chunked"),
    _varlen_case(
        _varlen_lengths(64, 64, 1024, seed=2), hq=32, hkv=8, tag="s64to1024", group="varlen"
    ),
    _varlen_case(*_chunked_lengths(8, seed=3), hq=32, hkv=8, tag="chunk256to2048", group="varlen"),
)
BENCH_CASES = LEGACY_BENCH_CASES + CLASS_BENCH_CASES
# The cheapest problem inside a fixed-length rule's class (config.FIXED_RULES rule 7: D = 64
# non-causal MHA, Sq = Sk = 512, batch x kv heads at its minimum 512; 34 GFLOP), so `check` and
# the sanitizers run a rule's config (L2 sections) through the op; the other cases keep defaults.
RULE_CASE = _case(2, 256, 256, 512, 64, causal=False)
# Every supported head dim and GQA ratios 1, 4, 16 at small sizes, then awkward lengths: a
# single token, lengths off every tile size, Sq < Sk (decode-like) and Sq > Sk, whose first
# Sq - Sk rows see no key under the causal mask (O = 0, LSE = -inf); short queries with GQA
# (packed: Sq < 128); varlen batches with empty sequences, lengths off the tiles and Sq != Sk
# per sequence.
CHECK_CASES = (
    _case(2, 16, 1, 512, 128),
    _case(2, 16, 1, 512, 128, causal=False),
    _case(2, 8, 8, 512, 64),
    _case(2, 8, 2, 300, 96),
    _case(1, 4, 4, 1000, 96, causal=False),
    _case(1, 4, 4, 512, 256),
    _case(1, 8, 8, 512, 192, dv=128),
    _case(1, 32, 2, 1024, 128),
    _case(2, 4, 1, 1, 128),
    _case(2, 4, 4, 1, 64, causal=False),
    _case(3, 4, 4, 17, 64),
    _case(1, 16, 1, 17, 128, causal=False),
    _case(1, 8, 2, 1000, 128),
    _case(2, 4, 4, 1000, 64, causal=False),
    _case(1, 4, 1, 4097, 128),
    _case(1, 2, 2, 4097, 64, causal=False),
    _case(2, 4, 1, 100, 128, sk=1000),
    _case(1, 4, 1, 100, 128, sk=1000, causal=False),
    _case(2, 4, 4, 1000, 64, sk=100),
    _case(1, 4, 4, 1000, 64, sk=100, causal=False),
    _case(2, 8, 2, 1, 128, sk=1000),
    _case(1, 4, 4, 17, 256, sk=4097),
    _case(1, 4, 1, 1000, 192, dv=128, sk=1003),
    _case(1, 8, 2, 1000, 128, scale=0.3),
    _case(3, 8, 8, 700, 64),
    _case(2, 16, 2, 50, 64, sk=300),
    _case(1, 8, 4, 127, 96),
    _varlen_case((1, 17, 1000, 0, 4097, 128), hq=8, hkv=2),
    _varlen_case((1, 17, 1000, 0, 4097, 128), hq=8, hkv=2, causal=False),
    _varlen_case((300, 5, 129, 64), (1000, 5, 0, 700), hq=4, hkv=4, d=64),
    _varlen_case((300, 5, 129, 64), (1000, 5, 0, 700), hq=4, hkv=1, d=96, causal=False),
    _varlen_case((200, 1000, 33), hq=4, hkv=1, d=192, dv=128),
    _varlen_case((200, 513, 33), hq=2, hkv=2, d=256, causal=False),
    # one small case per bench class, with what the class adds: GQA ratios 5 and 7, GQA at
    # D = 64 / 96 / 256, a chunk against a longer cached prefix (D = 128 and 192/128, fixed and
    # varlen)
    _case(1, 28, 4, 300, 128, group="causal-d128"),
    _case(2, 32, 2, 640, 128, group="gqa16"),
    _case(1, 40, 8, 1100, 128, causal=False, group="non-causal"),
    _case(4, 16, 4, 300, 64, causal=False, group="d64"),
    _case(1, 8, 2, 513, 96, causal=False, group="d96"),
    _case(1, 8, 4, 700, 256, group="d256"),
    _case(1, 16, 16, 256, 192, dv=128, sk=2048, group="d192-128"),
    _case(1, 8, 2, 512, 128, sk=4096, group="chunked"),
    _varlen_case((128, 300, 64), (1024, 2048, 700), hq=8, hkv=2, group="varlen"),
    RULE_CASE,
)
# compute-sanitizer (`forgekernel check --sanitize`) and tests/gpu/: every head-dim pair at small
# odd sizes, GQA (packed short queries at 17 tokens), causal and not, Sq > Sk (rows that see no
# key), Sq < Sk, and varlen batches with an empty sequence.
SANITIZE_CASES = (
    _case(1, 4, 1, 17, 128),
    _case(1, 8, 2, 1000, 128),
    _case(1, 2, 2, 1000, 64, causal=False),
    _case(1, 4, 4, 1000, 64, sk=100),
    _case(1, 8, 2, 1000, 64, sk=1003),  # D = 64 causal GQA: packed through views (PACK_CLASSES)
    _case(1, 8, 2, 1000, 64, sk=1003, causal=False),  # and non-causal
    _case(1, 2, 2, 300, 96),
    _case(1, 2, 1, 257, 256, causal=False),
    _case(1, 4, 1, 100, 192, dv=128, sk=1003),
    _varlen_case((1, 17, 300, 0, 129), hq=4, hkv=1),
    _varlen_case((200, 33), (17, 40), hq=2, hkv=1, d=192, dv=128, causal=False),
    RULE_CASE,
)


# bench's host microseconds per eager call: Llama-3 8B heads (32:8) at 128 tokens, a problem the
# device finishes before the host issues the next call (issue 17: 68 us per forgekernel.attention
# call against 26 us for SDPA on the H200 host).
HOST_CASE = _case(1, 32, 8, 128, 128, group="host")


def make_inputs(
    case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> Inputs:
    p = case.params

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device, generator=gen)

    common = {"causal": p["causal"], "softmax_scale": p["softmax_scale"]}
    if p.get("varlen"):
        tq, tk = sum(p["lens_q"]), sum(p["lens_k"])
        cu = [
            torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32, device=device)
            for n in (p["lens_q"], p["lens_k"])
        ]
        return {
            "q": randn(tq, p["hq"], p["d"]),
            "k": randn(tk, p["hkv"], p["d"]),
            "v": randn(tk, p["hkv"], p["dv"]),
            "cu_seqlens_q": cu[0],
            "cu_seqlens_k": cu[1],
            "max_seqlen_q": max(p["lens_q"]),
            "max_seqlen_k": max(p["lens_k"]),
            **common,
        }
    return {
        "q": randn(p["b"], p["sq"], p["hq"], p["d"]),
        "k": randn(p["b"], p["sk"], p["hkv"], p["d"]),
        "v": randn(p["b"], p["sk"], p["hkv"], p["dv"]),
        **common,
    }


# The tile deal of the varlen launch (docs/attention/NOTES.md, "The chunked varlen case at
# 0.765x" and "Measured 2026-12-04 00:40-00:50"): D = 128 varlen takes its tiles from a counter
# (AttnConfig.dynamic, one CTA a SM); `static` times the deal it replaced beside it (tiles dealt
# statically over config.VARLEN_CTAS_PER_SM CTAs a SM), through the leaf's launcher. The other
# grids measured there (one CTA a SM or a tile, 8 a SM; fixed length at 2 or 4 a SM, dynamic)
# are in the notes.
GRID_CANDIDATES: dict[str, dict[str, dict[str, int]]] = {
    "varlen": {"static": {"ctas_per_sm": 4, "dynamic": 0}},
}
GRID_TIMED = {
    "varlen8-hq32-hkv8-chunk256to2048-d128-causal": "varlen",
    "varlen64-hq32-hkv8-s64to1024-d128-causal": "varlen",
    "varlen16-hq64-hkv4-s256to8192-d128-causal": "varlen",
}


# The fixed-length rules (config.FIXED_RULES, adopted 2026-12-05: docs/attention/NOTES.md
# "192/128 and the L2 rules adopted", "Rule 8: D = 128 non-causal MHA in sections"): on each
# case they moved, `was` runs the plan before (the head dims' default: the global order or the
# static deal), so the bench shows was / ours. Still open on the three long 192/128 cases:
# `dyn_kahead` (K a key block ahead of V, with the counter: AttnConfig.k_ahead) and `dyn_sec12`
# (the counter in 12 MiB sections); these cases run in sections by size, so the candidates'
# wave_kv_mib (320) is moot there. On the cases the rules left unmoved, the L2 round's variants
# as timed: `wave0` (sections at every size, AttnConfig.wave_kv_mib = 0), causal `wave0_dyn`
# (with the counter): D = 64 causal a tie with the counter, the long GQA-4 D = 128 cases the
# energy controls (non-causal 1.014 / 1.015 at 19:56, outside rule 8). Each on the head dims'
# default config with the knobs set; the bf16 kernels of the open ones are
# SPEC.candidate_params (D192_CANDIDATES, L2_CANDIDATES), `was` and the rules' own keys (the
# D = 128 non-causal `wave0`: rule 8's) standard builds.
#
# D = 96 on 192-row tiles (three consumer warpgroups: WG3_CANDIDATES, docs/attention/NOTES.md
# "next/attn-fwd-gap (2026-12-07)"): `wg3` (112 keys a tile, 2 stages), `wg3_s3` (112, 3) and
# `wg3_n96s3` (96, 3) on the unmoved GQA-4 s8192 causal case, `wg3_wave0` (112, 2, in sections:
# the rule's order) beside `was` on the two D = 96 cases rules 2 and 3 moved.
WAS: dict[str, Any] = {}
CONFIG_CANDIDATES: dict[str, dict[str, dict[str, Any]]] = {
    "d192": {
        "was": WAS,
        "dyn_kahead": {"dynamic": True, "k_ahead": True},
        "dyn_sec12": {"dynamic": True, "l2_kv_mib": 12},
    },
    "moved": {"was": WAS},
    "moved-d96": {"was": WAS, "wg3_wave0": WG3_CANDIDATES[3][2]},
    "d96": {
        "wg3": WG3_CANDIDATES[0][2],
        "wg3_s3": WG3_CANDIDATES[1][2],
        "wg3_n96s3": WG3_CANDIDATES[2][2],
    },
    "global-full": {"wave0": {"wave_kv_mib": 0}},
    "global-causal": {
        "wave0": {"wave_kv_mib": 0},
        "wave0_dyn": {"dynamic": True, "wave_kv_mib": 0},
    },
}
CONFIG_TIMED = {
    # moved by FIXED_RULES
    "b2-hq128-hkv128-s8192-d192-dv128-causal": "d192",
    "b1-hq128-hkv128-s16384-d192-dv128-causal": "d192",
    "b1-hq128-hkv128-sq2048-sk16384-d192-dv128-causal": "d192",
    "b8-hq128-hkv128-s2048-d192-dv128-causal": "moved",
    "b8-hq32-hkv32-s2048-d96-causal": "moved-d96",
    "b16-hq32-hkv32-s1024-d96": "moved-d96",
    "b4-hq16-hkv16-s4096-d256-causal": "moved",
    "b8-hq16-hkv8-s2048-d256-causal": "moved",
    "b16-hq8-hkv4-s1024-d256": "moved",
    "b16-hq32-hkv32-s1024-d128-causal": "moved",
    "b32-hq16-hkv16-s512-d64": "moved",
    "b8-hq32-hkv32-s2048-d128": "moved",
    # unmoved
    "b4-hq32-hkv8-s8192-d128": "global-full",
    "b1-hq32-hkv8-s32768-d128": "global-full",
    "b1-hq32-hkv8-s32768-d128-causal": "global-causal",
    "b8-hq32-hkv32-s4096-d64-causal": "global-causal",
    "b2-hq32-hkv8-s8192-d96-causal": "d96",
}


# GQA packed in the fixed-length mode (docs/attention/NOTES.md "next/attn-gqa-pack
# (2026-12-07)"): `gqa_pack` runs the problem's own plan (its rule or the head dims' default)
# with every Sq GQA-packed through views of q / o / lse (`attention_fwd(pack_gqa=True)`, the
# view_group compile: PACK_CANDIDATES), FA4's form for every GQA call. On the short GQA-4
# D = 64 causal case the 192-row tiles of the packed rows run 104 key-block steps a kv head
# against 128; the two GQA-4 s512 D = 128 cases are the controls (whole tiles: the same steps,
# K / V read once for the group). Measured 2026-12-07 (H100): the D = 64 target 0.843x of
# ours' time, the controls 1.35x / 1.47x. Since then every GQA class the adoption would
# touch: D = 64 longer and non-causal, D = 128 long causal at G 8 and a chunk against a
# longer prefix (docs/attention/NOTES.md "next/gqa-pack-wide"). D = 64 causal packs by default
# since next/gqa-pack-d64, non-causal D = 64 since next/gqa-pack-d64nc (PACK_CLASSES): their
# rows time `unpacked` instead, the A/B reversed.
PACK_TIMED = (
    "b16-hq32-hkv8-s1024-d64-causal",
    "b8-hq32-hkv8-s2048-d64-causal",
    "b4-hq32-hkv8-s4096-d64",
    "b16-hq32-hkv8-s1024-d64",
    "b32-hq32-hkv8-s512-d128-causal",
    "b32-hq32-hkv8-s512-d128",
    "b4-hq64-hkv8-s8192-d128-causal",
    "b1-hq32-hkv8-sq2048-sk8192-d128-causal",
)


def variants(case: Case) -> dict[str, Any]:
    """The GRID_CANDIDATES of a GRID_TIMED case's kind, the CONFIG_CANDIDATES of a
    CONFIG_TIMED one's; on a PACK_TIMED one `gqa_pack`, or `unpacked` where ours packs by
    default (PACK_CLASSES: the default's A/B)."""
    if case.name in PACK_TIMED:
        if (case.params["d"], case.params["causal"]) in PACK_CLASSES:
            return {"unpacked": run_unpacked}
        return {"gqa_pack": run_packed}
    kind = GRID_TIMED.get(case.name)
    if kind is not None:
        grids = GRID_CANDIDATES[kind]
        return {name: functools.partial(run_grid, **knobs) for name, knobs in grids.items()}
    kind = CONFIG_TIMED.get(case.name)
    if kind is not None:
        configs = CONFIG_CANDIDATES[kind]
        return {name: functools.partial(run_config, **knobs) for name, knobs in configs.items()}
    return {}


def _run_fixed(inputs: Inputs, out: tuple | None, **launch: Any) -> tuple:
    """Ours (fixed length) through the leaf's launcher (`launch`: its config / pack_gqa
    arguments); validated inputs (the suite's) into `out`."""
    from forgekernel.kernels.attention.fwd.sm90.launch import attention_fwd

    o, lse = out if out is not None else alloc_out(inputs)
    q, v, causal, scale = inputs["q"], inputs["v"], inputs["causal"], inputs["softmax_scale"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    attention_fwd(q, inputs["k"], v, o, lse, scale, causal, **launch)
    return o, lse


def run_config(inputs: Inputs, out: tuple | None, **knobs: Any) -> tuple:
    """Ours with the head dims' default config (no knobs: the plan before the fixed-length
    rules, `was`), the AttnConfig fields in `knobs` replaced, on the config's grid."""
    from forgekernel.kernels.attention.fwd.sm90.config import default_config

    cfg = default_config(inputs["q"].shape[-1], inputs["v"].shape[-1])
    return _run_fixed(inputs, out, config=dataclasses.replace(cfg, **knobs))


def run_packed(inputs: Inputs, out: tuple | None) -> tuple:
    """Ours with GQA packed at any Sq (pack_gqa: the problem's own plan on the view_group
    compile)."""
    return _run_fixed(inputs, out, pack_gqa=True)


def run_unpacked(inputs: Inputs, out: tuple | None) -> tuple:
    """Ours with GQA never packed through views (pack_gqa=False: the launch before
    PACK_CLASSES, short queries packed by a copy)."""
    return _run_fixed(inputs, out, pack_gqa=False)


def run_grid(inputs: Inputs, out: tuple | None, ctas_per_sm: int = 1, dynamic: int = 0) -> tuple:
    """Ours through the leaf's launcher with the head dims' default config for the launch
    (varlen or not) with `dynamic` set as given (AttnConfig.dynamic: the tile counter) on
    ctas_per_sm CTAs a SM (0: one a tile); validated inputs (the suite's) into `out`."""
    from forgekernel.kernels.attention.fwd.sm90.config import default_config
    from forgekernel.kernels.attention.fwd.sm90.launch import attention_fwd, attention_varlen_fwd

    o, lse = out if out is not None else alloc_out(inputs)
    q, v, causal, scale = inputs["q"], inputs["v"], inputs["causal"], inputs["softmax_scale"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    varlen = _varlen(inputs)
    cfg = default_config(q.shape[-1], v.shape[-1], varlen=varlen)
    grid = {"ctas_per_sm": ctas_per_sm, "config": dataclasses.replace(cfg, dynamic=bool(dynamic))}
    if varlen:
        q, k, v, cu_q, cu_k, max_q, _ = _varlen_args(inputs)
        attention_varlen_fwd(q, k, v, o, lse, cu_q, cu_k, max_q, scale, causal, **grid)
    else:
        attention_fwd(q, inputs["k"], v, o, lse, scale, causal, **grid)
    return o, lse


def _varlen(inputs: Inputs) -> bool:
    return "cu_seqlens_q" in inputs


def _varlen_args(inputs: Inputs) -> tuple:
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return tuple(inputs[n] for n in names)


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    q, v = inputs["q"], inputs["v"]
    if _varlen(inputs):
        total, hq, _ = q.shape
        o = torch.empty(total, hq, v.shape[-1], dtype=q.dtype, device=q.device)
        return o, torch.empty(hq, total, dtype=torch.float32, device=q.device)
    b, sq, hq, _ = q.shape
    o = torch.empty(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    return o, torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)


def _args(inputs: Inputs) -> tuple:
    return inputs["q"], inputs["k"], inputs["v"], inputs["causal"], inputs["softmax_scale"]


def run_ours(inputs: Inputs, out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    from forgekernel.ops.attention import attention
    from forgekernel.ops.attention_varlen import attention_varlen

    if _varlen(inputs):
        return attention_varlen(
            *_varlen_args(inputs),
            inputs["causal"],
            inputs["softmax_scale"],
            return_lse=True,
            out=out,
        )
    return attention(*_args(inputs), return_lse=True, out=out)


def _ref(inputs: Inputs, upcast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from forgekernel.reference.attention import attention_ref, attention_varlen_ref

    if _varlen(inputs):
        q, k, v, cu_q, cu_k, _, _ = _varlen_args(inputs)
        return attention_varlen_ref(
            q, k, v, cu_q, cu_k, inputs["causal"], inputs["softmax_scale"], upcast
        )
    return attention_ref(*_args(inputs), upcast=upcast)


def reference(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return _ref(inputs, upcast=True)


def low_precision(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return _ref(inputs, upcast=False)


def _fa4() -> Any:
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:
        return None

    def fa4(inputs: Inputs) -> Any:
        q, k, v, causal, scale = _args(inputs)
        if _varlen(inputs):
            _, _, _, cu_q, cu_k, max_q, max_k = _varlen_args(inputs)
            return flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k,
                max_seqlen_q=max_q,
                max_seqlen_k=max_k,
                softmax_scale=scale,
                causal=causal,
            )
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)

    return fa4


def _cudnn() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if not torch.backends.cudnn.is_available():
        return None

    def cudnn(inputs: Inputs) -> torch.Tensor:
        refuse_other_semantics(inputs)
        q, k, v = _bhsd(inputs)
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(
                q, k, v, is_causal=inputs["causal"], scale=inputs["softmax_scale"], enable_gqa=gqa
            )

    return cudnn


def _bhsd(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """(B, H, S, D) views of q, k, v, made once per input set (outside any timed call)."""
    if "bhsd" not in inputs:
        inputs["bhsd"] = tuple(inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
    return inputs["bhsd"]


def sdpa_default(inputs: Inputs) -> torch.Tensor:
    """torch's SDPA as a user calls it (default backend choice): the host-time comparator."""
    refuse_other_semantics(inputs)
    q, k, v = _bhsd(inputs)
    gqa = q.shape[1] != k.shape[1]
    scale, causal = inputs["softmax_scale"], inputs["causal"]
    return scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)


def host_comparators() -> dict[str, Any]:
    return {"sdpa": sdpa_default if torch.cuda.is_available() else None}


def refuse_other_semantics(inputs: Inputs) -> None:
    """cuDNN through SDPA computes other math on these inputs: raise (the bench then reports it
    missing on the case, never timed against a different problem). SDPA takes no packed
    batches, and its causal mask is top-left aligned (query i sees key j <= i), ours
    bottom-right: the same only when Sq == Sk."""
    if "cu_seqlens_q" in inputs or "varlen" in inputs:
        raise NotImplementedError("SDPA takes no packed (cu_seqlens) batches")
    if inputs["causal"] and inputs["q"].shape[1] != inputs["k"].shape[1]:
        raise NotImplementedError(
            "SDPA's causal mask is top-left aligned, ours bottom-right: they differ at Sq != Sk"
        )


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fa4": None, "cudnn": None}
    return {"fa4": _fa4(), "cudnn": _cudnn()}


def causal_pairs(sq: int, sk: int) -> int:
    """Unmasked (i, j) pairs under the bottom-right causal mask: row i sees i + Sk - Sq + 1
    keys, clamped to [0, Sk]."""
    return sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))


def _sequences(p: dict) -> list[tuple[int, int, int]]:
    """(batch count, Sq, Sk) groups: one for a fixed-length case, one per sequence for varlen."""
    if p.get("varlen"):
        return [(1, sq, sk) for sq, sk in zip(p["lens_q"], p["lens_k"])]
    return [(p["b"], p["sq"], p["sk"])]


def kernel_sources() -> list[Path]:
    """What the compile cache hashes (the kernel's import closure) and the dispatch beside it:
    the leaf's `__init__` (the standard keys, PACK_CLASSES), its launcher (the plan, the GQA
    packing, PACK_GQA_MAX_SQ) and the ops that call it (a dispatch change moves the ledger's
    key, as a kernel change does; before next/gqa-pack-d64 it did not: GEMM's and FP8 GEMM's
    ledgers were the only ones hashing their choosers)."""
    leaf, ops = "forgekernel.kernels.attention.fwd.sm90", "forgekernel.ops"
    return with_dispatch(SPEC.sources, leaf, f"{leaf}.launch", f"{ops}.attention",
                         f"{ops}.attention_varlen")  # fmt: skip


def flops(case: Case) -> float:
    """4 * Hq * (D + Dv) / 2 per unmasked pair (FA4's count: masked pairs are free)."""
    p = case.params
    total = 0.0
    for b, sq, sk in _sequences(p):
        pairs = causal_pairs(sq, sk) if p["causal"] else sq * sk
        total += 2.0 * b * p["hq"] * (p["d"] + p["dv"]) * pairs
    return total


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q + k + v read, o written (the LSE, 1/D of o in fp32, is left out)."""
    p = case.params
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0.0
    for b, sq, sk in _sequences(p):
        q_o = sq * p["hq"] * (p["d"] + p["dv"])
        k_v = sk * p["hkv"] * (p["d"] + p["dv"])
        total += b * (q_o + k_v) * elem
    return float(total)


def suite() -> OpSuite:
    return OpSuite(
        name="attention",
        kernel_sources=kernel_sources(),
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=low_precision,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        atol=1e-3,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        host_case=HOST_CASE,
        host_comparators=host_comparators,
        variants=variants,
    )
