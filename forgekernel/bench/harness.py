"""`forgekernel bench`: ours against each comparator, same process, same inputs, interleaved.

Per case and dtype: verify ours against the reference first (a wrong kernel is reported as
wrong, never timed), then time ours and every comparator with each timing method asked for:
"graph" (`time_interleaved`: CUDA-graph replays rotating through enough input sets that one pass
exceeds the L2 several times over) and "eager" (`time_eager_flushed`: eager launches, L2 flushed
before each, each timed alone). A comparator that is unavailable or raises is reported as
missing with the reason. A sidecar comparator (`bench/sidecar.py`: packages that cannot share
this process) is timed after ours by the same methods in a child process of its own, on the
case's first input set saved and loaded bit-identically, and recorded in the same slot. A
suite's variants of ours on a case (the backward's deterministic mode) are verified the same way
and timed in the same interleaved run; their figure is variant time / our time, kept apart from
the comparators'.

Per suite, after its cases, `host_record` measures host microseconds per eager call
(`host_us_per_call`) of ours, the comparators and the suite's `host_comparators` (torch's own op
where the comparators lack it) on the suite's `host_case` (default: the bench case with the
fewest flops).

Once per run, after the cases of its first memory-bound suite, `device_copy` times an
elementwise copy kernel (`COPY_OP`) of `BenchTiming.copy_bytes` with each timing method: the
device's copy bandwidth (read + write bytes), the yardstick of every memory-bound suite's GB/s in
its ledger and reports.

After each case the cases done so far go to the ledger's partial bench section
(`ledger.PARTIAL`), so that a bench killed by its time limit keeps them; `resume=True`
(`bench --resume`) takes the cases of a partial section written on the same sources, GPU,
options (`bench_options`) and comparators as they were, times the others and writes the
suite's section from all of them in the suite's order: each case's ours and comparators were
timed in one process, which is all a ratio needs. The host time and the device copy, whole-suite
measurements, come after the cases: only the call that completes the suite takes them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench import ledger, report, sidecar
from forgekernel.bench.check import as_tuple, expected, free, poison, sync, unwritten, verify
from forgekernel.bench.methods import TIMING_METHODS, time_method
from forgekernel.bench.sidecar import Sidecar, SidecarMissing
from forgekernel.bench.suite import Case, Inputs, OpSuite, Runner
from forgekernel.runtime.arch import resolve_arch
from forgekernel.runtime.timing import (
    Samples,
    device_contention,
    host_us_per_call,
    l2_bytes,
    median,
    rotation_sets,
    time_eager_flushed,
    time_interleaved,
)

# Looser than `check` (2x): the bench only has to rule out a wrong kernel, not certify one.
VERIFY_FACTOR = 4.0


@dataclass(frozen=True)
class BenchTiming:
    """How `bench` times. methods: a subset of TIMING_METHODS; reps: graph samples per
    candidate; eager_reps: eager launches per candidate (fewer on slow cases, see
    `time_eager_flushed`); host_calls: calls per round of the host loop (0: no host time);
    copy_bytes: the buffer of the device copy timed for memory-bound suites (0: none)."""

    methods: Sequence[str] = TIMING_METHODS
    warmup: int = 5
    reps: int = 30
    eager_reps: int = 100
    host_calls: int = 200
    copy_bytes: int = 2**30

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in TIMING_METHODS]
        if unknown or not self.methods:
            raise ValueError(f"timing methods must be among {TIMING_METHODS}, got {self.methods}")


def _resolve(make: Callable[[], dict], what: str) -> tuple[dict[str, Callable], dict[str, str]]:
    try:
        comps = make()
    except Exception as e:
        return {}, {what: f"could not be resolved: {type(e).__name__}: {e}"}
    available = {k: v for k, v in comps.items() if v is not None}
    missing = {k: "not available in this process" for k, v in comps.items() if v is None}
    for name, comp in list(available.items()):  # a sidecar without its site: missing, why
        why = comp.unavailable() if isinstance(comp, Sidecar) else None
        if why:
            missing[name] = why
            del available[name]
    return available, missing


def resolve_comparators(suite: OpSuite) -> tuple[dict[str, Callable], dict[str, str]]:
    """(available comparators, missing ones with the reason)."""
    return _resolve(suite.comparators, "comparators")


def resolve_host_comparators(suite: OpSuite) -> tuple[dict[str, Callable], dict[str, str]]:
    """The suite's extra comparators of the host-time loop: (available, missing)."""
    if suite.host_comparators is None:
        return {}, {}
    return _resolve(suite.host_comparators, "host_comparators")


def figures(samples: Samples, flops: float, nbytes: float) -> dict[str, Any]:
    ms = median(samples)
    return {
        "ms": ms,
        "tflops": flops / ms / 1e9,
        "gbps": nbytes / ms / 1e6,
        "method": samples.method,
        "launches": samples.launches,
        "note": samples.note,
        "samples": list(samples),
    }


def _set_count(suite: OpSuite, case: Case, dtype: torch.dtype) -> int:
    """Input sets the graph method rotates through: a pass exceeds the L2 several times."""
    n = rotation_sets(suite.bytes(case, dtype), l2=l2_bytes())
    return max(n, 2) if suite.memory_bound else n


def _input_sets(suite: OpSuite, case: Case, dtype: torch.dtype, first: tuple, gen, device):
    n = _set_count(suite, case, dtype)
    sets = [first]
    for _ in range(n - 1):
        inputs = suite.make_inputs(case, dtype, device, gen)
        sets.append((inputs, poison(suite.alloc_out(inputs))))
    return sets


def _unwritten_by_rerun(samples: Samples, sets: list[tuple], device: torch.device) -> int:
    """Poison every output, rerun exactly what was timed, count elements it did not write."""
    for _, out in sets:
        poison(out)
    samples.rerun()
    sync(device)
    return sum(unwritten(t) for _, out in sets for t in as_tuple(out))


def _wrong(cmps: list) -> str:
    return "wrong: " + "; ".join(c.message for c in cmps if c.message)


def _verified_variants(
    suite: OpSuite, case: Case, inputs: Inputs, device: torch.device, expect, rec: dict
) -> dict[str, Runner]:
    """The suite's variants of ours on this case that pass the bench's verification."""
    good = {}
    for name, run in suite.variants_for(case).items():
        cmps = verify(suite, inputs, device, factor=VERIFY_FACTOR, run=run, expect=expect)[1]
        if all(c.ok for c in cmps):
            good[name] = run
        else:
            rec["variants"][name] = {"status": _wrong(cmps)}
    return good


def _variant_key(name: str) -> str:
    return f"ours[{name}]"


def _candidates(suite, inputs, variants, comps, rec, device) -> dict[str, Callable]:
    """ours, its verified variants and the comparators that ran on `inputs`, as fn(inp, out)."""
    fns: dict[str, Callable] = {"ours": lambda inp, o: suite.run_ours(inp, o)}
    for name, run in variants.items():
        fns[_variant_key(name)] = lambda inp, o, run=run: run(inp, o)
    for name, comp in comps.items():
        if isinstance(comp, Sidecar):  # timed in its own process (`_time_sidecars`)
            continue
        try:
            comp(inputs)
            sync(device)
            fns[name] = lambda inp, o, comp=comp: comp(inp)
        except Exception as e:
            rec["comparators"][name] = {"missing": f"raised {type(e).__name__}: {e}"[:300]}
            continue
        ran = _what_ran(comp, inputs)
        if ran:
            rec.setdefault("comparator_ran", {})[name] = ran
    return fns


def _what_ran(comp: Callable, inputs: Inputs) -> str:
    """The comparator's own account of what its first call on `inputs` ran (`comp.ran`, see
    OpSuite.comparators), "" where it gives none; a failing account is recorded, not raised."""
    ran = getattr(comp, "ran", None)
    if ran is None:
        return ""
    try:
        return str(ran(inputs))[:300]
    except Exception as e:
        return f"unknown ({type(e).__name__}: {e})"[:300]


def _method_view(rec: dict, method: str) -> dict:
    """Where one method's figures go: the record itself for graph (the form that predates the
    eager method), rec[method] otherwise, starting with the missing comparators and the variants
    that failed verification."""
    if method == "graph":
        return rec
    rec[method] = {
        "ours": None,
        "comparators": {k: v for k, v in rec["comparators"].items() if "missing" in v},
        "variants": {k: v for k, v in rec["variants"].items() if v.get("status") != "ok"},
    }
    return rec[method]


def _store_comparator(view: dict, name: str, samples: Samples, rec: dict) -> dict:
    fig = figures(samples, rec["flops"], rec["bytes"])
    entry = view["comparators"][name] = {**fig, "ratio": fig["ms"] / view["ours"]["ms"]}
    ran = rec.get("comparator_ran", {})
    if name in ran:
        entry["ran"] = ran[name]
    return entry


def _store(view: dict, samples: dict[str, Samples], variants: Iterable[str], rec: dict) -> None:
    ours = view["ours"] = figures(samples.pop("ours"), rec["flops"], rec["bytes"])
    for name in variants:
        fig = figures(samples.pop(_variant_key(name)), rec["flops"], rec["bytes"])
        view["variants"][name] = {"status": "ok", **fig, "time_ratio": fig["ms"] / ours["ms"]}
    for name, s in samples.items():
        _store_comparator(view, name, s, rec)


def _time_sidecars(suite, case, dtype, comps, first: tuple, rec, device, timing) -> bool:
    """Each sidecar comparator timed in its own process on the case's first input set (after
    ours: `sidecar`'s docstring), stored in every method's view as an in-process comparator's,
    with `vs_ours` (its first call's outputs against ours) and the child's package `versions`;
    missing with the reason if not.
    Whether there was any."""
    sides = {name: c for name, c in comps.items() if isinstance(c, Sidecar)}
    if not sides:
        return False
    free(device)  # the memory our input sets held, for the child
    inputs, out = first
    for name, side in sides.items():
        try:
            samples, outs, versions = sidecar.run(side, inputs, sets=_set_count(suite, case, dtype),
                                                  timing=timing, device=device)  # fmt: skip
            vs_ours = sidecar.agreement(as_tuple(out), outs)
            del outs
        except Exception as e:
            why = str(e) if isinstance(e, SidecarMissing) else f"raised {type(e).__name__}: {e}"
            for method in timing.methods:
                report.view(rec, method)["comparators"][name] = {"missing": why[:1000]}
            continue
        for method, s in samples.items():
            entry = _store_comparator(report.view(rec, method), name, s, rec)
            entry.update(vs_ours=vs_ours, versions=versions)
    return True


def _timed(method: str, fns: dict, sets: list, timing: BenchTiming) -> dict[str, Samples]:
    """`methods.time_method` with this module's timer names (which the CPU tests replace)."""
    return time_method(method, fns, sets, warmup=timing.warmup, reps=timing.reps,
                       eager_reps=timing.eager_reps,
                       timers=(time_interleaved, time_eager_flushed))  # fmt: skip


def _time_method(method, fns, sets, variants, rec, device, timing: BenchTiming) -> str | None:
    """Time every candidate with one method into the record; an error message when a timed
    launch of ours left outputs unwritten."""
    if method == "graph":
        rec["input_sets"] = len(sets)
    samples = _timed(method, fns, sets, timing)
    for name in ["ours", *map(_variant_key, variants)]:
        unwritten = _unwritten_by_rerun(samples[name], sets, device)
        if unwritten:
            return (
                f"error: the timed {method} launches of {name} left {unwritten} output elements "
                "unwritten (a launch outside the current stream?)"
            )
    _store(_method_view(rec, method), samples, variants, rec)
    return None


def _laps(rec: dict) -> Callable[[str], None]:
    """lap(name): the wall seconds since the previous lap (the first: since this call) into
    rec["seconds"][name], so that a slow bench says where its time went."""
    rec["seconds"] = {}
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        rec["seconds"][name] = round(now - last[0], 3)
        last[0] = now

    return lap


def _time_case(suite, case, dtype, comps, rec, seed, device, timing: BenchTiming) -> None:
    lap = _laps(rec)
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = suite.make_inputs(case, dtype, device, gen)
    expect = expected(suite, inputs)
    lap("reference")
    out, cmps = verify(suite, inputs, device, factor=VERIFY_FACTOR, expect=expect)
    rec["verified"] = all(c.ok for c in cmps)
    if not rec["verified"]:
        rec["status"] = _wrong(cmps)
        return
    variants = _verified_variants(suite, case, inputs, device, expect, rec)
    del expect  # the fp32 reference can take GBs the timed input sets need
    lap("verify")
    fns = _candidates(suite, inputs, variants, comps, rec, device)
    lap("first calls")  # the comparators' first calls: their JIT compiles and autotuning
    for method in timing.methods:
        # Graph replays rotate inputs past L2; eager launches flush it, one input set does.
        if method == "graph":
            sets = _input_sets(suite, case, dtype, (inputs, out), gen, device)
        else:
            sets = [(inputs, out)]
        error = _time_method(method, fns, sets, list(variants), rec, device, timing)
        del sets  # the graph's input sets, before the next method allocates
        lap(method)
        if error:
            rec["status"] = error
            return
    if _time_sidecars(suite, case, dtype, comps, (inputs, out), rec, device, timing):
        lap("sidecars")
    rec["status"] = "ok"


def bench_case(
    suite: OpSuite,
    case: Case,
    dtype: torch.dtype,
    *,
    comps: dict[str, Callable],
    missing: dict[str, str],
    seed: int,
    device: torch.device,
    timing: BenchTiming | None = None,
) -> dict[str, Any]:
    """One case and dtype; never raises (an exception becomes status "error: ...")."""
    timing = timing or BenchTiming()
    rec: dict[str, Any] = {
        "op": suite.name,
        "case": case.name,
        "group": case.group,
        "params": case.params,
        "dtype": report.dtype_name(dtype),
        "flops": suite.flops(case),
        "bytes": suite.bytes(case, dtype),
        "seed": seed,
        "timing": list(timing.methods),
        "status": "error",
        "verified": False,
        "ours": None,
        "comparators": {k: {"missing": v} for k, v in missing.items()},
        "variants": {},
    }
    try:
        _time_case(suite, case, dtype, comps, rec, seed, device, timing)
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:500]
    free(device)
    return rec


HOST_ROUNDS = 5


def host_case(suite: OpSuite) -> Case:
    """The suite's `host_case`, else its bench case with the fewest flops (then bytes)."""
    if suite.host_case is not None:
        return suite.host_case
    dtype = suite.dtypes_for_bench()[0]
    return min(suite.bench_cases, key=lambda c: (suite.flops(c), suite.bytes(c, dtype)))


def _time_host(suite, inputs, comps, rec, device) -> None:
    out, cmps = verify(suite, inputs, device, factor=VERIFY_FACTOR)
    if not all(c.ok for c in cmps):
        rec["status"] = _wrong(cmps)
        return
    fns: dict[str, Callable] = {"ours": lambda: suite.run_ours(inputs, out)}
    for name, comp in comps.items():
        try:
            comp(inputs)
            sync(device)
            fns[name] = lambda comp=comp: comp(inputs)
        except Exception as e:
            rec["missing"][name] = f"raised {type(e).__name__}: {e}"[:300]
    rounds = host_us_per_call(
        fns, calls=rec["calls"], rounds=rec["rounds"], sync=lambda: sync(device)
    )
    rec["us_per_call"] = {name: median(us) for name, us in rounds.items()}
    rec["issue_us_per_call"] = {name: median(us.issued) for name, us in rounds.items()}
    rec["rounds_us"] = {name: list(us) for name, us in rounds.items()}
    rec["device_bound"] = [name for name, us in rounds.items() if us.device_bound()]
    rec["status"] = "ok"


def host_record(
    suite: OpSuite,
    comps: dict[str, Callable],
    missing: dict[str, str],
    *,
    calls: int,
    seed: int,
    device: torch.device,
) -> dict[str, Any]:
    """Host microseconds per eager call of ours and each comparator on the host case (median
    over HOST_ROUNDS rounds of `calls` calls); never raises."""
    case, dtype = host_case(suite), suite.dtypes_for_bench()[0]
    rec: dict[str, Any] = {
        "case": case.name,
        "params": case.params,
        "dtype": report.dtype_name(dtype),
        "calls": calls,
        "rounds": HOST_ROUNDS,
        "status": "error",
        "us_per_call": {},
        "missing": dict(missing),
    }
    lap = _laps(rec)
    try:
        gen = torch.Generator(device=device).manual_seed(seed)
        _time_host(suite, suite.make_inputs(case, dtype, device, gen), comps, rec, device)
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:500]
    lap("host probe")
    free(device)
    return rec


def _suite_host(suite, comps, missing, seed, device, timing: BenchTiming) -> dict | None:
    if timing.host_calls <= 0 or (suite.host_case is None and not suite.bench_cases):
        return None
    extra, extra_missing = resolve_host_comparators(suite)
    sides = {k: "timed in a sidecar process: no host time" for k, c in comps.items()
             if isinstance(c, Sidecar)}  # fmt: skip
    host = host_record(
        suite,
        {k: c for k, c in {**comps, **extra}.items() if k not in sides},
        {**missing, **extra_missing, **sides},
        calls=timing.host_calls,
        seed=seed,
        device=device,
    )
    lines = "; ".join(report.host_lines(host))
    print(f"{suite.name} host: {lines} {_wall(host['seconds'])}", flush=True)
    return host


# An SM kernel that reads and writes every byte, not `dst.copy_(src)`: a contiguous copy_ is a
# cudaMemcpyAsync, which a CUDA graph replays as a memcpy node (2026-12-04: 2769 GB/s in graph
# replays against 4256 GB/s eager; our paged decode read 4339 GB/s in the same graph timing).
COPY_OP = "torch.neg(src, out=dst)"


def _time_copy(rec: dict, device: torch.device, timing: BenchTiming) -> None:
    nbytes = rec["buffer_bytes"]
    n = rotation_sets(rec["bytes"], l2=l2_bytes())
    sets = [
        (torch.rand(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device))
        for _ in range(n)
    ]
    fns = {"copy": lambda src, dst: torch.neg(src, out=dst)}
    for method in timing.methods:  # as a case's
        samples = _timed(method, fns, sets, timing)
        fig = figures(samples["copy"], 0.0, rec["bytes"])
        rec["methods"][method] = {k: v for k, v in fig.items() if k != "tflops"}
    rec["status"] = "ok"


def device_copy(device: torch.device, timing: BenchTiming) -> dict[str, Any]:
    """The device's copy bandwidth: `COPY_OP` over `timing.copy_bytes` (fp32) timed with
    each of `timing.methods` like a case, GB/s counting the bytes read and written; never
    raises."""
    rec: dict[str, Any] = {
        "op": COPY_OP,
        "buffer_bytes": timing.copy_bytes,
        "bytes": 2 * timing.copy_bytes,
        "status": "error",
        "methods": {},
    }
    lap = _laps(rec)
    try:
        _time_copy(rec, device, timing)
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:500]
    lap("device copy")
    free(device)
    return rec


def _copy_line(copy: dict) -> str:
    figs = [f"{m} {f['gbps']:.0f} GB/s" for m, f in copy["methods"].items()]
    text = ", ".join(figs) if copy["status"] == "ok" else copy["status"]
    return f"device copy ({report.size_text(copy['buffer_bytes'])}, read + write): {text}"


def bench_section(
    records: list[dict], methods: Sequence[str], host: dict | None, copy: dict | None = None
) -> dict[str, Any]:
    """The ledger's bench section: the records, per method the comparators' suite median, min
    and group medians (with the device copy of a memory-bound suite: the % of copy of ours and
    each comparator), the host record, the device copy; the top-level median / min / variant
    ratios are the graph method's (the README's table)."""
    data: dict[str, Any] = {
        "cases": records,
        "timing": list(methods),
        "methods": {m: report.method_summary(records, m, copy) for m in methods},
    }
    if host is not None:
        data["host"] = host
    if copy is not None:
        data["device_copy"] = copy
    if "graph" in methods:
        graph = data["methods"]["graph"]
        data.update({k: graph[k] for k in ("median_ratio", "min_ratio", "variant_ratio")})
    return data


def _device_check(suite: OpSuite, when: str) -> dict[str, Any]:
    """`device_contention` around a suite's timing, printed; a shared device is shouted (its
    times are not the kernels': runtime/timing.py's docstring)."""
    probe = device_contention()
    pids = probe["other_pids"]
    line = (f"{suite.name} device check {when}: matmul {probe['alone_ms']:.4f} ms alone, "
            f"{probe['burst_ms']:.4f} ms per launch in a burst ({probe['ratio']:.2f}x)"
            f"{f'; other processes on the GPU: {pids}' if pids else ''}")  # fmt: skip
    if probe["contended"] or pids:
        line += " -- DEVICE SHARED: times below are not the kernels' own"
    print(line, flush=True)
    return probe


def _wall(seconds: dict[str, float]) -> str:
    """Where a case's or probe's wall time went: (12.3 s: reference 0.4, verify 0.2, ...)."""
    if not seconds:
        return ""
    parts = ", ".join(f"{name} {s:.1f}" for name, s in seconds.items())
    return f"({sum(seconds.values()):.1f} s: {parts})"


def _progress(i: int, n: int, suite: OpSuite, rec: dict) -> str:
    times = [
        f"{m} {report.view(rec, m)['ours']['ms']:.4f} ms"
        for m in rec["timing"]
        if report.view(rec, m).get("ours")
    ]
    text = f"[{i + 1}/{n}] {suite.name} {rec['case']} {rec['dtype']}: {rec['status']}"
    return " ".join([text, *times, _wall(rec.get("seconds", {}))]).rstrip()


def bench_options(timing: BenchTiming, seed: int) -> dict[str, Any]:
    """What shapes a case's record besides the kernel sources, the GPU and the comparators: a
    partial bench section is resumed only under the same (the host calls and the device copy's
    size shape the whole-suite measurements, taken by the call that completes the suite)."""
    keep = ("warmup", "reps", "eager_reps")
    return {"timing": list(timing.methods), **{k: getattr(timing, k) for k in keep}, "seed": seed}


def _job_key(case: str, dtype: str, params: Any) -> str:
    """A job's identity in records read back from JSON (tuples there are lists)."""
    return json.dumps([case, dtype, params], sort_keys=True, default=str)


def _resumed(suite: OpSuite, jobs: list, match: dict, arch: str, results_dir) -> dict[int, dict]:
    """{job index: record} of the partial bench section's cases that are jobs of this run;
    why not on stderr when the section does not match."""
    records, why = ledger.partial_cases(suite, match, arch=arch, results_dir=results_dir)
    if why:
        print(f"{suite.name}: no partial bench resumed ({why}): from the first case",
              file=sys.stderr, flush=True)  # fmt: skip
        return {}
    done = {_job_key(r.get("case"), r.get("dtype"), r.get("params")): r for r in records}
    keys = [_job_key(c.name, report.dtype_name(d), c.params) for c, d in jobs]
    found = {i: done[k] for i, k in enumerate(keys) if k in done}
    print(
        f"{suite.name}: resumed {len(found)} of {len(jobs)} cases from the partial bench"
        f" ({len(records) - len(found)} of its records not in this suite)",
        flush=True,
    )
    return found


def _only_variants(suite: OpSuite, names: Sequence[str]) -> OpSuite:
    """The suite with only the named variants of ours (`bench --variants`)."""
    every = suite.variants_for

    def chosen(case: Case) -> dict[str, Runner]:
        return {n: run for n, run in every(case).items() if n in names}

    return replace(suite, variants=chosen)


def run_bench(
    suites: Iterable[OpSuite],
    *,
    results_dir: Path | None = None,
    report_dir: Path,
    arch: str | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    timing: BenchTiming | None = None,
    variant_cases: bool = False,
    variant_names: Sequence[str] = (),
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Bench every suite's cases; writes the ledger's bench section and the reports, and after
    each case the partial section (`resume`: go on from a matching one; the module's docstring).

    variant_cases: only the cases that carry variants of ours (the candidates a measure-only
    device call decides), ours, the variants and the comparators timed as always; a partial
    suite, so no ledger section and no host record: the reports go to `<op>-variants.*`.
    variant_names: with variant_cases, only these variants (the cases carrying one of them)."""
    timing = timing or BenchTiming()
    device = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
    arch = arch or resolve_arch()
    env = ledger.environment()
    versions = ledger.comparator_versions()
    all_records: list[dict[str, Any]] = []
    copy: dict[str, Any] | None = None
    match = {"gpu": env["gpu"], "options": bench_options(timing, seed),
             "comparator_versions": versions}  # fmt: skip
    resume = resume and not variant_cases  # a variant-case run writes no section to go on from
    for suite in suites:
        before = _device_check(suite, "before")
        comps, missing = resolve_comparators(suite)
        cases = suite.bench_cases
        if variant_cases:
            if variant_names:
                suite = _only_variants(suite, variant_names)
            cases = [c for c in cases if suite.variants_for(c)]
            if not cases:
                print(f"{suite.name}: no case carries a variant of ours: nothing to time")
                continue
        jobs = [(c, d) for c in cases for d in suite.dtypes_for_bench()]
        done = _resumed(suite, jobs, match, arch, results_dir) if resume else {}
        for i, (case, dtype) in enumerate(jobs):
            if i in done:
                continue
            rec = bench_case(
                suite,
                case,
                dtype,
                comps=comps,
                missing=missing,
                seed=seed + i,
                device=device,
                timing=timing,
            )
            print(_progress(i, len(jobs), suite, rec), flush=True)
            done[i] = rec
            if not variant_cases:  # what a kill leaves: the cases so far, in the suite's order
                part = {"cases": [done[j] for j in sorted(done)], **match}
                ledger.write_section(suite, ledger.PARTIAL, part, arch=arch,
                                     results_dir=results_dir, env=env)  # fmt: skip
        records = [done[i] for i in range(len(jobs))]
        sidecar.close_all()  # a live child would be "another process on the GPU" below
        if suite.memory_bound and copy is None and timing.copy_bytes > 0:
            copy = device_copy(device, timing)
            print(f"{_copy_line(copy)} {_wall(copy['seconds'])}", flush=True)
        suite_copy = copy if suite.memory_bound else None
        host = None if variant_cases else _suite_host(suite, comps, missing, seed, device, timing)
        after = _device_check(suite, "after")
        if not variant_cases:
            data = bench_section(records, timing.methods, host, suite_copy)
            data["device_check"] = {"before": before, "after": after}
            data["comparator_versions"] = versions
            path = ledger.write_section(
                suite, "bench", data, arch=arch, results_dir=results_dir, env=env
            )
            print(f"ledger: {path}")
        name = f"{suite.name}-variants" if variant_cases else suite.name
        paths = report.write_reports(
            name, records, Path(report_dir), {**env, "arch": arch}, host, suite_copy
        )
        print("reports: " + ", ".join(str(p) for p in paths.values()))
        table = report.console_table(records, host, suite_copy)
        print(f"\n{suite.name} ({env['gpu']})\n{table}\n")
        all_records += records
    return all_records
