"""Grouped (MoE, masked layout) block-scaled FP8 GEMM suite, the decode half of MoE: expert e
multiplies the first masked_m[e] rows of its slice of A (E, max_m, K) by its weight B[e]
(E, N, K), both float8_e4m3fn, sa (E, max_m, K/128) per 1x128 group, sb (E, N/128, K/128) per
128x128 block. The suite's dtypes are the output's.

A case names each expert's token count (`counts`), or a mean `tokens` per expert from which
the counts are drawn (log-normal around the mean, from a generator seeded by the case: the
same draw on every machine; 1 to 256 tokens each). max_m: the case's, else the largest count
rounded up to 64 (DeepGEMM's masked GEMM wants a multiple of 64); expected_m (the tile hint):
the case's, else the mean count rounded up. Rows past each count are the caller's garbage:
A's FP8 values and their scales are NaN there (a kernel that reads them into a real row, or
lets one row reach another, shows NaN).

The op leaves the rows past the counts alone, and the harness wants every element of `out`
written (it NaN-poisons it and counts what stays NaN): the suite's output is therefore one
tensor per expert, its counted rows (`alloc_out`: the views out[e, :masked_m[e]] of one
(E, max_m, N) buffer, which `run_ours` hands to the op whole). Nothing but the op runs in the
timed region; that it never writes the other rows is tests/gpu/test_gemm_fp8_masked_gpu.py's
to check.

Comparator: DeepGEMM's `m_grouped_fp8_fp4_gemm_nt_masked` (alias `fp8_m_grouped_gemm_nt_masked`)
on the same inputs, A's scales made M-major and TMA-aligned once per input set outside the
timing; bf16 out only. Bytes: the weights of experts with tokens (read once) and their scales,
the tokens' rows of A and their scales, the counts and the tokens' output rows (TB/s in the
report). Variants "rows8" ... "rows128": the chooser's neighbouring tiles (rows per m-tile)
forced through `expected_m`: the chooser covers twice expected_m with the fewest rows, so
experts above that take several m-tiles that re-read their weight tile from L2, and a taller
tile spends MMA rows on padding; the variants measure that trade.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites.gemm_fp8 import DSV3_MOE, _quantize, deepgemm_scales
from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC
from forgekernel.kernels.gemm.dense.sm90.masked_config import (
    STANDARD_CONFIGS,
    choose_config,
    expected_for,
    rows_per_tile,
)

MAX_M_ALIGN = 64  # DeepGEMM's masked GEMM: max_m % 64 == 0
MAX_TOKENS = 256
SPREAD = 0.75  # sigma of the log-normal draw of the counts around their mean


def _case(
    experts: int,
    n: int,
    k: int,
    *,
    counts: tuple[int, ...] = (),
    tokens: int = 0,
    max_m: int = 0,
    expected_m: int = 0,
    group: str = "",
    source: str = "",
) -> Case:
    """`counts` per expert, or a mean of `tokens` per expert drawn as the module says."""
    if counts and len(counts) != experts:
        raise ValueError(f"{len(counts)} counts for {experts} experts")
    params: dict[str, Any] = {"experts": experts, "n": n, "k": k}
    if counts:
        params["counts"] = counts
        rows = "-".join(map(str, counts))
    else:
        params["tokens"] = tokens
        rows = f"{tokens}d"
    for name, value in (("max_m", max_m), ("expected_m", expected_m), ("source", source)):
        if value:
            params[name] = value
    name = f"E{experts}:{rows}x{n}x{k}/m{max_rows(params)}e{expected_rows(params)}"
    return Case(name, params, group)


def expert_counts(params: dict[str, Any]) -> list[int]:
    """Tokens per expert: the case's counts, or its mean spread log-normally (mean kept), each
    in [1, 256], from a generator seeded by the case."""
    if "counts" in params:
        return list(params["counts"])
    e, t = params["experts"], params["tokens"]
    rng = random.Random(f"masked:{e}:{t}")
    shift = -(SPREAD**2) / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    return [min(MAX_TOKENS, max(1, round(t * rng.lognormvariate(shift, SPREAD)))) for _ in range(e)]


def max_rows(params: dict[str, Any]) -> int:
    """max_m: the case's, else the largest count rounded up to 64 (at least 64)."""
    if params.get("max_m"):
        return params["max_m"]
    return max(MAX_M_ALIGN, -(-max(expert_counts(params)) // MAX_M_ALIGN) * MAX_M_ALIGN)


def expected_rows(params: dict[str, Any]) -> int:
    """expected_m: the case's, else the mean count rounded up (what a caller knows: routed
    tokens x top-k / experts)."""
    counts = expert_counts(params)
    return params.get("expected_m") or max(1, math.ceil(sum(counts) / len(counts)))


def _dsv3(experts: int, tokens: int, proj: str) -> Case:
    """DeepSeek-V3's routed experts (hidden 7168, moe_intermediate 2048): up = gate and up
    fused (N 4096, K 7168), down (N 7168, K 2048)."""
    n, k = DSV3_MOE[proj]
    return _case(experts, n, k, tokens=tokens, group=f"e{experts}",
                 source=f"deepseek-v3.moe_{proj}")  # fmt: skip


# DeepSeek-V3 decode: 32 experts (EP8) and all 256, 2 to 96 tokens per expert on average,
# drawn (each expert 1 to 256); 256 experts stop at 32 (7.5 GB of up weights per input set).
BENCH_CASES = (
    *(_dsv3(32, t, p) for p in ("up", "down") for t in (2, 8, 32, 96)),
    *(_dsv3(256, t, p) for p in ("up", "down") for t in (2, 8, 32)),
)
# Every tile (expected_m 1 .. 128: A's box 8 / 16 / 32 rows, 64 and 128-row tiles), empty
# experts (first, middle, last, all), a count equal to max_m, max_m off every tile and off 8,
# experts with many more rows than expected (several m-tiles each), whole 64 / 128-row tiles
# (TMA store) beside partial ones (stored from registers), the shortest and longest K.
CHECK_CASES = (
    _case(1, 128, 128, counts=(1,), max_m=1, expected_m=1),
    _case(3, 256, 512, counts=(0, 5, 37), max_m=37, expected_m=8),
    _case(4, 384, 1024, counts=(16, 0, 9, 64), max_m=64, expected_m=16),
    _case(5, 1024, 7168, counts=(33, 1, 0, 32, 20), max_m=40, expected_m=32),
    _case(2, 512, 2048, counts=(64, 63), max_m=64, expected_m=64),
    _case(3, 640, 256, counts=(128, 200, 1), max_m=200, expected_m=128),
    _case(6, 4096, 384, counts=(0, 0, 0, 0, 0, 0), max_m=16, expected_m=4),
    _case(8, 256, 128, counts=(256, 3, 100, 0, 8, 9, 255, 17), max_m=256, expected_m=1),
    _case(2, 7168, 2048, counts=(5, 11), max_m=64, expected_m=8),
    _case(4, 256, 256, counts=(24, 24, 24, 24), max_m=24, expected_m=32),
)
# compute-sanitizer: A's 8-row box with several m-tiles, the 64-row tile (whole and partial),
# the 128-row tile (whole and partial), an empty expert in each.
SANITIZE_CASES = (
    _case(3, 256, 256, counts=(0, 20, 3), max_m=24, expected_m=8),
    _case(3, 384, 384, counts=(64, 0, 30), max_m=72, expected_m=64),
    _case(2, 256, 128, counts=(130, 0), max_m=136, expected_m=100),
)


def _padding_rows(counts: list[int], max_m: int, device: torch.device) -> torch.Tensor:
    """Rows e * max_m + r, r >= counts[e], of the (E x max_m) flattened output."""
    r = torch.arange(max_m)
    rows = [e * max_m + r[c:] for e, c in enumerate(counts)]
    return torch.cat(rows).to(device)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    e, n, k = p["experts"], p["n"], p["k"]
    counts, max_m = expert_counts(p), max_rows(p)
    a, sa = _quantize(torch.randn(e * max_m, k, device=device, generator=gen), 1)
    a, sa = a.view(e, max_m, k), sa.view(e, max_m, k // 128)
    padding = _padding_rows(counts, max_m, device)
    # the caller's garbage past each count: NaN data and scales
    a.view(e * max_m, k).view(torch.uint8).index_fill_(0, padding, 0x7F)
    sa.view(e * max_m, -1).index_fill_(0, padding, float("nan"))
    b = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
    sb = torch.empty(e, n // 128, k // 128, device=device)
    for first in range(0, e, 8):  # the fp32 weights 8 experts at a time (7.5 GB of FP8 at most)
        last = min(e, first + 8)
        q, s = _quantize(torch.randn((last - first) * n, k, device=device, generator=gen), 128)
        b[first:last], sb[first:last] = q.view(-1, n, k), s.view(-1, n // 128, k // 128)
    return {
        "a": a,
        "b": b,
        "sa": sa,
        "sb": sb,
        "masked_m": torch.tensor(counts, dtype=torch.int32, device=device),
        "counts": counts,
        "expected_m": expected_rows(p),
        "out_dtype": dtype,
    }


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Each expert's counted rows: views out[e, :masked_m[e]] of one (E, max_m, N) buffer."""
    a, b = inputs["a"], inputs["b"]
    full = torch.empty(*a.shape[:2], b.shape[1], dtype=inputs["out_dtype"], device=a.device)
    return tuple(full[e, :c] for e, c in enumerate(inputs["counts"]))


def full_output(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The (E, max_m, N) buffer behind `alloc_out`'s views."""
    return out[0]._base


def _args(inputs: Inputs) -> tuple:
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "masked_m"))


def _run(inputs: Inputs, out: tuple | None, expected_m: int) -> tuple[torch.Tensor, ...]:
    from forgekernel.ops.gemm_fp8_grouped_masked import gemm_fp8_grouped_masked

    out = alloc_out(inputs) if out is None else out
    gemm_fp8_grouped_masked(
        *_args(inputs), expected_m, out_dtype=inputs["out_dtype"], out=full_output(out)
    )
    return out


def run_ours(inputs: Inputs, out: tuple | None) -> tuple[torch.Tensor, ...]:
    return _run(inputs, out, inputs["expected_m"])


def variants(case: Case) -> dict[str, Any]:
    """The chooser's neighbours: the tiles of half and of twice its rows (expected_m forced to
    one that picks them: `expected_for`). Every tile was timed
    on every case until 2026-12-03 (the chooser's double cover comes from those figures)."""
    rows = [rows_per_tile(c) for c in STANDARD_CONFIGS]
    i = rows.index(rows_per_tile(choose_config(expected_rows(case.params))))
    return {
        f"rows{h}": (lambda inputs, out, h=h: _run(inputs, out, expected_for(h)))
        for h in rows[max(0, i - 1) : i] + rows[i + 1 : i + 2]
    }


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    from forgekernel.reference.gemm import gemm_fp8_masked_ref

    full = gemm_fp8_masked_ref(*_args(inputs))
    return tuple(full[e, :c] for e, c in enumerate(inputs["counts"]))


def low_precision(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The operands dequantized to the output dtype and multiplied there, expert by expert."""
    d = inputs["out_dtype"]
    a, b, sa, sb, _ = _args(inputs)
    outs = []
    for e, c in enumerate(inputs["counts"]):
        ad = (a[e, :c].float() * sa[e, :c].repeat_interleave(128, 1)).to(d)
        bd = (b[e].float() * sb[e].repeat_interleave(128, 0).repeat_interleave(128, 1)).to(d)
        outs.append(ad @ bd.t())
    return tuple(outs)


def _deepgemm():
    try:
        import deep_gemm
    except ImportError:
        return None
    masked = getattr(deep_gemm, "m_grouped_fp8_fp4_gemm_nt_masked", None) or getattr(
        deep_gemm, "fp8_m_grouped_gemm_nt_masked", None
    )
    if masked is None:
        return None

    def run(inputs: Inputs) -> torch.Tensor:
        if "deepgemm" not in inputs:
            inputs["deepgemm"] = (
                deepgemm_scales(deep_gemm, inputs["sa"]),
                full_output(alloc_out(inputs)),
            )
        sa, d = inputs["deepgemm"]
        masked(
            (inputs["a"], sa), (inputs["b"], inputs["sb"]), d, inputs["masked_m"],
            inputs["expected_m"],
        )  # fmt: skip
        return d

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"deepgemm": None}
    return {"deepgemm": _deepgemm()}


def flops(case: Case) -> float:
    p = case.params
    return 2.0 * sum(expert_counts(p)) * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """The weights of every expert with tokens and their scales (read once), the tokens' rows
    of A and their scales, the counts, the tokens' 16-bit output rows."""
    p = case.params
    counts, n, k = expert_counts(p), p["n"], p["k"]
    tokens, used = sum(counts), sum(1 for c in counts if c)
    weights = used * (n * k + 4 * (n // 128) * (k // 128))
    return float(weights + tokens * (k + 4 * (k // 128)) + 4 * len(counts) + 2 * tokens * n)


def suite() -> OpSuite:
    return OpSuite(
        name="gemm_fp8_masked",
        kernel_sources=MASKED_SPEC.sources,
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
        memory_bound=True,
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )
