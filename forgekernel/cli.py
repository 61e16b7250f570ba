"""`forgekernel` command line: check, bench, selftest, build, bundle, readme.

Nothing here imports the DSL at import time: check and bench run on a GPU host that may only
have prebuilt kernels, and build / bundle import the DSL when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NO_GPU_CHECK = "no CUDA device: check needs a GPU"
NO_GPU_BENCH = "no CUDA device: bench needs a GPU to time kernels; building them instead"
NEED_DSL = "building kernels needs the CuTe DSL (pip install nvidia-cutlass-dsl)"
NO_SANITIZER = "check --sanitize needs compute-sanitizer on PATH or in $CUDA_HOME/bin"


class CliError(Exception):
    """A usage problem reported as one line (exit 2), not a traceback."""


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _ledger():
    from forgekernel.bench import ledger

    return ledger


def _arch(explicit: str | None) -> str:
    from forgekernel.runtime.arch import resolve_arch

    try:
        return resolve_arch(explicit)
    except RuntimeError as e:
        raise CliError(str(e)) from e


def _build_arch(explicit: str | None) -> str:
    return _arch(explicit or os.environ.get("CUTE_DSL_ARCH") or "sm_90a")


def _suites(ops: Sequence[str]) -> list:
    from forgekernel.bench.suites import select_suites

    try:
        return select_suites(ops)
    except ValueError as e:
        raise CliError(str(e)) from e


def resource_table(records: Sequence[dict[str, Any]]) -> str:
    """One row per compiled kernel: its resources as the compiler left them."""
    from forgekernel.bench.report import format_table

    def cell(x: Any, fmt: str = "") -> str:
        return "-" if x is None else format(x, fmt)

    headers = ["name", "config", "regs", "smem B", "spill B", "hgmma", "compile s", "path"]
    rows = [
        [
            r.get("name"),
            r.get("config", ""),
            cell(r.get("registers")),
            cell(r.get("smem_bytes")),
            cell(r.get("spill_bytes")),
            cell(r.get("hgmma")),
            cell(r.get("compile_s"), ".1f"),
            r.get("path", ""),
        ]
        for r in records
    ]
    return format_table(headers, rows)


def _build(
    arch: str,
    out_dir: Path | None,
    candidates: bool = False,
    only: list[str] | None = None,
    jobs: int | None = None,
    representatives: bool = False,
    keys: Path | None = None,
) -> int:
    jobs = jobs or os.cpu_count() or 1
    start = time.perf_counter()
    try:
        from forgekernel.runtime.build import build_all
        from forgekernel.runtime.cache import read_keylog

        records = build_all(
            arch,
            out_dir,
            candidates,
            only,
            jobs=jobs,
            representatives=representatives,
            keys=None if keys is None else read_keylog(keys),
        )
    except ImportError as e:
        print(f"{NEED_DSL}: {e}", file=sys.stderr)
        return 1
    print(resource_table(records))
    for r in records:  # `inspect_cubin`: a .dec above the launch's count faults (CUDA error 715)
        for bad in r.get("setmaxnreg_wrong_way") or ():
            print(f"{r['name']} {r['config']}: {bad} against {r['registers']} registers at the "
                  "launch: an illegal instruction on the GPU", file=sys.stderr)  # fmt: skip
    wall = time.perf_counter() - start
    compiled = sum(1 for r in records if r.get("compile_s"))  # the rest were built before
    used = min(jobs, compiled) if compiled > 1 else 1
    print(f"built {len(records)} kernels in {wall:.1f} s with {used} processes")
    return 0


def _sanitize(args: argparse.Namespace) -> int:
    from forgekernel.bench.sanitize import find_sanitizer, run_sanitize

    sanitizer = find_sanitizer()
    if sanitizer is None:
        print(NO_SANITIZER, file=sys.stderr)
        return 2
    suites, arch = _suites(args.ops), _arch(args.arch)
    try:
        ok = run_sanitize(
            suites,
            sanitizer=sanitizer,
            tools=args.tools or ("memcheck", "racecheck"),
            timeout=args.sanitize_timeout,
            log_dir=args.sanitize_log_dir,
            results_dir=args.results_dir,
            arch=arch,
        )
    except ValueError as e:
        raise CliError(str(e)) from e
    return 0 if ok else 1


def _sanitize_child(args: argparse.Namespace) -> int:
    """What compute-sanitizer wraps: our op on one suite's sanitize cases, nothing else."""
    from forgekernel.bench.sanitize import run_child

    suites = _suites(args.ops)
    if len(suites) != 1:
        raise CliError("--sanitize-child takes exactly one operator")
    try:
        return run_child(suites[0], args.case or ())
    except ValueError as e:
        raise CliError(str(e)) from e


def cmd_check(args: argparse.Namespace) -> int:
    if args.sanitize_child:
        return _sanitize_child(args)
    if not _cuda_available():
        print(NO_GPU_CHECK, file=sys.stderr)
        return 2
    if args.sanitize:
        return _sanitize(args)
    from forgekernel.bench.check import run_check

    suites, arch = _suites(args.ops), _arch(args.arch)
    ok = run_check(suites, seed=args.seed, results_dir=args.results_dir, arch=arch)
    return 0 if ok else 1


def cmd_bench(args: argparse.Namespace) -> int:
    if not _cuda_available():
        print(NO_GPU_BENCH, file=sys.stderr)
        _build(_build_arch(args.arch), None)
        return 2
    from forgekernel.bench.harness import BenchTiming, run_bench

    suites, arch = _suites(args.ops), _arch(args.arch)
    report_dir = args.report_dir or _ledger().repo_root() / "benchmarks" / "reports" / arch
    timing = BenchTiming(
        methods=args.timing,
        warmup=args.warmup,
        reps=args.reps,
        eager_reps=args.eager_reps,
        host_calls=args.host_calls,
    )
    names = tuple(n for n in (args.variants or "").split(",") if n)
    run_bench(suites, results_dir=args.results_dir, report_dir=report_dir, arch=arch, timing=timing,
              variant_cases=args.variant_cases or bool(names), variant_names=names,
              resume=args.resume)  # fmt: skip
    return 0


TIMING_METHODS = ("graph", "eager")  # forgekernel.bench.harness.TIMING_METHODS, without torch


def timing_methods(text: str) -> tuple[str, ...]:
    """`--timing graph,eager`: the methods, in the order given, each once."""
    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in TIMING_METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(TIMING_METHODS)}, got {text!r}"
        )
    return methods


def cmd_selftest(args: argparse.Namespace) -> int:
    if not _cuda_available():
        print("no CUDA device: selftest needs a GPU", file=sys.stderr)
        return 2
    from forgekernel.bench.selftest import run_selftest

    return 0 if run_selftest() else 1


def cmd_build(args: argparse.Namespace) -> int:
    arch = _build_arch(args.arch)
    out = args.out
    if args.package:
        if out is not None:
            raise CliError("--package and --out are exclusive")
        from forgekernel.runtime.cache import package_prebuilt_dir

        out = package_prebuilt_dir(arch)
    return _build(arch, out, args.candidates, args.only, args.jobs, args.representatives, args.keys)


def cmd_bundle(args: argparse.Namespace) -> int:
    try:
        from forgekernel.runtime.bundle import make_bundle

        path = make_bundle(Path(args.dir), _build_arch(args.arch), args.candidates, args.jobs)
    except ImportError as e:
        print(f"{NEED_DSL}: {e}", file=sys.stderr)
        return 1
    print(f"bundle: {path}")
    return 0


def cmd_readme(args: argparse.Namespace) -> int:
    ledger = _ledger()
    readme = args.readme or ledger.repo_root() / "README.md"
    try:
        changed = ledger.update_readme(readme, args.results_dir)
    except (OSError, ValueError) as e:
        print(f"readme: {e}", file=sys.stderr)
        return 1
    print(f"{readme}: {'updated' if changed else 'already up to date'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forgekernel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.set_defaults(fn=fn)
        return p

    results = {
        "type": Path,
        "default": None,
        "help": "ledger root (default: $FORGEKERNEL_RESULTS_DIR or benchmarks/results)",
    }
    arch = {"default": None, "help": "target arch, e.g. sm_90a (default: the device's)"}
    ops = {"nargs": "*", "metavar": "op", "help": "operators (default: all)"}
    jobs = {"type": int, "default": None, "metavar": "N", "help": "processes (default: all cores)"}

    p = add("check", cmd_check, "correctness of every check case against the reference")
    p.add_argument("ops", **ops)
    p.add_argument("--results-dir", **results)
    p.add_argument("--arch", **arch)
    p.add_argument("--seed", type=int, default=None, help="input seed (default: from the clock)")
    p.add_argument(
        "--sanitize",
        action="store_true",
        help="instead: compute-sanitizer memcheck and racecheck on each operator's sanitize cases",
    )
    p.add_argument(
        "--tool",
        dest="tools",
        action="append",
        default=None,
        metavar="TOOL",
        help="with --sanitize: memcheck or racecheck, repeatable (default: both)",
    )
    p.add_argument(
        "--sanitize-timeout", type=float, default=600.0, metavar="S", help="seconds per tool run"
    )
    p.add_argument(
        "--sanitize-log-dir", type=Path, default=None, metavar="DIR", help="keep each run's output"
    )
    p.add_argument("--sanitize-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", action="append", default=None, help=argparse.SUPPRESS)

    p = add("bench", cmd_bench, "time ours against the comparators, interleaved")
    p.add_argument("ops", **ops)
    p.add_argument(
        "--report-dir", type=Path, default=None, help="default: benchmarks/reports/<arch>/"
    )
    p.add_argument("--results-dir", **results)
    p.add_argument("--arch", **arch)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--timing",
        type=timing_methods,
        default=TIMING_METHODS,
        metavar="graph,eager",
        help="timing methods (default: both): graph = CUDA-graph replays, inputs rotated past "
        "L2; eager = eager launches, L2 flushed before each, each launch timed alone",
    )
    p.add_argument("--reps", type=int, default=30, help="graph: timed samples per candidate")
    p.add_argument(
        "--variant-cases",
        action="store_true",
        help="only the cases that carry variants of ours (candidates), beside ours and the "
        "comparators: a partial suite, so no ledger section; reports as <op>-variants.*",
    )
    p.add_argument(
        "--variants",
        default=None,
        metavar="NAME,...",
        help="--variant-cases with only these variants of ours (the cases carrying one of them)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on from the cases of the ledger's partial bench section (a bench cut by its "
        "time limit) written on the same kernel sources, GPU, options and comparators; without "
        "one: from the first case",
    )
    p.add_argument(
        "--eager-reps",
        type=int,
        default=100,
        metavar="N",
        help="eager: launches per candidate, median taken (fewer, not below 20, on slow cases)",
    )
    p.add_argument(
        "--host-calls",
        type=int,
        default=200,
        metavar="N",
        help="host us per eager call: back-to-back calls per round on the suite's tiny host "
        "case (0: skip)",
    )

    add("selftest", cmd_selftest, "launch semantics the timing relies on (stream, graph)")

    p = add("build", cmd_build, "compile every standard kernel ahead of time (no GPU needed)")
    p.add_argument("--arch", default=None, help="default: $CUTE_DSL_ARCH or sm_90a")
    p.add_argument("--out", type=Path, default=None, help="default: the user kernel cache")
    p.add_argument("--candidates", action="store_true", help="also the tuning candidates")
    p.add_argument("--package", action="store_true", help="into the package (ship them in a wheel)")
    p.add_argument(
        "--only", action="append", default=None, metavar="KERNEL", help="only these kernels"
    )
    p.add_argument("-j", "--jobs", **jobs)
    p.add_argument(
        "--representatives",
        action="store_true",
        help="one configuration per kernel (what the tests build to prove each leaf)",
    )
    p.add_argument(
        "--keys",
        type=Path,
        default=None,
        metavar="FILE",
        help="only the configurations a key log names ($FORGEKERNEL_KEYLOG's lines: what "
        "earlier runs loaded), of those the other options choose",
    )

    p = add("bundle", cmd_bundle, "prebuilt kernels for a GPU host without the DSL")
    p.add_argument("dir", type=Path)
    p.add_argument("-j", "--jobs", **jobs)
    p.add_argument("--candidates", action="store_true", help="also the tuning candidates")
    p.add_argument("--arch", default=None, help="default: $CUTE_DSL_ARCH or sm_90a")

    p = add("readme", cmd_readme, "rewrite the README results block from the ledgers")
    p.add_argument("--results-dir", **results)
    p.add_argument("--readme", type=Path, default=None, help="default: <repo>/README.md")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except CliError as e:
        print(f"forgekernel {args.command}: {e}", file=sys.stderr)
        return 2
