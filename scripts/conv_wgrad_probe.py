"""The weight gradient's floor (H200 2026-12-03 03:50 bench: 0.54-0.78x cuDNN) against cuDNN,
after the last part's split sum loads several parts ahead (wgrad.py `_sum_parts`) and stride 1
compares the rectangles with the im2col walk (`wgrad_config.wgrad_prefers_im2col`;
docs/conv/NOTES.md, "The weight gradient's floor after 03:50"). For each case: the launcher's
plan (`pick`, on the walk the launcher takes), at stride 1 the other walk's (`rect` where the
pick is the im2col walk, `im2col` where it is the rectangles), the 18:47 chooser's (`old`,
stride 2, where it differs), each standard tile at the split the chooser likes best for it, the
pick's tile at half, twice and (where it fits two waves) three times its parts; every plan's dW
checked against cuDNN's first, then all timed interleaved (runtime/timing.py, graph replays).
One line a plan: tile, parts x k-tiles a part, CTAs, the model's figure (cost x UNIT_US, the
rectangles with WGRAD_START a wave), the time, cudnn/this.

    python3 scripts/conv_wgrad_probe.py [CASE ...]    (default: the cases below)
    python3 scripts/conv_wgrad_probe.py --plans [CASE ...]    (the plans and the model, no GPU)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forgekernel.bench.suites.conv_wgrad import BENCH_CASES  # noqa: E402
from forgekernel.kernels.conv.sm90 import launch  # noqa: E402
from forgekernel.kernels.conv.sm90 import wgrad_config as W  # noqa: E402
from forgekernel.kernels.conv.sm90.config import (  # noqa: E402
    IM2COL_ROWS_128,
    MAX_WORKSPACE,
    split_cost,
)
from forgekernel.kernels.conv.sm90.geometry import rect_k_tiles, rect_width  # noqa: E402

CASES = (
    # the 1x1 floor (64x64 / 128x64 tiles, 8-42 parts: the split sum's tail)
    "n32-c64-56x56-k64-1x1",
    "n32-c64-56x56-k256-1x1",
    "n32-c256-56x56-k64-1x1",
    "n32-c256-56x56-k128-1x1",
    "n32-c512-28x28-k256-1x1",
    "n32-c512-28x28-k128-1x1",
    # stride 1 moved to the im2col walk (23% zero-filled rectangles)
    "n32-c512-7x7-k512-3x3",
    "n32-c256-14x14-k256-3x3",
    # guards: kept on rectangles at a model margin of 9% (1.266x at 03:50); the stride-2 twins
    # of the two moved cases (the same GEMM and plan on the im2col walk)
    "n32-c128-28x28-k128-3x3",
    "n32-c512-14x14-k512-3x3-s2",
    "n32-c256-28x28-k256-3x3-s2",
)
UNIT_US = 0.426  # split_cost's unit: a 128x128 k-tile's multiply-adds at 650 TF/s on 132 SMs
SMS = 132


def _walk(p: dict, im2col: bool = False) -> tuple[int, int]:
    """(rect, pixel k-tiles) of the launch `launch._wgrad_launch` makes for the case (C and K
    multiples of 8), or of the im2col walk where `im2col`."""
    (h, w_), (r, s) = p["spatial"], p["kernel"]
    pad, (sh, sw) = p["padding"], p["stride"]
    ph, pw = (pad, pad) if isinstance(pad, int) else tuple(pad)
    out_p = (h + 2 * ph - r) // sh + 1
    out_q = (w_ + 2 * pw - s) // sw + 1
    n, m = p["n"], p["n"] * out_p * out_q
    if im2col or (sh, sw) != (1, 1):
        return 0, -(-m // 64)
    if r * s == 1 and m % 8 == 0 and not (ph or pw):  # an unpadded 1x1: one plane 8 wide
        n, out_p, out_q = 1, m // 8, 8
    rect = rect_width(out_p, out_q)
    return rect, rect_k_tiles(n, 1, out_p, out_q, rect)


def _old_cost(cfg, k, c, taps, k_tiles, splits):
    """The 18:47 chooser's `wgrad_cost` on the im2col walk (B's rows at IM2COL_ROWS_128)."""
    cm = cfg.cluster_m
    tiles_mn = (-(-k // (cfg.tile_m * cm)) * cm, -(-c // cfg.tile_n) * taps)
    tile = (cfg.tile_m, cfg.tile_n)
    eff = W._WGRAD_EFFICIENCY[cfg]
    rows = cfg.tile_n / cm
    return split_cost(
        tile, tiles_mn, (cm, 1), k_tiles, splits, SMS, eff, rows, row_rate=IM2COL_ROWS_128
    )


def _best(cost, cfgs, k, c, taps, k_tiles):
    """(cost, WgradPlan) of the least `cost` over `cfgs` and the chooser's split limits."""
    best = None
    for cfg in cfgs:
        tiles = W.wgrad_tiles(cfg, k, c, taps)
        limit = min(W.WGRAD_MAX_SPLITS, max(1, k_tiles // W.WGRAD_MIN_PER_SPLIT))
        limit = min(limit, max(1, MAX_WORKSPACE // (tiles * cfg.tile_m * cfg.tile_n)))
        for s in range(1, limit + 1):
            value, per, parts = cost(cfg, k, c, taps, k_tiles, s)
            if best is None or value < best[0]:
                best = (value, W.WgradPlan(cfg, per, parts, tiles))
    return best


def variants(p: dict) -> list[tuple[str, bool, object, float]]:
    """(name, on the im2col walk, WgradPlan, the model's us) of each plan timed. At stride 1
    `pick` is the launcher's walk (`wgrad_prefers_im2col`), `rect` the rectangles' plan where
    the pick is the im2col walk, `im2col` the im2col walk's plan where the pick is rectangles;
    the rectangles' model with WGRAD_START a wave (as the walks are compared)."""
    k, c = p["k"], p["c"]
    taps = p["kernel"][0] * p["kernel"][1]
    rect, k_tiles = _walk(p)
    _, kt0 = _walk(p, im2col=True)
    tiled = rect > 0
    to_im2col = tiled and W.wgrad_prefers_im2col(k, c, taps, k_tiles, kt0, SMS)

    def cost(cfg, k, c, taps, kt, s, tiled=tiled):
        return W.wgrad_cost(cfg, k, c, taps, kt, s, SMS, tiled, started=True)

    def us(plan, tiled=tiled, kt=k_tiles):
        return cost(plan.config, k, c, taps, kt, plan.parts, tiled)[0] * UNIT_US

    def best_im2col():
        def cost0(cfg, k, c, taps, kt, s):
            return cost(cfg, k, c, taps, kt, s, tiled=False)

        return _best(cost0, W.WGRAD_CONFIGS, k, c, taps, kt0)[1]

    if to_im2col:
        pick = best_im2col()
        out = [("pick", True, pick, us(pick, tiled=False, kt=kt0))]
    else:
        pick = W.choose_wgrad(k, c, taps, k_tiles, SMS, tiled=tiled)
        out = [("pick", False, pick, us(pick))]
    seen = {(pick.config, pick.per_split, to_im2col)}

    def add(name, plan, im2col=False, model=None):
        key = (plan.config, plan.per_split, im2col)
        if key not in seen:
            seen.add(key)
            out.append((name, im2col, plan, us(plan) if model is None else model))

    if to_im2col:  # the rectangles' plan the launcher had before the walks were compared
        add("rect", W.choose_wgrad(k, c, taps, k_tiles, SMS, tiled=True))
    if not tiled:
        add("old", _best(_old_cost, W.WGRAD_CONFIGS, k, c, taps, k_tiles)[1])

    def chooser(cfg, k, c, taps, kt, s):  # choose_wgrad's cost on the rectangles' walk
        return W.wgrad_cost(cfg, k, c, taps, kt, s, SMS, tiled)

    for cfg in W.WGRAD_CONFIGS:  # each tile at the split the chooser likes best for it
        add("tile", _best(chooser, (cfg,), k, c, taps, k_tiles)[1])
    # the pick's tile at half, twice and (a split sum of many parts: _sum_parts's loads
    # ahead) three times its parts, on its walk, where three times fits in two waves
    kt = kt0 if to_im2col else k_tiles
    many = (3,) if pick.tiles * pick.parts * 3 <= 2 * SMS else ()
    for parts in (max(1, pick.parts // 2), *(pick.parts * f for f in (2, *many))):
        per = -(-kt // parts)
        plan = W.WgradPlan(pick.config, per, -(-kt // per), pick.tiles)
        model = us(plan, tiled=tiled and not to_im2col, kt=kt)
        add("parts", plan, to_im2col, model)
    if tiled and not to_im2col:  # the im2col walk at stride 1, its own best plan
        plan = best_im2col()
        add("im2col", plan, True, us(plan, tiled=False, kt=kt0))
    return out


def _label(name, plan) -> str:
    cfg = plan.config
    ctas = plan.tiles * plan.parts
    tag = f"{cfg.tile_m}x{cfg.tile_n}_c{cfg.cluster_m}x1 {plan.parts}x{plan.per_split}"
    return f"{name:7s} {tag:22s} {ctas:5d} CTAs"


@contextlib.contextmanager
def _im2col_walk():
    """The launcher's walk forced to im2col rows (stride 1 takes the rectangles)."""
    real = launch._wgrad_walk
    launch._wgrad_walk = lambda stride1, n, z, p, q: (0, -(-(n * z * p * q) // 64))
    try:
        yield
    finally:
        launch._wgrad_walk = real


@contextlib.contextmanager
def _rect_walk():
    """The launcher's stride-1 walk forced to rectangles (no comparison with the im2col
    walk)."""
    real = launch._wgrad_im2col
    launch._wgrad_im2col = lambda *args: False
    try:
        yield
    finally:
        launch._wgrad_im2col = real


def _call(dy5, x5, dw5, g, plan, im2col):
    with _im2col_walk() if im2col else _rect_walk():
        launch.wgrad(dy5, x5, dw5, g, plan)


def plans(names: list[str]) -> None:
    for case in BENCH_CASES:
        if case.name in (names or CASES):
            print(case.name)
            for name, _, plan, model in variants(dict(case.params)):
                print(f"  {_label(name, plan)}  model {model:6.1f} us")


def main(names: list[str]) -> None:
    import torch

    from forgekernel.bench.suites import conv_layers as L
    from forgekernel.ops import conv as op
    from forgekernel.runtime.timing import median, time_interleaved

    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in BENCH_CASES:
        if case.name not in (names or CASES):
            continue
        p = dict(case.params)
        inputs = L.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
        d = len(p["spatial"])
        dy5, x5 = op._as5d(inputs["dy"]), op._as5d(inputs["x"])
        g = op._geometry(d, p["kernel"], p["stride"], p["padding"], p["dilation"])
        ref = L.cudnn(inputs).float()
        scale = ref.abs().max().item()
        fns = {"cudnn": functools.partial(L.cudnn, inputs)}
        models = {}
        for name, im2col, plan, model in variants(p):
            dw = L.alloc_out(inputs)
            fn = functools.partial(_call, dy5, x5, op._view5d(dw), g, plan, im2col)
            fn()
            torch.cuda.synchronize()
            err = (dw.float() - ref).abs().max().item() / scale
            label = _label(name, plan)
            if not err < 2e-2:
                print(f"{case.name} {label}: WRONG (rel err {err:.3g})", flush=True)
                continue
            fns[label], models[label] = fn, model
        samples = time_interleaved(fns, reps=10)
        flop = L.flops(case)
        base = median(samples["cudnn"])
        print(case.name, flush=True)
        for label, s in samples.items():
            ms = median(s)
            model = f"model {models[label]:6.1f} us" if label in models else " " * 15
            rate = flop / ms / 1e9
            print(
                f"  {label:42s} {model}  {ms * 1e3:7.1f} us {rate:4.0f} TF/s"
                f"  cudnn/this {base / ms:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--plans"]:
        plans(args[1:])
    else:
        main(args)
