"""ncu target: the block-scaled FP8 GEMM, ours (`forgekernel.gemm_fp8`, the default chooser:
LARGE_MCAST_A 128x128 cluster 1x2 at M >= 8192, LARGE 128x128 cluster 2x1 below) against
DeepGEMM's `fp8_gemm_nt` (sgl-deep-gemm) on the largest prefill gaps of the bench
(benchmarks/reports/sm_90a/gemm_fp8.md, 2026-12-02 06:55, graph: 16384x7168x18432 0.766x,
4096x7168x2048 0.809x). bf16 out, A's scales per 1x128, B's per 128x128: the suite's
`make_inputs` and comparator callables (bench/suites/gemm_fp8.py), so what is profiled is what
was benched; `--comparator cublaslt` puts cuBLASLt's block-scaled GEMM there instead.

    python3 scripts/profile_gemm_fp8.py [--which ours|comparator|both] [--case MxNxK ...]

ncu (scripts/device_profile_gaps.sh runs it with --profile-from-start off: only the profiled
calls, every kernel of them). Kernel-name regexes for KERNELS / `-k regex:` where filtering by
name instead: ours `forgekernel` (CuTe DSL names: kernel_cutlass_kernel_forgekernelkernels
gemmdensesm90kernelGemmSm90_...), DeepGEMM `deep_gemm|fp8_gemm|sm90_fp8`, cuBLASLt
`nvjet|sm90_xmma|cutlass`; `spin_kernel` is the segment marker (scripts/profile_suite.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402


def describe(suite_name: str, case) -> str:
    from forgekernel.kernels.gemm.fp8.sm90.config import choose_config

    p = case.params
    return choose_config(p["m"], p["n"], p["k"]).tag()


TARGET = profile_suite.Target(
    name="gemm_fp8",
    suites=("gemm_fp8",),
    default_cases=("gemm_fp8:16384x7168x18432", "gemm_fp8:4096x7168x2048"),
    comparator={"gemm_fp8": "deepgemm"},
    describe=describe,
)

if __name__ == "__main__":
    sys.exit(profile_suite.main(TARGET))
