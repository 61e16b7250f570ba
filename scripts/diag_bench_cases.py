"""The bench's candidates one at a time: every bench case of a suite x every candidate the
bench would run on it (ours, each of ours' variants, each comparator), each in its own process
under CUDA_LAUNCH_BLOCKING=1 and a timeout, so that a device fault is pinned to one (case,
candidate, stage) instead of poisoning the whole `forgekernel bench` process (a CUDA fault is
sticky: every later case then fails too, as kda_prefill's did on 2026-12-02):

    python3 scripts/diag_bench_cases.py kda_prefill [--cases 1x2048 mix16] [--candidates ours]
        [--stages call,repeat,graph,eager] [--harness] [--timeout 300]

Stages, each on the previous one's process state (the bench's order):
    call    one call on the case's inputs into a poisoned output, then a sync
    repeat  one call on each of the bench's rotated input sets (as the graph timing rotates)
    graph   the bench's graph timing alone (`time_interleaved`: warm-up, CUDA-graph capture or
            its eager fallback, replays), then one more eager call: after a failed capture
    eager   the bench's flushed eager timing alone (`time_eager_flushed`)
`--harness` adds, per case, the bench's own `_time_case` (every candidate in one process, as
`forgekernel bench` runs them) with the traceback of whatever it raises: with blocking
launches the traceback names the faulting launch's call site.

Each line: PASS / CRASH (a device fault or a signal: the stage it happened in) / HANG (no exit
in the timeout: the stage it was in) / ERROR (a Python exception: a missing comparator raises
NotImplementedError) / MISSING (a comparator the process does not have). Comparators and
variants are the suite's own (`OpSuite.comparators`, `OpSuite.variants`). Inputs: the bench's
(`make_inputs`, seed --seed). No reference is computed (the large cases' fp64 references take
minutes); `call` reports whether the output is finite. Pending suites are found too."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
STAGES = ("call", "repeat", "graph", "eager")
FAULTS = ("illegal memory access", "misaligned address", "unspecified launch failure",
          "illegal instruction", "device-side assert", "CUDA error")  # fmt: skip
HARNESS = "harness"  # the pseudo-candidate: the bench's own _time_case
OURS = "ours"


def _suite(name: str):
    """The suite, registered or pending (whether or not FORGEKERNEL_PENDING_SUITES was set when
    the registry was imported)."""
    import importlib

    from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES

    modules = {**SUITE_MODULES, **PENDING_SUITE_MODULES}
    if name not in modules:
        raise SystemExit(f"unknown suite {name!r}; known: {', '.join(modules)}")
    return importlib.import_module(modules[name]).suite()


def candidate_names(suite, case) -> list[str]:
    """ours, ours[variant] for each of the suite's variants on `case`, each comparator name
    (available or not: the child reports a missing one)."""
    from forgekernel.bench.harness import _variant_key

    names = [OURS, *map(_variant_key, suite.variants_for(case))]
    try:
        names += list(suite.comparators())
    except Exception:  # resolved again in the child, which reports the error
        pass
    return names


def _runner(suite, case, name: str):
    """fn(inputs, out) -> output(s) for a candidate name; None when the comparator is missing."""
    from forgekernel.bench.harness import _variant_key

    if name == OURS:
        return suite.run_ours
    for variant, run in suite.variants_for(case).items():
        if name == _variant_key(variant):
            return run
    comps = suite.comparators()
    if name not in comps:
        raise KeyError(f"no candidate {name!r} on {case.name}")
    comp = comps[name]
    return None if comp is None else (lambda inputs, out, comp=comp: comp(inputs))


def _finite(result, out) -> bool:
    import torch

    from forgekernel.bench.check import as_tuple

    got = result if result is not None else out
    return all(
        bool(torch.isfinite(t).all())
        for t in as_tuple(got)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def _stage(name: str, fn, device) -> dict:
    from forgekernel.bench.check import sync

    t0 = time.perf_counter()
    print(f"STAGE {name} start", flush=True)
    info = fn() or {}
    sync(device)
    print(f"STAGE {name} done", flush=True)
    return {"seconds": round(time.perf_counter() - t0, 3), **info}


def _call(name, run, sets) -> dict:
    inputs, out = sets[0]
    return {"finite": _finite(run(inputs, out), out)}


def _repeat(name, run, sets) -> dict:
    for inputs, out in sets:
        run(inputs, out)
    return {"sets": len(sets)}


def _graph(name, run, sets) -> dict:
    from forgekernel.runtime.timing import time_interleaved

    s = time_interleaved({name: run}, rotate=sets, warmup=2, reps=3)[name]
    run(*sets[0])  # eager again, after the capture (failed or not)
    return {"method": s.method, "note": s.note}


def _eager(name, run, sets) -> dict:
    from forgekernel.runtime.timing import time_eager_flushed

    time_eager_flushed({name: run}, rotate=sets[:1], warmup=2, reps=3, min_reps=3)
    return {}


_STAGE_FNS = {"call": _call, "repeat": _repeat, "graph": _graph, "eager": _eager}


def run_child(suite_name: str, case_index: int, name: str, stages: list[str], seed: int,
              device: str = "cuda") -> dict:  # fmt: skip
    """One candidate on one bench case through `stages`, in this process (`device` cpu: the
    tests, with the kernels' replays and without the timing stages)."""
    import torch

    from forgekernel.bench.check import poison
    from forgekernel.bench.harness import _input_sets

    suite = _suite(suite_name)
    case = suite.bench_cases[case_index]
    dtype = suite.dtypes_for_bench()[0]
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = suite.make_inputs(case, dtype, device, gen)
    out = poison(suite.alloc_out(inputs))
    run = _runner(suite, case, name)
    if run is None:
        return {"missing": True}
    report: dict = {}
    sets = [(inputs, out)]
    for stage in stages:
        if stage in ("repeat", "graph") and len(sets) == 1:
            sets = _input_sets(suite, case, dtype, (inputs, out), gen, device)
        report[stage] = _stage(stage, lambda s=stage, x=sets: _STAGE_FNS[s](name, run, x), device)
    return report


def run_harness_child(suite_name: str, case_index: int, seed: int) -> dict:
    """The bench's own `_time_case` on one case (every candidate, one process); raises."""
    import torch

    from forgekernel.bench.harness import BenchTiming, _time_case, resolve_comparators

    suite = _suite(suite_name)
    case = suite.bench_cases[case_index]
    comps, _ = resolve_comparators(suite)
    rec: dict = {"comparators": {}, "variants": {}, "flops": 1.0, "bytes": 1.0}
    timing = BenchTiming(reps=3, eager_reps=3)
    dtype = suite.dtypes_for_bench()[0]
    _time_case(suite, case, dtype, comps, rec, seed, torch.device("cuda"), timing)
    torch.cuda.synchronize()
    return {"status": rec.get("status"), "comparators": rec["comparators"],
            "variants": rec["variants"]}  # fmt: skip


def classify(rc: int | None, out: str, err: str, timed_out: bool) -> tuple[str, str]:
    """(verdict, detail) of one child from its exit and output."""
    started = [ln.split()[1] for ln in out.splitlines() if ln.startswith("STAGE ") and
               ln.endswith(" start")]  # fmt: skip
    stage = started[-1] if started else "setup"
    if timed_out:
        return "HANG", f"in stage {stage}"
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        r = json.loads(lines[-1])
        if r.get("missing"):
            return "MISSING", "not available in this process"
        return "PASS", json.dumps(r, sort_keys=True)[:400]
    text = err.strip().splitlines() or ["(no output)"]
    fault = next((ln for ln in text if any(f in ln for f in FAULTS)), None)
    if rc is not None and rc < 0:
        return "CRASH", f"signal {-rc} in stage {stage}: {text[-1][:300]}"
    if fault is not None:
        site = [ln.strip() for ln in text if ln.strip().startswith("File ")][-3:]
        return "CRASH", f"in stage {stage}: {fault.strip()[:200]} | " + " <- ".join(site)[:600]
    return "ERROR", f"rc {rc} in stage {stage}: {text[-1][:300]}"


def run_ladder(suite_name: str, picks: list[tuple[int, str, str]], stages: list[str],
               timeout: float, seed: int) -> bool:  # fmt: skip
    """Each (case index, case name, candidate) in its own process; one line each."""
    all_ok = True
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "FORGEKERNEL_PENDING_SUITES": "1"}
    for index, case_name, name in picks:
        cmd = [sys.executable, __file__, suite_name, "--child", str(index), name,
               "--stages", ",".join(stages), "--seed", str(seed)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        verdict, detail = classify(proc.returncode, out, err, timed_out)
        print(f"{verdict:7} {case_name} {name}: {detail}", flush=True)
        all_ok &= verdict in ("PASS", "MISSING")
    return all_ok


def pick(suite, case_filters, candidate_filters, harness: bool) -> list[tuple[int, str, str]]:
    """(case index, case name, candidate) to run: the cases whose name contains one of
    `case_filters` (all without), the candidates named in `candidate_filters` (all without)."""
    picks = []
    for index, case in enumerate(suite.bench_cases):
        if case_filters and not any(f in case.name for f in case_filters):
            continue
        names = candidate_names(suite, case) + ([HARNESS] if harness else [])
        picks += [(index, case.name, n) for n in names
                  if not candidate_filters or n in candidate_filters]  # fmt: skip
    return picks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", default="kda_prefill")
    parser.add_argument("--cases", nargs="+", help="case names containing one of these")
    parser.add_argument("--candidates", nargs="+", help="ours, ours[VARIANT], a comparator, "
                        f"{HARNESS} (the bench's _time_case)")  # fmt: skip
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, in order")
    parser.add_argument("--harness", action="store_true", help="add the bench's _time_case")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print what would run and exit")
    parser.add_argument("--child", nargs=2, metavar=("CASE_INDEX", "CANDIDATE"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {STAGES}")
    if args.child:
        index, name = int(args.child[0]), args.child[1]
        try:
            if name == HARNESS:
                r = run_harness_child(args.suite, index, args.seed)
            else:
                r = run_child(args.suite, index, name, stages, args.seed)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(3)  # no CUDA teardown after a fault
        print(json.dumps(r, default=str), flush=True)
        return 0
    suite = _suite(args.suite)
    picks = pick(suite, args.cases, args.candidates, args.harness)
    if args.list:
        for index, case_name, name in picks:
            print(index, case_name, name)
        return 0
    return 0 if run_ladder(args.suite, picks, stages, args.timeout, args.seed) else 1


if __name__ == "__main__":
    sys.exit(main())
