"""The stride-1 forward's two A walks timed against each other on the GPU (docs/conv/NOTES.md,
"The stride-1 forward on output rectangles"): for each stride-1 conv_fwd bench case, the
chooser's plan, then its tile and split on the im2col walk and on each rectangle width, timed
interleaved (runtime/timing.py, graph replays), and where the 18:47 refit moved a case's tile
(PREVIOUS) the plan it left ("was", its walk), timed with them. Checks the walk model's picks
(config.py plan_cost; tests/test_conv_walks_model.py replays its tables).

    python3 scripts/conv_fwd_walks.py [CASE ...]    (default: every stride-1 bench case)
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
from forgekernel.kernels.conv.sm90.config import (  # noqa: E402
    K_TILE,
    LARGE,
    SplitPlan,
    choose_plan,
    split_tiles,
)
from forgekernel.kernels.conv.sm90.geometry import RECT_WIDTHS  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.device import num_sms  # noqa: E402
from forgekernel.runtime.timing import median, time_interleaved  # noqa: E402

# The plans the 18:47 refit moved off (tile, parts, walk), timed there: n32-c512-7x7 3x3
# 128x256 c2x1 split 4 on im2col 0.0243 ms (now 128x128 c2x1 split 2, untimed).
PREVIOUS = {"n32-c512-7x7-k512-3x3": (LARGE, 4, 0)}


def _previous(name, m, k, c, taps, pixels):
    """The SplitPlan the case ran before the refit, or None."""
    if name not in PREVIOUS:
        return None
    cfg, parts, rect = PREVIOUS[name]
    per = -(-(-(-c // K_TILE) * taps) // parts)
    tiles = split_tiles(cfg, m, k, pixels, rect)
    cfg = dataclasses.replace(cfg, split=parts > 1)
    return SplitPlan(cfg, per, parts, tiles, rect)


def _plan(x5, w5, y5, g):
    """The chooser's plan for the launch `launch._launch` makes (stride 1, C and K multiples of
    8: the bench's stride-1 cases), with its pixels (an unpadded 1x1 as one plane), and the
    problem (M, K, C, taps, pixels)."""
    n, z, p, q, k = y5.shape
    m, taps, c = n * z * p * q, w5.shape[1] * w5.shape[2] * w5.shape[3], x5.shape[-1]
    pixels = (n, z, p, q)
    if taps == 1 and m % 8 == 0 and not any(g.pad_lo + g.pad_hi):
        pixels = (1, 1, m // 8, 8)
    problem = (m, k, c, taps, pixels)
    return choose_plan(*problem[:4], num_sms(torch.cuda.current_device()), pixels), problem


def main(names: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in BENCH_CASES:
        p = dict(case.params)
        if (names and case.name not in names) or set(p["stride"]) != {1}:
            continue
        if p["c"] % 8 or p["k"] % 8:
            continue
        inputs = L.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
        y = L.alloc_out(inputs)
        d = len(p["spatial"])
        x5, w5, y5 = op._as5d(inputs["x"]), op._as5d(inputs["w"]), op._view5d(y)
        g = op._geometry(d, p["kernel"], p["stride"], p["padding"], p["dilation"])
        plan, problem = _plan(x5, w5, y5, g)
        fns = {}
        for rect in (0, *RECT_WIDTHS):
            forced = dataclasses.replace(plan, rect=rect)
            name = f"rect{rect}" + ("*" if rect == plan.rect else "")
            fns[name] = functools.partial(launch.fprop, x5, w5, inputs.get("bias"), y5, g, forced)
        was = _previous(case.name, *problem)
        if was is not None:
            name = f"was{was.config.tag()}:rect{was.rect}"
            fns[name] = functools.partial(launch.fprop, x5, w5, inputs.get("bias"), y5, g, was)
        samples = time_interleaved(fns, reps=10)
        flop = L.flops(case)
        line = "  ".join(
            f"{name} {median(s):.4f} ms {flop / median(s) / 1e9:.0f} TF/s"
            for name, s in samples.items()
        )
        print(f"{case.name:40s} {plan.config.tag():20s} parts {plan.parts}  {line}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
