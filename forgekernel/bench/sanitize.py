"""`forgekernel check --sanitize`: compute-sanitizer over each suite's small odd-sized cases.

For each operator and tool (memcheck: out-of-bounds and misaligned accesses; racecheck:
shared-memory hazards, one report per hazard), the parent runs compute-sanitizer around a child
`python -m forgekernel check --sanitize-child OP` that runs the suite's `sanitize_cases` through
our op and nothing else: inputs (and the backward's O and LSE) are made on the CPU and copied
over, so no reference or comparator kernel runs under the tool. The counts come from the tool's
summary line. A run that is not clean is repeated case by case to attribute the findings. The
result is the ledger's "sanitize" section (`benchmarks/results/<arch>/<op>.json`):

    sanitize: {source_hash, gpu, driver, cuda, torch, dsl_version, date,
               sanitizer, sanitizer_version, dtype, passed,
               tools: {memcheck | racecheck: {
                   args, status ("ok", "timeout after N s", "incomplete: ..."),
                   count, unit (errors | hazards), summary (the tool's summary lines),
                   [errors, warnings, kinds {RAW, WAR, WAW} (racecheck)], first (the first
                   report's lines), explained, passed, seconds,
                   cases: {case: {count, [summary, first, status, explanation,
                                  explained_count, explained]}}}}}

A tool passes when its run completed and every case counts 0, or exactly the count that an
`Explained` entry of the suite (a hazard shown to be a tool artifact) gives with its reason.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench import ledger
from forgekernel.bench.check import sync
from forgekernel.bench.report import dtype_name, format_table
from forgekernel.bench.suite import Case, OpSuite
from forgekernel.runtime.arch import resolve_arch

TOOLS: dict[str, tuple[str, ...]] = {
    "memcheck": ("--tool", "memcheck"),
    "racecheck": ("--tool", "racecheck", "--racecheck-report", "hazard"),
}
UNITS = {"memcheck": "errors", "racecheck": "hazards"}
EXTRA_ARGS_ENV = "FORGEKERNEL_SANITIZER_ARGS"  # appended to every sanitizer command line
CASE_MARK = "forgekernel-sanitize: case "
DONE_MARK = "forgekernel-sanitize: done "
FIRST_LINES = 12  # of the first report, kept in the ledger beside a nonzero count

# "ERROR SUMMARY: N errors" counts every error; a second "... errors were not printed" line
# (past --print-limit) must not be taken for it.
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?\s*$", re.M)
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+)")
_HAZARD_KIND = re.compile(r"Potential (RAW|WAR|WAW) hazard")
_LOCATION_HAZARDS = re.compile(r"\[(\d+) hazards?\]")  # --racecheck-report analysis / all
_REPORT_HEAD = re.compile(
    r"^========= (?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target )\S"
)


def find_sanitizer() -> Path | None:
    """compute-sanitizer on PATH, else under $CUDA_HOME/bin (or /usr/local/cuda/bin)."""
    found = shutil.which("compute-sanitizer")
    if found:
        return Path(found)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        path = Path(root or "/nonexistent") / "bin" / "compute-sanitizer"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def sanitizer_version(path: Path) -> str:
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("Version")), lines[-1] if lines else "?")


# ---- the child: our op on the sanitize cases, nothing else ----------------------------------


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def sanitize_dtype(suite: OpSuite) -> torch.dtype:
    return suite.dtypes_for_bench()[0]


def select_cases(suite: OpSuite, names: Sequence[str] = ()) -> list[Case]:
    """The suite's sanitize cases, or the named ones of them; unknown names raise ValueError."""
    by_name = {c.name: c for c in suite.sanitize_cases}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"{suite.name}: no sanitize case named {', '.join(unknown)}")
    return [by_name[n] for n in names] if names else list(suite.sanitize_cases)


def run_child(suite: OpSuite, names: Sequence[str] = (), device: str = "cuda") -> int:
    """Run our op once per case, each between markers the parent can find in the output."""
    dev, cpu = torch.device(device), torch.device("cpu")
    cases = select_cases(suite, names)
    for case in cases:
        print(CASE_MARK + case.name, flush=True)
        gen = torch.Generator().manual_seed(0)
        inputs = to_device(suite.make_inputs(case, sanitize_dtype(suite), cpu, gen), dev)
        suite.run_ours(inputs, suite.alloc_out(inputs))
        sync(dev)
    print(f"{DONE_MARK}{len(cases)} cases", flush=True)
    return 0


# ---- reading the tool's output ---------------------------------------------------------------


def first_report(text: str) -> list[str]:
    """The first finding's lines (its header and indented continuation), at most FIRST_LINES."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _REPORT_HEAD.match(line):
            block = [line]
            for more in lines[i + 1 : i + FIRST_LINES]:
                if not more.startswith("=========  "):
                    break
                block.append(more)
            return [b.removeprefix("=========").strip() for b in block]
    return []


def parse_counts(tool: str, text: str) -> dict[str, Any]:
    """{count (None: no summary line), unit, ...} from one sanitizer run's output."""
    counts: dict[str, Any] = {"count": None, "unit": UNITS.get(tool, "findings")}
    summary = [line.removeprefix("=========").strip() for line in text.splitlines()]
    counts["summary"] = [line for line in summary if "SUMMARY" in line]
    if tool == "racecheck":
        found = _RACE_SUMMARY.findall(text)
        if found:
            # the count is every hazard (errors and warnings); "displayed" stops at the print
            # limit (100 by default)
            displayed, errors, warnings = map(int, found[-1])
            counts.update(count=errors + warnings, errors=errors, warnings=warnings)
            counts["displayed"] = displayed
            kinds: dict[str, int] = {}
            for kind in _HAZARD_KIND.findall(text):
                kinds[kind] = kinds.get(kind, 0) + 1
            counts["kinds"] = kinds
            located = [int(n) for n in _LOCATION_HAZARDS.findall(text)]
            if located:
                counts["location_hazards"] = sum(located)
    else:
        found = _ERROR_SUMMARY.findall(text)
        if found:
            counts["count"] = int(found[0])
    if counts["count"]:
        counts["first"] = first_report(text)
    return counts


def run_status(text: str, returncode: int | None, n_cases: int, count: int | None) -> str:
    """`ok` when the child ran every case and exited 0 and the tool printed its summary."""
    if returncode is None:
        return "timeout"
    if f"{DONE_MARK}{n_cases} cases" not in text:
        return f"incomplete: the child stopped before its last case (exit code {returncode})"
    if returncode != 0:
        return f"incomplete: exit code {returncode}"
    if count is None:
        return "incomplete: no summary line from the sanitizer"
    return "ok"


# ---- the parent --------------------------------------------------------------------------------


def sanitizer_command(sanitizer: Path, tool: str, op: str, names: Sequence[str] = ()) -> list[str]:
    extra = shlex.split(os.environ.get(EXTRA_ARGS_ENV, ""))
    child = [sys.executable, "-m", "forgekernel", "check", "--sanitize-child", op]
    for name in names:
        child += ["--case", name]
    return [str(sanitizer), *TOOLS[tool], *extra, *child]


def run_command(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit code, None on timeout; stdout and stderr together). On timeout the whole process
    group goes: the sanitizer and the child it started."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def _explanations(suite: OpSuite, tool: str, cases: Sequence[str]) -> dict[str, Any]:
    """case -> its Explained entry (one for "*" covers every case without its own)."""
    notes = [e for e in suite.sanitize_explained if e.tool == tool]
    everywhere = next((e for e in notes if e.case == "*"), None)
    own = {e.case: e for e in notes if e.case != "*"}
    return {name: own.get(name, everywhere) for name in cases}


def _kinds_covered(counts: dict[str, Any], note: Any) -> bool:
    """Every hazard kind the tool reported is one the explanation covers."""
    if note.kinds is None:
        return True
    return all(kind in note.kinds for kind, n in counts.get("kinds", {}).items() if n)


def _case_entry(counts: dict[str, Any], status: str, note: Any) -> dict[str, Any]:
    entry = {k: v for k, v in counts.items() if k != "unit"}
    if status != "ok":
        entry["status"] = status
    if note is not None:
        entry["explanation"] = note.why
        entry["explained_count"] = note.count
        entry["explained"] = (
            status == "ok"
            and note.count in (None, counts["count"])
            and _kinds_covered(counts, note)
        )
    return entry


def _case_passed(entry: dict[str, Any]) -> bool:
    return "status" not in entry and (entry["count"] == 0 or entry.get("explained", False))


class ToolRunner:
    """Runs one tool over one suite's cases and keeps the logs."""

    def __init__(self, sanitizer: Path, timeout: float, log_dir: Path | None):
        self.sanitizer, self.timeout, self.log_dir = sanitizer, timeout, log_dir

    def run(self, tool: str, op: str, names: Sequence[str], n_cases: int, tag: str):
        t0 = time.perf_counter()
        cmd = sanitizer_command(self.sanitizer, tool, op, names)
        returncode, text = run_command(cmd, self.timeout)
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = re.sub(r"[^A-Za-z0-9._-]", "_", f"{op}-{tool}{tag}") + ".log"
            (self.log_dir / log).write_text(" ".join(cmd) + "\n" + text)
        counts = parse_counts(tool, text)
        status = run_status(text, returncode, n_cases, counts["count"])
        if status == "timeout":
            status = f"timeout after {self.timeout:g} s"
        return counts, status, time.perf_counter() - t0


def sanitize_tool(runner: ToolRunner, suite: OpSuite, tool: str) -> dict[str, Any]:
    """One tool over the suite's cases: one run, then one run per case if it was not clean."""
    cases = [c.name for c in suite.sanitize_cases]
    counts, status, seconds = runner.run(tool, suite.name, (), len(cases), "")
    print(f"  {tool}: {counts['count']} {counts['unit']}, {status} ({seconds:.0f} s)", flush=True)
    notes = _explanations(suite, tool, cases)
    result: dict[str, Any] = {"args": list(TOOLS[tool]), "status": status, **counts}
    if status == "ok" and counts["count"] == 0:
        result["cases"] = {name: _case_entry({"count": 0}, "ok", notes.get(name)) for name in cases}
    else:
        result["cases"] = {}
        for name in cases:
            one, one_status, s = runner.run(tool, suite.name, [name], 1, "-" + name)
            seconds += s
            print(f"    {name}: {one['count']} {one['unit']}, {one_status}", flush=True)
            result["cases"][name] = _case_entry(one, one_status, notes.get(name))
    result["seconds"] = round(seconds, 1)
    result["passed"] = status == "ok" and all(map(_case_passed, result["cases"].values()))
    result["explained"] = result["passed"] and bool(counts["count"])
    return result


def sanitize_suite(runner: ToolRunner, suite: OpSuite, tools: Sequence[str]) -> dict[str, Any]:
    """The ledger's sanitize section for one suite (without the environment stamp)."""
    data: dict[str, Any] = {
        "sanitizer": str(runner.sanitizer),
        "sanitizer_version": sanitizer_version(runner.sanitizer),
        "dtype": dtype_name(sanitize_dtype(suite)),
        "tools": {},
    }
    if not suite.sanitize_cases:
        data.update(passed=False, message=f"{suite.name} lists no sanitize_cases")
        return data
    for tool in tools:
        data["tools"][tool] = sanitize_tool(runner, suite, tool)
    data["passed"] = all(t["passed"] for t in data["tools"].values())
    return data


def _table(data: dict[str, Any]) -> str:
    rows = []
    for tool, t in data["tools"].items():
        for case, entry in t["cases"].items():
            verdict = "ok" if _case_passed(entry) else entry.get("status", "FINDINGS")
            count = f"{entry['count']} {t['unit']}"
            rows.append([tool, case, count, verdict, entry.get("explanation", "")[:60]])
    return format_table(["tool", "case", "count", "result", "note"], rows)


def run_sanitize(
    suites: Iterable[OpSuite],
    *,
    sanitizer: Path,
    tools: Sequence[str] = tuple(TOOLS),
    timeout: float = 600.0,
    log_dir: Path | None = None,
    results_dir: Path | None = None,
    arch: str | None = None,
) -> bool:
    """Sanitize every suite, print a table per suite, record its ledger; True when all pass."""
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        raise ValueError(f"unknown sanitizer tool {', '.join(unknown)}; known: {', '.join(TOOLS)}")
    arch = arch or resolve_arch()
    runner = ToolRunner(sanitizer, timeout, log_dir)
    all_ok = True
    for suite in suites:
        print(f"{suite.name}: {len(suite.sanitize_cases)} cases under {sanitizer}", flush=True)
        data = sanitize_suite(runner, suite, tools)
        all_ok &= data["passed"]
        print(f"\n{suite.name}: {'clean' if data['passed'] else 'NOT CLEAN'}")
        print(data.get("message") or _table(data))
        path = ledger.write_section(suite, "sanitize", data, arch=arch, results_dir=results_dir)
        print(f"ledger: {path}\n")
    return all_ok
