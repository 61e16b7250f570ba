"""The K = 128 conv3d forward against cuDNN, after the producer's k-tile walk lost its run-time
divisions (docs/conv/NOTES.md, "The producer's k-tile walk"): for each case, the chooser's plan,
its tile on the other walk, the 128x128 tile with the weight multicast over a 4x1 cluster
(B's L2 reads a CTA halved again) and without a cluster, and cuDNN, timed interleaved
(runtime/timing.py, graph replays); each plan's output checked against cuDNN's first.

    python3 scripts/conv_k128_probe.py [CASE ...]    (default: the cases below)

Before (H200 2026-12-02 15:48, scripts/conv_fwd_walks.py): the three K = 128 cases at
0.556 / 0.555 / 0.196 ms (~410 TF/s) on 128x128 c2x1 rect 8, the K = 256 reference at
0.176 ms (659 TF/s) on 128x256 c2x1 rect 8.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from forgekernel.bench.suites import conv_layers as L  # noqa: E402
from forgekernel.bench.suites.conv_fwd import BENCH_CASES  # noqa: E402
from forgekernel.kernels.conv.sm90 import launch  # noqa: E402
from forgekernel.kernels.conv.sm90.config import SMALL, SQUARE, SplitPlan  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.timing import median, time_interleaved  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conv_fwd_walks import _plan  # noqa: E402

CASES = (
    "n4-c128-16x64x64-k128-3x3x3",
    "n1-c128-16x128x128-k128-3x3x3",
    "n1-c128-16x128x128-k128-1x3x3",
    "n2-c128-8x64x64-k256-3x3x3",  # same C and reduction on 128x256: the reference rate
    "n2-c512-8x64x64-k512-3x3x3",
)


def _plans(plan: SplitPlan) -> dict[str, SplitPlan]:
    """The chooser's plan, its tile on the other walk, and (K = 128 tiles) 128x128 c4x1 and
    c1x1 on the plan's walk."""
    other = 8 if plan.rect == 0 else 0
    plans = {"chosen": plan, f"rect{other}": dataclasses.replace(plan, rect=other)}
    if plan.config.tile_n == 128 and plan.parts == 1:
        plans["c4x1"] = dataclasses.replace(plan, config=dataclasses.replace(SQUARE, cluster_m=4))
        plans["c1x1"] = dataclasses.replace(plan, config=SMALL)
    return plans


def main(names: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    wanted = names or CASES
    for case in BENCH_CASES:
        if case.name not in wanted:
            continue
        p = dict(case.params)
        inputs = L.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
        d = len(p["spatial"])
        x5, w5 = op._as5d(inputs["x"]), op._as5d(inputs["w"])
        g = op._geometry(d, p["kernel"], p["stride"], p["padding"], p["dilation"])
        ref = L.cudnn(inputs)
        fns = {"cudnn": functools.partial(L.cudnn, inputs)}
        plan = _plan(x5, w5, op._view5d(L.alloc_out(inputs)), g)
        for name, forced in _plans(plan).items():
            y = L.alloc_out(inputs)
            y5 = op._view5d(y)
            fn = functools.partial(launch.fprop, x5, w5, inputs.get("bias"), y5, g, forced)
            fn()
            torch.cuda.synchronize()
            err = (y.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
            if not err < 2e-2:
                print(f"{case.name} {name} {forced.config.tag()}: WRONG (rel err {err:.3g})")
                continue
            fns[f"{name}[{forced.config.tag()} rect{forced.rect}]"] = fn
        samples = time_interleaved(fns, reps=10)
        flop = L.flops(case)
        base = median(samples["cudnn"])
        print(case.name, flush=True)
        for name, s in samples.items():
            ms = median(s)
            rate = flop / ms / 1e9
            line = f"  {name:44s} {ms:.4f} ms {rate:5.0f} TF/s  cudnn/this {base / ms:.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
