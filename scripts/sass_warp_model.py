"""One warp alone on its scheduler, walked through a kernel's loop body from its SASS: the
per-class instruction counts, the static schedule (the sum of the stall counts ptxas wrote in
the control words) and a timing model that adds the scoreboard waits and the pipes' issue
intervals. Written for the fused KDA design's stage 1 (docs/linear_attention/NOTES.md, "Stage 1
measured 2026-12-03 16:55"), where each scheduler holds exactly one warp, so nothing hides a
stall; CPU only.

    python scripts/sass_warp_model.py kda_loop [--held] [--segments]
    python scripts/sass_warp_model.py FILE.cubin [--segments]

Control word (high 64 bits >> 41): stall 4 bits, yield 1, write scoreboard 3, read scoreboard
3, wait mask 6. The model: an instruction issues at max(previous issue + its stall, the waited
scoreboards, its pipe free); a scoreboard clears `LATENCY` after its setter issues (LDG at
`--mem` cycles, LDGSTS's group at DEPBAR the same); BAR.SYNC costs 30. Pipe intervals a warp
instruction (Hopper, one scheduler; estimates): FP32 1, ALU / IMAD 2 (IMAD.WIDE 4), MUFU 8,
HMMA 8, shared memory bytes / 128 x `--mio-share` (the warps of the SM that contend for it).
Not modelled: instruction fetch, bank conflicts, barrier skew, clocks.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from pathlib import Path

from forgekernel.runtime.resources import sass_text

LINE = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* 0x[0-9a-f]{16} \*/\s*\n\s*/\* 0x([0-9a-f]{16}) \*/"
)
LATENCY = {"LDS": 33, "LDSM": 33, "LDL": 40, "MUFU": 20, "S2R": 25, "SHFL": 30, "HMMA": 34,
           "LDC": 20, "ULDC": 20, "R2UR": 10, "I2F": 12, "F2I": 12, "F2F": 12}  # fmt: skip
CLASSES = (
    ("HMMA", ("HMMA",)),
    ("LDS / LDSM", ("LDS", "LDSM")),
    ("STS", ("STS",)),
    ("LDG", ("LDG",)),
    ("cp.async", ("LDGSTS", "LDGDEPBAR", "DEPBAR")),
    ("STG", ("STG",)),
    ("LDL / STL", ("LDL", "STL")),
    ("SHFL", ("SHFL",)),
    ("MUFU", ("MUFU",)),
    ("FP32", ("FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX")),
    ("pack / HMUL2 / PRMT", ("F2FP", "HMUL2", "HFMA2", "PRMT", "F2F", "I2F")),
    ("barrier", ("BAR", "WARPSYNC", "NOP")),
    ("branch", ("BRA", "EXIT")),
)


def parse(sass: str) -> list[dict]:
    out = []
    for m in LINE.finditer(sass):
        text = m.group(2).strip()
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        c = int(m.group(3), 16) >> 41
        out.append({"addr": int(m.group(1), 16), "text": text, "op": op, "stall": c & 15,
                    "wb": (c >> 5) & 7, "rb": (c >> 8) & 7, "wait": (c >> 11) & 63})  # fmt: skip
    return out


def loop_body(ins: list[dict], trips: int = 3) -> list[dict]:
    """One pass of the outermost loop (the backward branch of the longest span), as issued:
    a loop nested in it unrolled to `trips` passes (the KDA loop's rolled block paths: 3 on
    the warps that take three)."""
    loops = []
    for i in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", i["text"])
        if m and int(m.group(1), 16) < i["addr"]:
            loops.append((int(m.group(1), 16), i["addr"]))
    if not loops:
        raise ValueError("no loop")
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    body = [j for j in ins if lo <= j["addr"] <= hi]
    for a, b in loops:
        if lo < a and b < hi:
            first = next(k for k, j in enumerate(body) if j["addr"] == a)
            last = next(k for k, j in enumerate(body) if j["addr"] == b)
            body[first:last + 1] = body[first:last + 1] * trips
    return body


def klass(op: str) -> str:
    base = op.split(".")[0]
    return next((name for name, ops in CLASSES if base in ops), "integer / address / move")


def _pipe(op: str, share: float) -> tuple[str | None, float]:
    base = op.split(".")[0]
    if base in ("FFMA", "FMUL", "FADD", "HMUL2", "HFMA2"):
        return "fma", 1
    if base == "IMAD":
        return "fmaheavy", 4 if "WIDE" in op else 2
    if base in ("MUFU", "HMMA"):
        return base, 8
    if base in ("LDS", "STS", "LDSM", "LDG", "STG", "LDGSTS", "LDL", "STL", "SHFL"):
        wide = 16 if ".128" in op or op.startswith("LDSM") and ".4" in op else (
            8 if ".64" in op else 4)  # fmt: skip
        return "mio", wide * share / 4
    if base in ("BAR", "BRA", "EXIT", "NOP", "DEPBAR", "LDGDEPBAR"):
        return None, 0
    return "alu", 2


def model(body: list[dict], mem: int = 800, share: float = 1.0) -> int:
    """Cycles for one pass of `body` by one warp alone on its scheduler (module docstring)."""
    board, free, t, stall, cp = [0] * 6, Counter(), 0, 0, []
    for i in body:
        base = i["op"].split(".")[0]
        pipe, cost = _pipe(i["op"], share)
        waited = max([board[k] for k in range(6) if i["wait"] >> k & 1] + [0])
        t = max(t + stall, waited, free[pipe] if pipe else 0)
        if base == "LDGSTS":
            cp.append(t)
        if base == "DEPBAR":
            t = max(t, max(cp, default=0) + mem)
        if base == "BAR":
            t += 30
        if pipe:
            free[pipe] = t + cost
        if i["wb"] != 7:
            lat = mem if base == "LDG" else LATENCY.get(base, 15)
            board[i["wb"]] = max(board[i["wb"]], t + lat)
        if i["rb"] != 7:
            board[i["rb"]] = max(board[i["rb"]], t + 10)
        stall = max(i["stall"], 1)
    return t + stall


def _kda_loop_sass(held: bool, own_scratch: bool = False) -> str:
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile_loop import (
        compile_kda_intra_loop,
    )
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra_loop import (
        KdaIntraLoopSm90,
    )

    with tempfile.TemporaryDirectory() as d:
        out = compile_kda_intra_loop({"dtype": "bfloat16", "k": 128}, "sm_90a",
                                     f"--keep-cubin --dump-dir {d}",
                                     kernel=KdaIntraLoopSm90(128, recompute_addresses=not held,
                                                             own_scratch=own_scratch))
        path = Path(d) / "k.cubin"
        path.write_bytes(out.artifacts.CUBIN)
        return sass_text(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", help="kda_loop, or a .cubin")
    ap.add_argument("--held", action="store_true", help="kda_loop: recompute_addresses=False")
    ap.add_argument("--segments", action="store_true", help="also per barrier-delimited part")
    ap.add_argument("--mem", type=int, default=800, help="global load latency, cycles")
    ap.add_argument("--own-scratch", action="store_true", help="kda_loop: own_scratch=True")
    args = ap.parse_args()
    if args.target == "kda_loop":
        sass = _kda_loop_sass(args.held, args.own_scratch)
    else:
        sass = sass_text(args.target)
    ins = parse(sass)
    body = loop_body(ins)
    lo, hi = body[0]["addr"], body[-1]["addr"]
    print(f"loop code: {sum(lo <= i['addr'] <= hi for i in ins)} instructions "
          f"({(hi - lo + 16) // 1024} KB)")
    counts = Counter(klass(i["op"]) for i in body)
    print(f"loop body: {len(body)} instructions a warp, static schedule "
          f"{sum(max(i['stall'], 1) for i in body)} cycles, "
          f"{sum(1 for i in body if i['text'].startswith('@'))} predicated")  # fmt: skip
    for name, n in counts.most_common():
        print(f"  {name:26s} {n:5d}")
    for share in (1, 4):
        t = model(body, args.mem, share)
        print(f"model, shared memory shared by {share} warp(s): {t} cycles "
              f"({t / 1.83e3:.2f} us at 1.83 GHz)")  # fmt: skip
    if args.segments:
        part: list[dict] = []
        for i in body:
            part.append(i)
            if i["op"].startswith(("BAR", "DEPBAR")) or i is body[-1]:
                top = ", ".join(f"{k} {v}" for k, v in
                                Counter(klass(j["op"]) for j in part).most_common(4))
                print(f"  {part[0]['addr']:#07x}-{part[-1]['addr']:#07x} {len(part):5d} instr, "
                      f"static {sum(max(j['stall'], 1) for j in part):5d}, model "
                      f"{model(part, args.mem):5d}: {top}")  # fmt: skip
                part = []


if __name__ == "__main__":
    main()
