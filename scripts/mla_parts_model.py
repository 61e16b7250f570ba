"""Load-balance model of MLA decode's plans on the suite's page-64 cases (CPU only; MLA_NOTES.md,
"next/mla-gap (2026-12-06)", plan item 1).

Today: the step's schedule (schedule.ranged_plan: `per` tiles an item, one item a CTA) where
the width plan splits, else the width plan's one-split grid (the direct form); the hardware
starts each CTA on the SM that frees first. Parts (not built): each of the slots / head_blocks
parts takes a contiguous range of the flattened (unit, tile) stream, whole units while they
fit, else a piece (FlashMLA's sm90 metadata rule, written anew). Both cost a piece its tiles +
SPLIT_OVERHEAD_TILES. Printed: makespan in tile-units, the balanced bound, and parts / today;
the notes turn that into time with the 02:55 fit (F ~11.5 us + the stream).

    python scripts/mla_parts_model.py
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forgekernel.bench.suites.mla_decode import BENCH_CASES  # noqa: E402
from forgekernel.kernels.attention.mla.sm90 import config, schedule  # noqa: E402

SMS = 132
OVERHEAD = config.SPLIT_OVERHEAD_TILES


def _list_makespan(costs: list[int], slots: int) -> int:
    """Greedy: each CTA (its cost) on the slot that frees first, in launch order."""
    free = [0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def today(tiles: list[int], head_blocks: int) -> int:
    splits, per_keys = config.tile_split_plan(
        len(tiles), head_blocks, max(tiles) * config.TILE, SMS, config.RESIDENT
    )
    if splits > 1 and len(tiles) > 1:  # the step's schedule (launch.schedule_shapes' rule)
        fewest = min(max(tiles), config.MIN_TOKENS_PER_SPLIT // config.TILE)
        cap = schedule.ranged_capacity(len(tiles), SMS)
        per_keys, items, _ = schedule.ranged_plan(tiles, head_blocks, fewest, SMS, cap)
        per = per_keys // config.TILE
        costs = [min(per, tiles[u] - s * per) + OVERHEAD for u, s in items]
    else:
        per = per_keys // config.TILE
        costs = [min(per, t - s * per) + OVERHEAD for t in tiles for s in range(splits)]
    return _list_makespan([c for c in costs for _ in range(head_blocks)], SMS)


def parts(tiles: list[int], head_blocks: int) -> int:
    """The busiest part's cost: pieces of one unit's tiles, contiguous over the batch."""
    n = SMS // head_blocks
    payload = -(-sum(t + OVERHEAD for t in tiles) // n) + OVERHEAD
    loads, left, u = [], list(tiles), 0
    for _ in range(n):
        room, load = payload, 0
        while u < len(tiles):
            if room >= left[u] + OVERHEAD:  # the rest of unit u fits
                room -= left[u] + OVERHEAD
                load += left[u] + OVERHEAD
                u += 1
            else:
                if room > OVERHEAD:  # a piece of it
                    left[u] -= room - OVERHEAD
                    load += room
                break
        loads.append(load)
    assert u == len(tiles), "the payload covers every unit"
    return max(loads)


def main() -> None:
    print(f"{'case':28s} {'today':>6s} {'parts':>6s} {'bound':>6s} {'parts/today':>11s}")
    for case in BENCH_CASES:
        p = case.params
        # one sequence keeps the width plan (launch.schedule_shapes): nothing to balance
        if p["page"] != 64 or p["cache"] != "combined" or "q_lens" in p or p["b"] == 1:
            continue
        heads = config.heads_per_cta(p["hq"], p["s_q"])
        blocks = p["hq"] // heads
        tiles = [max(1, -(-n // config.TILE)) for n in p["lens"]]
        t, q = today(tiles, blocks), parts(tiles, blocks)
        bound = sum(t + OVERHEAD for t in tiles) * blocks / SMS
        print(f"{case.name:28s} {t:6d} {q:6d} {bound:6.1f} {q / t:11.3f}")


if __name__ == "__main__":
    main()
