"""Load-balance model of the sm90 attention forward's tile deal, by launch grid (CPU only).

The kernel walks tiles of 128 query rows of one head (`scheduler.longest_first`, varlen:
row block from the sequence's end slowest, then sequence, then head); CTA c takes tiles c,
c + G, c + 2G, ... of a grid of G CTAs, one CTA resident a SM. G = the SM count: a static
deal. G > SMs: the hardware starts CTA 132, 133, ... on the SMs that free first (a dynamic
deal of whole CTAs); G = tiles: one CTA a tile (FA4's sm90 varlen grid).

A tile costs its key blocks (`_key_blocks`: causal bottom-right, tight) plus `tile_cost`
blocks (the per-tile epilogue / refill a persistent CTA does not hide), a CTA `cta_cost`
more (start, first loads), an empty tile (a row block past its sequence) `empty_cost`.
Printed: busiest SM / mean load (1 = perfect) per grid, and the time of each grid relative
to one CTA a SM.

    python scripts/attn_grid_model.py
"""

from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMS = 132
TILE_M = TILE_N = 128


def key_blocks(m0: int, sq: int, sk: int, causal: bool = True) -> tuple[int, int]:
    """(key blocks a tile at row m0 processes, of them masked), as the kernel's _key_blocks."""
    n_max, n_unmasked = -(-sk // TILE_N), sk // TILE_N
    if causal:
        off = sk - sq
        q_last = min(m0 + TILE_M, sq) - 1
        n_max = min(n_max, (q_last + off + TILE_N) // TILE_N)
        n_unmasked = min(n_unmasked, (m0 + off + 1) // TILE_N)
    n_max = max(n_max, 0)
    return n_max, n_max - max(min(n_unmasked, n_max), 0)


def tiles(lens_q, lens_k, heads: int, causal: bool = True) -> list[int | None]:
    """Key blocks of every tile in the kernel's order (None: an empty tile)."""
    m_blocks = [-(-q // TILE_M) for q in lens_q]
    out: list[int | None] = []
    for r in range(max(m_blocks)):
        for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
            for _ in range(heads):
                if r < m_blocks[b]:
                    out.append(key_blocks((m_blocks[b] - 1 - r) * TILE_M, sq, sk, causal)[0])
                else:
                    out.append(None)
    return out


@dataclass(frozen=True)
class Costs:
    tile_cost: float = 0.5
    cta_cost: float = 1.5
    empty_cost: float = 0.1


def makespan(work: list[int | None], grid: int, c: Costs = Costs()) -> float:
    """Busiest SM's load with `grid` CTAs (CTA c: tiles c, c + grid, ...), started in index
    order on the first free SM."""
    grid = min(grid, len(work))
    free = [0.0] * SMS
    for cta in range(grid):
        load = c.cta_cost
        for n in work[cta::grid]:
            load += c.empty_cost if n is None else n + c.tile_cost
        heapq.heappush(free, heapq.heappop(free) + load)
    return max(free)


def dynamic_makespan(work: list[int | None], c: Costs = Costs()) -> float:
    """Busiest SM's load with one CTA a SM taking tiles in order from a counter
    (AttnConfig.dynamic): each tile to the SM that frees first, one CTA start a SM."""
    free = [c.cta_cost] * SMS
    for n in work:
        heapq.heappush(free, heapq.heappop(free) + (c.empty_cost if n is None else n + c.tile_cost))
    return max(free)


def mean_load(work: list[int | None], c: Costs = Costs()) -> float:
    return sum(n + c.tile_cost for n in work if n is not None) / SMS


def cases() -> dict[str, tuple]:
    from forgekernel.bench.suites.attention import _chunked_lengths, _varlen_lengths

    s64 = _varlen_lengths(64, 64, 1024, seed=2)
    s256 = _varlen_lengths(16, 256, 8192, seed=0)
    return {
        "varlen8-hq32-hkv8-chunk256to2048": (*_chunked_lengths(8, seed=3), 32),
        "varlen64-hq32-hkv8-s64to1024": (s64, s64, 32),
        "varlen16-hq64-hkv4-s256to8192": (s256, s256, 64),
        "b1-hq32-hkv8-sq2048-sk8192": ((2048,), (8192,), 32),
        "b2-hq64-hkv8-sq1024-sk16384": ((1024,) * 2, (16384,) * 2, 64),
    }


GRIDS = {"x1": 1, "x2": 2, "x4": 4, "x8": 8, "one_a_tile": 0, "dynamic": 1}


def table(c: Costs = Costs()) -> dict[str, dict[str, float]]:
    """Per case: 'imbalance xN' (busiest / mean) and 'time xN' (relative to x1) per grid."""
    out = {}
    for name, (lq, lk, h) in cases().items():
        work = tiles(lq, lk, h)
        base = makespan(work, SMS, c)
        row = {}
        for g, per_sm in GRIDS.items():
            if g == "dynamic":
                span = dynamic_makespan(work, c)
            else:
                span = makespan(work, SMS * per_sm if per_sm else len(work), c)
            row[f"imbalance {g}"] = span / mean_load(work, c)
            row[f"time {g}"] = span / base
        out[name] = row
    return out


def main() -> None:
    lq, lk = cases()["varlen8-hq32-hkv8-chunk256to2048"][:2]
    print("chunk256to2048: lens_q", lq, "lens_k", lk)
    blocks = masked = 0
    for sq, sk in zip(lq, lk):
        per = [key_blocks(m * TILE_M, sq, sk) for m in range(-(-sq // TILE_M))]
        blocks += 32 * sum(n for n, _ in per)
        masked += 32 * sum(k for _, k in per)
        first, last = per[0][0], per[-1][0]
        print(f"  Sq {sq:5d} Sk {sk:5d}: {len(per):2d} row blocks, key blocks {first}..{last}")
    print(f"  key blocks {blocks}, masked {masked}, per SM {blocks / SMS:.0f}")
    for costs in (Costs(), Costs(cta_cost=3.0), Costs(cta_cost=6.0)):
        print(costs)
        for name, row in table(costs).items():
            cells = "  ".join(
                f"{g} {row['imbalance ' + g]:.3f}/{row['time ' + g]:.3f}" for g in GRIDS
            )
            print(f"  {name:34s} {cells}")


if __name__ == "__main__":
    main()
