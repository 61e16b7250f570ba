"""The grouped FP8 GEMM's walk against the L2 (issue 21, docs/gemm/NOTES.md "The grouped FP8
GEMM at 0.86x DeepGEMM"): for each gemm_fp8_grouped bench case, the HBM bytes the persistent
walk reads under a least-recently-used L2 model, as a multiple of what A and B hold (A once,
each expert's B once), for the M-first walk (the standard until 2026-12-03, the dense FP8
tiles' walk) and the standard's bands (`config.GROUPED`, swizzle 8), beside the last measured
ratio against DeepGEMM (> 1: ours faster).

Model (CPU only, no GPU): the static schedule's order of cluster blocks (kernels/common/sm90/
scheduler/static.py, mirrored in `walk`), taken a wave of co-resident clusters at a time; a
wave reads, for each of its blocks, the tile row's A (128 x K bytes, multicast to the
cluster's two CTAs) and its expert's two n-tiles of B (256 x K), then writes its C tiles
(resident in L2 until evicted, never read). Whole tiles, not k-slices: the clusters of a
wave stream their K in step. L2 sizes are what it keeps of its 50 MB for these operands.

    python3 scripts/fp8_grouped_walk.py [RESULTS_JSON]
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import OrderedDict
from pathlib import Path

from forgekernel.bench.suites.gemm_fp8_grouped import BENCH_CASES, expert_counts
from forgekernel.kernels.common.sm90.constants import NUM_SMS_H100_H200
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED

RESULTS = Path("benchmarks/results/sm_90a/gemm_fp8_grouped.json")
L2_BYTES = (20e6, 30e6, 45e6)
TILE = 128
M_FIRST = dataclasses.replace(GROUPED, swizzle=1)


def walk(blocks_m: int, blocks_n: int, swizzle: int, along_m: bool = True) -> list:
    """(block_m, block_n) of each work index, in order (StaticScheduler.tile, swizzle s)."""
    major, minor = (blocks_m, blocks_n) if along_m else (blocks_n, blocks_m)
    order = []
    for work in range(major * minor):
        group, rest = divmod(work, swizzle * major)
        if swizzle == 1:
            a, b = rest, group
        else:
            width = min(swizzle, minor - group * swizzle)
            a, b = rest // width, group * swizzle + rest % width
        order.append((a, b) if along_m else (b, a))
    return order


def hbm_reads(params: dict, cfg, l2_bytes: float) -> tuple[float, float]:
    """(bytes read from HBM under the model, bytes of A and of every used expert's B)."""
    n, k = params["n"], params["k"]
    experts = []
    for e, c in enumerate(expert_counts(params)):
        experts += [e] * -(-c // TILE)
    cn = cfg.cluster_n
    order = walk(len(experts), n // (TILE * cn), cfg.swizzle, cfg.raster_along_m)
    clusters = NUM_SMS_H100_H200 // cn
    lru: OrderedDict = OrderedDict()
    held = read = 0.0

    def touch(key, size, from_hbm=True):
        nonlocal held, read
        if key in lru:
            lru.move_to_end(key)
            return
        read += size if from_hbm else 0
        lru[key] = size
        held += size
        while held > l2_bytes:
            held -= lru.popitem(last=False)[1]

    for w in range(0, len(order), clusters):
        wave = order[w : w + clusters]
        for m, j in wave:
            touch(("A", m), TILE * k)
            touch(("B", experts[m], j), cn * TILE * k)
        for m, j in wave:
            touch(("C", m, j), TILE * cn * TILE * 2, from_hbm=False)
    held_ab = len(experts) * TILE * k + len(set(experts)) * n * k
    return read, held_ab


def measured(path: Path) -> dict:
    if not path.exists():
        return {}
    cases = json.loads(path.read_text())["bench"]["cases"]
    out = {}
    for rec in cases:
        cmp = rec.get("comparators", {}).get("deepgemm", {})
        if rec.get("ours", {}).get("ms") and cmp.get("ms"):
            out[rec["case"]] = cmp["ms"] / rec["ours"]["ms"]
    return out


def main(argv: list[str]) -> None:
    ratios = measured(Path(argv[0]) if argv else RESULTS)
    cfgs = (M_FIRST, GROUPED)
    names = ["M first" if c.swizzle == 1 else f"band{c.swizzle}" for c in cfgs]
    print("HBM reads / (A + B) at L2 " + ", ".join(f"{b / 1e6:.0f}" for b in L2_BYTES) + " MB")
    head = " ".join(f"{x:>14s}" for x in names)
    print(f"{'case':22s} {'A+B MB':>7s} {head}  DeepGEMM/ours")
    for case in BENCH_CASES:
        cols = []
        for cfg in cfgs:
            runs = [hbm_reads(case.params, cfg, b) for b in L2_BYTES]
            cols.append("/".join(f"{r / h:.1f}" for r, h in runs))
        held = hbm_reads(case.params, M_FIRST, L2_BYTES[0])[1]
        ratio = ratios.get(case.name)
        shown = f"{ratio:.3f}" if ratio else "-"
        row = " ".join(f"{c:>14s}" for c in cols)
        print(f"{case.name:22s} {held / 1e6:7.0f} {row}  {shown}")


if __name__ == "__main__":
    main(sys.argv[1:])
