"""ncu target: the MLA decode, ours (`forgekernel.mla_decode`: the seesaw pass over 16-bit caches
of 64-token pages, the split combine where the plan splits) against FlashMLA's
`flash_mla_with_kvcache` (sgl-flash-mla) on the bench's largest gaps (benchmarks/reports/sm_90a/
mla_decode.md, 2026-12-03 16:40, graph): b1-h16-p64-L65536 0.801x (128 splits: the combine's walk
over them, ~42 us of 65 by MLA_NOTES.md's model: the combine's ncu time says), b48-h16-p64-mixed
0.710x (ragged lengths), b16-h128-p64-L4096 0.901x (compute-bound, 128 CTAs and a combine).
The suite's `make_inputs` and comparator callable
(bench/suites/mla_decode.py), so what is profiled is what was benched.

    python3 scripts/profile_mla.py [--which ours|comparator|both] [--case NAME ...]

scripts/device_profile_gaps.sh runs it (target `mla`). Kernel names: ours `MlaSeesaw`,
`MlaDecode` (decode.py), `MlaCombine`; FlashMLA `flash_fwd_splitkv_mla|flash_mla|combine`.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

TARGET = profile_suite.Target(
    name="mla",
    suites=("mla_decode",),
    default_cases=(
        "mla_decode:b1-h16-p64-L65536",
        "mla_decode:b48-h16-p64-mixed",
        "mla_decode:b16-h128-p64-L4096",
    ),
    comparator={"mla_decode": "flashmla"},
)

if __name__ == "__main__":
    sys.exit(profile_suite.main(TARGET))
