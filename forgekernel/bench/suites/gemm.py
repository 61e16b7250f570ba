"""Dense 16-bit GEMM suite: C = A @ B^T (B as (N, K), or (K, N) with b_layout "kn")."""

from __future__ import annotations

from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.gemm.dense.sm90 import SPEC


def _case(m: int, n: int, k: int, b_layout: str = "nk") -> Case:
    name = f"{m}x{n}x{k}" + ("-kn" if b_layout == "kn" else "")
    return Case(name, {"m": m, "n": n, "k": k, "b_layout": b_layout})


def _unique(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    return tuple({c.name: c for c in cases}.values())


# OPS.md lists 8192^3 twice (square, and M = 8192 with (N, K) = (8192, 8192)); run it once.
BENCH_CASES = _unique(
    (
        _case(4096, 4096, 4096),
        _case(8192, 8192, 8192),
        *(
            _case(8192, n, k)
            for n, k in ((28672, 8192), (8192, 28672), (10240, 8192), (8192, 8192))
        ),
        *(_case(m, 8192, 8192) for m in (64, 128, 256)),
        _case(1000, 3000, 4104),
        _case(8192, 8192, 8192, "kn"),
    )
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
)
CHECK_CASES = _unique(BENCH_CASES + EDGE_CASES)
# compute-sanitizer (`forgekernel check --sanitize`) and tests/gpu/: every standard configuration
# the chooser picks (64x64 skinny, 64x128 skinny, 128x128, 128x192 wide, 128x256 large), each on
# ragged edges, both B layouts, and the smallest problem (M = 1, N = K = 8).
SANITIZE_CASES = (
    _case(1, 8, 8),
    _case(33, 264, 520),
    _case(100, 264, 1000, "kn"),
    _case(255, 136, 72),
    _case(1000, 1000, 1032, "kn"),
    _case(1500, 2504, 520),
)


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


def flops(case: Case) -> float:
    p = case.params
    return 2.0 * p["m"] * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    elem = torch.empty((), dtype=dtype).element_size()
    return float((p["m"] * p["k"] + p["n"] * p["k"] + p["m"] * p["n"]) * elem)


def suite() -> OpSuite:
    return OpSuite(
        name="gemm",
        kernel_sources=SPEC.sources,  # the ledger hashes what the compile cache hashes
        dtypes=(torch.float16, torch.bfloat16),
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
        sanitize_cases=SANITIZE_CASES,
    )
