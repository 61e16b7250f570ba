"""ncu target: DeepSeek sparse attention's decode over FlashMLA's FP8 cache, ours
(`forgekernel.dsa_sparse_attention`: the MLA partial pass's sparse mode, the split combine where
the plan splits) against FlashMLA's sparse decode (sgl-flash-mla, the bench's `flashmla_fp8`)
on the bench's FP8 cases (benchmarks/reports/sm_90a/dsa_sparse.md, 2026-12-04 17:35, graph):
t1-h16 (0.732x with 8 splits; 32 splits from config.sparse_split_plan), t128-h16 0.770x (one
CTA a token, 128 CTAs), t64-h128 0.552x (two head blocks a token). The suite's `make_inputs`
and comparator callable (bench/suites/dsa_sparse.py): what is profiled is what was benched.

    python3 scripts/profile_dsa.py [--which ours|comparator|both] [--case NAME ...]

scripts/device_profile_gaps.sh runs it (target `dsa`).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

TARGET = profile_suite.Target(
    name="dsa",
    suites=("dsa_sparse",),
    default_cases=(
        "dsa_sparse:t1-h16-p64-k2048-L32768-fp8",
        "dsa_sparse:t128-h16-p64-k2048-L32768-fp8",
        "dsa_sparse:t64-h128-p64-k2048-L8192-fp8",
    ),
    comparator={"dsa_sparse": "flashmla_fp8"},
)

if __name__ == "__main__":
    sys.exit(profile_suite.main(TARGET))
