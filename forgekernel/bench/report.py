"""Benchmark reports: `<op>.json`, `<op>.md`, `<op>.png` and the console table.

A bench record (one per case and dtype, built by `forgekernel.bench.harness`) is a dict:
    case, dtype, params, flops, bytes, status ("ok", "wrong: ...", "error: ..."), verified,
    ours: {ms, tflops, gbps, method, launches, samples} | None,
    comparators: {name: {ms, tflops, gbps, ratio, ...} | {missing: reason}},
    variants: {name: {status, ms, tflops, gbps, time_ratio, ...}} (other modes of ours).
ratio = comparator_ms / ours_ms: above 1 we are faster. time_ratio = variant_ms / ours_ms: what
the variant (deterministic=True, say) costs; above 1 it is slower.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Plain aligned text table (console output)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def comparator_names(records: Sequence[dict]) -> list[str]:
    names: dict[str, None] = {}
    for rec in records:
        names.update(dict.fromkeys(rec.get("comparators", {})))
    return list(names)


def summarize(records: Sequence[dict]) -> dict[str, dict]:
    """Per comparator: median and min ratio over the verified cases where it was timed."""
    out = {}
    for name in comparator_names(records):
        ratios, reasons = [], set()
        for rec in records:
            entry = rec.get("comparators", {}).get(name)
            if entry is None:
                continue
            if "missing" in entry:
                reasons.add(entry["missing"])
            elif rec.get("status") == "ok" and entry.get("ratio") is not None:
                ratios.append(entry["ratio"])
        out[name] = {
            "median_ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios) if ratios else None,
            "cases": len(ratios),
            "missing_reasons": sorted(reasons),
        }
    return out


def variant_ratios(records: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Per variant of ours: {"<case> <dtype>": variant time / our time} over the timed cases."""
    out: dict[str, dict[str, float]] = {}
    for rec in records:
        for name, entry in rec.get("variants", {}).items():
            if rec.get("status") == "ok" and entry.get("time_ratio") is not None:
                out.setdefault(name, {})[f"{rec['case']} {rec['dtype']}"] = entry["time_ratio"]
    return out


def variant_rows(records: Sequence[dict]) -> list[list[str]]:
    rows = []
    for rec in records:
        for name, entry in rec.get("variants", {}).items():
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


def _cells(rec: dict, names: Sequence[str]) -> list[str]:
    ours = rec.get("ours")
    if rec.get("status") != "ok" or ours is None:
        return [rec.get("status", "?"), "-"] + ["-", "-"] * len(names)
    row = [_num(ours["ms"], ".4f"), _num(ours["tflops"], ".1f")]
    for name in names:
        entry = rec.get("comparators", {}).get(name)
        if entry is None or "missing" in entry:
            row += ["missing", "-"]
        else:
            row += [_num(entry["ms"], ".4f"), _ratio(entry["ratio"])]
    return row


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
        for reason in s["missing_reasons"]:
            lines.append(f"{name}: missing: {reason}")
    return lines


def markdown(op: str, records: Sequence[dict], env: dict | None = None) -> str:
    names = comparator_names(records)
    headers = ["case", "dtype", "ours ms", "ours TFLOP/s"]
    for name in names:
        headers += [f"{name} ms", f"{name} ratio"]
    lines = [f"# {op}", ""]
    if env:
        lines += [", ".join(f"{k}: {v}" for k, v in env.items()), ""]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for rec in records:
        lines.append("| " + " | ".join([rec["case"], rec["dtype"], *_cells(rec, names)]) + " |")
    lines += [""] + [f"- {s}" for s in summary_lines(summarize(records))]
    rows = variant_rows(records)
    if rows:
        lines += ["", VARIANT_NOTE + ":", ""]
        lines += ["| " + " | ".join(VARIANT_HEADERS) + " |", "|" + "---|" * len(VARIANT_HEADERS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def console_table(records: Sequence[dict]) -> str:
    names = comparator_names(records)
    headers = ["case", "dtype", "ours ms", "TFLOP/s"]
    for name in names:
        headers += [f"{name} ms", f"{name} ratio"]
    rows = [[rec["case"], rec["dtype"], *_cells(rec, names)] for rec in records]
    parts = [format_table(headers, rows), *summary_lines(summarize(records))]
    variants = variant_rows(records)
    if variants:
        parts += ["", VARIANT_NOTE, format_table(VARIANT_HEADERS, variants)]
    return "\n".join(parts)


def plot(op: str, records: Sequence[dict], path: Path) -> Path | None:
    """Bar chart of ratio per case and comparator, line at 1.0; None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib not installed, skipping {path.name}")
        return None
    names = comparator_names(records)
    labels = [f"{r['case']} {r['dtype']}" for r in records]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(labels) + 2), 4.5))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, rec in enumerate(records):
            entry = rec.get("comparators", {}).get(name, {})
            if rec.get("status") == "ok" and entry.get("ratio") is not None:
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(entry["ratio"])
        # Bars grow from 1.0: wins point up, losses down, and a 3% gap stays visible.
        bars = ax.bar(xs, [y - 1.0 for y in ys], bottom=1.0, width=width, label=name)
        ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=6)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("comparator ms / ours ms (> 1: ours faster)")
    ax.set_title(op)
    if names:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(
    op: str, records: Sequence[dict], report_dir: Path, env: dict | None = None
) -> dict[str, Path]:
    """Write `<op>.json`, `<op>.md` and (with matplotlib) `<op>.png`; returns their paths."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "op": op,
        "env": env or {},
        "summary": summarize(records),
        "variant_ratio": variant_ratios(records),
        "cases": list(records),
    }
    paths = {"json": report_dir / f"{op}.json", "md": report_dir / f"{op}.md"}
    paths["json"].write_text(json.dumps(doc, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(op, records, env))
    png = plot(op, records, report_dir / f"{op}.png")
    if png is not None:
        paths["png"] = png
    return paths
