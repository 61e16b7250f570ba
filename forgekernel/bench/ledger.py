"""The results ledger: `<results_dir>/<arch>/<op>.json`, the GPU evidence behind every kernel.

One file per operator and arch with three sections, "check", "bench" and "sanitize" (the
compute-sanitizer counts, `forgekernel.bench.sanitize`), each stamped with the source hash of the
kernel it measured and the machine it ran on. Writing one section keeps the others only while
their source hash is still current. The README results block is built from these files and
nothing else.

The bench section (`forgekernel.bench.harness.bench_section`): "cases" (the records,
`forgekernel.bench.report`), "timing" (the methods timed: "graph", "eager"), "methods" ({method:
{median_ratio, min_ratio, group_median_ratio: {comparator: {group: ratio}}, variant_ratio}}),
"host" (host microseconds per eager call: case, dtype, calls, rounds, status, us_per_call,
rounds_us, missing), "comparator_versions" (`comparator_versions`: the comparators installed),
for memory-bound suites "device_copy" (`harness.device_copy`: the copy's GB/s per method) and
per method "copy_fraction" ({name: {median, min, cases}}: GB/s / the copy's; sections written
before it hold neither), and, from the graph method, "median_ratio", "min_ratio" and
"variant_ratio" at the top level, where the README table reads them (sections written before
the eager method hold only these).

"bench_partial" (`PARTIAL`): while a bench runs, the cases it finished so far, rewritten after
each case ({cases, options, comparator_versions} beside the source hash and the machine), so that
a bench killed by its time limit leaves them on disk; `bench --resume` goes on from it when the
source hash, the GPU, the options and the comparators are the same (`partial_cases`). Writing the
bench section drops it; nothing else reads it (no README figure, no gate).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.report import copy_gbps
from forgekernel.bench.suite import OpSuite
from forgekernel.runtime.hashing import PACKAGE_ROOT, source_hash

RESULTS_ENV = "FORGEKERNEL_RESULTS_DIR"
KERNEL_DIR_ENV = "FORGEKERNEL_KERNEL_DIR"
SECTIONS = ("check", "bench", "sanitize", "bench_partial")
PARTIAL = "bench_partial"  # a bench suite's cases so far (the module's docstring)
README_BEGIN = "<!-- results:begin -->"
README_END = "<!-- results:end -->"


def repo_root() -> Path:
    """The checkout holding the package, else (an installed package) the working directory."""
    root = PACKAGE_ROOT.parent
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def default_results_dir() -> Path:
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else repo_root() / "benchmarks" / "results"


def ledger_path(results_dir: Path, arch: str, op: str) -> Path:
    return Path(results_dir) / arch / f"{op}.json"


def dsl_version() -> str:
    """Installed nvidia-cutlass-dsl, else the prebuilt bundle's manifest, else "unknown"."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        pass
    kernel_dir = os.environ.get(KERNEL_DIR_ENV)
    if kernel_dir:
        try:
            manifest = json.loads((Path(kernel_dir) / "manifest.json").read_text())
            return f"{manifest['dsl_version']} (bundle)"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return "unknown"


# The comparators' distributions at the versions the bench sections ran with (the pyproject's
# `bench` extra pins the same, less sgl-flash-mla: its 1.0.0 declares torch >= 2.14.1 and ran on
# 2.11, so it goes in with --no-deps; README "Comparators"). cuBLAS, cuBLASLt and cuDNN come
# with torch. Each bench section records what was installed (`comparator_versions`).
COMPARATOR_PINS = {
    "flash-attn-4": "4.0.0b36",
    "quack-kernels": "0.6.5",
    "flash-linear-attention": "0.6.0",
    "fla-core": "0.6.0",
    "sgl-deep-gemm": "0.1.4.post1",
    "flashinfer-python": "0.7.2.post1",
    "nvidia-cudnn-frontend": "1.32.0",
    "sgl-flash-mla": "1.0.0",
}


def comparator_versions() -> dict[str, str]:
    """The installed comparator distributions (COMPARATOR_PINS' names and triton) with their
    versions, and torch's cuDNN; a comparator not installed is absent (its cases say missing)."""
    from forgekernel.bench.sidecar import installed_versions

    found = installed_versions((*COMPARATOR_PINS, "triton"))
    if torch.backends.cudnn.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    return found


def driver_version() -> str:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if torch.cuda.is_available() and get is not None:
        return f"cuda driver api {get()}"
    return "unknown"


def environment() -> dict[str, str]:
    """Where and with what a result was produced."""
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "driver": driver_version() if cuda else "none",
        "cuda": torch.version.cuda or "none",
        "torch": torch.__version__,
        "dsl_version": dsl_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_section(
    suite: OpSuite,
    section: str,
    data: dict[str, Any],
    *,
    arch: str,
    results_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Path:
    """Record one section for `suite`, keeping the others unless their source is stale."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
    path = ledger_path(results_dir or default_results_dir(), arch, suite.name)
    current = source_hash(suite.kernel_sources)
    env = env or environment()
    doc: dict[str, Any] = {"op": suite.name, "arch": arch, "source_hash": current, **env}
    skip = {section, PARTIAL} if section == "bench" else {section}  # the whole suite's: done
    doc |= _sections_on(load(path) or {}, current, skip=skip)
    doc[section] = {"source_hash": current, **env, **data}
    return _write(path, doc)


def partial_cases(
    suite: OpSuite, match: dict[str, Any], *, arch: str, results_dir: Path | None = None
) -> tuple[list[dict[str, Any]], str]:
    """The case records of `suite`'s partial bench section when it was written on the current
    kernel sources and every field of `match` (gpu, options, comparator_versions) is the same;
    else no records and why not."""
    path = ledger_path(results_dir or default_results_dir(), arch, suite.name)
    part = (load(path) or {}).get(PARTIAL)
    if not isinstance(part, dict):
        return [], f"no {PARTIAL} section in {path}"
    current = source_hash(suite.kernel_sources)
    for key, want in {"source_hash": current, **match}.items():
        if part.get(key) != want:
            return [], f"its {key} {part.get(key)!r} is not this run's {want!r}"
    return list(part.get("cases") or []), ""


def _sections_on(doc: dict[str, Any], source: Any, skip=()) -> dict[str, Any]:
    """The sections of `doc` written on `source` (a source hash), in SECTIONS order, but `skip`:
    what a ledger keeps when another section is written on that source."""
    return {
        s: doc[s]
        for s in SECTIONS
        if s not in skip and isinstance(doc.get(s), dict) and doc[s].get("source_hash") == source
    }


def _write(path: Path, doc: dict[str, Any]) -> Path:
    """Write a ledger atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def take(src: Path, dst: Path) -> Path:
    """Copy the ledger `src` (written on a GPU host) to `dst`, keeping the sections of the ledger
    already at `dst` that `src` lacks and that were written on `src`'s source hash: a later call
    on a fresh host starts from the committed ledgers and drops what an earlier call of the same
    session wrote on newer sources (write_section's rule, applied across the two files). A partial
    bench section at `dst` is kept that way too, unless `src` holds a bench section no older than
    it (a later call completed the suite)."""
    doc = load(src)
    if doc is None:
        raise ValueError(f"{src}: not a ledger")
    kept = _sections_on(load(dst) or {}, doc.get("source_hash"), skip=doc.keys())
    done = doc.get("bench")
    if PARTIAL in kept and isinstance(done, dict):
        if str(done.get("date", "")) >= str(kept[PARTIAL].get("date", "")):
            del kept[PARTIAL]
    merged = {k: v for k, v in doc.items() if k not in SECTIONS}
    merged |= {s: doc[s] if s in doc else kept[s] for s in SECTIONS if s in doc or s in kept}
    return _write(dst, merged)


def ledger_status(
    suite: OpSuite, results_dir: Path | None = None, arch: str | None = None
) -> tuple[bool, str]:
    """ok only when a ledger's check section passed on the current kernel sources."""
    if not suite.kernel_sources:
        return False, f"{suite.name}: the suite lists no kernel sources"
    results_dir = Path(results_dir or default_results_dir())
    current = source_hash(suite.kernel_sources)
    if arch:
        paths = [ledger_path(results_dir, arch, suite.name)]
    else:
        paths = sorted(results_dir.glob(f"*/{suite.name}.json"))
    paths = [p for p in paths if p.exists()]
    if not paths:
        return False, (
            f"{suite.name}: no ledger under {results_dir}; "
            f"run `forgekernel check {suite.name}` on a GPU"
        )
    reasons = []
    for p in paths:
        check = (load(p) or {}).get("check")
        if not isinstance(check, dict):
            reasons.append(f"{p}: no check section")
        elif check.get("source_hash") != current:
            reasons.append(f"{p}: checked source {check.get('source_hash')}, current {current}")
        elif check.get("passed") is not True:
            reasons.append(f"{p}: check failed on source {current}")
        else:
            return True, f"{p}: check passed on {check.get('gpu')} {check.get('date')}"
    return False, "; ".join(reasons)


def _fmt_ratio(x: Any) -> str:
    """The seed's form: +1.7% (1.017x); > 0 means ours is faster."""
    return f"{(x - 1) * 100:+.1f}% ({x:.3f}x)" if isinstance(x, (int, float)) else "-"


def _kernel_dir(op: str) -> str:
    """The kernel leaf measured, from the operator's suite (the ledger predates the field): the
    folder holding most of its sources, the shared toolkit (kernels/common) left out."""
    from forgekernel.bench.suites import PENDING_SUITE_MODULES, get_suite

    try:
        suite = get_suite(op)
        if suite.leaf:
            return "forgekernel/" + suite.leaf
        dirs = [p.parent.relative_to(PACKAGE_ROOT) for p in suite.kernel_sources]
        own = [d for d in dirs if "common" not in d.parts] or dirs
        return "forgekernel/" + max(sorted(set(own)), key=own.count).as_posix()
    except ValueError:
        # a pending suite's ledger is an earlier path's: its new kernel has no GPU record yet
        return "pending (docs/PENDING.md)" if op in PENDING_SUITE_MODULES else "?"


def _ledger_rows(doc: dict[str, Any]) -> list[list[str]]:
    check, bench = doc.get("check") or {}, doc.get("bench") or {}
    verdict = {True: "passed", False: "FAILED"}.get(check.get("passed"), "none")
    medians, mins = bench.get("median_ratio") or {}, bench.get("min_ratio") or {}
    gpu = bench.get("gpu") or check.get("gpu") or doc.get("gpu", "?")
    date = (bench.get("date") or check.get("date") or doc.get("date", "?"))[:10]
    head = [str(doc.get("op", "?")), str(gpu)]
    tail = [verdict, date, str(doc.get("source_hash", "?")), _kernel_dir(str(doc.get("op")))]
    if not medians:
        return [head + ["-", "-", "-"] + tail]
    return [head + [c, _fmt_ratio(m), _fmt_ratio(mins.get(c))] + tail for c, m in medians.items()]


def readme_table(results_dir: Path | None = None) -> str:
    """Markdown table of every ledger under `results_dir` (the only source of README figures)."""
    results_dir = Path(results_dir or default_results_dir())
    rows = []
    for path in sorted(results_dir.glob("*/*.json")):
        doc = load(path)
        if doc and "op" in doc:
            rows += _ledger_rows(doc)
    if not rows:
        return "_No GPU results recorded yet._\n"
    headers = [
        "Operator",
        "GPU",
        "Compared against",
        "Speedup (suite median)",
        "Slowest case",
        "Check",
        "Date",
        "Source hash",
        "Directory",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("")
    lines.append(
        "Speedup = comparator time / our time - 1, same GPU, same process, same inputs"
        " (> 0: ours faster); each figure comes from `benchmarks/results/<arch>/<op>.json`."
    )
    docs = [d for d in map(load, sorted(results_dir.glob("*/*.json"))) if d and "op" in d]
    extra = _eager_host_lines(docs) + _variant_lines(docs) + _sanitize_lines(docs)
    return "\n".join(lines + extra) + "\n"


def _eager_figures(eager: dict[str, Any]) -> str:
    medians, mins = eager.get("median_ratio") or {}, eager.get("min_ratio") or {}
    figs = [
        f"{c} {_fmt_ratio(m)}, slowest {_fmt_ratio(mins.get(c))}"
        for c, m in medians.items()
        if m is not None
    ]
    return "eager, L2 flushed: " + "; ".join(figs) if figs else ""


def _host_figures(host: dict[str, Any]) -> str:
    where = f"host per eager call ({host.get('case', '?')} {host.get('dtype', '?')})"
    if host.get("status") != "ok":
        return f"{where}: {host.get('status', '?')}"
    us = ", ".join(f"{name} {x:.1f} us" for name, x in (host.get("us_per_call") or {}).items())
    return f"{where}: {us}"


def _copy_figures(bench: dict[str, Any]) -> str:
    """'ours 81.2% (graph), 78.0% (eager) of a device copy (median)' from a memory-bound
    suite's bench section; "" where no copy was timed."""
    figs = []
    for method, summary in (bench.get("methods") or {}).items():
        median = ((summary.get("copy_fraction") or {}).get("ours") or {}).get("median")
        copy = bench.get("device_copy")
        if copy is not None and not copy_gbps(copy, method):
            continue  # a figure against a copy that does not count (copy_gbps)
        if isinstance(median, (int, float)):
            figs.append(f"{100 * median:.1f}% ({method})")
    return f"ours {', '.join(figs)} of a device copy (median)" if figs else ""


def _eager_host_lines(docs: list[dict[str, Any]]) -> list[str]:
    """One line per operator: the eager method's suite medians, the host time per call and, for
    memory-bound operators, ours as a % of a device copy."""
    lines, copies = [], False
    for doc in docs:
        bench = doc.get("bench") or {}
        eager = (bench.get("methods") or {}).get("eager")
        host = bench.get("host")
        copy = _copy_figures(bench)
        copies |= bool(copy)
        parts = [_eager_figures(eager) if eager else "", _host_figures(host) if host else "", copy]
        if any(parts):
            lines.append(f"- {doc['op']}: " + "; ".join(p for p in parts if p))
    if not lines:
        return []
    head = (
        "Second timing method and host time (`forgekernel bench`): eager launches with L2 flushed"
        " before each, comparator time / our time, suite median and slowest case; host"
        " microseconds per eager call on a tiny case, ours and each comparator"
    )
    if copies:
        head += (
            "; memory-bound operators: our GB/s as a % of a device copy's (an elementwise copy"
            " kernel, read + write bytes, same timing method), suite median"
        )
    return ["", head + ":", "", *lines]


def _variant_lines(docs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for doc in docs:
        for name, cases in ((doc.get("bench") or {}).get("variant_ratio") or {}).items():
            figs = ", ".join(f"{r:.3f}x ({c})" for c, r in cases.items())
            lines.append(f"- {doc['op']}, {name}: {figs}")
    if not lines:
        return []
    head = "Variants of ours (`forgekernel bench`: variant time / default time, same run):"
    return ["", head, "", *lines]


def sanitize_summary(entry: dict[str, Any]) -> str:
    """'memcheck 0 errors, racecheck 0 hazards' from a ledger's sanitize section."""
    parts = []
    for tool, t in (entry.get("tools") or {}).items():
        text = f"{tool} {t.get('count', '?')} {t.get('unit', 'findings')}"
        if t.get("status") != "ok":
            text += f" ({t.get('status')})"
        elif t.get("explained"):
            text += " (explained in the ledger)"
        parts.append(text)
    return ", ".join(parts) or "no tools run"


def _sanitize_lines(docs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for doc in docs:
        entry = doc.get("sanitize")
        if isinstance(entry, dict):
            verdict = "clean" if entry.get("passed") else "NOT CLEAN"
            date = str(entry.get("date", "?"))[:10]
            lines.append(f"- {doc['op']}: {verdict}: {sanitize_summary(entry)} ({date})")
    if not lines:
        return []
    head = "Sanitizers (`forgekernel check --sanitize`, compute-sanitizer on small odd cases):"
    return ["", head, "", *lines]


def update_readme(readme: Path, results_dir: Path | None = None) -> bool:
    """Rewrite the block between the results markers; True when the file changed."""
    text = Path(readme).read_text()
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {README_BEGIN} ... {README_END} block")
    block = f"{README_BEGIN}\n{readme_table(results_dir)}{README_END}"
    new = pattern.sub(lambda _: block, text, count=1)
    if new != text:
        Path(readme).write_text(new)
    return new != text
