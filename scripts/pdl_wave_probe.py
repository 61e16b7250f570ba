"""PDL's trigger against the partial wave (docs/gemm/NOTES.md "PDL's trigger and the partial
wave"): the dense GEMM at M = 16, K = 8192 (bf16) on the configuration chosen for 16x5120x8192
(64x64 c1x2, a_rows 16), forced, over N giving 40 to 132 CTAs, each N timed in three builds:
"top" (the standard one: launch_dependents after the wait, before the role split), "off" (no
PDL, `pdl.off()`) and "late" (the trigger after each CTA's last mainloop, `pdl.late()`); then
the FP8 GEMM at M = 1, K = 5120 on the configuration of 1x10240x5120 (64x128 c1x2, a_rows 8)
the same way. Timed with the bench's methods (`bench/methods.py`): "graph", CUDA-graph replays
of back-to-back calls with the inputs rotated past L2 (each launch has a PDL primary: the
measured losses), and "eager", single launches with L2 flushed. Before timing, each build's
output is checked against the reference and against the top build's (bit for bit).

    python3 scripts/pdl_wave_probe.py             (the GPU; the DSL installed: 6 compiles)
    python3 scripts/pdl_wave_probe.py --dry-run   (the plan: configs, compile keys, N and CTAs)
    python3 scripts/pdl_wave_probe.py --compile   (CPU: the 6 builds into the compile cache)

Prints a table per dtype and writes JSON to /tmp/probes/pdl_wave.json (--out), rewritten after
each row: rows past DEADLINE_S are left out (the device session kills the probe at 100 s)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

START = time.perf_counter()
DEADLINE_S = float(os.environ.get("PROBE_DEADLINE", "85"))  # PROBE_T - 15 or so
# N = tile_n x tiles: the grid's CTAs (one tile row, one wave); the losses of 2026-12-05 04:10
# were at 72-80 CTAs, the gains at <= 64 and ~128
DENSE_TILES = (40, 48, 56, 64, 66, 68, 72, 76, 80, 88, 96, 104, 112, 120, 128, 132)
FP8_TILES = (40, 56, 64, 72, 80, 88, 96, 112, 128, 132)
FORMS = ("top", "off", "late")
GRAPH_REPS, EAGER_REPS = 20, 60


def form_context(form: str) -> contextlib.AbstractContextManager:
    """What a call of `form` runs inside (its plans are keyed apart: runtime/pdl.py; "top"
    inside `pdl.top()`, the trigger at the top whatever partial-wave rule is adopted)."""
    from forgekernel.runtime import pdl

    return {"top": pdl.top, "off": pdl.off, "late": pdl.late}[form]()


def sweeps(sms: int) -> list[dict]:
    """The two sweeps: dtype, the forced config, M, K, the N of each point and its compile
    keys per form (runtime/pdl.py `key`)."""
    from forgekernel.kernels.gemm.dense.sm90 import SPEC as DENSE
    from forgekernel.kernels.gemm.dense.sm90.config import choose_config, params_for
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8
    from forgekernel.kernels.gemm.fp8.sm90.config import params_for as fp8_params
    from forgekernel.kernels.gemm.fp8.sm90.config import wide_config as fp8_config
    from forgekernel.runtime import pdl

    dense = choose_config(16, 5120, 8192, sms)
    # FP8's 128-column decode tile, as probed (the chooser takes a narrow full-K tile on
    # 1x10240x5120 since 2026-12-05: `wide_config` is its plan before)
    fp8 = fp8_config(1, 10240, 5120, sms)
    found = [
        ("bf16", DENSE, dense, params_for("bfloat16", False, dense), 16, 8192, DENSE_TILES),
        ("fp8", FP8, fp8, fp8_params("bfloat16", fp8), 1, 5120, FP8_TILES),
    ]
    return [
        {
            "dtype": dtype,
            "spec": spec,
            "config": cfg,
            "m": m,
            "k": k,
            "n": [cfg.tile_n * t for t in tiles],
            "keys": {
                "top": pdl.key(params, True),
                "off": pdl.key(params, False),
                "late": pdl.key(params, True, "late"),
            },
        }
        for dtype, spec, cfg, params, m, k, tiles in found
    ]


def ctas(cfg, m: int, n: int, sms: int) -> int:
    """The tiled walk's grid: the tiles rounded up to whole clusters, at most one wave."""
    cluster = cfg.cluster_m * cfg.cluster_n
    tiles = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
    return min(-(-tiles // cluster), sms // cluster) * cluster


def _compile(job: tuple) -> float:
    from forgekernel.runtime.cache import compile_to, user_cache_dir

    spec, params = job
    t = time.perf_counter()
    compile_to(spec, params, user_cache_dir(spec.arch))
    return time.perf_counter() - t


def precompile(plan: list[dict]) -> None:
    """Every build of the plan into the compile cache, in parallel (spawned processes)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = [(s["spec"], s["keys"][f]) for s in plan for f in FORMS]
    t = time.perf_counter()
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        each = list(pool.map(_compile, jobs))
    print(
        f"compiled {len(jobs)} builds in {time.perf_counter() - t:.0f} s "
        f"(each {min(each):.1f}-{max(each):.1f} s)",
        flush=True,
    )


def dry_run(plan: list[dict], sms: int) -> None:
    for s in plan:
        print(f"{s['dtype']}: M = {s['m']}, K = {s['k']}, config {s['config'].tag()} (forced)")
        for form in FORMS:
            print(f"  {form:4s} key {dict(s['keys'][form])}")
        points = ", ".join(f"{n} ({ctas(s['config'], s['m'], n, sms)})" for n in s["n"])
        print(f"  N (CTAs): {points}")
    print(f"{sum(len(s['n']) for s in plan)} points x {len(FORMS)} forms, graph and eager")


def _calls(s: dict, device: str):
    """(make the inputs of N, the call of one form, the reference) of a sweep: the bench
    suites' inputs and references, the launchers with the config forced."""
    import torch

    from forgekernel.bench.suite import Case

    cfg, m, k = s["config"], s["m"], s["k"]
    if s["dtype"] == "bf16":
        from forgekernel.bench.suites import gemm as suite
        from forgekernel.kernels.gemm.dense.sm90.launch import gemm

        def call(inputs, out):
            return gemm(inputs["a"], inputs["b"], out, False, cfg)

        params = {"b_layout": "nk"}
    else:
        from forgekernel.bench.suites import gemm_fp8 as suite
        from forgekernel.kernels.gemm.fp8.sm90.launch import gemm_fp8

        def call(inputs, out):
            return gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out, cfg)

        params = {}

    def make(n, gen):
        case = Case(f"{m}x{n}x{k}", {"m": m, "n": n, "k": k, **params})
        inputs = suite.make_inputs(case, torch.bfloat16, torch.device(device), gen)
        return inputs, suite.alloc_out(inputs)

    def run(form):
        def fn(inputs, out):
            with form_context(form):
                call(inputs, out)

        return fn

    return make, run, suite.reference


def measure(s: dict, n: int, sms: int, device: str = "cuda") -> dict:
    """One point: each form checked, then timed by both methods."""
    import torch

    from forgekernel.bench.methods import time_method
    from forgekernel.runtime.timing import median, rotation_sets

    make, run, reference = _calls(s, device)
    gen = torch.Generator(device=device).manual_seed(n)
    first = make(n, gen)
    set_bytes = sum(t.numel() * t.element_size() for t in (*first[0].values(), first[1])
                    if isinstance(t, torch.Tensor))  # fmt: skip
    sets = [first] + [make(n, gen) for _ in range(rotation_sets(set_bytes) - 1)]
    fns = {form: run(form) for form in FORMS}
    inputs, out = first
    ref = reference(inputs).float()
    outs = {}
    for form, fn in fns.items():
        out.fill_(float("nan"))
        fn(inputs, out)
        outs[form] = out.clone()
    err = ((outs["top"].float() - ref).abs().max() / ref.abs().max()).item()
    same = all(torch.equal(outs["top"], outs[f]) for f in FORMS)
    row = {"n": n, "ctas": ctas(s["config"], s["m"], n, sms), "sets": len(sets), "err": err,
           "same": same}  # fmt: skip
    if not (err < 1e-2 and same):
        print(f"  N = {n}: WRONG (rel err {err:.2e}, forms bit-identical {same}): not timed")
        return row
    for method in ("graph", "eager"):
        samples = time_method(method, fns, sets, warmup=5, reps=GRAPH_REPS, eager_reps=EAGER_REPS)
        row[method] = {f: median(samples[f]) * 1e3 for f in FORMS}  # us
        row[f"{method}_how"] = {f: samples[f].method for f in FORMS}
    return row


def line(row: dict) -> str:
    g, e = row["graph"], row["eager"]
    return (
        f"{row['ctas']:5d} {row['n']:6d} | graph top {g['top']:6.1f} off {g['off']:6.1f} late "
        f"{g['late']:6.1f} us  off/top {g['off'] / g['top']:.3f} off/late "
        f"{g['off'] / g['late']:.3f} top/late {g['top'] / g['late']:.3f} | eager off/top "
        f"{e['off'] / e['top']:.3f} off/late {e['off'] / e['late']:.3f}"
    )


def verdict(rows: list[dict]) -> str:
    """What the sweep's graph times adopt (docs/gemm/NOTES.md "PDL's trigger and the partial
    wave", rules 1-4): the band is the CTAs where top loses to off by more than 2 %."""
    rows = [r for r in rows if "graph" in r]
    if not rows:
        return "no timed rows"

    def ratio(r, a, b):
        return r["graph"][a] / r["graph"][b]  # > 1: b faster

    band = [r for r in rows if ratio(r, "off", "top") < 0.98]
    where = f"band {[r['ctas'] for r in band]} CTAs"
    eager = [r["ctas"] for r in rows if any(abs(r["eager"][f] / r["eager"]["top"] - 1) > 0.03
                                            for f in FORMS)]  # fmt: skip
    note = f"; eager differs by > 3 % at {eager} CTAs: a code difference, look" if eager else ""
    if not any(72 <= r["ctas"] <= 88 for r in band):
        return f"4 (no loss at 72-88 CTAs): nothing; {where}{note}"
    if all(ratio(r, "off", "late") >= 0.99 for r in band):
        rest = [r for r in rows if r not in band]
        if all(ratio(r, "top", "late") >= 0.99 for r in rest) and all(
            ratio(r, "off", "late") >= 0.99 for r in rows
        ):
            return f"1: the late trigger everywhere; {where}{note}"
        return f"2: a per-problem trigger, late in the {where}{note}"
    if all(0.95 <= ratio(r, "top", "late") <= 1.05 for r in band if 72 <= r["ctas"] <= 88):
        return f"3: a per-problem switch, PDL off in the {where}{note}"
    return f"none of 1-4 (late fixes part of the band): read the table; {where}{note}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan only")
    ap.add_argument("--compile", action="store_true", help="compile the builds only (CPU)")
    ap.add_argument("--out", default="/tmp/probes/pdl_wave.json")
    args = ap.parse_args()
    if args.dry_run or args.compile:
        sms = 132  # an H200's
        plan = sweeps(sms)
        if args.compile:
            precompile(plan)
        dry_run(plan, sms)
        return

    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = sweeps(sms)
    dry_run(plan, sms)
    precompile(plan)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "sms": sms,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "sweeps": []}  # fmt: skip
    for s in plan:
        sweep = {"dtype": s["dtype"], "config": s["config"].tag(), "m": s["m"], "k": s["k"],
                 "rows": []}  # fmt: skip
        result["sweeps"].append(sweep)
        print(f"{s['dtype']} M = {s['m']} K = {s['k']} {s['config'].tag()}; CTAs, N:", flush=True)
        for n in s["n"]:
            if time.perf_counter() - START > DEADLINE_S:
                print(f"  deadline ({DEADLINE_S:.0f} s): N = {n} and after left out", flush=True)
                break
            row = measure(s, n, sms)
            sweep["rows"].append(row)
            if "graph" in row:
                print(line(row), flush=True)
            out.write_text(json.dumps(result, indent=1))
            torch.cuda.empty_cache()
        sweep["verdict"] = verdict(sweep["rows"])
        out.write_text(json.dumps(result, indent=1))
    for sweep in result["sweeps"]:
        print(f"{sweep['dtype']}: rule {sweep['verdict']}")
    print(f"wrote {out} ({time.perf_counter() - START:.0f} s)")


if __name__ == "__main__":
    main()
