"""L2-reuse model of the sm90 attention backward's launch order (CPU only), over the bench suite.

One CTA a (key block, kv head, batch) tile (head_split: a query head), dispatched in launch
order onto 132 SMs as they free (the hardware's dispatch; D = 64's persistent counter deals the
same order the same way). A CTA holds its SM for its steps + OVERHEAD; each step (query head h,
query block m) reads the Q, dO, LSE and Dsum rows of (h, m) and reduce-adds into its fp32 dQ
rows: one L2 entry of those bytes, dirty (a miss reads all of it from HBM; evicted, its dQ part
is written back). K / V are read once a CTA (head_split: the kv tile through L2, its fp32
dK / dV reduce-add entry dirty at the CTA's end); dK / dV written once. Orders:

    ours  the launcher's config (`choose_config`): l2_swizzle sections of k (kv head, batch)
          pairs with the key block slowest in a section (causal fixed length), else the key
          block fastest; walk_order; head_split
    fa4   FA4 sm90, not deterministic (`SingleTileScheduler`): grid (key block, query head,
          batch), the key block fastest; one CTA a query head (GQA: fp32 dK / dV workspace)
    fa3   FA3 hopper (causal fixed length: `SingleTileBwdLPTScheduler`): sections of
          2^floor(log2(40 MiB / (Sq (D + Dv) 2 + Sq D 4))) query heads, the key block slowest
          in a section; else as fa4

plus the compulsory bytes of the preprocess (O, dO read; Dsum, LSE written; dQ accumulator
zeroed) and postprocess (dQ accumulator read, dQ written), against the graph time of
benchmarks/reports/sm_90a/attention_bwd.md at the device copy's rate.

    python scripts/attn_bwd_l2_model.py [name filter, comma-separated]

docs/attention/BWD_NOTES.md, "The launch order against the forward's L2 finding".
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

SMS = 132
OVERHEAD = 2  # step units a CTA spends outside its steps (K / V load, dK / dV epilogue)
COPY_TBPS = 4.25  # H200 device copy, TB/s (OPS.md)
REPORT = Path(__file__).resolve().parents[1] / "benchmarks/reports/sm_90a/attention_bwd.md"


def _swizzled(idx: int, num_n: int, pairs: int, sw: int) -> tuple[int, int]:
    from forgekernel.kernels.attention.bwd.sm90.config import swizzled_block

    return swizzled_block(idx, num_n, pairs, sw)


def ctas(p: dict, order: str, cfg=None) -> list[tuple]:
    """[(steps as [(batch, query head, query block)], kv tile (batch, kv head, key block),
    split)] in launch order."""
    b, hq, hkv, sq, sk, causal = p["b"], p["hq"], p["hkv"], p["sq"], p["sk"], p["causal"]
    tm, tn = (cfg.tile_m, cfg.tile_n) if cfg else (64, 128)
    num_n, num_m, group = -(-sk // tn), -(-sq // tm), hq // hkv
    if order == "ours":
        split, sw, walk = bool(cfg.head_split), cfg.l2_swizzle if causal else 0, cfg.walk_order
    else:  # one CTA a query head; GQA adds dK / dV in fp32 (MHA: the kv head itself)
        split, walk, sw = group > 1, 0, 0
        if order == "fa3" and causal:
            head = sq * (p["d"] + p["dv"]) * 2 + sq * p["d"] * 4
            sw = 1 if head > 40 * 2**20 else 2 ** int(math.log2(40 * 2**20 // head))
    heads = hq if split or order != "ours" else hkv
    out = []
    for idx in range(num_n * b * heads):
        n, pair = _swizzled(idx, num_n, b * heads, sw) if sw else divmod(idx, num_n)[::-1]
        batch, gh = divmod(pair, heads)
        if split and order == "ours":  # heads interleaved over the kv heads
            kv, qheads = gh % hkv, [(gh % hkv) * group + gh // hkv]
        elif order != "ours":
            kv, qheads = gh // group, [gh]
        else:
            kv, qheads = gh, range(gh * group, gh * group + group)
        first = max(n * tn - (sk - sq), 0) // tm if causal else 0
        ms = range(min(first, num_m), num_m)
        ms = ms[::-1] if walk == 2 else ms
        out.append(([(batch, h, m) for h in qheads for m in ms], (batch, kv, n), split))
    return out


def hbm_bytes(p: dict, work: list[tuple], tm: int, tn: int, l2_mib: float) -> float:
    """Main-kernel HBM bytes of `work` through an LRU L2 of l2_mib (write-back of dirty dQ /
    dK / dV accumulator entries)."""
    d, dv = p["d"], p["dv"]
    row = tm * (d + dv) * 2 + tm * 8 + tm * d * 4  # Q, dO, LSE, Dsum + the dQ accumulator
    dq, kv, dkv = tm * d * 4, tn * (d + dv) * 2, tn * (d + dv) * 4
    events, free = [], [0.0] * SMS
    for steps, tile, split in work:
        t = heapq.heappop(free)
        if split:
            events.append((t, ("kv", *tile), kv, 0))
        events += [(t + 1 + i, s, row, dq) for i, s in enumerate(steps)]
        end = t + len(steps) + OVERHEAD
        if split:
            events.append((end - 0.5, ("dkv", *tile), dkv, dkv))
        heapq.heappush(free, end)
    events.sort(key=lambda e: e[0])
    cap, used, total, lru = l2_mib * 2**20, 0, 0.0, OrderedDict()
    for _, key, size, dirty in events:
        if key in lru:
            lru.move_to_end(key)
            continue
        total += size
        lru[key] = (size, dirty)
        used += size
        while used > cap:
            _, (s, w) = lru.popitem(last=False)
            used -= s
            total += w
    total += sum(w for s, w in lru.values())
    tiles = len({tile for _, tile, _ in work})
    unsplit = sum(1 for *_, split in work if not split)
    return total + unsplit * kv + tiles * kv  # K / V read, dK / dV written (bf16)


def compulsory(p: dict) -> float:
    """Pre- and postprocess bytes: O, dO read, LSE / Dsum, dQ accumulator zeroed, read, dQ."""
    rows = p["b"] * p["sq"] * p["hq"]
    return rows * (p["dv"] * 2 * 2 + 16 + p["d"] * 4 * 2 + p["d"] * 2)


def measured() -> dict[str, tuple[float, float]]:
    out, text = {}, REPORT.read_text().split("## eager")[0]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 6 and cells[2] == "bf16":
            try:
                out[cells[0]] = (float(cells[3]), float(cells[5]))
            except ValueError:
                pass
    return out


def config_for(p: dict):
    from forgekernel.kernels.attention.bwd.sm90.config import choose_config

    return choose_config(p["d"], p["dv"], False, p["b"], p["sk"], p["hq"], p["hkv"], SMS,
                         p["causal"])  # fmt: skip


def rows(names: str = "", orders: dict | None = None, l2_mibs=(50, 25)) -> list[dict]:
    from forgekernel.bench.suites.attention_bwd import BENCH_CASES

    times, out = measured(), []
    for case in BENCH_CASES:
        p = dict(case.params)
        if p.get("varlen") or (names and not any(n in case.name for n in names.split(","))):
            continue
        p.setdefault("dv", p["d"])
        p.setdefault("sk", p["sq"])
        cfg = config_for(p)
        row = {"case": case.name, "ms": times.get(case.name, (0, 0)), "cfg": cfg.tag()}
        for name, (order, c) in (orders or _orders(p, cfg)).items():
            work = ctas(p, order, c)
            row[name] = [(compulsory(p) + hbm_bytes(p, work, c.tile_m, c.tile_n, m)) / 1e9
                         for m in l2_mibs]  # fmt: skip
        out.append(row)
    return out


def _orders(p: dict, cfg) -> dict:
    out = {"ours": ("ours", cfg), "fa4": ("fa4", cfg), "fa3": ("fa3", cfg)}
    if p["causal"]:
        for k in (0, 2, 8):
            if k != cfg.l2_swizzle:
                out[f"sw{k}"] = ("ours", replace(cfg, l2_swizzle=k))
    return out


def main() -> None:
    for r in rows(sys.argv[1] if len(sys.argv) > 1 else ""):
        ms, fa4 = r["ms"]
        gb = r["ours"]
        cells = " ".join(f"{k}={v[0]:.2f}/{v[1]:.2f}" for k, v in r.items() if isinstance(v, list))
        print(f"{r['case']} [{r['cfg']}] ms {ms} fa4 {fa4} floor {gb[0] / COPY_TBPS:.3f}/"
              f"{gb[1] / COPY_TBPS:.3f} ms ({gb[0] / COPY_TBPS / ms:.2f}/"
              f"{gb[1] / COPY_TBPS / ms:.2f}) | {cells}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
