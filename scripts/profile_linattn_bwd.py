"""Profile target: the Gated DeltaNet and Kimi Delta Attention backwards (`forgekernel bench`'s
gdn_bwd / kda_bwd suites: their inputs, `run_ours` and comparator callables), where each call
is many launches (the kernel path's kernels and its torch glue: docs/linear_attention/NOTES.md
"KDA backward: the torch glue, counted"). The H100 run of 2026-12-06 timed kda_bwd at 4.1 ms
(1 x 2048, H = HV = 16) against cuDNN's 0.20 ms, gdn_bwd at 0.565 ms (HV 32) with no comparator.

    python3 scripts/profile_linattn_bwd.py --timeline [--which ours|both] [--case SUITE:CASE]

--timeline (torch.profiler, no ncu) prints each side's kernels with their GPU time per call:
the split between our kernels (names with GdnBwd / KdaBwd / Gdn) and torch's. Without it, an
ncu target as scripts/device_profile.sh runs (KERNELS regex: ours `GdnBwd|KdaBwd`, cuDNN's
`kda`). gdn_bwd's comparators (fla, FlashQLA) run only as sidecars: `--which ours` there, or
`--sidecar-here` with the sidecar's site on PYTHONPATH (its runner made in this process:
scripts/device_profile.sh SITE=, device_profile_gaps.sh's gdn_bwd_qla).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

TARGET = profile_suite.Target(
    name="linattn_bwd",
    suites=("kda_bwd", "gdn_bwd"),
    default_cases=(
        "kda_bwd:1x2048-h16-hv16",
        "kda_bwd:4x8192-h16-hv16",
        "gdn_bwd:1x2048-h16-hv32",
        "gdn_bwd:4x8192-h16-hv32",
    ),
    comparator={"kda_bwd": "cudnn", "gdn_bwd": "fla"},
)

if __name__ == "__main__":
    raise SystemExit(profile_suite.main(TARGET))
