"""ncu target: the dense bf16 GEMM, ours (`forgekernel.gemm`, the default chooser) against
cuBLAS (`torch.matmul` into a preallocated output, the suite's comparator) on the largest gaps
of the bench (benchmarks/reports/sm_90a/gemm.md, 2026-12-02 06:54, graph: 129x10240x8192 0.683x
ragged, 4096x576x7168 0.759x, 512x10240x5120 0.826x), B as (N, K) ("nk", as the suite): the
suite's `make_inputs` and comparator callables (bench/suites/gemm.py).

    python3 scripts/profile_gemm.py [--which ours|comparator|both] [--case MxNxK ...]

Kernel-name regexes for KERNELS / `-k regex:` where filtering by name: ours `forgekernel`
(kernel_cutlass_kernel_forgekernelkernelsgemmdensesm90kernelGemmSm90_...; stream-K plans are
one kernel too), cuBLAS on sm90 `nvjet|sm90_xmma|cutlass|gemm` (cuBLAS 13 names most of its
Hopper GEMMs nvjet_*); `spin_kernel` is the segment marker (scripts/profile_suite.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402


def describe(suite_name: str, case) -> str:
    """The chooser's pick and, for M > 128, the rivals it weighed (the bench's variants)."""
    from forgekernel.kernels.gemm.dense.sm90.config import choose_config, prefill_rivals

    p = case.params
    m, n, k = p["m"], p["n"], p["k"]
    text = choose_config(m, n, k).tag()
    if m > 128:
        rivals = ", ".join(f"{kind} {cfg.tag()}" for kind, cfg in prefill_rivals(m, n, k).items())
        text += f" (rivals: {rivals})"
    return text


TARGET = profile_suite.Target(
    name="gemm",
    suites=("gemm",),
    default_cases=("gemm:129x10240x8192", "gemm:4096x576x7168", "gemm:512x10240x5120"),
    comparator={"gemm": "cublas"},
    describe=describe,
)

if __name__ == "__main__":
    sys.exit(profile_suite.main(TARGET))
