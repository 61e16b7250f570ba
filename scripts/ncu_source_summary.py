"""Summarise `ncu --page source --csv --print-source sass` output: per kernel, the executed
instruction count by opcode and the instructions with the most warp-stall samples.

    python scripts/ncu_source_summary.py source.csv [top]
"""

from __future__ import annotations

import csv
import re
import sys
from collections import Counter


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    text = open(path, errors="replace").read().splitlines()
    # One table per kernel; a header row starts with "Address" (or "#").
    blocks, cur = [], None
    for line in text:
        if line.startswith('"Address"') or line.startswith("Address"):
            cur = [line]
            blocks.append(cur)
        elif cur is not None and line.strip():
            cur.append(line)
        elif not line.startswith('"'):
            if line.strip():
                print("#", line[:200])
    for bi, block in enumerate(blocks):
        rows = list(csv.reader(block))
        head, body = rows[0], rows[1:]
        print(f"\n=== kernel table {bi}: {len(body)} instructions; columns: {head}")
        col = {h: i for i, h in enumerate(head)}
        src = col.get("Source", 1)
        samp = next((i for h, i in col.items() if "Sampling (All" in h), None)
        execd = next((i for h, i in col.items() if h.startswith("Instructions Executed")), None)
        ops, tot_s, tot_e = Counter(), 0.0, 0.0
        for r in body:
            if len(r) <= max(src, samp or 0, execd or 0):
                continue
            op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0]
            e = _num(r[execd]) if execd is not None else 0.0
            ops[op] += e
            tot_e += e
            tot_s += _num(r[samp]) if samp is not None else 0.0
        print(f"executed {tot_e:.4g} warp-instructions, stall samples {tot_s:.4g}")
        print(
            "by opcode:",
            ", ".join(f"{k} {v / max(tot_e, 1) * 100:.1f}%" for k, v in ops.most_common(30)),
        )
        if samp is not None:
            ranked = sorted(body, key=lambda r: -_num(r[samp]) if len(r) > samp else 0)
            num_cols = [i for i, h in enumerate(head) if i not in (0, src)]
            print("top stalls: address | source | " + " | ".join(head[i] for i in num_cols))
            for r in ranked[:top]:
                vals = " | ".join(r[i] for i in num_cols if i < len(r) and r[i] not in ("", "0"))
                print(f"{r[0]} | {r[src][:70]} | {vals}")


if __name__ == "__main__":
    main()
