"""Dense 16-bit GEMM suite: C = A @ B^T (B as (N, K), or (K, N) with b_layout "kn")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite, with_dispatch
from forgekernel.kernels.gemm.dense.sm90 import SPEC
from forgekernel.runtime import pdl


def _case(
    m: int, n: int, k: int, b_layout: str = "nk", *, group: str = "", source: str = ""
) -> Case:
    """`source`: the model layer the (N, K) comes from (kept in the params, for the report)."""
    name = f"{m}x{n}x{k}" + ("-kn" if b_layout == "kn" else "")
    params = {"m": m, "n": n, "k": k, "b_layout": b_layout}
    return Case(name, {**params, **({"source": source} if source else {})}, group)


def _unique(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """First occurrence of each name wins (its group stays)."""
    seen: dict[str, Case] = {}
    for c in cases:
        seen.setdefault(c.name, c)
    return tuple(seen.values())


# The suite before issue 17 (OPS.md's list; 8192^3 listed twice there, run once), each case in
# the class it samples: 64 x 8192 x 8192 is Llama-3 70B's O projection at decode.
LEGACY_BENCH_CASES = _unique(
    (
        _case(4096, 4096, 4096, group="square"),
        _case(8192, 8192, 8192, group="square"),
        *(
            _case(8192, n, k, group="llm")
            for n, k in ((28672, 8192), (8192, 28672), (10240, 8192), (8192, 8192))
        ),
        _case(64, 8192, 8192, group="decode"),
        *(_case(m, 8192, 8192, group="llm") for m in (128, 256)),
        _case(1000, 3000, 4104, group="ragged"),
        _case(8192, 8192, 8192, "kn", group="square"),
    )
)
# Projection weights (N, K) of common open models, from their configs: fused QKV
# ((Hq + 2 Hkv) * head_dim, hidden), O (hidden, Hq * head_dim), fused gate/up (2 * inter,
# hidden), down (hidden, inter). Mistral 7B has Llama-3 8B's shapes; a Mixtral 8x7B expert
# adds its unfused w1 / w3 (w2 is Llama-3 8B's down); DeepSeek-V3: the dense layers' FFN and the
# MLA projections of every layer (q_a 7168 -> 1536, q_b 1536 -> 128 * 192, kv_a 7168 -> 512 +
# 64, kv_b 512 -> 128 * 256, o 128 * 128 -> 7168). A shape a model shares with one listed
# before it is kept once, under the first name.
MODEL_PROJECTIONS: dict[str, dict[str, tuple[int, int]]] = {
    "llama3-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    },
    "llama3-70b": {
        "qkv": (10240, 8192),
        "o": (8192, 8192),
        "gate_up": (57344, 8192),
        "down": (8192, 28672),
    },
    "qwen2.5-7b": {
        "qkv": (4608, 3584),
        "o": (3584, 3584),
        "gate_up": (37888, 3584),
        "down": (3584, 18944),
    },
    "qwen2.5-32b": {
        "qkv": (7168, 5120),
        "o": (5120, 5120),
        "gate_up": (55296, 5120),
        "down": (5120, 27648),
    },
    "qwen3-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    },
    "qwen3-32b": {
        "qkv": (10240, 5120),
        "o": (5120, 8192),
        "gate_up": (51200, 5120),
        "down": (5120, 25600),
    },
    "mixtral-8x7b-expert": {"w1": (14336, 4096), "w2": (4096, 14336)},
    "deepseek-v3": {
        "kv_a": (576, 7168),
        "q_a": (1536, 7168),
        "q_b": (24576, 1536),
        "kv_b": (32768, 512),
        "o": (7168, 16384),
        "gate_up": (36864, 7168),
        "down": (7168, 18432),
    },
}
DECODE_M = (1, 4, 16, 32, 64)
PREFILL_M = (512, 1024, 2048, 4096, 8192, 16384)


def projections() -> list[tuple[str, int, int]]:
    """(source, N, K) of every distinct projection, in MODEL_PROJECTIONS' order."""
    out: dict[tuple[int, int], str] = {}
    for model, layers in MODEL_PROJECTIONS.items():
        for layer, nk in layers.items():
            out.setdefault(nk, f"{model}.{layer}")
    return [(src, n, k) for (n, k), src in out.items()]


def _sampled(phase: str, sizes: tuple[int, ...], drop: int) -> tuple[Case, ...]:
    """A fixed sample of projections x sizes: projection i is left out when i % 3 == drop (one
    in three; decode and prefill leave out different thirds, so every projection is in at least
    one phase), and the j-th one kept takes sizes[j % len(sizes)] (every size of the phase)."""
    kept = [p for i, p in enumerate(projections()) if i % 3 != drop]
    return tuple(
        _case(sizes[j % len(sizes)], n, k, group=phase, source=src)
        for j, (src, n, k) in enumerate(kept)
    )


# Ragged: row counts that are no tile multiple (a prefill chunk of 5000 tokens, M in the
# hundreds against a wide N, one row past a tile), and a small N against large M and K.
RAGGED_CASES = (
    _case(300, 28672, 4096, group="ragged", source="llama3-8b.gate_up"),
    _case(777, 4096, 14336, group="ragged", source="llama3-8b.down"),
    _case(129, 10240, 8192, group="ragged", source="llama3-70b.qkv"),
    _case(5000, 6144, 4096, group="ragged", source="llama3-8b.qkv"),
    _case(3000, 576, 7168, group="ragged", source="deepseek-v3.kv_a"),
)
# 55 cases (decode 21, prefill 20, ragged 6, llm 5, square 3), bf16 (see suite()).
BENCH_CASES = _unique(
    LEGACY_BENCH_CASES
    + _sampled("decode", DECODE_M, drop=0)
    + _sampled("prefill", PREFILL_M, drop=1)
    + RAGGED_CASES
)
# Awkward edges: M = 1, M and K off every tile size, N at the 8-element minimum, K tiny.
EDGE_CASES = (
    _case(1, 8, 8),
    _case(7, 24, 40),
    _case(17, 136, 72),
    _case(129, 264, 520),
    _case(1000, 3000, 4104, "kn"),
    _case(255, 8, 4096),
    _case(64, 8200, 8),
    # every configuration the chooser can pick, on ragged edges: split K (M <= 128), the wide
    # 128x192 tile, the skinny 64x64 tile with an odd number of N tiles in a 1x2 cluster
    _case(100, 264, 1000),
    _case(97, 1000, 4104, "kn"),
    _case(1000, 2000, 4104, "kn"),
    _case(33, 328, 4096),
    # decode: stream K with 16 CTAs on each tile, the short A box tiled (and the kn layout)
    _case(2, 512, 16384),
    _case(24, 1000, 4104, "kn"),
    _case(5, 4096, 1024, "kn"),
    # decode stream K, each A box (8 / 16 / 32 / 64 rows): CTAs whose range crosses a tile
    # boundary (part 0 parked as its CTA's last unit, slot 2c + 1), a CTA with a whole tile
    # between two parked units (136 tiles of 39 k-tiles, 41 a CTA), and two tiles of 65
    # k-tiles over 8 CTAs of 17
    _case(5, 8704, 2496),
    _case(13, 8704, 2496, "kn"),
    _case(24, 8704, 2496),
    _case(40, 8704, 2496, "kn"),
    _case(3, 128, 4160),
    _case(24, 128, 4160, "kn"),
)
# Prefill stream K and the 64-row tile (config.py MID, PREFILL_STREAM), each walk the chooser
# picks on odd sizes: a cluster block over the edge of M or N whose dead CTA skips its part
# ("dead parked"), a tile cut into three parts and more, part 0 parked as its cluster's last unit,
# data-parallel rounds before the streamed ones (tests/test_gemm_stream_k_clusters.py
# `test_the_suite_checks_every_prefill_walk` keeps it so). Since the refit of 2026-12-02 07:00
# (a streamed k-iteration 1.2x slower) the chooser streams data-parallel rounds only where the
# last round of cluster blocks is nearly empty. Since the one-wave tiles (config.py FIT, their
# efficiencies assumed) the chooser takes a 192-row tile where it took MID (MID is forced by
# tests/gpu/test_gemm_prefill_stream_gpu.py), and the first four cases below check those.
PREFILL_STREAM_CASES = (
    _case(129, 10248, 520, "kn"),  # 128x160 (192x80 until a tile past M was priced: NOTES)
    _case(301, 28680, 4104, group="ragged", source="llama3-8b.gate_up"),  # 128x80 swapped
    _case(519, 17024, 2312, "kn"),  # 192x80: 3 tile rows, 213 columns (a dead CTA of a 1x2)
    _case(1091, 10248, 4104),  # 192x80 since the refit (was 192x96): 6 tile rows
    _case(2057, 216, 6344),  # LARGE stream K: 17 tile rows (dead parked), 3 parts, N < a tile
    _case(3680, 5832, 3840, "kn"),  # LARGE stream K: 29 tile rows (dead parked), dp rounds
    # WIDE stream K: dead parked, part 0 as a last unit, 3 parts (its data-parallel rounds are
    # no pick since the refit of the FIT tiles: tests/gpu/test_gemm_prefill_stream_gpu.py
    # forces them, 4095x1544x4104)
    _case(1104, 512, 8192),
    _case(1026, 520, 4104),  # WIDE stream K: dead parked, 3 parts
)
# The one-wave tiles (config.py FIT), each on the shapes the chooser picks it for, M and N off
# its tile (both B layouts over the set): 128x224, 128x160, 128x144 and 128x112 with 16-column
# epilogue sub-tiles (N smaller than a tile), 192x80 and 192x96 (three consumer warpgroups).
FIT_CASES = (
    _case(130, 13864, 136),  # 128x80 swapped (128x224's before the swap; kn below)
    _case(1000, 6720, 168, "kn"),  # 128x224
    _case(511, 4840, 160, "kn"),  # 128x160
    _case(333, 8824, 128),  # 128x160 since the refit (was 128x144's)
    _case(257, 40, 288, "kn"),  # 128x112, N under one tile
    _case(129, 8848, 136, "kn"),  # 128x144 (192x80 until a tile past M was priced)
    _case(129, 11120, 136),  # 192x80 swapped (192x96 until a tile past M was priced)
    _case(344, 11960, 520),  # 192x96: 2 tile rows, 125 columns
)
# One moderate case per class the bench samples besides the legacy ones (checked in full above).
# The swapped tiles (config.py SWAP: C^T = B A^T, C through its M-major view), B "nk", on the
# shapes the chooser picks each for: tokens off the 16-row steps and off the token tile (the last
# token tile moved back), the weight's N off 128 / 192, 1x2 clusters with an odd tile count.
SWAP_CASES = (
    _case(777, 4104, 520),  # 128x208 swapped: 4 token tiles (the last moved back), 33 N tiles
    _case(129, 10248, 520),  # 192x80 swapped: 2 token tiles (49 rows recomputed), 54 N tiles
    _case(300, 6152, 136),  # 192x80 swapped: 4 token tiles, 33 N tiles (the last moved back)
)  # 128x80 swapped: 301x28680x4104 and 130x13864x136 above
CLASS_CHECK_CASES = (
    _case(16, 6144, 4096, group="decode", source="llama3-8b.qkv"),
    _case(1, 576, 7168, "kn", group="decode", source="deepseek-v3.kv_a"),
    _case(16, 10240, 8192, group="decode", source="llama3-70b.qkv"),  # stream K, 160 tiles
    _case(1024, 4608, 3584, group="prefill", source="qwen2.5-7b.qkv"),
    _case(333, 1536, 7168, group="ragged", source="deepseek-v3.q_a"),
)
# the twins `config.walked` picks (LARGE_BAND, FIT_144_A), against the reference too (the
# sanitizer's two twin cases below: memcheck / racecheck compare no values)
TWIN_CHECK_CASES = (_case(16300, 1792, 1608), _case(4000, 568, 520, "kn"))
CHECK_CASES = _unique(
    LEGACY_BENCH_CASES
    + EDGE_CASES
    + CLASS_CHECK_CASES
    + PREFILL_STREAM_CASES
    + FIT_CASES
    + SWAP_CASES
    + TWIN_CHECK_CASES
)
# N or K not a multiple of 8 (cuBLAS takes any shape): checked once forgekernel.gemm takes them
# (`odd_sizes_accepted`), with GPT-2's LM head (vocabulary 50257) as the real-model one.
ODD_CASES = (
    _case(1, 1001, 4097, group="odd"),
    _case(7, 1001, 4096, group="odd"),
    _case(33, 4096, 4097, "kn", group="odd"),
    _case(5, 13, 7, group="odd"),
    _case(257, 1001, 4097, "kn", group="odd"),
    _case(1000, 3001, 1025, group="odd"),
    _case(2048, 50257, 768, group="odd", source="gpt2.lm_head"),
)
# compute-sanitizer (`forgekernel check --sanitize`) and tests/gpu/: every kind of standard
# configuration the chooser picks (decode stream K and short A box, 64x64 skinny, 64x128
# skinny, 128x128 with and without a cluster, 128x192 wide, 128x256 large, prefill stream K
# over 2-CTA clusters, the one-wave tiles), each on ragged edges, both B layouts, and the
# smallest problem (M = 1, N = K = 8). Prefill stream K: parts parked and summed by CTAs of
# clusters, a dead CTA skipping its part, data-parallel rounds before the streamed ones.
SANITIZE_CASES = (
    _case(1, 8, 8),
    _case(2, 512, 16384),
    _case(24, 1000, 4104, "kn"),
    _case(5, 4096, 1024, "kn"),
    _case(13, 128, 4160),
    _case(24, 128, 4160, "kn"),
    _case(40, 128, 4160),
    _case(5, 8704, 2496),
    _case(12, 2048, 1032),
    _case(20, 2056, 520, "kn"),
    _case(16, 520, 1032),
    _case(64, 4096, 1024),
    _case(640, 1024, 1032),  # 128x80 swapped (was 128x112's, 128x128's)
    _case(929, 144, 128),  # 192x72: N in two tiles (72 divides N: `prefill_rivals`)
    _case(1868, 4184, 520),  # 128x128 c2x1
    _case(2000, 1400, 520, "kn"),
    _case(33, 264, 520),
    _case(100, 264, 1000, "kn"),
    _case(255, 136, 72),  # 128x128 c1x1 (192x72 while it was offered where 72 does not divide N)
    _case(255, 8256, 520),  # 128x128 c1x1: 2 x 65 tiles
    _case(1000, 1000, 1032, "kn"),  # 128x112
    _case(1500, 2504, 520),
    _case(129, 10248, 520, "kn"),  # 128x160 (was 192x80's, MID's)
    _case(129, 264, 4104),  # 128x80 swapped (was WIDE stream K's)
    _case(1026, 520, 4104, "kn"),  # WIDE stream K, dead parked, 3 parts
    _case(331, 25584, 2312),  # 192x80 (was LARGE stream K's)
    # LARGE stream K: data-parallel rounds, dead parked, part 0 parked as a cluster's last unit,
    # a whole block between two cut ones
    _case(3680, 5832, 3896),
    # the one-wave tiles (FIT_CASES): 128x160 (two), 192x80 swapped, 128x224, 128x144, 192x96;
    # 128x112 above (1000 rows), 192x80 above; 130x13864x136 128x80 swapped
    _case(130, 13864, 136),
    _case(511, 4840, 160, "kn"),
    _case(333, 8824, 128, "kn"),
    _case(129, 11120, 136),
    _case(1000, 6720, 168, "kn"),
    _case(1120, 3672, 160, "kn"),
    _case(344, 11960, 520),
    # the swapped tiles (SWAP_CASES): 128x208, 192x72 (192x80 at 129x11120x136 above)
    _case(777, 4104, 520),
    _case(129, 10248, 520),
    # the twins config.walked puts in: LARGE in bands of 6 N blocks (7 N blocks: a band of 6 and
    # one of 1; the last tile row moved back), 128x144 with A multicast (ragged M and N, B "kn")
    _case(16300, 1792, 1608),
    _case(4000, 568, 520, "kn"),
)


# bench's host microseconds per eager call: a problem the device finishes (~3 us) before the host
# issues the next call, so the loop times validation, dispatch and launch (issue 17: 55 us per
# forgekernel.gemm call against 20 us for torch.matmul on the H200 host).
HOST_CASE = _case(16, 1024, 1024, group="host")


def odd_sizes_accepted() -> bool:
    """Whether forgekernel.gemm takes N and K that are not multiples of 8: its validation is
    run on meta tensors (shape errors come before device errors there), both B layouts; only a
    "multiple of" refusal counts as not taking them."""
    import importlib

    op = importlib.import_module("forgekernel.ops.gemm")
    a = torch.empty(16, 4097, dtype=torch.bfloat16, device="meta")
    for b_layout, b_shape in (("nk", (1001, 4097)), ("kn", (4097, 1001))):
        b = torch.empty(*b_shape, dtype=torch.bfloat16, device="meta")
        try:
            op.gemm(a, b, b_layout=b_layout)
        except ValueError as e:
            if "multiple of" in str(e):
                return False
        except Exception:
            pass  # anything past the shape checks (the device check on meta tensors)
    return True


def check_cases() -> tuple[Case, ...]:
    return CHECK_CASES + (ODD_CASES if odd_sizes_accepted() else ())


def make_inputs(
    case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> Inputs:
    p = case.params
    b_shape = (p["n"], p["k"]) if p["b_layout"] == "nk" else (p["k"], p["n"])
    a = torch.randn(p["m"], p["k"], dtype=dtype, device=device, generator=gen)
    b = torch.randn(*b_shape, dtype=dtype, device=device, generator=gen)
    return {"a": a, "b": b, "b_layout": p["b_layout"]}


def alloc_out(inputs: Inputs) -> torch.Tensor:
    a, b = inputs["a"], inputs["b"]
    n = b.shape[0] if inputs["b_layout"] == "nk" else b.shape[1]
    return torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)


def run_ours(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    from forgekernel.ops.gemm import gemm

    return gemm(inputs["a"], inputs["b"], out=out, b_layout=inputs["b_layout"])


def variants(case: Case) -> dict[str, Any]:
    """M > 128: the prefill configurations the chooser weighed against its pick and left
    (config.py `prefill_rivals`: "tile", the measured tile, "challenger", the 64-row tile or a
    stream-K one, "fit", the fastest one-wave tile by the model, "swap", the fastest swapped
    tile on B "nk" up to `SWAP_MAX_M` rows), and on the cases that list them the candidates
    no group holds (config.py `CASE_CANDIDATES`, B "nk"), forced through the op: variant time
    / our time says whether the choice paid (docs/gemm/NOTES.md "Mid-size M", "One-wave
    tiles", "The swap", "256 tokens: candidates"). Decode and skinny M: only the listed
    candidates."""
    from forgekernel.kernels.gemm.dense.sm90.config import (
        CASE_CANDIDATES,
        choose_config,
        prefill_rivals,
    )

    p = case.params
    m, n, k = p["m"], p["n"], p["k"]
    b_kn = p["b_layout"] == "kn"
    chosen = choose_config(m, n, k, b_kn=b_kn)
    configs = prefill_rivals(m, n, k, b_kn=b_kn) if m > 128 else {}
    if not b_kn:
        configs.update(CASE_CANDIDATES.get((m, n, k), {}))
    found = {
        kind: (lambda inputs, out, cfg=cfg: _forced(inputs, out, cfg))
        for kind, cfg in configs.items()
        if cfg != chosen
    }
    if case.name in NO_PDL_CASES:
        found["no_pdl"] = run_no_pdl
    return found


# The short calls timed without programmatic dependent launch too (variant `no_pdl`: ours /
# this time is what PDL saves, docs/gemm/NOTES.md "Programmatic dependent launch"): decode
# weights from 12 to 55 us, the 129-token ragged case, a small prefill.
NO_PDL_CASES = (
    "1x4096x4096",
    "16x5120x8192",
    "64x8192x8192",
    "4x28672x4096",
    "129x10240x8192",
    "512x3584x3584",
)


def run_no_pdl(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with its kernel built and launched without PDL (runtime/pdl.py `off`; compiled on
    first use)."""
    with pdl.off():
        return run_ours(inputs, out)


def _forced(inputs: Inputs, out: torch.Tensor | None, cfg) -> torch.Tensor:
    from forgekernel.ops.gemm import gemm

    return gemm(inputs["a"], inputs["b"], out=out, b_layout=inputs["b_layout"], config=cfg)


def reference(inputs: Inputs) -> torch.Tensor:
    from forgekernel.reference.gemm import gemm_ref

    return gemm_ref(inputs["a"], inputs["b"], b_layout=inputs["b_layout"])


def _b_kn(inputs: Inputs) -> torch.Tensor:
    return inputs["b"].T if inputs["b_layout"] == "nk" else inputs["b"]


def low_precision(inputs: Inputs) -> torch.Tensor:
    return torch.matmul(inputs["a"], _b_kn(inputs))


def cublas(inputs: Inputs) -> torch.Tensor:
    """torch.matmul into an output allocated once per input set, as ours writes into `out`."""
    if "cublas_out" not in inputs:
        inputs["cublas_out"] = alloc_out(inputs)
    return torch.matmul(inputs["a"], _b_kn(inputs), out=inputs["cublas_out"])


def comparators() -> dict[str, Any]:
    return {"cublas": cublas if torch.cuda.is_available() else None}


def matmul_default(inputs: Inputs) -> torch.Tensor:
    """torch.matmul as a user calls it (allocating its output; `cublas` writes into out= as
    ours does): the host-time comparator."""
    return torch.matmul(inputs["a"], _b_kn(inputs))


def host_comparators() -> dict[str, Any]:
    return {"matmul": matmul_default if torch.cuda.is_available() else None}


def flops(case: Case) -> float:
    p = case.params
    return 2.0 * p["m"] * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    elem = torch.empty((), dtype=dtype).element_size()
    return float((p["m"] * p["k"] + p["n"] * p["k"] + p["m"] * p["n"]) * elem)


def kernel_sources() -> list[Path]:
    """What the compile cache hashes (the kernel's import closure) and the chooser beside it: the
    configuration tables and the plan that pick a call's configuration, its launcher and the op
    (a chooser change moves the ledger's key, as a kernel change does; before 2026-12-06 it did
    not, so a chooser change kept the GEMM ledger's figures)."""
    leaf = "forgekernel.kernels.gemm.dense.sm90"
    return with_dispatch(SPEC.sources, f"{leaf}.config", f"{leaf}.plan", f"{leaf}.launch",
                         "forgekernel.ops.gemm")  # fmt: skip


def suite() -> OpSuite:
    return OpSuite(
        name="gemm",
        kernel_sources=kernel_sources(),
        dtypes=(torch.float16, torch.bfloat16),
        check_cases=check_cases(),
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
        # bf16 only, to keep the 55 cases near 2 minutes: the traffic is bf16, and on the 10
        # cases of the H200 record of 2026-12-01 the cuBLAS ratio of fp16 and bf16 differed by
        # 0.034 at most (128x8192x8192), the medians by 0.003. The check runs both dtypes.
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        host_case=HOST_CASE,
        host_comparators=host_comparators,
        variants=variants,
    )
