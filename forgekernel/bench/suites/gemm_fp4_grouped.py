"""Grouped GEMM with FP4 weights, contiguous layout, at decode sizes (issue 21): C[r] = (A[r] x
sa[r]) @ dequant(W[e])^T with e = m_indices[r], A (M, K) float8_e4m3fn with sa (M, K/128),
W (E, N, K/2) packed e2m1 with UE8M0 words (E, N, K/128) N-major (as `gemm_fp4_masked`). The
suite's dtypes are the output's. Cases and m_indices (each expert's rows padded to 128 with -1)
as the FP8 contiguous suite (`gemm_fp8_grouped`), here with 1 to 128 tokens per expert (one
128-row segment each: decode). Padding rows are not the caller's and the op leaves them alone:
the suite's output is one view per expert of its tokens' rows of one (M, N) buffer
(`alloc_out`), which `run_ours` hands to the op whole (at 4 tokens per expert, zeroing the
padding rows after the call would cost 7% of the GEMM's bytes).

Comparators on the same problem: "fp8_ours", our FP8-weight contiguous GEMM
(`gemm_fp8_grouped`) on the weights re-quantized to e4m3 per 128x128 block (the bar: >= 1.3x);
"deepgemm_fp8", DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous` on those; "deepgemm_fp4",
`m_grouped_fp8_fp4_gemm_nt_contiguous` on the packed weights (reported missing where the build
rejects packed FP4 on sm90). Variants "tokens8", "tokens16": the tile forced through
`expected_m` (the default and largest contiguous tile is 32 tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import gemm_fp8_grouped as fp8_grouped
from forgekernel.bench.suites.gemm_fp4_masked import _weights
from forgekernel.bench.suites.gemm_fp8 import DSV3_MOE, _quantize, deepgemm_scales
from forgekernel.bench.suites.gemm_fp8_grouped import (
    _case,
    _padded,
    expert_counts,
    m_indices_for,
    total_rows,
)
from forgekernel.kernels.gemm.fp4.sm90 import SPEC
from forgekernel.kernels.gemm.fp4.sm90.config import (
    CONTIGUOUS_STANDARD_TOKENS,
    CONTIGUOUS_TOKENS,
)


def _dsv3(experts: int, tokens: int, proj: str, skew: float = 0.0) -> Case:
    """DeepSeek-V3's routed experts: up (N 4096, K 7168), down (N 7168, K 2048)."""
    n, k = DSV3_MOE[proj]
    return _case(experts, n, k, tokens=tokens, skew=skew, group=f"e{experts}",
                 source=f"deepseek-v3.moe_{proj}")  # fmt: skip


# DeepSeek-V3 decode, contiguous: 32 and 256 experts, 4 to 96 tokens each (skewed +-75%).
BENCH_CASES = (
    *(_dsv3(32, t, p, 0.75) for p in ("up", "down") for t in (4, 16, 64)),
    *(_dsv3(32, 96, p) for p in ("up", "down")),
    *(_dsv3(256, t, p, 0.75) for p in ("up", "down") for t in (4, 16)),
)
# Empty experts, 1 to 128 tokens (whole and partial segments), trailing padding, one and two
# k-tile parities, the longest K.
CHECK_CASES = (
    _case(2, 256, 128, counts=(1, 128)),
    _case(3, 384, 512, counts=(0, 77, 9)),
    _case(4, 640, 256, counts=(1, 128, 0, 33), tail=128),
    _case(5, 1024, 7168, counts=(20, 0, 0, 31, 64)),
    _case(2, 7168, 2048, counts=(5, 11)),
    _case(8, 512, 640, counts=(0, 0, 0, 0, 0, 0, 0, 100), tail=128),
)
SANITIZE_CASES = (
    _case(2, 256, 256, counts=(0, 65), tail=128),
    _case(3, 384, 128, counts=(1, 0, 128)),
    _case(2, 128, 256, counts=(33, 7)),
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    e, n, k = p["experts"], p["n"], p["k"]
    m_indices = m_indices_for(p).to(device)
    a, sa = _quantize(torch.randn(m_indices.numel(), k, device=device, generator=gen), 1)
    b, sb = _weights(e, n, k, False, device, gen)
    return {
        "a": a,
        "b": b,
        "sa": sa,
        "sb": sb,
        "m_indices": m_indices,
        "segments": _segments(p),
        "out_dtype": dtype,
    }


def _segments(params: dict[str, Any]) -> list[tuple[int, int]]:
    """(first row, tokens) of each expert's segment."""
    out, row = [], 0
    for c in expert_counts(params):
        out.append((row, c))
        row += _padded(c)
    return out


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Each expert's tokens' rows: views of one (M, N) buffer."""
    a, b = inputs["a"], inputs["b"]
    full = torch.empty(a.shape[0], b.shape[1], dtype=inputs["out_dtype"], device=a.device)
    return tuple(full[s : s + c] for s, c in inputs["segments"])


def full_output(out: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The (M, N) buffer behind `alloc_out`'s views."""
    return out[0]._base


def _rows(inputs: Inputs, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(full[s : s + c] for s, c in inputs["segments"])


def _args(inputs: Inputs) -> tuple:
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "m_indices"))


def _run(inputs: Inputs, out: tuple | None, expected_m: int | None) -> tuple[torch.Tensor, ...]:
    from forgekernel.ops.gemm_fp4_grouped import gemm_fp4_grouped

    out = alloc_out(inputs) if out is None else out
    gemm_fp4_grouped(
        *_args(inputs), expected_m=expected_m, out_dtype=inputs["out_dtype"],
        out=full_output(out),
    )  # fmt: skip
    return out


def run_ours(inputs: Inputs, out: tuple | None) -> tuple[torch.Tensor, ...]:
    return _run(inputs, out, None)


def variants(case: Case) -> dict[str, Any]:
    """Every other tile; the default tile in the opt-in forms ("staged": the activation scales
    staged in the ring, "convert": a converter warpgroup widening; docs/gemm/NOTES.md "FP4 at
    16-96 tokens")."""
    out = {
        f"tokens{h}": (lambda inputs, out, h=h: _run(inputs, out, h))
        for h in CONTIGUOUS_STANDARD_TOKENS
        if h != CONTIGUOUS_TOKENS
    }
    out["staged"] = lambda inputs, o: run_form(inputs, o, False)
    out["convert"] = lambda inputs, o: run_form(inputs, o, True)
    return out


def run_form(inputs: Inputs, out: tuple | None, converter: bool | int) -> tuple[torch.Tensor, ...]:
    """Ours on the default tile in an opt-in form (the op's launch with the opt-in key)."""
    from forgekernel.kernels.gemm.fp4.sm90.launch import gemm_fp4_contiguous
    from forgekernel.ops.gemm_fp4_grouped_masked import weight_words
    from forgekernel.runtime.device import copy_back, tma_target

    out = alloc_out(inputs) if out is None else out
    full = full_output(out)
    target = tma_target(full, keep=True)
    a, b, sa, sb, idx = _args(inputs)
    gemm_fp4_contiguous(
        a, b.view(torch.uint8), weight_words(sb), sa, idx, target, staged_sa=True,
        converter=converter,
    )  # fmt: skip
    copy_back((full,), (target,))
    return out


def reference(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    from forgekernel.reference.gemm import gemm_fp4_grouped_ref

    return _rows(inputs, gemm_fp4_grouped_ref(*_args(inputs)))


def low_precision(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """The operands dequantized to the output dtype and multiplied there."""
    from forgekernel.reference.gemm import dequantize_fp4

    d = inputs["out_dtype"]
    a, b, sa, sb, idx = _args(inputs)
    ad = (a.float() * sa.repeat_interleave(128, 1)).to(d)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=d, device=a.device)
    for e in range(b.shape[0]):
        rows = (idx == e).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = ad[rows] @ dequantize_fp4(b[e], sb[e]).to(d).t()
    return _rows(inputs, out)


def _fp8_ours(inputs: Inputs) -> torch.Tensor:
    from forgekernel.bench.suites.gemm_fp4_masked import fp8_weights
    from forgekernel.ops.gemm_fp8_grouped import gemm_fp8_grouped

    if "fp8_out" not in inputs:
        inputs["fp8_out"] = full_output(alloc_out(inputs))
    b8, s8 = fp8_weights(inputs)
    return gemm_fp8_grouped(
        inputs["a"], b8, inputs["sa"], s8, inputs["m_indices"], out_dtype=inputs["out_dtype"],
        out=inputs["fp8_out"],
    )  # fmt: skip


def _deepgemm(fp4: bool):
    try:
        import deep_gemm
    except ImportError:
        return None
    name = "m_grouped_fp8_fp4_gemm_nt_contiguous" if fp4 else "m_grouped_fp8_gemm_nt_contiguous"
    fn = getattr(deep_gemm, name, None)
    if fn is None:
        return None

    def run(inputs: Inputs) -> torch.Tensor:
        from forgekernel.bench.suites.gemm_fp4_masked import fp8_weights

        if "deepgemm" not in inputs:
            sa = deepgemm_scales(deep_gemm, inputs["sa"])
            inputs["deepgemm"] = (sa, full_output(alloc_out(inputs)))
        sa, d = inputs["deepgemm"]
        a = (inputs["a"], sa)
        if fp4:
            fn(a, (inputs["b"], inputs["sb"]), d, inputs["m_indices"], recipe_a=(1, 128),
               recipe_b=(1, 32))  # fmt: skip
        else:
            fn(a, fp8_weights(inputs), d, inputs["m_indices"])
        return d

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


flops = fp8_grouped.flops


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """FP8 A (padding rows too), the packed W and words of every expert with tokens, the
    indices and the 16-bit output."""
    p = case.params
    m, n, k = total_rows(p), p["n"], p["k"]
    used = sum(1 for c in expert_counts(p) if c)
    a = m * k + 4 * m * (k // 128)
    w = used * (n * k // 2 + 4 * n * (k // 128))
    return float(a + w + 4 * m + 2 * m * n)


def suite() -> OpSuite:
    return OpSuite(
        name="gemm_fp4_grouped",
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
