"""CPU model of the attention backward's causal GQA launch (BWD_NOTES.md "GQA 16 at 4096").

Per configuration (the head-group walk or head_split, l2_swizzle k, walk_order), with equal step
times and CTAs dispatched in launch order onto the SMs (greedy): the makespan in step units
(a CTA costs its steps + 2: K / V load and epilogue, BWD_NOTES "Persistent CTAs"), its growth
when each CTA's speed is off by a random sigma (the tail of coarse CTAs), and an LRU L2 model of
the Q / dO (bf16) and dQ-accumulator (fp32, reduce-add: a miss reads it, a dirty eviction
writes it back) tiles, plus head_split's fp32 dK / dV tile per CTA: DRAM MB per step unit.
The L2 model overstates measured DRAM bytes ~2-2.4x (ncu at hq64 / hkv8 s8192, s16384); use
it to compare configurations.

    python scripts/bwd_gqa_model.py 8,32,2,4096 16,32,2,2048
"""

from __future__ import annotations

import heapq
import random
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from forgekernel.kernels.attention.bwd.sm90.config import swizzled_block  # noqa: E402

SMS, TM, TN, D, OVERHEAD = 132, 64, 128, 128, 2
CONFIGS = {
    "walk sw4 (default)": dict(sw=4),
    "split (head_split 2)": dict(sw=4, split=True),
    "walk2 sw8": dict(sw=8, walk=2),
    "walk sw16": dict(sw=16),
}


def ctas(b, hq, hkv, s, sw, split=False, walk=0):
    """[(steps as (batch, q head, query block), dK / dV tile)] in launch order."""
    num_n, num_m, g = -(-s // TN), -(-s // TM), hq // hkv
    heads = hq if split else hkv
    out = []
    for idx in range(num_n * b * heads):
        n, pair = swizzled_block(idx, num_n, b * heads, sw) if sw else divmod(idx, num_n)[::-1]
        batch, gh = divmod(pair, heads)
        kv = gh % hkv if split else gh
        qheads = [kv * g + gh // hkv] if split else range(gh * g, gh * g + g)
        ms = range(min(2 * n, num_m), num_m)
        ms = ms[::-1] if walk == 2 else ms
        out.append(([(batch, h, m) for h in qheads for m in ms], (batch, kv, n)))
    return out


def makespan(work, sigma=0.0, rng=None):
    free = [0.0] * SMS
    end = 0.0
    for steps, _ in work:
        cost = (len(steps) + OVERHEAD) * (rng.gauss(1.0, sigma) if sigma else 1.0)
        t = heapq.heappop(free) + cost
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def dram(work, split, l2_bytes=50 << 20):
    """DRAM bytes of the tile traffic, every running CTA one step per time unit."""
    cache, used, total = OrderedDict(), 0, 0

    def touch(key, size, write):
        nonlocal used, total
        if key in cache:
            cache[key] = cache.pop(key) or write
            return
        total += size
        cache[key], used = write, used + size
        while used > l2_bytes:
            (kind, *_), dirty = cache.popitem(last=False)
            size_out = SIZES[kind]
            used -= size_out
            total += size_out if dirty else 0

    active, nxt = [], 0
    while nxt < len(work) or active:
        while len(active) < SMS and nxt < len(work):
            active.append([nxt, -OVERHEAD])
            nxt += 1
        for a in active:
            steps, tile = work[a[0]]
            if a[1] >= 0:
                batch, h, m = steps[a[1]]
                touch(("q", batch, h, m), SIZES["q"], False)
                touch(("do", batch, h, m), SIZES["do"], False)
                touch(("dq", batch, h, m), SIZES["dq"], True)
            a[1] += 1
            if a[1] == len(steps) and split:
                touch(("dkv", *tile), SIZES["dkv"], True)
        active = [a for a in active if a[1] < len(work[a[0]][0])]
    return total + sum(SIZES[k[0]] for k, dirty in cache.items() if dirty)


SIZES = {"q": TM * D * 2, "do": TM * D * 2, "dq": TM * D * 4, "dkv": TN * 2 * D * 4}


def main(shapes):
    rng = random.Random(1)
    for shape in shapes:
        b, hq, hkv, s = map(int, shape.split(","))
        print(f"b{b} hq{hq} hkv{hkv} s{s}: makespan / ideal at sigma 0, 2, 5, 10%; DRAM")
        for name, cfg in CONFIGS.items():
            work = ctas(b, hq, hkv, s, **cfg)
            ideal = sum(len(st) + OVERHEAD for st, _ in work) / SMS
            tails = [
                sum(makespan(work, sg, rng) for _ in range(20)) / 20 / ideal
                for sg in (0.02, 0.05, 0.10)
            ]
            span = makespan(work)
            mb = dram(work, cfg.get("split", False)) / 1e6
            print(
                f"  {name:22s} ideal {ideal:7.0f} makespan {span:7.0f} "
                f"({span / ideal:.3f} {' '.join(f'{t:.3f}' for t in tails)}) "
                f"DRAM {mb / 1e3:5.1f} GB = {mb / span:5.2f} MB / step unit"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["8,32,2,4096", "4,64,4,8192"])
