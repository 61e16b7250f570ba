"""The shared part of the ncu targets that put ours beside a comparator on a bench suite's cases
(scripts/profile_gemm_fp8.py, profile_gemm.py, profile_conv.py; all of them in one device call:
scripts/device_profile_gaps.sh).

What is profiled is what `forgekernel bench` times: the suite's own `make_inputs` (fresh random
inputs, the bench's dtype, seed --seed + the case's index), its `alloc_out`, `run_ours` and the
comparator callable of `comparators()`. Per case:

  1. inputs and output, then --warmup calls of each side outside the profiled range (the first
     calls: the compile cache's loads, DeepGEMM's JIT, cuDNN's benchmark-mode search, cuBLAS's
     heuristics, the comparators' per-input-set state cached in `inputs`);
  2. cudaProfilerStart (ncu --profile-from-start off profiles nothing before it), then for
     each side a marker kernel and --calls calls of that side, then cudaProfilerStop.

The marker (torch.cuda._sleep's `spin_kernel`, a few microseconds) opens each segment, so the
kernels ncu reports split into segments (case, side) in launch order whatever the libraries
name their kernels or however many they launch; --plan FILE writes that order for
scripts/ncu_gap_summary.py. NVTX ranges "CASE/SIDE" wrap the same calls (ncu --nvtx keeps them
in the report). `--list` prints the cases and our configuration without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIDES = ("ours", "comparator")
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: opens every profiled segment
MARKER_CYCLES = 2000


@dataclass(frozen=True)
class Target:
    """One ncu target: the suites its cases come from ("forgekernel.bench.suites.<name>"), the
    cases profiled by default ("suite:case"), the comparator per suite (a `comparators()` key)
    and an optional one-line description of our configuration for a case (no GPU needed)."""

    name: str
    suites: tuple[str, ...]
    default_cases: tuple[str, ...]
    comparator: dict[str, str]
    describe: Callable[[str, Any], str] | None = None


def load_suite(name: str):
    """The OpSuite of forgekernel.bench.suites.<name>."""
    return importlib.import_module(f"forgekernel.bench.suites.{name}").suite()


def parse_args(target: Target, argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"profile_{target.name}.py",
        description=f"ncu target: ours against the comparator on {', '.join(target.suites)} "
        "cases (the suites' own inputs and callables)",
    )
    p.add_argument("--which", choices=("ours", "comparator", "both"), default="both")
    p.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="[SUITE:]CASE",
        help="a bench or check case by name (repeatable; default: the target's)",
    )
    p.add_argument(
        "--suite", choices=target.suites, default=None, help="only this suite's default cases"
    )
    p.add_argument(
        "--comparator",
        default=None,
        help="a comparators() key (default: "
        + ", ".join(f"{s}: {c}" for s, c in target.comparator.items())
        + ")",
    )
    p.add_argument(
        "--sidecar-here",
        action="store_true",
        help="a sidecar comparator (forgekernel/bench/sidecar.py) called in this process by its "
        "runner: run the target with the sidecar's site first on PYTHONPATH and the main wheel "
        "set left out, as its child is (scripts/device_profile.sh SITE=)",
    )
    p.add_argument("--warmup", type=int, default=2, help="unprofiled calls of each side")
    p.add_argument("--calls", type=int, default=1, help="profiled calls of each side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", type=Path, default=None, help="write the segments' order (json)")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="no ncu: torch.profiler (CUPTI) over each side's calls; prints its kernels' GPU "
        "time per call and the wall time per call (where a multi-kernel op's time goes)",
    )
    p.add_argument("--top", type=int, default=25, help="--timeline: kernels listed per side")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no GPU)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a module constant before the run (a temporary A/B switch, e.g. "
        "forgekernel.ops.kda_bwd.FINAL_QK=True; VALUE a Python literal; repeatable)",
    )
    args = p.parse_args(argv)
    try:
        args.set = [_setting(spec) for spec in args.set]
    except ValueError as e:
        p.error(str(e))
    if args.warmup < 0 or args.calls < 1:
        p.error("--warmup must be >= 0 and --calls >= 1")
    return args


def _setting(spec: str) -> tuple[str, str, Any]:
    """MODULE.NAME=VALUE -> (module, name, value): VALUE a Python literal."""
    import ast

    target, sep, value = spec.partition("=")
    module, dot, name = target.rpartition(".")
    if not (sep and dot and module and name):
        raise ValueError(f"--set {spec!r}: expected MODULE.NAME=VALUE")
    try:
        return module, name, ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--set {spec!r}: VALUE is not a Python literal ({e})") from None


def apply_settings(settings) -> None:
    """Each (module, name, value) of --set onto its module, which must already define name (a
    misspelt switch fails here instead of timing the default)."""
    import importlib

    for module, name, value in settings:
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"--set: {module} has no {name}")
        setattr(mod, name, value)
        print(f"set {module}.{name} = {value!r}", flush=True)


def _split(target: Target, spec: str) -> tuple[str, str]:
    if ":" in spec:
        suite, case = spec.split(":", 1)
    elif len(target.suites) == 1:
        suite, case = target.suites[0], spec
    else:
        raise SystemExit(f"case {spec!r}: name its suite, one of {target.suites} (SUITE:CASE)")
    if suite not in target.suites:
        raise SystemExit(f"case {spec!r}: suite {suite!r} is not one of {target.suites}")
    return suite, case


def find_case(suite, name: str):
    """The suite's bench case `name`, else its check case of that name."""
    for case in (*suite.bench_cases, *suite.check_cases):
        if case.name == name:
            return case
    names = ", ".join(c.name for c in suite.bench_cases)
    raise SystemExit(f"{suite.name}: no case {name!r}; bench cases: {names}")


def resolve_cases(target: Target, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(suite name, Case) in profiling order: --case's, else the target's defaults (of --suite
    only, where given)."""
    specs = list(args.case) or [
        s for s in target.default_cases if args.suite is None or s.startswith(args.suite + ":")
    ]
    suites: dict[str, Any] = {}
    out = []
    for spec in specs:
        suite_name, case_name = _split(target, spec)
        if suite_name not in suites:
            suites[suite_name] = load_suite(suite_name)
        out.append((suite_name, find_case(suites[suite_name], case_name)))
    return out


def sides(which: str) -> tuple[str, ...]:
    return SIDES if which == "both" else (which,)


def comparator_name(target: Target, suite_name: str, args: argparse.Namespace) -> str:
    return args.comparator or target.comparator[suite_name]


def segments(target: Target, cases, args: argparse.Namespace) -> list[dict[str, str]]:
    """The profiled segments in launch order, each opened by one marker kernel."""
    return [
        {
            "suite": suite_name,
            "case": case.name,
            "side": side,
            "impl": "ours" if side == "ours" else comparator_name(target, suite_name, args),
            "calls": args.calls,
        }
        for suite_name, case in cases
        for side in sides(args.which)
    ]


def write_plan(path: Path, target: Target, plan: list[dict], markers: bool) -> None:
    doc = {"target": target.name, "marker": MARKER if markers else None, "segments": plan}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def describe(target: Target, suite_name: str, case) -> str:
    text = f"{suite_name}:{case.name} {case.params}"
    if target.describe is not None:
        try:
            text += f"  ours: {target.describe(suite_name, case)}"
        except Exception as e:  # a description only: never stop the profile for it
            text += f"  ours: ({type(e).__name__}: {e})"
    return text


def _comparator(suite, name: str, here: bool = False):
    """The comparator `name` of `suite`; `here`: a sidecar's runner made in this process (the
    sidecar child's own `runner`), else the sidecar object refuses the call."""
    from forgekernel.bench.harness import resolve_comparators
    from forgekernel.bench.sidecar import Sidecar, runner

    comps, missing = resolve_comparators(suite)
    if name not in comps:
        raise SystemExit(
            f"{suite.name}: comparator {name!r} unavailable ({missing.get(name, 'unknown')}); "
            f"available: {sorted(comps)}"
        )
    comp = comps[name]
    if not (here and isinstance(comp, Sidecar)):
        return comp
    run = runner(comp.runner)
    if run is None:
        raise SystemExit(f"{comp.label}: {comp.runner} found no packages on this PYTHONPATH")
    return run


def _marker(torch) -> None:
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(MARKER_CYCLES)


def _nvtx(torch, name: str | None) -> None:
    """Push the range `name` (None: pop); a torch without NVTX only loses the labels."""
    try:
        if name is None:
            torch.cuda.nvtx.range_pop()
        else:
            torch.cuda.nvtx.range_push(name)
    except (AttributeError, RuntimeError):
        pass


def _calls(target, args, index, suite_name, case) -> dict[str, Callable[[], Any]]:
    """side -> one call of it, on the suite's inputs and output for this case."""
    import torch

    suite = load_suite(suite_name)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed + index)
    inputs = suite.make_inputs(case, suite.dtypes_for_bench()[0], device, gen)
    out = suite.alloc_out(inputs)
    calls = {"ours": lambda: suite.run_ours(inputs, out)}
    if "comparator" in sides(args.which):
        comp = _comparator(suite, comparator_name(target, suite_name, args), args.sidecar_here)
        calls["comparator"] = lambda: comp(inputs)
    return calls


def per_call(kernels: Sequence[tuple[str, float]], calls: int) -> dict[str, tuple[float, float]]:
    """(kernel name, GPU us) records of `calls` calls -> name: (launches a call, us a call)."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for name, us in kernels:
        total[name] = total.get(name, 0.0) + us
        count[name] = count.get(name, 0) + 1
    return {name: (count[name] / calls, total[name] / calls) for name in total}


def kernel_table(kernels: Sequence[tuple[str, float]], calls: int, top: int) -> list[str]:
    """Lines for (kernel name, GPU us) records of `calls` calls: the sum per call, then the
    kernels by total time (count per call, us per call, share), `top` of them."""
    rows = per_call(kernels, calls)
    whole = sum(us for _, us in rows.values())
    launches = sum(n for n, _ in rows.values())
    lines = [f"  kernels {launches:.0f} a call, {whole:.1f} us a call"]
    for name in sorted(rows, key=lambda n: -rows[n][1])[:top]:
        n, us = rows[name]
        share = us / whole if whole else 0.0
        lines.append(f"  {us:10.1f} us {n:5.1f}x {share:6.1%}  {name[:110]}")
    return lines


def profiled_kernels(torch, work: Callable[[], Any]) -> tuple[list[tuple[str, float]], float]:
    """`work()` under torch.profiler (CUPTI; kernels a CUDA-graph replay launches included):
    (kernel name, GPU us) of each kernel it ran, and its wall us up to a synchronize."""
    import time

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e6
    kernels = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return kernels, wall


def _timeline(torch, args, case_name: str, side: str, call: Callable[[], Any]) -> None:
    """`args.calls` calls under torch.profiler: the kernels' table and the wall time a call."""

    def calls() -> None:
        for _ in range(args.calls):
            call()

    kernels, wall = profiled_kernels(torch, calls)
    print(f"{case_name}/{side}: wall {wall / args.calls:.1f} us a call (profiled)", flush=True)
    for line in kernel_table(kernels, args.calls, args.top):
        print(line, flush=True)


def _profile_case(target, args, index, suite_name, case) -> None:
    """Warm-ups, then the profiled segments of one case."""
    import torch

    calls = _calls(target, args, index, suite_name, case)
    for side in sides(args.which):
        for _ in range(args.warmup):
            calls[side]()
    torch.cuda.synchronize()
    if args.timeline:
        for side in sides(args.which):
            _timeline(torch, args, case.name, side, calls[side])
        return
    torch.cuda.profiler.start()
    for side in sides(args.which):
        _marker(torch)
        _nvtx(torch, f"{case.name}/{side}")
        for _ in range(args.calls):
            calls[side]()
        _nvtx(torch, None)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(target: Target, argv: Sequence[str] | None = None) -> int:
    args = parse_args(target, argv)
    cases = resolve_cases(target, args)
    for suite_name, case in cases:
        print(describe(target, suite_name, case), flush=True)
    if args.list:
        return 0
    apply_settings(args.set)
    import torch

    if args.plan is not None:  # first: a run cut short still has its kernels labelled
        markers = hasattr(torch.cuda, "_sleep")
        write_plan(args.plan, target, segments(target, cases, args), markers)
    for index, (suite_name, case) in enumerate(cases):
        _profile_case(target, args, index, suite_name, case)
        torch.cuda.empty_cache()  # the case's inputs went with its calls
        print(f"profiled {suite_name}:{case.name} ({args.which})", flush=True)
    return 0
