"""Masked grouped GEMM with FP4 weights (MoE decode, issue 21): expert e multiplies the first
masked_m[e] rows of its slice of A (E, max_m, K) float8_e4m3fn, sa (E, max_m, K/128) per 1x128,
by its weight W[e] packed e2m1 (E, N, K/2) int8 with UE8M0 scales per 1x32 of K as int32 words
(E, N, K/128), N-major (`forgekernel.ops.fp4_pack`; DeepGEMM's FP8 x FP4 tensors). The suite's
dtypes are the output's. Counts, max_m, expected_m and the NaN garbage past the counts as the
FP8 masked suite (`gemm_fp8_masked`, whose case helpers this reuses); the weights are drawn in
fp32 and quantized by `quantize_fp4_weights` (a case with `spread` scales its 1x32 groups by
up to 2^-14 first, so that some sub-blocks sit more than 2^11 below their k-tile's largest and
are flushed).

Comparators, on the same problem: "fp8_ours", our FP8-weight masked GEMM (the bar: >= 1.3x) on
the weights dequantized and re-quantized to e4m3 per 128x128 block; "deepgemm_fp8",
DeepGEMM's `m_grouped_fp8_fp4_gemm_nt_masked` on those FP8 weights (its only sm90 path in
sgl-deep-gemm 0.1.4.post1); "deepgemm_fp4", the same call on the packed FP4 weights and words
(recipe_b (1, 32)): on sm90 builds that reject packed FP4 it is reported missing with
DeepGEMM's message. The comparators' weights are made once per input set, outside the timing.
Bytes: the packed weights and words of experts with tokens, the tokens' rows of A and their
scales, the counts and the tokens' output rows (the weight stream's TB/s against the copy
bandwidth: the bar's 85%). Variants "tokens8" ... "tokens64": every other tile forced;
"convert" on every bench case: the chosen tile in the opt-in converter form (`converter`: a
warpgroup widens, the MMAs read A from shared memory); on the 8-, 32- and 96-token cases also
"staged" / "staged64" (the chosen / the 64-token tile with `staged_sa`: the activation scales
staged in the ring), "convert2" (the chosen tile, two converter warpgroups), "convert64", and
on the 96-token ones "convert96" (docs/gemm/NOTES.md "FP4 at 16-96 tokens").
"""

from __future__ import annotations

from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import gemm_fp8_masked as fp8_masked
from forgekernel.bench.suites.gemm_fp8 import DSV3_MOE, _quantize, deepgemm_scales
from forgekernel.bench.suites.gemm_fp8_masked import (
    alloc_out,
    expected_rows,
    expert_counts,
    full_output,
    max_rows,
)
from forgekernel.kernels.gemm.fp4.sm90 import SPEC
from forgekernel.kernels.gemm.fp4.sm90.config import TOKENS, choose_tokens, expected_for
from forgekernel.ops.fp4_pack import quantize_fp4_weights

SPREAD_EXP = 14  # a `spread` case's 1x32 groups scaled by 2^-0 .. 2^-14 before quantizing


def _case(experts: int, n: int, k: int, *, spread: bool = False, **kw: Any) -> Case:
    case = fp8_masked._case(experts, n, k, **kw)
    if spread:
        case.params["spread"] = True
        return Case(case.name + "/spread", case.params, case.group)
    return case


def _dsv3(experts: int, tokens: int, proj: str) -> Case:
    """DeepSeek-V3's routed experts: up = gate and up fused (N 4096, K 7168), down (N 7168,
    K 2048)."""
    n, k = DSV3_MOE[proj]
    return _case(experts, n, k, tokens=tokens, group=f"e{experts}",
                 source=f"deepseek-v3.moe_{proj}")  # fmt: skip


# DeepSeek-V3 decode: 32 experts (EP8) and all 256, 1 to 96 tokens per expert on average
# (each expert drawn in 1 .. 256).
BENCH_CASES = (
    *(_dsv3(32, t, p) for p in ("up", "down") for t in (1, 2, 8, 32, 96)),
    *(_dsv3(256, t, p) for p in ("up", "down") for t in (2, 8, 32)),
)
# Every tile (8 / 16 / 32 / 64 tokens), experts above their tile (several token tiles), empty
# experts, a count equal to max_m, max_m off every tile, a single k-tile and odd / even k-tile
# counts (the mainloop's two tails), flushed sub-blocks.
CHECK_CASES = (
    _case(1, 128, 128, counts=(1,), max_m=1, expected_m=1),
    _case(3, 256, 384, counts=(0, 5, 37), max_m=37, expected_m=8),
    _case(4, 384, 1024, counts=(16, 0, 9, 64), max_m=64, expected_m=16),
    _case(5, 1024, 7168, counts=(33, 1, 0, 32, 20), max_m=40, expected_m=32),
    _case(2, 512, 2048, counts=(64, 63), max_m=64, expected_m=64),
    _case(3, 640, 256, counts=(128, 200, 1), max_m=200, expected_m=64),
    _case(6, 4096, 384, counts=(0, 0, 0, 0, 0, 0), max_m=16, expected_m=4),
    _case(8, 256, 128, counts=(256, 3, 100, 0, 8, 9, 255, 17), max_m=256, expected_m=1),
    _case(2, 7168, 2048, counts=(5, 11), max_m=64, expected_m=8),
    _case(4, 256, 640, counts=(24, 24, 24, 24), max_m=24, expected_m=32, spread=True),
)
SANITIZE_CASES = (
    _case(3, 256, 256, counts=(0, 20, 3), max_m=24, expected_m=8),
    _case(3, 384, 384, counts=(64, 0, 30), max_m=72, expected_m=64),
    _case(2, 128, 128, counts=(1, 17), max_m=17, expected_m=16),  # K = 128: one scale word
)


def _weights(e: int, n: int, k: int, spread: bool, device, gen) -> tuple[torch.Tensor, ...]:
    """Packed FP4 weights and their words, 8 experts at a time (fp32 temporaries)."""
    packed = torch.empty(e, n, k // 2, dtype=torch.int8, device=device)
    words = torch.empty(e, k // 128, n, dtype=torch.int32, device=device).transpose(1, 2)
    for first in range(0, e, 8):
        last = min(e, first + 8)
        w = torch.randn(last - first, n, k, device=device, generator=gen)
        if spread:
            exps = torch.randint(-SPREAD_EXP, 1, (last - first, n, k // 32), device=device,
                                 generator=gen)  # fmt: skip
            w = w * torch.exp2(exps.float()).repeat_interleave(32, -1)
        packed[first:last], words[first:last] = quantize_fp4_weights(w)
    return packed, words


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    e, n, k = p["experts"], p["n"], p["k"]
    counts, max_m = expert_counts(p), max_rows(p)
    a, sa = _quantize(torch.randn(e * max_m, k, device=device, generator=gen), 1)
    a, sa = a.view(e, max_m, k), sa.view(e, max_m, k // 128)
    padding = fp8_masked._padding_rows(counts, max_m, device)
    a.view(e * max_m, k).view(torch.uint8).index_fill_(0, padding, 0x7F)
    sa.view(e * max_m, -1).index_fill_(0, padding, float("nan"))
    b, sb = _weights(e, n, k, bool(p.get("spread")), device, gen)
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


def _args(inputs: Inputs) -> tuple:
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "masked_m"))


def _run(inputs: Inputs, out: tuple | None, expected_m: int) -> tuple[torch.Tensor, ...]:
    from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked

    out = alloc_out(inputs) if out is None else out
    gemm_fp4_grouped_masked(
        *_args(inputs), expected_m, out_dtype=inputs["out_dtype"], out=full_output(out)
    )
    return out


def run_ours(inputs: Inputs, out: tuple | None) -> tuple[torch.Tensor, ...]:
    return _run(inputs, out, inputs["expected_m"])


# The bench cases (mean tokens an expert) that also time the opt-in forms on other tiles
STAGED_TIMED = (8, 32, 96)


def variants(case: Case) -> dict[str, Any]:
    """Every other tile than the chooser's (expected_m forced to one that picks it); the
    chosen tile in the converter form; on the STAGED_TIMED cases the chosen and the 64-token
    tile with `staged_sa` and the 64- (and at 96 the 96-) token tile in the converter form."""
    chosen = choose_tokens(expected_rows(case.params))
    out = {
        f"tokens{h}": (lambda inputs, out, h=h: _run(inputs, out, expected_for(h)))
        for h in TOKENS
        if h != chosen
    }
    out["convert"] = lambda inputs, o, h=chosen: _run_staged(inputs, o, h, converter=True)
    mean = case.params.get("tokens")
    if mean in STAGED_TIMED:
        out["staged"] = lambda inputs, o, h=chosen: _run_staged(inputs, o, h)
        out["convert2"] = lambda inputs, o, h=chosen: _run_staged(inputs, o, h, converter=2)
        wider = [64, 96] if mean == 96 else [64]
        for h in wider:
            if h != chosen:
                out[f"convert{h}"] = lambda inputs, o, h=h: _run_staged(inputs, o, h, True)
        if chosen != 64:
            out["staged64"] = lambda inputs, o: _run_staged(inputs, o, 64)
    return out


def _run_staged(
    inputs: Inputs, out: tuple | None, tokens: int, converter: bool | int = False
) -> tuple[torch.Tensor, ...]:
    """Ours on `tokens` per tile in an opt-in form: the activation scales staged in the ring,
    and with `converter` (1 or 2) the widening in that many converter warpgroups (the op's
    launch with the opt-in key)."""
    from forgekernel.kernels.gemm.fp4.sm90.launch import gemm_fp4_masked
    from forgekernel.ops.gemm_fp4_grouped_masked import weight_words
    from forgekernel.runtime.device import copy_back, tma_target

    out = alloc_out(inputs) if out is None else out
    full = full_output(out)
    target = tma_target(full, keep=True)
    a, b, sa, sb, masked_m = _args(inputs)
    gemm_fp4_masked(
        a, b.view(torch.uint8), weight_words(sb), sa, masked_m, inputs["expected_m"], target,
        tokens=tokens, staged_sa=True, converter=converter,
    )  # fmt: skip
    copy_back((full,), (target,))
    return out


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    from forgekernel.reference.gemm import gemm_fp4_masked_ref

    full = gemm_fp4_masked_ref(*_args(inputs))
    return tuple(full[e, :c] for e, c in enumerate(inputs["counts"]))


def low_precision(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The operands dequantized to the output dtype and multiplied there, expert by expert."""
    from forgekernel.reference.gemm import dequantize_fp4

    d = inputs["out_dtype"]
    a, b, sa, sb, _ = _args(inputs)
    outs = []
    for e, c in enumerate(inputs["counts"]):
        ad = (a[e, :c].float() * sa[e, :c].repeat_interleave(128, 1)).to(d)
        outs.append(ad @ dequantize_fp4(b[e], sb[e]).to(d).t())
    return tuple(outs)


def fp8_weights(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP4 weights dequantized and re-quantized to e4m3 per 128x128 block (the FP8
    comparators' weights), made once per input set, 8 experts at a time."""
    if "fp8_weights" not in inputs:
        from forgekernel.reference.gemm import dequantize_fp4

        b, sb = inputs["b"], inputs["sb"]
        e, n, half_k = b.shape
        k = 2 * half_k
        q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=b.device)
        s = torch.empty(e, n // 128, k // 128, device=b.device)
        for first in range(0, e, 8):
            last = min(e, first + 8)
            w = dequantize_fp4(b[first:last], sb[first:last]).float().view(-1, k)
            qq, ss = _quantize(w, 128)
            q[first:last], s[first:last] = qq.view(-1, n, k), ss.view(-1, n // 128, k // 128)
            del w
        inputs["fp8_weights"] = (q, s)
    return inputs["fp8_weights"]


def _fp8_ours(inputs: Inputs) -> torch.Tensor:
    from forgekernel.ops.gemm_fp8_grouped_masked import gemm_fp8_grouped_masked

    if "fp8_out" not in inputs:
        inputs["fp8_out"] = full_output(alloc_out(inputs))
    b8, s8 = fp8_weights(inputs)
    return gemm_fp8_grouped_masked(
        inputs["a"], b8, inputs["sa"], s8, inputs["masked_m"], inputs["expected_m"],
        out_dtype=inputs["out_dtype"], out=inputs["fp8_out"],
    )  # fmt: skip


def _deepgemm(fp4: bool):
    try:
        import deep_gemm
    except ImportError:
        return None
    masked = getattr(deep_gemm, "m_grouped_fp8_fp4_gemm_nt_masked", None)
    if masked is None:
        return None

    def run(inputs: Inputs) -> torch.Tensor:
        if "deepgemm" not in inputs:
            sa = deepgemm_scales(deep_gemm, inputs["sa"])
            inputs["deepgemm"] = (sa, full_output(alloc_out(inputs)))
        sa, d = inputs["deepgemm"]
        a = (inputs["a"], sa)
        args = (d, inputs["masked_m"], inputs["expected_m"])
        if fp4:
            return masked(a, (inputs["b"], inputs["sb"]), *args, recipe_a=(1, 128),
                          recipe_b=(1, 32))  # fmt: skip
        return masked(a, fp8_weights(inputs), *args)

    return run


def comparators() -> dict[str, Any]:
    names = ("fp8_ours", "deepgemm_fp8", "deepgemm_fp4")
    if not torch.cuda.is_available():
        return dict.fromkeys(names)
    return {
        "fp8_ours": _fp8_ours,
        "deepgemm_fp8": _deepgemm(False),
        "deepgemm_fp4": _deepgemm(True),
    }


def flops(case: Case) -> float:
    p = case.params
    return 2.0 * sum(expert_counts(p)) * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """The packed weights and words of every expert with tokens (read once), the tokens' rows
    of A and their scales, the counts, the tokens' 16-bit output rows."""
    p = case.params
    counts, n, k = expert_counts(p), p["n"], p["k"]
    tokens, used = sum(counts), sum(1 for c in counts if c)
    weights = used * (n * k // 2 + 4 * n * (k // 128))
    return float(weights + tokens * (k + 4 * (k // 128)) + 4 * len(counts) + 2 * tokens * n)


def suite() -> OpSuite:
    return OpSuite(
        name="gemm_fp4_masked",
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
        memory_bound=True,
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )
