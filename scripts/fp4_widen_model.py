"""The FP4-weight GEMM's k-tile on one scheduler, from its SASS (docs/gemm/NOTES.md "FP4 at
16-96 tokens"): the masked kernel compiled in the standard form, `staged_sa` and `converter`
(one or two converter warpgroups), each loop's per-k-tile body found in the SASS and the warps
that share a scheduler interleaved greedily (one issue a cycle, the ready warp first;
`sass_warp_model`'s parse, pipes and latencies, uniform-datapath instructions on a pipe of their
own). The standard and `staged_sa`: the two MMA warps of a scheduler on the two-k-tile loop; the
converter: its warp (or both paths of two converters) with the two MMA warps. Prints cycles a
k-tile for a few load latencies (the standard's activation-scale loads). CPU only.

    python scripts/fp4_widen_model.py [--tokens 8 32 64] [--mem 400 800]
"""

from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter
from pathlib import Path

import sass_warp_model as warp
from sass_warp_model import LATENCY, parse

from forgekernel.runtime.resources import sass_text


def pipe(op: str) -> tuple[str | None, float]:
    """`sass_warp_model`'s pipe of an instruction, the uniform datapath's own."""
    if op.startswith("U") and not op.startswith("UTMA"):
        return "uniform", 1
    return warp._pipe(op, 1.0)


def interleave(progs: list[tuple[list[dict], int]], mem: int) -> tuple[int, Counter]:
    """Warps (body, trips) on one scheduler: the cycle the last one ends, each pipe's busy
    cycles."""
    state = [dict(body=b, pc=0, trips=n, t=0, board=[0] * 6) for b, n in progs]
    free, busy, cycle, first = Counter(), Counter(), 0, True
    while any(w["trips"] for w in state):
        best = None
        for w in (w for w in state if w["trips"]):
            i = w["body"][w["pc"]]
            ready = max([w["t"]] + [w["board"][k] for k in range(6) if i["wait"] >> k & 1])
            p, cost = pipe(i["op"])
            ready = max(ready, free[p]) if p else ready
            if best is None or ready < best[0]:
                best = (ready, w, i, p, cost)
        ready, w, i, p, cost = best
        cycle = ready if first else max(cycle + 1, ready)
        first = False
        if p:
            free[p], busy[p] = cycle + cost, busy[p] + cost
        base = i["op"].split(".")[0]
        if i["wb"] != 7:
            lat = mem if base == "LDG" else LATENCY.get(base, 15)
            w["board"][i["wb"]] = max(w["board"][i["wb"]], cycle + lat)
        if i["rb"] != 7:
            w["board"][i["rb"]] = max(w["board"][i["rb"]], cycle + 10)
        w["t"] = cycle + max(i["stall"], 1)
        w["pc"] += 1
        if w["pc"] == len(w["body"]):
            w["pc"], w["trips"] = 0, w["trips"] - 1
    return cycle, busy


def loops(sass: str) -> tuple[list[dict], list[dict], dict[int, dict]]:
    """(the smallest loop holding 8 QGMMA: two k-tiles of an MMA warp; the smallest holding
    STS.128: a converter's k-tile, or []; all instructions by address)."""
    ins = parse(sass)
    by = {i["addr"]: i for i in ins}
    mma, conv = None, None
    for i in ins:
        m = re.search(r"BRA 0x([0-9a-f]+)", i["text"])
        if not (m and int(m.group(1), 16) < i["addr"]):
            continue
        body = [j for j in ins if int(m.group(1), 16) <= j["addr"] <= i["addr"]]
        ops = Counter(j["op"] for j in body)
        if sum(v for k, v in ops.items() if k.startswith("QGMMA")) == 8:
            mma = body if mma is None or len(body) < len(mma) else mma
        if ops["STS.128"] and (conv is None or len(body) < len(conv)):
            conv = body
    return mma, conv or [], by


def paths(conv: list[dict], by: dict[int, dict]) -> list[list[dict]]:
    """The converter loop as each part runs it: one path, or (two converters) the two sides of
    its one forward branch inside the loop."""
    lo, hi = conv[0]["addr"], conv[-1]["addr"]
    fork = [i for i in conv if re.match(r"@!?P\d BRA 0x", i["text"])
            and lo < int(i["text"].split("0x")[1], 16) <= hi]  # fmt: skip
    out = []
    for take in (False, True) if fork else (False,):
        body, addr = [], lo
        while True:
            i = by[addr]
            body.append(i)
            if addr == hi:
                break
            m = re.search(r"BRA 0x([0-9a-f]+)", i["text"])
            jump = m and (not i["text"].startswith("@") or (take and i in fork))
            target = int(m.group(1), 16) if m else 0
            addr = target if jump and lo <= target <= hi else addr + 16
        out.append(body)
    return out


def compile_sass(tokens: int, form: dict) -> str:
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC, config

    with tempfile.TemporaryDirectory() as d:
        out = SPEC.compile(
            config.params_for("bfloat16", tokens, **form), f"--keep-cubin --dump-dir {d}"
        )
        path = Path(d) / "k.cubin"
        path.write_bytes(out.artifacts.CUBIN)
        return sass_text(path)


def per_k_tile(sass: str, mem: int, trips: int = 6) -> int:
    mma, conv, by = loops(sass)
    if not conv:  # the MMA warps widen: two of them a scheduler, two k-tiles a trip
        return round(interleave([(mma, trips), (mma, trips)], mem)[0] / (2 * trips))
    progs = [(p, 2 * trips) for p in paths(conv, by)] + [(mma, trips), (mma, trips)]
    return round(interleave(progs, mem)[0] / (2 * trips))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--mem", type=int, nargs="+", default=[0, 400, 600, 800])
    args = ap.parse_args()
    forms = {"standard": {}, "staged_sa": {"staged_sa": True}, "converter": {"converter": 1},
             "converter x2": {"converter": 2}}  # fmt: skip
    for h in args.tokens:
        for name, form in forms.items():
            if h > 64 and name != "converter":
                continue
            sass = compile_sass(h, form)
            times = [per_k_tile(sass, m) for m in args.mem]
            print(f"h={h:3d} {name:13s} cycles a k-tile at L={args.mem}: {times}", flush=True)


if __name__ == "__main__":
    main()
