"""Grouped (MoE, contiguous layout) block-scaled FP8 GEMM suite: C[r] = (A[r] x sa[r]) @
(B[e] x sb[e])^T with e = m_indices[r], A (M, K) and B (E, N, K) float8_e4m3fn, sa (M, K/128)
per 1x128 group, sb (E, N/128, K/128) per 128x128 block. The suite's dtypes are the output's.

A case names each expert's token count (`counts`, or a mean `tokens` per expert spread by
`skew`) and `tail` trailing padding rows (a buffer sized for the worst case, as under CUDA
graphs); each expert's rows are padded to a multiple of 128 with index -1. Every row, padding
included, is FP8 quantized from fresh random fp32 values, each group / block scaled to use the
e4m3 range. Padding rows are not the caller's: the reference gives them 0 and `run_ours` zeroes
them after the call (one `index_fill_` over the padding rows, none where there are none: the
bench cases of whole 128-token segments pay nothing, the skewed ones well under 1% of the GEMM),
so the check compares every row and still catches an unwritten real row.

Comparator: DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous` on the same inputs (A's scales made
M-major and TMA-aligned once per input set, outside the timing; bf16 out only) where `deep_gemm`
is installed. Variant `f4_sw` (VARIANT_CASES): the tile with its scales loaded by a warp of
their own four k-tiles ahead (config.py GROUPED_F4_SW, a candidate build; what won on the dense
narrow tiles 2026-12-07, docs/gemm/NOTES.md "next/fp8-f4sw"). Measured and dropped
(docs/gemm/NOTES.md): "wide" (the 128x192 tile), "band6" (the tiles walked in bands of 6
cluster columns; bands of 8, "band8", became the standard walk on 2026-12-03, the M-first walk
before it) and "f4" (the scales four k-tiles ahead by one warp, 2026-12-05: the dense probe
lost everywhere, the grouped variant never ran).
"""

from __future__ import annotations

from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites.gemm_fp8 import DSV3_MOE, _quantize, deepgemm_scales
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED_F4_SW

ALIGN = 128  # each expert's segment: whole tiles, DeepGEMM's contiguous-layout alignment
GOLDEN = 0.6180339887498949


def _case(
    experts: int,
    n: int,
    k: int,
    *,
    counts: tuple[int, ...] = (),
    tokens: int = 0,
    skew: float = 0.0,
    tail: int = 0,
    group: str = "",
    source: str = "",
) -> Case:
    """`counts` per expert, or `tokens` per expert (uniform, or spread by +-skew of it)."""
    if counts and len(counts) != experts:
        raise ValueError(f"{len(counts)} counts for {experts} experts")
    if counts:
        rows = "-".join(map(str, counts))
        params: dict[str, Any] = {"experts": experts, "n": n, "k": k, "counts": counts}
    else:
        rows = f"{tokens}{'s' if skew else ''}"
        params = {"experts": experts, "n": n, "k": k, "tokens": tokens}
        if skew:
            params["skew"] = skew
    if tail:
        params["tail"] = tail
    if source:
        params["source"] = source
    name = f"E{experts}:{rows}x{n}x{k}" + (f"+{tail}" if tail else "")
    return Case(name, params, group)


def expert_counts(params: dict[str, Any]) -> list[int]:
    """Tokens per expert: the case's counts, or its mean spread deterministically over
    [1 - skew, 1 + skew] of it (a golden-ratio sequence: no two experts alike)."""
    if "counts" in params:
        return list(params["counts"])
    t, skew = params["tokens"], params.get("skew", 0.0)
    return [round(t * (1 + skew * (2 * ((e * GOLDEN) % 1) - 1))) for e in range(params["experts"])]


def _padded(count: int) -> int:
    return -(-count // ALIGN) * ALIGN


def total_rows(params: dict[str, Any]) -> int:
    """M: every expert's segment padded to whole tiles, and the tail."""
    return sum(map(_padded, expert_counts(params))) + params.get("tail", 0)


def m_indices_for(params: dict[str, Any]) -> torch.Tensor:
    """int32 (M,): each segment's expert for its tokens, then -1 for its padding and the tail."""
    parts = []
    for e, c in enumerate(expert_counts(params)):
        parts += [torch.full((c,), e), torch.full((_padded(c) - c,), -1)]
    parts.append(torch.full((params.get("tail", 0),), -1))
    return torch.cat(parts).to(torch.int32)


def _dsv3(experts: int, tokens: int, proj: str, group: str, skew: float = 0.0) -> Case:
    """DeepSeek-V3's routed experts (hidden 7168, moe_intermediate 2048): up = gate and up
    fused (N 4096, K 7168), down (N 7168, K 2048); TP8 shards them (N 512; K 256)."""
    tp = 8 if group == "tp8" else 1
    n, k = DSV3_MOE[proj]
    n, k = (n // tp, k) if proj == "up" else (n, k // tp)
    return _case(experts, n, k, tokens=tokens, skew=skew, group=group,
                 source=f"deepseek-v3.moe_{proj}")  # fmt: skip


def _qwen3(model: str, experts: int, tokens: int, proj: str) -> Case:
    """Qwen3-MoE experts: 235B-A22B (hidden 4096, moe_intermediate 1536), 30B-A3B (2048, 768);
    up = gate and up fused."""
    hidden, inter = {"235b-a22b": (4096, 1536), "30b-a3b": (2048, 768)}[model]
    n, k = {"up": (2 * inter, hidden), "down": (hidden, inter)}[proj]
    return _case(experts, n, k, tokens=tokens, group="qwen3", source=f"qwen3-{model}.moe_{proj}")


# DeepSeek-V3 (256 routed experts) under EP32 (8 local experts), EP8 (32) and TP8 (all 256,
# sharded), 128 to 4096 tokens per expert (M up to 131072), and skewed routing at EP8 (128 to
# 896 tokens per expert: partial segments); Qwen3-235B-A22B at EP8 (16 of its 128 experts) and
# Qwen3-30B-A3B on one GPU (all 128).
BENCH_CASES = (
    *(_dsv3(8, t, p, "ep32") for p in ("up", "down") for t in (128, 1024, 4096)),
    *(_dsv3(32, t, p, "ep8") for p in ("up", "down") for t in (128, 512)),
    *(_dsv3(32, 512, p, "ep8-skewed", skew=0.75) for p in ("up", "down")),
    *(_dsv3(256, t, p, "tp8") for p in ("up", "down") for t in (128, 512)),
    *(_qwen3("235b-a22b", 16, t, p) for p in ("up", "down") for t in (512, 2048)),
    *(_qwen3("30b-a3b", 128, t, p) for p in ("up", "down") for t in (128, 512)),
)
# `f4_sw` on four of the cases furthest behind DeepGEMM (H100 2026-12-05 19:54: 0.74-0.89x),
# long and short K, few and many experts
VARIANT_CASES = ("E8:4096x4096x7168", "E16:2048x3072x4096", "E32:512x7168x2048",
                 "E128:512x1536x2048")  # fmt: skip
# Empty experts (first, middle, last, expert 0 under padding tiles), partial segments of 1 to
# 127 padding rows, trailing padding tiles, N off the wide tile's 192, the shortest and longest
# K (the promotion every 128 of K matters there).
CHECK_CASES = (
    _case(2, 256, 128, counts=(128, 256)),
    _case(3, 384, 512, counts=(0, 77, 300)),
    _case(4, 640, 256, counts=(1, 128, 0, 129), tail=128),
    _case(8, 1024, 1024, counts=(5, 0, 250, 128, 64, 0, 400, 3)),
    _case(5, 2048, 7168, counts=(200, 0, 0, 31, 513), tail=256),
    _case(6, 4096, 2048, counts=(130, 260, 1, 127, 0, 384)),
    _case(2, 1408, 7168, counts=(0, 1000)),
    _case(7, 768, 384, counts=(96, 96, 96, 96, 96, 96, 96)),
    _case(8, 512, 640, counts=(0, 0, 0, 0, 0, 0, 0, 300), tail=128),
)
# compute-sanitizer: small, every edge above.
SANITIZE_CASES = (
    _case(2, 256, 256, counts=(0, 130), tail=128),
    _case(3, 384, 128, counts=(1, 0, 128)),
    _case(4, 640, 384, counts=(64, 200, 0, 5)),
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    e, n, k = p["experts"], p["n"], p["k"]
    m_indices = m_indices_for(p).to(device)
    a32 = torch.randn(m_indices.numel(), k, device=device, generator=gen)
    b32 = torch.randn(e * n, k, device=device, generator=gen)
    a, sa = _quantize(a32, 1)
    del a32
    b, sb = _quantize(b32, 128)  # N is a multiple of 128: no block straddles two experts
    return {
        "a": a,
        "b": b.view(e, n, k),
        "sa": sa,
        "sb": sb.view(e, n // 128, k // 128),
        "m_indices": m_indices,
        "padding": (m_indices < 0).nonzero().squeeze(1),
        "out_dtype": dtype,
    }


def alloc_out(inputs: Inputs) -> torch.Tensor:
    a, b = inputs["a"], inputs["b"]
    return torch.empty(a.shape[0], b.shape[1], dtype=inputs["out_dtype"], device=a.device)


def _zero_padding(inputs: Inputs, out: torch.Tensor) -> torch.Tensor:
    """Padding rows are not the caller's: 0, as in the reference."""
    if inputs["padding"].numel():
        out.index_fill_(0, inputs["padding"], 0)
    return out


def run_ours(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    from forgekernel.ops.gemm_fp8_grouped import gemm_fp8_grouped

    c = gemm_fp8_grouped(
        inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], inputs["m_indices"],
        out_dtype=inputs["out_dtype"], out=out,
    )  # fmt: skip
    return _zero_padding(inputs, c)


def run_f4_sw(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with GROUPED_F4_SW forced through the launcher (the op's checks left out: the
    suite's inputs are valid)."""
    from forgekernel.kernels.gemm.fp8.sm90 import launch

    out = alloc_out(inputs) if out is None else out
    launch.gemm_fp8_grouped(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"],
                            inputs["m_indices"], out, config=GROUPED_F4_SW)  # fmt: skip
    return _zero_padding(inputs, out)


def variants(case: Case) -> dict[str, Any]:
    return {"f4_sw": run_f4_sw} if case.name in VARIANT_CASES else {}


def reference(inputs: Inputs) -> torch.Tensor:
    from forgekernel.reference.gemm import gemm_fp8_grouped_ref

    return gemm_fp8_grouped_ref(
        inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], inputs["m_indices"]
    )


def low_precision(inputs: Inputs) -> torch.Tensor:
    """The operands dequantized to the output dtype and multiplied there, expert by expert;
    padding rows 0."""
    d = inputs["out_dtype"]
    a, b, sa, sb, idx = (inputs[x] for x in ("a", "b", "sa", "sb", "m_indices"))
    ad = (a.float() * sa.repeat_interleave(128, 1)).to(d)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=d, device=a.device)
    for e in range(b.shape[0]):
        rows = (idx == e).nonzero().squeeze(1)
        if rows.numel():
            bd = (b[e].float() * sb[e].repeat_interleave(128, 0).repeat_interleave(128, 1)).to(d)
            out[rows] = ad[rows] @ bd.t()
    return out


def _deepgemm():
    try:
        import deep_gemm
    except ImportError:
        return None

    def run(inputs: Inputs) -> torch.Tensor:
        if "deepgemm" not in inputs:
            inputs["deepgemm"] = (deepgemm_scales(deep_gemm, inputs["sa"]), alloc_out(inputs))
        sa, d = inputs["deepgemm"]
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
            (inputs["a"], sa), (inputs["b"], inputs["sb"]), d, inputs["m_indices"]
        )
        return d

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"deepgemm": None}
    return {"deepgemm": _deepgemm()}


def flops(case: Case) -> float:
    """The tokens' work (padding rows are not counted)."""
    p = case.params
    return 2.0 * sum(expert_counts(p)) * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """FP8 A (padding rows too) and the B of every expert with tokens, their scales, the
    indices and the 16-bit output."""
    p = case.params
    m, n, k = total_rows(p), p["n"], p["k"]
    used = sum(1 for c in expert_counts(p) if c)
    a = m * k + 4 * m * (k // 128)
    b = used * (n * k + 4 * (n // 128) * (k // 128))
    return float(a + b + 4 * m + 2 * m * n)


def suite() -> OpSuite:
    return OpSuite(
        name="gemm_fp8_grouped",
        kernel_sources=SPEC.sources,
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
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )
