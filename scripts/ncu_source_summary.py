"""Summarise `ncu --page source --csv --print-source sass` output (scripts/device_profile.sh
with SOURCE=1): per kernel, the executed warp instructions and warp-stall samples, the stall
reasons split by opcode, and the instructions with the most stall samples.

    python scripts/ncu_source_summary.py SOURCE.csv[.gz] [top]
"""

from __future__ import annotations

import csv
import gzip
import sys
from collections import Counter

REASONS = ("short_sb", "mio", "wait", "long_sb", "barrier", "math", "selected", "dispatch")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def load(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, one dict per SASS instruction) for each kernel in the export."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = f.read().splitlines()
    kernels, name, block = [], "", None
    for line in lines:
        if line.startswith('"Kernel Name"'):
            name = next(csv.reader([line]))[1]
        elif line.startswith('"Address"'):
            block = [line]
            kernels.append((name, block))
        elif block is not None and line.startswith('"0x'):
            block.append(line)
    return [(n, list(csv.DictReader(b))) for n, b in kernels]


def opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    for name, rows in load(sys.argv[1]):
        total = sum(_num(r[SAMPLES]) for r in rows) or 1.0
        executed = sum(_num(r[EXECUTED]) for r in rows)
        print(f"\n=== {name[:100]}\n{len(rows)} instructions, {executed:.4g} executed, "
              f"{total:.4g} stall samples")  # fmt: skip
        for reason in REASONS:
            col = f"stall_{reason}"
            by_op = Counter()
            for r in rows:
                by_op[opcode(r["Source"].strip())] += _num(r.get(col, "0"))
            share = sum(by_op.values()) / total * 100
            ops = ", ".join(f"{k} {v / total * 100:.1f}" for k, v in by_op.most_common(7) if v)
            print(f"  {reason:12s} {share:5.1f}%: {ops}")
        print(f"top {top} instructions by stall samples (share, executed, top reasons):")
        for r in sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]:
            s = _num(r[SAMPLES]) or 1.0
            reasons = sorted(REASONS, key=lambda x: -_num(r.get(f"stall_{x}", "0")))[:3]
            why = " ".join(
                f"{x}={_num(r.get(f'stall_{x}', '0')) / s * 100:.0f}"
                for x in reasons
                if _num(r.get(f"stall_{x}", "0"))
            )
            print(f"  {s / total * 100:5.2f}% ex={_num(r[EXECUTED]):.3g} "
                  f"{r['Source'].strip()[:60]:60s} {why}")  # fmt: skip


if __name__ == "__main__":
    main()
