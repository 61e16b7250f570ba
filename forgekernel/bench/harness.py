"""`forgekernel bench`: ours against each comparator, same process, same inputs, interleaved.

Per case and dtype: verify ours against the reference first (a wrong kernel is reported as
wrong, never timed), then time ours and every comparator with `time_interleaved`, rotating
through enough input sets that one pass exceeds the L2 several times over. A comparator that
is unavailable or raises is reported as missing with the reason. A suite's variants of ours on
a case (the backward's deterministic mode) are verified the same way and timed in the same
interleaved run; their figure is variant time / our time, kept apart from the comparators'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench import ledger, report
from forgekernel.bench.check import as_tuple, expected, free, poison, sync, verify
from forgekernel.bench.suite import Case, Inputs, OpSuite, Runner
from forgekernel.runtime.arch import resolve_arch
from forgekernel.runtime.timing import Samples, l2_bytes, median, rotation_sets, time_interleaved

# Looser than `check` (2x): the bench only has to rule out a wrong kernel, not certify one.
VERIFY_FACTOR = 4.0


def resolve_comparators(suite: OpSuite) -> tuple[dict[str, Callable], dict[str, str]]:
    """(available comparators, missing ones with the reason)."""
    try:
        comps = suite.comparators()
    except Exception as e:
        return {}, {"comparators": f"could not be resolved: {type(e).__name__}: {e}"}
    available = {k: v for k, v in comps.items() if v is not None}
    missing = {k: "not available in this process" for k, v in comps.items() if v is None}
    return available, missing


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


def _input_sets(suite: OpSuite, case: Case, dtype: torch.dtype, first: tuple, gen, device):
    n = rotation_sets(suite.bytes(case, dtype), l2=l2_bytes())
    if suite.memory_bound:
        n = max(n, 2)
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
    outs = [t for _, out in sets for t in as_tuple(out) if t.is_floating_point()]
    return sum(int(torch.isnan(t).sum()) for t in outs)


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


def _time_case(suite, case, dtype, comps, rec, seed, device, warmup, reps) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = suite.make_inputs(case, dtype, device, gen)
    expect = expected(suite, inputs)
    out, cmps = verify(suite, inputs, device, factor=VERIFY_FACTOR, expect=expect)
    rec["verified"] = all(c.ok for c in cmps)
    if not rec["verified"]:
        rec["status"] = _wrong(cmps)
        return
    variants = _verified_variants(suite, case, inputs, device, expect, rec)
    del expect  # the fp32 reference can take GBs the timed input sets need
    fns: dict[str, Callable] = {"ours": lambda inp, o: suite.run_ours(inp, o)}
    for name, run in variants.items():
        fns[_variant_key(name)] = lambda inp, o, run=run: run(inp, o)
    for name, comp in comps.items():
        try:
            comp(inputs)
            sync(device)
            fns[name] = lambda inp, o, comp=comp: comp(inp)
        except Exception as e:
            rec["comparators"][name] = {"missing": f"raised {type(e).__name__}: {e}"[:300]}
    sets = _input_sets(suite, case, dtype, (inputs, out), gen, device)
    rec["input_sets"] = len(sets)
    # The warm-up touches every input set, so that what a candidate caches per set on its first
    # call (a comparator's own forward, for a backward suite) never runs in a timed region.
    samples = time_interleaved(fns, rotate=sets, warmup=max(warmup, len(sets)), reps=reps)
    for name in ["ours", *map(_variant_key, variants)]:
        unwritten = _unwritten_by_rerun(samples[name], sets, device)
        if unwritten:
            rec["status"] = (
                f"error: the timed launches of {name} left {unwritten} output elements "
                "unwritten (a launch outside the current stream?)"
            )
            return
    rec["ours"] = figures(samples.pop("ours"), rec["flops"], rec["bytes"])
    for name in variants:
        fig = figures(samples.pop(_variant_key(name)), rec["flops"], rec["bytes"])
        rec["variants"][name] = {"status": "ok", **fig, "time_ratio": fig["ms"] / rec["ours"]["ms"]}
    for name, s in samples.items():
        rec["comparators"][name] = figures(s, rec["flops"], rec["bytes"])
        rec["comparators"][name]["ratio"] = rec["comparators"][name]["ms"] / rec["ours"]["ms"]
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
    warmup: int = 5,
    reps: int = 30,
) -> dict[str, Any]:
    """One case and dtype; never raises (an exception becomes status "error: ...")."""
    rec: dict[str, Any] = {
        "op": suite.name,
        "case": case.name,
        "params": case.params,
        "dtype": report.dtype_name(dtype),
        "flops": suite.flops(case),
        "bytes": suite.bytes(case, dtype),
        "seed": seed,
        "status": "error",
        "verified": False,
        "ours": None,
        "comparators": {k: {"missing": v} for k, v in missing.items()},
        "variants": {},
    }
    try:
        _time_case(suite, case, dtype, comps, rec, seed, device, warmup, reps)
    except Exception as e:
        rec["status"] = f"error: {type(e).__name__}: {e}"[:500]
    free(device)
    return rec


def run_bench(
    suites: Iterable[OpSuite],
    *,
    results_dir: Path | None = None,
    report_dir: Path,
    arch: str | None = None,
    seed: int = 0,
    warmup: int = 5,
    reps: int = 30,
    device: str | torch.device | None = None,
) -> list[dict[str, Any]]:
    """Bench every suite's cases; writes the ledger's bench section and the reports."""
    device = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
    arch = arch or resolve_arch()
    env = ledger.environment()
    all_records = []
    for suite in suites:
        comps, missing = resolve_comparators(suite)
        jobs = [(c, d) for c in suite.bench_cases for d in suite.dtypes_for_bench()]
        records = []
        for i, (case, dtype) in enumerate(jobs):
            rec = bench_case(
                suite,
                case,
                dtype,
                comps=comps,
                missing=missing,
                seed=seed + i,
                device=device,
                warmup=warmup,
                reps=reps,
            )
            ms = f"{rec['ours']['ms']:.4f} ms" if rec["ours"] else ""
            print(
                f"[{i + 1}/{len(jobs)}] {suite.name} {case.name} {rec['dtype']}: "
                f"{rec['status']} {ms}",
                flush=True,
            )
            records.append(rec)
        summary = report.summarize(records)
        data = {
            "cases": records,
            "median_ratio": {k: v["median_ratio"] for k, v in summary.items()},
            "min_ratio": {k: v["min_ratio"] for k, v in summary.items()},
            "variant_ratio": report.variant_ratios(records),
        }
        path = ledger.write_section(
            suite, "bench", data, arch=arch, results_dir=results_dir, env=env
        )
        paths = report.write_reports(suite.name, records, Path(report_dir), {**env, "arch": arch})
        print(f"ledger: {path}")
        print("reports: " + ", ".join(str(p) for p in paths.values()))
        print(f"\n{suite.name} ({env['gpu']})\n{report.console_table(records)}\n")
        all_records += records
    return all_records
