"""The stride-1 forward's two A walks timed against each other on the GPU (docs/conv/NOTES.md,
"The stride-1 forward on output rectangles"): for each stride-1 conv_fwd bench case, the
chooser's plan, then its tile and split on the im2col walk and on each rectangle width, timed
interleaved (runtime/timing.py, graph replays), and where the 18:47 refit moved a case's tile
(PREVIOUS) the plan it left ("was", its walk), timed with them. Checks the walk model's picks
(config.py plan_cost; tests/test_conv_walks_model.py replays its tables).

Then ("split table", docs/conv/NOTES.md "The stride-2 forwards at 0.66-0.79x") each strided
bench case and its stride-1 twin (the same M, K, C, taps: SPLIT_TABLE) on the im2col walk over
SPLIT_GRID's tiles and parts, inputs rotated past L2 as the bench does: the chooser's plan
(`*`, config.STRIDED_ROWS_128 at stride 2), the 12-01 rate's plan it left (`was`), and the
rest of the grid.

    python3 scripts/conv_fwd_walks.py [CASE ...]    (default: every stride-1 bench case, then
                                                     every SPLIT_TABLE case)
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
    SMALL,
    SQUARE,
    SplitPlan,
    choose_plan,
    split_tiles,
)
from forgekernel.kernels.conv.sm90.geometry import RECT_WIDTHS  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.device import num_sms  # noqa: E402
from forgekernel.runtime.timing import (  # noqa: E402
    l2_bytes,
    median,
    rotation_sets,
    time_interleaved,
)

# The plans the 18:47 refit moved off (tile, parts, walk), timed there: n32-c512-7x7 3x3
# 128x256 c2x1 split 4 on im2col 0.0243 ms (now 128x128 c2x1 split 2, untimed).
PREVIOUS = {"n32-c512-7x7-k512-3x3": (LARGE, 4, 0)}


# The split table's cases: the ResNet stride-2 3x3 forwards (0.66-0.79x cuDNN at 2026-12-03
# 03:50) and their stride-1 twins; the tiles and parts timed on each (im2col walk).
SPLIT_TABLE = (
    "n32-c128-56x56-k128-3x3-s2",
    "n32-c128-28x28-k128-3x3",
    "n32-c256-28x28-k256-3x3-s2",
    "n32-c256-14x14-k256-3x3",
    "n32-c512-14x14-k512-3x3-s2",
    "n32-c512-7x7-k512-3x3",
)
SPLIT_GRID = ((SQUARE, (1, 2, 3, 4)), (LARGE, (1, 2, 4)), (SMALL, (1, 2)))


def _forced(cfg, parts, m, k, c, taps, pixels=None, rect=0):
    """The SplitPlan of tile `cfg` with the reduction cut `parts` ways (fewer where parts of
    ceil(k-tiles / parts) leave one empty), on walk `rect`."""
    k_tiles = -(-c // K_TILE) * taps
    per = -(-k_tiles // parts)
    parts = -(-k_tiles // per)
    tiles = split_tiles(cfg, m, k, pixels, rect)
    cfg = dataclasses.replace(cfg, split=parts > 1)
    return SplitPlan(cfg, per, parts, tiles, rect)


def _previous(name, m, k, c, taps, pixels):
    """The SplitPlan the case ran before the refit, or None."""
    if name not in PREVIOUS:
        return None
    cfg, parts, rect = PREVIOUS[name]
    return _forced(cfg, parts, m, k, c, taps, pixels, rect)


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
    plan = choose_plan(*problem[:4], num_sms(torch.cuda.current_device()), pixels, forward=True)
    return plan, problem


def split_plans(m, k, c, taps, sms, pixels=None) -> dict[str, SplitPlan]:
    """{name: plan} of the split table's row for problem (M, K, C, taps), strided where `pixels`
    is None: SPLIT_GRID's tiles and parts on the im2col walk, the chooser's plan marked `*`, and
    (strided) the 12-01 rate's plan, `was`, added where the grid lacks it."""
    chosen = choose_plan(m, k, c, taps, sms, pixels, strided=pixels is None, forward=True)
    was = choose_plan(m, k, c, taps, sms, forward=True) if pixels is None else None
    plans = {}
    for cfg, parts_list in SPLIT_GRID:
        for parts in parts_list if cfg.tile_n < 2 * k else ():  # no half-empty tiles
            plan = _forced(cfg, parts, m, k, c, taps, pixels)
            plans.setdefault((plan.config, plan.parts), plan)
    for plan in (was, chosen):
        if plan is not None:
            plans[(plan.config, plan.parts)] = dataclasses.replace(plan, rect=0)
    named = {}
    for (cfg, parts), plan in plans.items():
        name = f"{cfg.tag()}:p{parts}"
        if was is not None and (cfg, parts) == (was.config, was.parts):
            name = "was" + name
        if (cfg, parts) == (chosen.config, chosen.parts):
            name += "*"
        named[name] = plan
    return named


def _split_row(case, gen) -> None:
    """One SPLIT_TABLE case: the grid's plans on the im2col walk, timed interleaved on input sets
    rotated past L2 (as the bench's graph figures)."""
    p = dict(case.params)
    sets = []
    for _ in range(rotation_sets(L.nbytes(case, torch.bfloat16), l2=l2_bytes())):
        inputs = L.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
        sets.append((inputs, L.alloc_out(inputs)))
    inputs, y = sets[0]
    d = len(p["spatial"])
    g = op._geometry(d, p["kernel"], p["stride"], p["padding"], p["dilation"])
    x5, w5, y5 = op._as5d(inputs["x"]), op._as5d(inputs["w"]), op._view5d(y)
    n, z, pp, q, k = y5.shape
    m, taps, c = n * z * pp * q, w5.shape[1] * w5.shape[2] * w5.shape[3], x5.shape[-1]
    strided = set(p["stride"]) != {1}
    pixels = None if strided else (n, z, pp, q)
    fns = {}
    sms = num_sms(torch.cuda.current_device())
    for name, plan in split_plans(m, k, c, taps, sms, pixels).items():

        def run(inp, out, plan=plan):
            launch.fprop(
                op._as5d(inp["x"]), op._as5d(inp["w"]), inp.get("bias"), op._view5d(out), g, plan
            )

        fns[name] = run
    samples = time_interleaved(fns, rotate=sets, reps=10)
    flop = L.flops(case)
    line = "  ".join(
        f"{name} {median(s):.4f} ms {flop / median(s) / 1e9:.0f} TF/s"
        for name, s in sorted(samples.items(), key=lambda kv: median(kv[1]))
    )
    print(f"split {case.name:40s} {line}", flush=True)


def main(names: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in BENCH_CASES:
        if case.name in SPLIT_TABLE and (not names or case.name in names):
            _split_row(case, gen)
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
