"""Benchmark reports: `<op>.json`, `<op>.md`, `<op>.png` (`<op>-eager.png`) and the console table.

A bench record (one per case and dtype, built by `forgekernel.bench.harness`) is a dict:
    case, group (the case's shape class, "" = ungrouped), dtype, params, flops, bytes,
    status ("ok", "wrong: ...", "error: ..."), verified, timing (the methods timed, below),
    ours: {ms, tflops, gbps, method, launches, samples} | None,
    comparators: {name: {ms, tflops, gbps, ratio, ..., ran (what the comparator says it ran,
        where it says)} | {missing: reason}},
    variants: {name: {status, ms, tflops, gbps, time_ratio, ...}} (other modes of ours),
    eager: {ours, comparators, variants} in the same form, from the eager method.
ratio = comparator_ms / ours_ms: above 1 we are faster. time_ratio = variant_ms / ours_ms: what
the variant (deterministic=True, say) costs; above 1 it is slower.

Timing methods: "graph" (CUDA-graph replays, inputs rotated past L2: the top-level figures, and
the only method of records written before the field existed) and "eager" (eager launches, L2
flushed before each, each launch timed alone: the record's "eager" entry). The host record
(`host_record` in the harness) holds host microseconds per eager call on one tiny case:
us_per_call (to the sync after the last call), issue_us_per_call (to the last call's return)
and device_bound (the names whose loop waited for the device: their figure is not host time).

Memory-bound suites also carry the device copy (`device_copy` in the harness): {op,
buffer_bytes, bytes (read + write), status, methods: {method: figures}}, the copy kernel `op`
timed with each method (records written before `op` existed timed `dst.copy_(src)`). Their
tables add ours GB/s and ours GB/s as a % of the copy's of the same method, their summary the
median and min % of copy of ours and each comparator; without it (records written before it
existed, compute-bound suites) neither appears.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

METHODS = {
    "graph": "CUDA-graph replays, inputs rotated past L2",
    "eager": "eager launches, L2 flushed before each, each launch timed alone",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned text table (console output)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def view(rec: dict, method: str = "graph") -> dict:
    """{ours, comparators, variants} of one timing method in a record ({} when not timed)."""
    if method == "graph":
        return rec
    return rec.get(method) or {}


def timed_methods(records: Sequence[dict]) -> list[str]:
    """The methods any record was timed with, in METHODS order (old records: graph)."""
    seen = {m for rec in records for m in rec.get("timing", ["graph"])}
    return [m for m in METHODS if m in seen]


def comparator_names(records: Sequence[dict], method: str = "graph") -> list[str]:
    names: dict[str, None] = {}
    for rec in records:
        names.update(dict.fromkeys(view(rec, method).get("comparators", {})))
    return list(names)


def _timed_ratio(rec: dict, entry: dict | None) -> float | None:
    if entry is None or rec.get("status") != "ok":
        return None
    return entry.get("ratio")


def _by_group(pairs: Sequence[tuple[str, float]]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for group, ratio in pairs:
        groups.setdefault(group, []).append(ratio)
    return dict(sorted(groups.items()))


def summarize(records: Sequence[dict], method: str = "graph") -> dict[str, dict]:
    """Per comparator: median and min ratio over the verified cases where it was timed, and
    the median of each case group ("" = ungrouped cases)."""
    out = {}
    for name in comparator_names(records, method):
        pairs, reasons, ran = [], set(), {}
        for rec in records:
            entry = view(rec, method).get("comparators", {}).get(name)
            if entry is not None and "missing" in entry:
                reasons.add(entry["missing"])
            if entry is not None and entry.get("ran"):
                ran[entry["ran"]] = ran.get(entry["ran"], 0) + 1
            ratio = _timed_ratio(rec, entry)
            if ratio is not None:
                pairs.append((rec.get("group", ""), ratio))
        ratios, groups = [r for _, r in pairs], _by_group(pairs)
        out[name] = {
            "median_ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios) if ratios else None,
            "cases": len(ratios),
            "group_median_ratio": {g: statistics.median(rs) for g, rs in groups.items()},
            "group_cases": {g: len(rs) for g, rs in groups.items()},
            "missing_reasons": sorted(reasons),
            "ran": dict(sorted(ran.items())),
        }
    return out


def variant_ratios(records: Sequence[dict], method: str = "graph") -> dict[str, dict[str, float]]:
    """Per variant of ours: {"<case> <dtype>": variant time / our time} over the timed cases."""
    out: dict[str, dict[str, float]] = {}
    for rec in records:
        for name, entry in view(rec, method).get("variants", {}).items():
            if rec.get("status") == "ok" and entry.get("time_ratio") is not None:
                out.setdefault(name, {})[f"{rec['case']} {rec['dtype']}"] = entry["time_ratio"]
    return out


def method_summary(
    records: Sequence[dict], method: str, copy: dict | None = None
) -> dict[str, Any]:
    """What the ledger keeps of one method: per comparator the suite median, min and the
    median of each case group; the variants' time ratios; with a device copy timed with the
    method, the % of copy of ours and each comparator (`copy_summary`)."""
    summary = summarize(records, method)
    kept = {
        "median_ratio": {k: v["median_ratio"] for k, v in summary.items()},
        "min_ratio": {k: v["min_ratio"] for k, v in summary.items()},
        "group_median_ratio": {k: v["group_median_ratio"] for k, v in summary.items()},
        "variant_ratio": variant_ratios(records, method),
    }
    if copy_gbps(copy, method):
        kept["copy_fraction"] = copy_summary(records, copy, method)
    return kept


def copy_gbps(copy: dict | None, method: str = "graph") -> float | None:
    """The device copy's GB/s (read + write) with one timing method; None when not timed, and
    for the graph replays of records without `op` (their `dst.copy_(src)` was a memcpy node in
    the graph, 2769 GB/s against 4256 eager: harness.COPY_OP)."""
    if not copy or copy.get("status") != "ok" or (method == "graph" and "op" not in copy):
        return None
    return ((copy.get("methods") or {}).get(method) or {}).get("gbps")


def copy_summary(records: Sequence[dict], copy: dict | None, method: str = "graph") -> dict:
    """Per candidate (ours first, then each comparator): median and min of its GB/s / the
    copy's GB/s over the verified cases where it was timed; {} without a copy figure."""
    ref = copy_gbps(copy, method)
    if not ref:
        return {}
    names = comparator_names(records, method)
    fractions: dict[str, list[float]] = {name: [] for name in ["ours", *names]}
    for rec in records:
        v = view(rec, method)
        if rec.get("status") != "ok" or not v.get("ours"):
            continue
        fractions["ours"].append(v["ours"]["gbps"] / ref)
        for name in names:
            entry = v.get("comparators", {}).get(name) or {}
            if entry.get("gbps") is not None:
                fractions[name].append(entry["gbps"] / ref)
    return {
        name: {
            "median": statistics.median(fs) if fs else None,
            "min": min(fs) if fs else None,
            "cases": len(fs),
        }
        for name, fs in fractions.items()
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def size_text(nbytes: int) -> str:
    """1 GiB, 256 MiB, 1000 bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


def copy_lines(records: Sequence[dict], copy: dict | None, method: str = "graph") -> list[str]:
    """The device copy's GB/s and the median / min % of copy of ours and each comparator."""
    if not copy:
        return []
    ref = copy_gbps(copy, method)
    if not ref:
        status = copy.get("status", "?") if copy.get("status") != "ok" else "not timed"
        return [f"device copy ({method}): {status}"]
    figs = ", ".join(
        f"{name} {_pct(s['median'])} / {_pct(s['min'])} ({s['cases']})"
        for name, s in copy_summary(records, copy, method).items()
        if s["cases"]
    )
    size = size_text(copy.get("buffer_bytes", 0))
    return [
        f"device copy: {ref:.0f} GB/s ({copy.get('op', 'dst.copy_(src)')} of {size}, read + write"
        f" counted); "
        f"% of copy, median / min (cases): {figs or 'no timed cases'}"
    ]


def variant_rows(records: Sequence[dict], method: str = "graph") -> list[list[str]]:
    rows = []
    for rec in records:
        for name, entry in view(rec, method).get("variants", {}).items():
            if entry.get("status") != "ok":
                rows.append([rec["case"], rec["dtype"], name, entry.get("status", "?"), "-", "-"])
                continue
            ms, tflops = _num(entry["ms"], ".4f"), _num(entry["tflops"], ".1f")
            rows.append([rec["case"], rec["dtype"], name, ms, tflops, _ratio(entry["time_ratio"])])
    return rows


VARIANT_HEADERS = ["case", "dtype", "variant", "ms", "TFLOP/s", "x ours time"]
VARIANT_NOTE = "variants of ours: variant ms / ours ms, same run (> 1: the variant is slower)"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _grouped(records: Sequence[dict]) -> bool:
    return any(rec.get("group") for rec in records)


def _cells(
    rec: dict, names: Sequence[str], method: str = "graph", copy: float | None = None
) -> list[str]:
    """Ours' ms and TFLOP/s (with `copy`, the device copy's GB/s: ours' GB/s and % of copy),
    then each comparator's ms and ratio."""
    ours = view(rec, method).get("ours")
    if rec.get("status") != "ok" or ours is None:
        return [rec.get("status", "?"), "-"] + ["-", "-"] * (len(names) + bool(copy))
    row = [_num(ours["ms"], ".4f"), _num(ours["tflops"], ".1f")]
    if copy:
        row += [_num(ours["gbps"], ".0f"), _pct(ours["gbps"] / copy)]
    for name in names:
        entry = view(rec, method).get("comparators", {}).get(name)
        if entry is None or "missing" in entry:
            row += ["missing", "-"]
        else:
            row += [_num(entry["ms"], ".4f"), _ratio(entry["ratio"])]
    return row


def _case_table(
    records: Sequence[dict], method: str, tflops: str, copy: float | None = None
) -> tuple[list, list]:
    """(headers, rows) of the per-case table of one method; `copy`: the device copy's GB/s."""
    names, grouped = comparator_names(records, method), _grouped(records)
    headers = ["case", *(["group"] if grouped else []), "dtype", "ours ms", tflops]
    if copy:
        headers += ["ours GB/s", "% of copy"]
    for name in names:
        headers += [f"{name} ms", f"{name} ratio"]
    rows = []
    for rec in records:
        key = [rec["case"], *([rec.get("group", "")] if grouped else []), rec["dtype"]]
        rows.append(key + _cells(rec, names, method, copy))
    return headers, rows


def summary_lines(summary: dict[str, dict]) -> list[str]:
    lines = []
    for name, s in summary.items():
        if s["cases"]:
            lines.append(
                f"{name}: median ratio {_ratio(s['median_ratio'])}, min {_ratio(s['min_ratio'])}"
                f" over {s['cases']} cases ({name} ms / ours ms; > 1: ours faster)"
            )
        else:
            lines.append(f"{name}: no timed cases")
        groups = s.get("group_median_ratio") or {}
        if any(groups):
            counts = s.get("group_cases") or {}
            figs = ", ".join(
                f"{g or 'ungrouped'} {_ratio(r)} ({counts.get(g, '?')})" for g, r in groups.items()
            )
            lines.append(f"{name} by group (median, cases): {figs}")
        for what, cases in (s.get("ran") or {}).items():
            lines.append(f"{name}: ran {what} ({cases} cases)")
        for reason in s["missing_reasons"]:
            lines.append(f"{name}: missing: {reason}")
    return lines


def host_lines(host: dict | None) -> list[str]:
    """Host microseconds per eager call: ours and each comparator on the host case."""
    if not host:
        return []
    where = f"{host.get('case', '?')} {host.get('dtype', '?')}"
    head = f"host time per eager call ({where}, {host.get('calls', '?')} back-to-back calls)"
    if host.get("status") != "ok":
        return [f"{head}: {host.get('status', '?')}"]
    us = host.get("us_per_call") or {}
    ours = us.get("ours")
    parts = [f"ours {_num(ours, '.1f')} us"]
    for name, x in us.items():
        if name != "ours":
            rel = f" ({_ratio(x / ours)})" if ours and x is not None else ""
            parts.append(f"{name} {_num(x, '.1f')} us{rel}")
    lines = [f"{head}: " + ", ".join(parts) + " (x: comparator us / ours us)"]
    for name in host.get("device_bound") or []:
        issued = (host.get("issue_us_per_call") or {}).get(name)
        lines.append(
            f"host: {name}: device-bound loop ({_num(issued, '.1f')} us per call issued, "
            f"{_num(us.get(name), '.1f')} us to the sync): the host case is too large"
        )
    lines += [f"host: {name}: missing: {why}" for name, why in (host.get("missing") or {}).items()]
    return lines


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(
    op: str,
    records: Sequence[dict],
    env: dict | None = None,
    host: dict | None = None,
    copy: dict | None = None,
) -> str:
    lines = [f"# {op}", ""]
    if env:
        lines += [", ".join(f"{k}: {v}" for k, v in env.items()), ""]
    for method in timed_methods(records):
        lines += [f"## {method}: {METHODS[method]}", ""]
        lines += _md_table(*_case_table(records, method, "ours TFLOP/s", copy_gbps(copy, method)))
        summary = summary_lines(summarize(records, method)) + copy_lines(records, copy, method)
        lines += [""] + [f"- {s}" for s in summary]
        rows = variant_rows(records, method)
        if rows:
            lines += ["", VARIANT_NOTE + ":", ""] + _md_table(VARIANT_HEADERS, rows)
        lines.append("")
    if host:
        lines += ["## host", ""] + [f"- {s}" for s in host_lines(host)]
    return "\n".join(lines).rstrip("\n") + "\n"


def console_table(
    records: Sequence[dict], host: dict | None = None, copy: dict | None = None
) -> str:
    parts = []
    for method in timed_methods(records):
        parts += [
            f"{method}: {METHODS[method]}",
            format_table(*_case_table(records, method, "TFLOP/s", copy_gbps(copy, method))),
        ]
        parts += summary_lines(summarize(records, method)) + copy_lines(records, copy, method)
        variants = variant_rows(records, method)
        if variants:
            parts += ["", VARIANT_NOTE, format_table(VARIANT_HEADERS, variants)]
        parts.append("")
    parts += host_lines(host)
    return "\n".join(parts).rstrip("\n")


def plot(op: str, records: Sequence[dict], path: Path, method: str = "graph") -> Path | None:
    """Bar chart of ratio per case and comparator, line at 1.0; None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib not installed, skipping {path.name}")
        return None
    names = comparator_names(records, method)
    labels = [f"{r['case']} {r['dtype']}" for r in records]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(labels) + 2), 4.5))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, rec in enumerate(records):
            ratio = _timed_ratio(rec, view(rec, method).get("comparators", {}).get(name))
            if ratio is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(ratio)
        # Bars grow from 1.0: wins point up, losses down, and a 3% gap stays visible.
        bars = ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, width=width, label=name)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("comparator ms / ours ms (> 1: ours faster)")
    ax.set_title(f"{op} ({METHODS.get(method, method)})")
    if names:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(
    op: str,
    records: Sequence[dict],
    report_dir: Path,
    env: dict | None = None,
    host: dict | None = None,
    copy: dict | None = None,
) -> dict[str, Path]:
    """Write `<op>.json`, `<op>.md` and (with matplotlib) one PNG per timing method: `<op>.png`
    (graph) and `<op>-eager.png`; returns their paths. `copy`: the device copy of a
    memory-bound suite (kept in the JSON with each method's `copy_summary`)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    methods = timed_methods(records)
    doc = {
        "op": op,
        "env": env or {},
        "summary": summarize(records),
        "variant_ratio": variant_ratios(records),
        "methods": {m: summarize(records, m) for m in methods},
        "host": host,
        "cases": list(records),
    }
    if copy:
        doc["device_copy"] = copy
        doc["copy_fraction"] = {m: copy_summary(records, copy, m) for m in methods}
    paths = {"json": report_dir / f"{op}.json", "md": report_dir / f"{op}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(op, records, env, host, copy))
    for method in methods:
        suffix = "" if method == "graph" else f"-{method}"
        png = plot(op, records, report_dir / f"{op}{suffix}.png", method)
        if png is not None:
            paths["png" if method == "graph" else f"png-{method}"] = png
    return paths
