"""ncu target: the attention forward of one bench case, unpacked and GQA-packed through views
(the suite's `run_unpacked` / `run_packed`, its inputs), for the loss of the packed form on the
s512 D = 128 controls (docs/attention/NOTES.md "next/gqa-pack-d64": 1.36x / 1.49x of the
unpacked time, per tile rather than per step). Two warm-up calls of each form, then one of
each between cudaProfilerStart / Stop: unpacked first, packed second.

    source scripts/device_setup.sh || exit 1; SCRIPT=scripts/profile_attn_pack.py \\
      KERNELS=forgekernel SKIP=0 COUNT=2 NCU_EXTRA="--profile-from-start off" \\
      PROFILE_NAME=attn-pack bash scripts/device_profile.sh [CASE]

CASE: a bench case name (default b32-hq32-hkv8-s512-d128, the non-causal control); bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's forgekernel


def main(name: str) -> None:
    import torch

    from forgekernel.bench.suites import attention as suite_module

    suite = suite_module.suite()
    case = next((c for c in suite.bench_cases if c.name == name), None)
    if case is None:
        raise SystemExit(f"no bench case {name!r}")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = suite.make_inputs(case, torch.bfloat16, device, gen)
    out = suite.alloc_out(inputs)
    forms = (suite_module.run_unpacked, suite_module.run_packed)
    for run in forms * 2:
        run(inputs, out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in forms:
        run(inputs, out)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{name}: profiled unpacked then packed")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "b32-hq32-hkv8-s512-d128")
