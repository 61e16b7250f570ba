"""Time the block-scaled FP8 GEMM with each candidate configuration forced, against DeepGEMM,
on the gemm_fp8 suite's shapes and three more (issue 21).

Per shape: the suite's quantized inputs, as many sets as the bench rotates through; each config
run through the launcher (`launch.gemm_fp8(..., config=cfg)`: stream K gets its workspace and
plan as in production), checked against the fp64 reference with the suite's criterion (max
error <= 2 x cuBLASLt's + atol), then timed beside DeepGEMM's fp8_gemm_nt (where deep_gemm
imports) with the bench's timer (`time_interleaved`: CUDA-graph replays over the rotated sets).
ratio = DeepGEMM ms / ours (> 1: ours is faster). Configs: the chooser's pick first, then every
prebuilt 128-row tile (data-parallel and stream K) and, up to M = 512, the 64-row ones (MID,
SKINNY, the decode boxes that fit, their stream-K twins), then the tiled 128-row ones with A's
scales read the other way (M-major, `_mn`: from the suite's K-major scales, so through the
launcher's transpose) (`configs_for`); and the chosen tile's M-major twin given M-major scales
made outside the timing, as DeepGEMM's are (`+sa_mn`, `given_mn_major`); last the pick's twins
(`twins`: a narrow pick's scales loaded another way, a tiled pick's by a warp of their own, LARGE
walked in bands), compiled at first use.
A config that fails gets a row with its error. The JSON is rewritten after every shape.

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/fp8_tiles.py OUT.json [--twins] [GROUP ...]
GROUP: decode, mid, prefill, square, extra, stride (default all). --twins: the pick and its
twins only (and DeepGEMM), a short call. Kernels from a bundle made
after the configs changed (`forgekernel bundle .bundle`;
FORGEKERNEL_KERNEL_DIR=$PWD/.bundle/kernels).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from forgekernel.bench.check import expected, free, verify
from forgekernel.bench.report import format_table
from forgekernel.bench.suite import Case
from forgekernel.bench.suites import gemm_fp8 as fp8_suite
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.fp8.sm90 import launch
from forgekernel.kernels.gemm.fp8.sm90.config import (
    LARGE_MCAST_A,
    NARROW_CONFIGS,
    STANDARD_CONFIGS,
    choose_config,
    one_warp_scales,
)
from forgekernel.runtime.timing import median, rotation_sets, time_interleaved

DTYPE = torch.bfloat16
GROUPS = ("decode", "mid", "prefill", "square", "extra", "stride")
EXTRA = ((2048, 7168, 4096), (8192, 4608, 7168), (4096, 1536, 7168))
# 8192^3 beside K = 7680 (A's scale rows 240 bytes apart instead of 256, every other dimension
# alike): whether the square case's per-k-tile time comes from the scales' power-of-two stride
STRIDE = ((8192, 8192, 7680),)
SMALL_TILES_UP_TO = 512  # M up to which the 64-row configurations are timed too
# The tiled pick's band: 8 clusters across N (16 n-tiles of a 1x2 cluster: 2048 columns, the
# columns DeepGEMM's 256x128 schedule groups), walked down M; the standard walk of
# LARGE_MCAST_A (since 2026-12-07) and of the grouped GEMM, so a twin of LARGE's only.
BAND = LARGE_MCAST_A.swizzle


def cases(groups: tuple[str, ...]) -> list[Case]:
    suite_cases = [c for c in fp8_suite.BENCH_CASES if c.group in groups]
    more = [(g, shape) for g, shapes in (("extra", EXTRA), ("stride", STRIDE)) for shape in shapes]
    return suite_cases + [
        Case(f"{m}x{n}x{k}", {"m": m, "n": n, "k": k}, g) for g, (m, n, k) in more if g in groups
    ]


def configs_for(m: int, n: int, k: int, only_twins: bool = False) -> list[GemmConfig]:
    """The chooser's pick first, then every prebuilt config that computes M rows: the 128-row
    ones always, the 64-row ones up to SMALL_TILES_UP_TO (none with `only_twins`), then the
    pick's twins."""
    found = [choose_config(m, n, k)]
    if only_twins:
        return found + twins(found[0], m, n)
    for cfg in STANDARD_CONFIGS:
        if cfg.fits(m) and (cfg.tile_m == 128 or m <= SMALL_TILES_UP_TO) and cfg not in found:
            found.append(cfg)
    tiled = [c for c in found if c.tile_m == 128 and not c.stream_k]
    # (The other epilogue depth of each tiled 128-row config, 4 deep and 5 AB stages against
    # the standard 3 and 6, was timed from 15:48 to 18:47 and is no longer: it lost or tied on
    # every shape, and the rows below keep one call of `square stride prefill` in 10 minutes.)
    # (The scales one and four k-tiles ahead of the standard two, `_f1` / `_f4`, were timed on
    # 2026-12-02 18:47 and 2026-12-05 02:42 and lost everywhere: docs/gemm/NOTES.md "Is the
    # producer still the floor?".)
    # ... and reading A's scales the other way (`scale_mn_major`, docs/gemm/NOTES.md "A's
    # scales M-major"): K-major inputs, so these rows pay the launcher's transpose.
    mn = [dataclasses.replace(c, scale_mn_major=not c.scale_mn_major) for c in tiled]
    found += [c for c in mn if c not in found]
    return found + [c for c in twins(found[0], m, n) if c not in found]


def twins(pick: GemmConfig, m: int, n: int) -> list[GemmConfig]:
    """The pick's candidates. A narrow full-K pick (one CTA a tile, no cluster) loading its
    scales by a warp of their own (the 64-row box, `config.NARROW_SCALE_AHEAD`): the TMA warp
    loading them one k-tile ahead (the standard before it: the control), four ahead (`_f4`: the
    lead without the warp) and the scale warp two ahead (`_f2_sw`); a decode-box narrow pick
    (one warp, one ahead): two ahead (`_f2`), by their own warp (`_sw`) and their own warp four
    ahead (`_f4_sw`) (docs/gemm/NOTES.md "Measured: next/fp8-narrow-scales"). A tiled 128-row
    pick (its scales by a warp of their own since 2026-12-07: LARGE two ahead, LARGE_MCAST_A
    four): the TMA warp loading them two ahead (`one_warp_scales`, the standard before) and the
    scale warp at the other lead (two / four ahead), and
    walking M first (LARGE) walked in bands of BAND clusters (`swizzle`) too. Stream K and the
    64-row 128-column tiles have none. (The narrow picks' A / B multicast twins were timed on
    the H100 2026-12-07 and dropped: "next/fp8-band8"; the band was adopted on LARGE_MCAST_A.)"""
    if pick.scale_warp and pick.tile_m == 64:
        one = one_warp_scales(pick)
        four = dataclasses.replace(one, scale_ahead=4)
        return [one, four, dataclasses.replace(pick, scale_ahead=2)]
    if pick in NARROW_CONFIGS:
        warp = dataclasses.replace(pick, scale_warp=True)
        return [dataclasses.replace(pick, scale_ahead=2), warp,
                dataclasses.replace(warp, scale_ahead=4)]  # fmt: skip
    if pick.tile_m == 128 and not pick.stream_k:
        lead = 4 if pick.scale_ahead == 2 else 2
        found = [one_warp_scales(pick), dataclasses.replace(pick, scale_ahead=lead)]
        if pick.swizzle == 1:
            found.append(dataclasses.replace(pick, swizzle=BAND))
        return found
    return []


def given_mn_major(m: int, n: int, k: int) -> GemmConfig | None:
    """The one config also timed with A's scales handed over M-major (DeepGEMM's layout, made
    once outside the timing as DeepGEMM's are: no transpose in the call): the chooser's pick
    reading them M-major, if it is a tiled 128-row tile. Its row is tagged `+sa_mn`."""
    pick = choose_config(m, n, k)
    if pick.tile_m != 128 or pick.stream_k:
        return None
    return dataclasses.replace(pick, scale_mn_major=True)


def forced(cfg: GemmConfig, scales: str = "sa"):
    """run(inputs, out): the launcher with `cfg` forced (N is a multiple of 8: out is C), A's
    scales inputs[scales] ("sa_mn": the M-major copy `measure` made)."""

    def run(inputs, out):
        launch.gemm_fp8(inputs["a"], inputs["b"], inputs[scales], inputs["sb"], out, config=cfg)
        return out

    return run


def measure(case: Case, suite, gen, device, only_twins: bool = False) -> list[dict]:
    m, n, k = (case.params[x] for x in "mnk")
    assert n % 8 == 0, "forced configs write C directly: N must be a multiple of 8"
    sets = [fp8_suite.make_inputs(case, DTYPE, device, gen)]
    sets += [fp8_suite.make_inputs(case, DTYPE, device, gen)
             for _ in range(rotation_sets(suite.bytes(case, DTYPE)) - 1)]  # fmt: skip
    expect = expected(suite, sets[0])
    runs = [(cfg.tag(), forced(cfg)) for cfg in configs_for(m, n, k, only_twins)]
    mn = None if only_twins else given_mn_major(m, n, k)
    if mn is not None:
        for inputs in sets:
            inputs["sa_mn"] = launch.mn_major_copy(inputs["sa"])
        runs.append((mn.tag() + "+sa_mn", forced(mn, "sa_mn")))
    rows, fns = [], {}
    for i, (tag, run) in enumerate(runs):
        row = {"shape": case.name, "group": case.group, "config": tag, "chosen": i == 0}
        rows.append(row)
        try:
            cmp = verify(suite, sets[0], device, run=run, expect=expect)[1][0]
        except Exception as e:  # noqa: BLE001 (a config the kernel rejects: recorded)
            row["status"] = f"not built: {type(e).__name__}: {e}"[:200]
            continue
        row.update(max_err=cmp.err, bound=cmp.bound, status="ok" if cmp.ok else cmp.message)
        if cmp.ok:
            fns[row["config"]] = run
    deepgemm = suite.comparators().get("deepgemm")
    if deepgemm is not None:
        fns["deepgemm"] = lambda inputs, out: deepgemm(inputs)
        err = float((deepgemm(sets[0]).float() - expect[0][0]).abs().max())
        rows.append({"shape": case.name, "group": case.group, "config": "deepgemm",
                     "chosen": False, "max_err": err, "status": "comparator"})  # fmt: skip
    rotate = [(inputs, fp8_suite.alloc_out(inputs)) for inputs in sets]
    samples = time_interleaved(fns, rotate=rotate, warmup=max(5, len(rotate)), reps=15)
    ref_ms = median(samples["deepgemm"]) if deepgemm is not None else None
    for row in rows:
        if row["config"] in samples:
            ms = median(samples[row["config"]])
            row.update(ms=ms, tflops=suite.flops(case) / ms / 1e9, deepgemm_ms=ref_ms)
            row["ratio"] = ref_ms / ms if ref_ms else None
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    only_twins = "--twins" in argv
    path, *rest = [a for a in argv if a != "--twins"]
    groups = tuple(rest) or GROUPS
    device = torch.device("cuda")
    suite = fp8_suite.suite()
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    have_dg = suite.comparators().get("deepgemm") is not None
    print(f"{torch.cuda.get_device_name()}; DeepGEMM {'found' if have_dg else 'absent'}")
    for case in cases(groups):
        rows += measure(case, suite, gen, device, only_twins)
        free(device)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"{case.name} done", flush=True)
    headers = ("shape", "config", "chosen", "ms", "TFLOP/s", "vs DeepGEMM", "max err", "status")
    table = [
        (r["shape"], r["config"], "*" if r["chosen"] else "", _fmt(r.get("ms"), ".4f"),
         _fmt(r.get("tflops"), ".0f"), _fmt(r.get("ratio"), ".3f"),
         _fmt(r.get("max_err"), ".3g"), r["status"][:60])
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))


if __name__ == "__main__":
    main(sys.argv[1:])
