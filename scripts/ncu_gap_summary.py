"""Summarise one ncu report of a gap target (scripts/device_profile_gaps.sh): per case, ours and
the comparator side by side, one column per kernel, one row per metric (duration, SOL, DRAM /
L2 / L1 traffic and hit rates, issue and tensor-pipe activity, occupancy and launch shape, the
largest warp-stall reasons), then the details page filtered to the same subjects (ncu's own
OPT / WRN rule texts kept: they often name the cause).

    python3 scripts/ncu_gap_summary.py --raw P-raw.csv --details P.txt --plan P-plan.json

--raw: `ncu --import P.ncu-rep --page raw --csv --print-units base`; --details: `--page details
--print-units base`; --plan: the target's --plan (scripts/profile_suite.py). Kernels go to
segments (case, side) in launch order: each marker kernel (`spin_kernel`) opens the next
segment and is not shown. Without markers (a torch without torch.cuda._sleep) a kernel is ours
when its name holds "forgekernel". Metrics are matched by name patterns, so a metric this ncu
version does not collect is left out rather than failing the summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

NAME = "Kernel Name"
MARKER = "spin_kernel"  # scripts/profile_suite.py's marker, dropped even without a plan
# (label, pattern on the raw page's metric names): the first column matching is shown.
METRICS = (
    ("duration", r"gpu__time_duration\.sum"),
    ("SM clock", r"(smsp|sm|gpc)__cycles_elapsed\.avg\.per_second"),
    ("grid", r"launch__grid_size"),
    ("block", r"launch__block_size"),
    ("cluster", r"launch__cluster_(dim_size|size)\w*"),
    ("waves / SM", r"launch__waves_per_multiprocessor"),
    ("registers / thread", r"launch__registers_per_thread"),
    ("smem / block (dyn)", r"launch__shared_mem_per_block_dynamic"),
    ("smem / block (static)", r"launch__shared_mem_per_block_static"),
    ("occupancy theor. %", r"sm__maximum_warps_per_active_cycle_pct"),
    ("occupancy achieved %", r"sm__warps_active\.avg\.pct_of_peak_sustained_active"),
    ("compute SOL %", r"sm__throughput\.avg\.pct_of_peak_sustained_elapsed"),
    ("memory SOL %", r"gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed"),
    ("DRAM %", r"(gpu__)?dram__throughput\.avg\.pct_of_peak_sustained_elapsed"),
    ("DRAM read", r"dram__bytes_read\.sum"),
    ("DRAM write", r"dram__bytes_write\.sum"),
    ("L2 %", r"lts__throughput\.avg\.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", r"lts__t_sector_hit_rate\.pct"),
    ("L1/TEX %", r"l1tex__throughput\.avg\.pct_of_peak_sustained_active"),
    ("L1 hit %", r"l1tex__t_sector_hit_rate\.pct"),
    ("smem bank conflicts", r"l1tex__data_bank_conflicts_pipe_lsu_mem_shared\w*\.sum"),
    ("instructions", r"smsp__inst_executed\.sum"),
    ("IPC (active)", r"sm__inst_executed\.avg\.per_cycle_active"),
    ("issue slots busy %", r"sm__inst_issued\.avg\.pct_of_peak_sustained_active"),
    ("SM busy %", r"sm__instruction_throughput\.avg\.pct_of_peak_sustained_active"),
    ("warps eligible / cyc", r"smsp__warps_eligible\.avg\.per_cycle_active"),
    ("no eligible %", r"smsp__issue_inst0\.avg\.pct_of_peak_sustained_active"),
    ("warp cycles / issue", r"smsp__average_warp_latency_per_inst_issued\.ratio"),
)
# The tensor pipe's utilization columns (sm__pipe_tensor_cycles_active, the GMMA / HMMA
# instruction shares; names vary by ncu version), averages only; all-zero rows are left out.
TENSOR = re.compile(r"sm__\w*tensor\w*\.avg\.pct_of_peak_sustained_(active|elapsed)")
NOT_TENSOR = re.compile(r"dmma|imma")
TOP_TENSOR = 6
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
TOP_STALLS = 8
LABEL = 34  # the metric column's width (a tensor-pipe metric's name)
# Lines of the details page worth keeping (the subjects of the table above).
KEEP = re.compile(
    r"Duration|Throughput|Busy|Ipc|Issue|Issued|Tensor|Pipe|Hit Rate|DRAM|L2|L1|Bandwidth|"
    r"Occupancy|Registers|Shared Memory|Waves|Grid Size|Block Size|Cluster|Warp Cycles|"
    r"Eligible|Active Warps|Stall|Bank|Executed Instructions|SM Frequency",
    re.I,
)
HEADER = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")


def read_raw(path: Path) -> tuple[list[str], dict[str, str], list[dict[str, str]]]:
    """(columns, units by column, one dict per profiled kernel in launch order)."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return [], {}, []
    table = list(csv.reader(lines[start:]))
    columns, units = table[0], dict(zip(table[0], table[1])) if len(table) > 1 else {}
    rows = [dict(zip(columns, r)) for r in table[2:] if len(r) == len(columns)]
    if NAME not in columns:  # another ncu's name column ("Function Name", "Demangled Name")
        alt = next(
            (c for c in columns if c.endswith("Name") and c[:4] not in ("Proc", "Host")), None
        )
        for row in rows:
            row[NAME] = row.get(alt, "") if alt else ""
    return columns, units, rows


def number(text: str) -> float | None:
    t = text.replace(",", "").strip()
    return float(t) if re.fullmatch(r"-?\d+(\.\d*)?([eE][-+]?\d+)?", t) else None


def segment_rows(rows: list[dict], plan: dict) -> list[tuple[dict, list[dict]]]:
    """(segment, its kernels) in launch order; markers open segments and are dropped. Without
    markers or a plan: one segment per side over every case, ours told by its name."""
    segs, marker = plan.get("segments", []), plan.get("marker")
    if marker and segs:
        out: list[tuple[dict, list[dict]]] = [(s, []) for s in segs]
        index = -1
        for row in rows:
            if marker in row.get(NAME, ""):
                index += 1
            elif 0 <= index < len(out):
                out[index][1].append(row)
        return out
    marker = marker or MARKER
    kernels = [r for r in rows if marker not in r.get(NAME, "")]
    mine = [r for r in kernels if "forgekernel" in r.get(NAME, "")]
    theirs = [r for r in kernels if "forgekernel" not in r.get(NAME, "")]
    every = {"suite": plan.get("target", "?"), "case": "all cases (no markers)", "calls": 1}
    return [({**every, "side": "ours", "impl": "ours"}, mine),
            ({**every, "side": "comparator", "impl": "?"}, theirs)]  # fmt: skip


def short(name: str, width: int = 60) -> str:
    """A kernel name without the DSL's module-path prefix and argument-mangled tail."""
    name = re.sub(r"^kernel_cutlass_kernel_forgekernelkernels", "fk:", name)
    name = re.sub(r"_object_at_.*$", "", name)
    name = re.sub(r"\(.*$", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


_PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# ncu's unit names, base and auto: "nsecond" / "usecond" / "msecond" (older ncu), "ns" / "us" /
# "ms" (later ones: a duration of 4,098,912 "ns" read as seconds once printed a per call of
# 4098912000000.0 us), "byte" / "Kbyte" / "Gbyte", "hz" / "Ghz", clocks as "cycle/nsecond".
_BASE = {"second": "second", "s": "second", "byte": "byte", "hz": "hz"}
_UNIT = re.compile(r"([numKMGT]?)((?i:second|s|byte|hz))")
_PER_SECOND = re.compile(r"cycle/([numKMGT]?)s(econd)?")


def in_base(value: str, unit: str) -> tuple[float | None, str]:
    """(value in the base unit, base unit: "second", "byte", "hz" or the unit as it is)."""
    x = number(value)
    if x is not None and (per := _PER_SECOND.fullmatch(unit.strip())):
        return x / _PREFIX[per.group(1)], "hz"  # a clock counted as cycles per second
    m = _UNIT.fullmatch(unit.strip())
    if x is None or not m:
        return x, unit
    return x * _PREFIX[m.group(1)], _BASE[m.group(2).lower()]


def fmt(value: str, unit: str) -> str:
    x, base = in_base(value, unit)
    if x is None:
        return value[:14]
    if base == "second":
        return f"{x * 1e6:.1f} us"
    if base == "byte":
        for div, suffix in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
            if x >= div:
                return f"{x / div:.2f} {suffix}"
        return f"{x:.0f} B"
    if base == "hz":
        return f"{x / 1e9:.2f} GHz"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.2f}M"
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"


def metric_rows(columns: list[str], kernels: list[dict]) -> list[tuple[str, str]]:
    """(label, column) to show: the fixed list, the tensor-pipe columns, the top stalls."""
    chosen = []
    for label, pattern in METRICS:
        col = next((c for c in columns if re.fullmatch(pattern, c)), None)
        if col:
            chosen.append((label, col))

    def peak(col: str) -> float:
        return max((number(k.get(col, "")) or 0.0 for k in kernels), default=0.0)

    tensor = [c for c in columns if TENSOR.fullmatch(c) and not NOT_TENSOR.search(c)]
    chosen += [(c.split(".")[0].replace("sm__", "") + " %", c) for c in tensor if peak(c) > 0][
        :TOP_TENSOR
    ]
    stalls = sorted(
        ((peak(c), f"stall {m.group(1)}", c) for c in columns if (m := STALL.fullmatch(c))),
        reverse=True,
    )
    return chosen + [(label, col) for _, label, col in stalls[:TOP_STALLS]]


def case_table(columns, units, group: list[tuple[dict, list[dict]]]) -> list[str]:
    """One case: a legend of its kernels, then the metric table (a column per kernel)."""
    kernels = [(seg, k) for seg, ks in group for k in ks]
    if not kernels:
        return ["  (no kernels profiled for this case)"]
    lines = []
    totals: dict[str, float] = {}  # seconds per call
    dur_col = "gpu__time_duration.sum"
    dur_unit = units.get(dur_col) or "nsecond"  # ncu's own unit of the metric
    for i, (seg, k) in enumerate(kernels, 1):
        dur = in_base(k.get(dur_col, ""), dur_unit)[0] or 0.0
        totals[seg["side"]] = totals.get(seg["side"], 0.0) + dur / max(1, seg.get("calls", 1))
        where = f"grid {k.get('Grid Size', '?')} block {k.get('Block Size', '?')}"
        lines.append(
            f"  [{i}] {seg['side']:<10} {seg['impl']:<9} {short(k.get(NAME, ''))}  {where}"
        )
    if in_base("1", dur_unit)[1] != "second":  # no per-call figure rather than a wrong one
        lines.append(f"  per call: the duration's unit {dur_unit!r} not understood")
    elif "ours" in totals and "comparator" in totals and totals["ours"]:
        ratio = totals["comparator"] / totals["ours"]
        lines.append(
            f"  per call: ours {totals['ours'] * 1e6:.1f} us, comparator "
            f"{totals['comparator'] * 1e6:.1f} us: comparator / ours {ratio:.3f}x (ncu durations)"
        )
    head = (
        "  "
        + f"{'metric':<{LABEL}}"
        + "".join(f"{f'[{i}]':>14}" for i in range(1, len(kernels) + 1))
    )
    lines += ["", head]
    for label, col in metric_rows(columns, [k for _, k in kernels]):
        cells = [fmt(k.get(col, ""), units.get(col, "")) for _, k in kernels]
        if any(c for c in cells):
            lines.append("  " + f"{label[:LABEL]:<{LABEL}}" + "".join(f"{c:>14}" for c in cells))
    return lines


def detail_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(kernel header, kept lines) per kernel of the details page, in launch order."""
    blocks: list[tuple[str, list[str]]] = []
    rule = 0
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            blocks.append((m.group(1), []))
            rule = 0
            continue
        if not blocks:
            continue
        kept = blocks[-1][1]
        stripped = line.strip()
        if re.match(r"^\s{4}(OPT|WRN)\b", line):
            rule = 4
            kept.append(line.rstrip())
        elif rule and line.startswith(" " * 10) and stripped:
            rule -= 1
            kept.append(line.rstrip())
        else:
            rule = 0
            if stripped.startswith("Section:") or (stripped and KEEP.search(stripped)):
                kept.append(line.rstrip())
    return blocks


def summarize(raw: Path, details: Path | None, plan: dict, title: str) -> str:
    columns, units, rows = read_raw(raw) if raw.exists() else ([], {}, [])
    out = [f"=== {title}: {len(rows)} kernels profiled ==="]
    if not rows:
        out.append(f"no raw page at {raw} (ncu cut by its timeout, or nothing profiled)")
    groups = segment_rows(rows, plan)
    cases: dict[tuple[str, str], list] = {}
    for seg, ks in groups:
        cases.setdefault((seg["suite"], seg["case"]), []).append((seg, ks))
    for (suite, case), group in cases.items():
        out += ["", f"--- {suite}:{case} ---", *case_table(columns, units, group)]
    if details is not None and details.exists():
        marker = plan.get("marker") or MARKER
        out += ["", f"=== {title}: details page, filtered ==="]
        labels = iter(_labels(groups, rows, marker))
        for name, kept in detail_blocks(details.read_text(errors="replace")):
            if marker in name:
                continue
            out += ["", f"  {next(labels, '?')}: {short(name, 100)}", *kept]
    return "\n".join(out) + "\n"


def _labels(groups, rows, marker: str) -> list[str]:
    """'case side' per non-marker kernel in launch order (the details page's order)."""
    by_id = {id(k): f"{seg['case']} {seg['side']}" for seg, ks in groups for k in ks}
    return [by_id.get(id(r), "?") for r in rows if marker not in r.get(NAME, "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--details", type=Path, default=None)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    plan = json.loads(args.plan.read_text()) if args.plan.exists() else {"segments": []}
    title = args.title or plan.get("target", args.raw.stem)
    sys.stdout.write(summarize(args.raw, args.details, plan, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
