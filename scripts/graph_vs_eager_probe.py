"""Graph replays against eager launches, kernel by kernel: the Gated DeltaNet and Kimi Delta
Attention backwards at the bench's 4 x 8192 cases (docs/linear_attention/NOTES.md
"next/capture-drop (2026-12-06)": the bench's graph column 5.94 ms at gdn_bwd
4x8192-h16-hv32 against 4.79 eager, 6.11 against 5.17 at kda_bwd 4x8192-h16-hv16; the single
sequences and dsa_sparse_bwd graph = eager).

Per case and form, the suite's own inputs (`make_inputs`, bf16, seed = the case's index) and
output buffers, the op called as the bench calls it (`gdn_bwd.run_backward`):
  varlen  the bench's form: B = 1 and cu_seqlens at N equal lengths. Eager reads the offsets
          and takes the batch path (a reshape); a capture cannot read them: the slot layout.
  batch   the same tensors as (N, T / N, ...) without cu_seqlens: the batch path in both, no
          host read.
  slots   varlen with the capture's route taken by the eager calls too (ops/_linattn_varlen.py
          `capturing` true): the slot layout in both.
Each form is timed by the bench's two methods (`bench.methods.time_method`: "eager", L2
flushed before each launch; "graph", CUDA-graph replays), then torch.profiler records what
each timed thing runs (`Samples.rerun`: the eager calls back to back, the very graph the timer
replayed) and the kernels are listed side by side, per call, the largest differences first.

    python3 scripts/graph_vs_eager_probe.py [--case SUITE:CASE ...] [--form FORM ...]
        [--l2norm] [--reps N] [--calls N] [--top N] [--json PATH] [--list]
        [--set MODULE.NAME=VALUE ...]

--set as scripts/profile_suite.py's (a temporary A/B switch set before the run, e.g.
forgekernel.ops._linattn_varlen.NATIVE_STORES=True: the slot layout's gradients written at
their token rows, NOTES "next/varlen-stores").

~60 s on an H100 for the defaults once the kernels are built (2 cases x 3 forms).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

DEFAULT_CASES = ("gdn_bwd:4x8192-h16-hv32", "kda_bwd:4x8192-h16-hv16")
FORMS = ("varlen", "batch", "slots")
BACKWARDS = {  # suite -> (module, its explicit backward entry)
    "gdn_bwd": ("forgekernel.ops.gated_delta_rule_bwd", "gated_delta_rule_backward"),
    "kda_bwd": ("forgekernel.ops.kda_bwd", "kimi_delta_attention_backward"),
}
TOKENS = ("q", "k", "v", "g", "beta", "do")  # the (1, T, ...) inputs of the suites' form


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="graph_vs_eager_probe.py",
        description="graph replays against eager launches, kernel by kernel (the linear-attention "
        "backwards)",
    )
    default = ", ".join(DEFAULT_CASES)
    p.add_argument("--case", action="append", default=[], metavar="SUITE:CASE",
                   help=f"a bench case (repeatable; default: {default})")  # fmt: skip
    p.add_argument("--form", action="append", default=[], choices=FORMS,
                   help="repeatable; default: every form")  # fmt: skip
    p.add_argument("--l2norm", action="store_true",
                   help="use_qk_l2norm_in_kernel=True (the bench's cases: off)")  # fmt: skip
    p.add_argument("--reps", type=int, default=10, help="timed samples of each method")
    p.add_argument("--calls", type=int, default=3, help="eager calls profiled")
    p.add_argument("--top", type=int, default=15, help="kernels listed a form")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--list", action="store_true", help="print the cases and forms (no GPU)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="a module constant set first (profile_suite's; repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.set = [profile_suite._setting(spec) for spec in args.set]
    except ValueError as e:
        p.error(str(e))
    args.case = args.case or list(DEFAULT_CASES)
    args.form = args.form or list(FORMS)
    if args.reps < 1 or args.calls < 1 or args.top < 1:
        p.error("--reps, --calls and --top must be >= 1")
    return args


def resolve_cases(specs: Sequence[str]) -> list[tuple[str, Any]]:
    """(suite name, Case) of each SUITE:CASE: a bench case of gdn_bwd or kda_bwd."""
    out = []
    for spec in specs:
        suite_name, sep, name = spec.partition(":")
        if not sep or suite_name not in BACKWARDS:
            raise SystemExit(f"case {spec!r}: expected SUITE:CASE with SUITE one of "
                             f"{', '.join(BACKWARDS)}")  # fmt: skip
        out.append((suite_name, profile_suite.find_case(profile_suite.load_suite(suite_name),
                                                        name)))  # fmt: skip
    return out


def batched(inputs: dict, out: tuple, lens: Sequence[int]) -> tuple[dict, tuple]:
    """The suite's (1, T, ...) inputs and output buffers as N = len(lens) sequences (N, T / N,
    ...) without cu_seqlens (views: the same memory); the states as they are. Equal lengths
    only: the batch form of a varlen mix does not exist."""
    if len(set(lens)) != 1:
        raise ValueError(f"the batch form needs equal lengths, got {list(lens)}")
    n = len(lens)

    def seq(x):
        return x.reshape(n, x.shape[1] // n, *x.shape[2:])

    shaped = dict(inputs, cu_seqlens=None, **{key: seq(inputs[key]) for key in TOKENS})
    return shaped, (*(seq(x) for x in out[:5]), *out[5:])


@contextlib.contextmanager
def slot_route() -> Iterator[None]:
    """Eager varlen calls take the route a capture takes (the slot layout, no host read)."""
    varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
    saved = varlen.capturing
    varlen.capturing = lambda t: True
    try:
        yield
    finally:
        varlen.capturing = saved


def form_call(backward: Callable, inputs: dict, out: tuple, lens: Sequence[int], form: str,
              l2norm: bool) -> Callable[[], Any]:  # fmt: skip
    """One call of the op in `form` on the suite's inputs, writing `out` (the bench's call,
    `gdn_bwd.run_backward`)."""
    from forgekernel.bench.suites import gdn_bwd

    op = functools.partial(backward, use_qk_l2norm_in_kernel=l2norm)
    if form == "batch":
        inputs, out = batched(inputs, out, lens)

    def call():
        if form == "slots":
            with slot_route():
                return gdn_bwd.run_backward(op, inputs, out)
        return gdn_bwd.run_backward(op, inputs, out)

    return call


def comparison(eager: dict[str, tuple[float, float]], graph: dict[str, tuple[float, float]],
               top: int) -> list[str]:  # fmt: skip
    """Lines for two `profile_suite.per_call` tables: their totals, then the kernels by |graph
    us - eager us| a call, largest first (`top` of them; a kernel one side lacks counts 0)."""
    none = (0.0, 0.0)
    e_us, e_n = sum(us for _, us in eager.values()), sum(n for n, _ in eager.values())
    g_us, g_n = sum(us for _, us in graph.values()), sum(n for n, _ in graph.values())
    head = f"{'eager us':>10} {'n':>5} {'graph us':>10} {'n':>5} {'delta':>9}"
    lines = [f"  kernels a call: eager {e_n:.0f} launches {e_us:.1f} us, graph {g_n:.0f} "
             f"launches {g_us:.1f} us, graph - eager {g_us - e_us:+.1f} us",
             f"  {head}  kernel"]  # fmt: skip

    def delta(name: str) -> float:
        return graph.get(name, none)[1] - eager.get(name, none)[1]

    for name in sorted(set(eager) | set(graph), key=lambda k: -abs(delta(k)))[:top]:
        (en, eu), (gn, gu) = eager.get(name, none), graph.get(name, none)
        lines.append(f"  {eu:10.1f} {en:5.1f} {gu:10.1f} {gn:5.1f} {gu - eu:+9.1f}  {name[:100]}")
    return lines


def measure(torch, call: Callable[[], Any], args: argparse.Namespace) -> dict[str, Any]:
    """Both methods' median ms, then each timed thing's kernels a call under torch.profiler."""
    from forgekernel.bench.methods import time_method
    from forgekernel.runtime.timing import median

    times = {m: time_method(m, {"fn": call}, [()], warmup=3, reps=args.reps,
                            eager_reps=args.reps)["fn"] for m in ("eager", "graph")}  # fmt: skip
    eager, graph = times["eager"], times["graph"]

    def eager_calls() -> None:
        for _ in range(args.calls):
            eager.rerun()  # the eager calls on the timed set

    rec = {"eager_ms": median(eager), "graph_ms": median(graph), "graph_method": graph.method,
           "graph_note": graph.note, "graph_calls": graph.launches, "profile_error": "",
           "eager_kernels": {}, "graph_kernels": {}}  # fmt: skip
    try:  # the times stand without the tables: a profiler failure costs only these
        kernels_e, _ = profile_suite.profiled_kernels(torch, eager_calls)
        kernels_g, _ = profile_suite.profiled_kernels(torch, graph.rerun)  # the timer's graph
    except Exception as e:
        rec["profile_error"] = f"{type(e).__name__}: {e}"[:300]
        return rec
    rec["eager_kernels"] = profile_suite.per_call(kernels_e, args.calls)
    rec["graph_kernels"] = profile_suite.per_call(kernels_g, graph.launches)
    return rec


def report(label: str, rec: dict[str, Any], top: int) -> list[str]:
    gap = rec["graph_ms"] - rec["eager_ms"]
    how = rec["graph_method"] + (f", {rec['graph_note']}" if rec["graph_note"] else "")
    lines = [f"{label}: graph {rec['graph_ms']:.3f} ms ({how}, {rec['graph_calls']} calls a "
             f"replay), eager {rec['eager_ms']:.3f} ms, graph - eager {gap:+.3f} ms"]  # fmt: skip
    if rec["profile_error"]:
        return [*lines, f"  torch.profiler failed: {rec['profile_error']}"]
    if not rec["graph_kernels"] and rec["graph_method"] == "cuda-graph":
        lines.append("  the profiler saw no kernel in the replay (no graph node trace here)")
    return lines + comparison(rec["eager_kernels"], rec["graph_kernels"], top)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cases = resolve_cases(args.case)
    for suite_name, case in cases:
        print(f"{suite_name}:{case.name} {case.params}", flush=True)
    print(f"forms: {', '.join(args.form)}; l2norm {'on' if args.l2norm else 'off'}", flush=True)
    if args.list:
        return 0
    import torch

    profile_suite.apply_settings(args.set)
    device, results = torch.device("cuda"), {}
    for index, (suite_name, case) in enumerate(cases):
        suite = profile_suite.load_suite(suite_name)
        module, entry = BACKWARDS[suite_name]
        backward = getattr(importlib.import_module(module), entry)
        gen = torch.Generator(device=device).manual_seed(index)
        inputs = suite.make_inputs(case, suite.dtypes_for_bench()[0], device, gen)
        out = tuple(suite.alloc_out(inputs))
        lens = case.params["lens"]
        for form in args.form:
            label = f"{suite_name}:{case.name} {form}"
            if form == "batch" and len(set(lens)) != 1:
                print(f"{label}: skipped (unequal lengths)", flush=True)
                continue
            rec = measure(torch, form_call(backward, inputs, out, lens, form, args.l2norm), args)
            results[label] = rec
            for line in report(label, rec, args.top):
                print(line, flush=True)
        del inputs, out
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
