"""L2-reuse model of the sm90 attention forward's tile order and deal (CPU only).

Fixed length, causal, 128 x 128 tiles. The tiles go in the kernel's longest-first order
(`scheduler.longest_first`: the row block slowest over every head and batch, or batch by batch
in L2 sections of `section` query heads, the row block slowest within a section); a deal runs
them on 132 CTAs: `static` (CTA c takes tiles c, c + 132, ...: ours) or `greedy` (each tile in
order to the CTA that frees first: FA4's one CTA a tile under the hardware's dispatch, FA3's
and `AttnConfig.dynamic`'s tile counter). A CTA reads its tile's key blocks last to first, one
a step, steps of equal time, tile_cost steps between tiles. Every K + V block read goes
through an LRU cache of `l2_mib`; the misses are the K / V bytes read from HBM.

    python scripts/attn_l2_model.py

docs/attention/NOTES.md, "192/128 against FA4's schedule".
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

SMS = 132
TILE = 128


def tiles(b: int, hq: int, hkv: int, sq: int, sk: int, section: int | None) -> list[tuple]:
    """(kv head, key blocks) of each tile in the kernel's order (section None: global)."""
    m_blocks, group = math.ceil(sq / TILE), hq // hkv

    def blocks(m: int) -> int:
        last = min((m + 1) * TILE, sq) - 1
        return max(min(math.ceil(sk / TILE), (last + sk - sq + TILE) // TILE), 0)

    if section is None:
        heads = [(bb, h) for bb in range(b) for h in range(hq)]
        return [(bb * hkv + h // group, blocks(m_blocks - 1 - r))
                for r in range(m_blocks) for bb, h in heads]  # fmt: skip
    out = []
    for bb in range(b):
        for h0 in range(0, hq, section):
            here = range(h0, min(h0 + section, hq))
            out += [(bb * hkv + h // group, blocks(m_blocks - 1 - r))
                    for r in range(m_blocks) for h in here]  # fmt: skip
    return out


def reads(order: list[tuple], deal: str, tile_cost: float = 0.5) -> list[tuple]:
    """(time, kv head, key block) of every block read under `deal` ("static" or "greedy")."""
    events = []
    if deal == "greedy":
        free = [(0.0, c) for c in range(SMS)]
        for head, n in order:
            t, c = heapq.heappop(free)
            events += [(t + i, head, n - 1 - i) for i in range(n)]
            heapq.heappush(free, (t + n + tile_cost, c))
    else:
        for c in range(SMS):
            t = 0.0
            for head, n in order[c::SMS]:
                events += [(t + i, head, n - 1 - i) for i in range(n)]
                t += n + tile_cost
    return sorted(events)


def hbm_bytes(events: list[tuple], block_bytes: int, l2_mib: float) -> int:
    """K / V bytes that miss an LRU cache of l2_mib holding whole blocks."""
    cap, lru, misses = int(l2_mib * 2**20 // block_bytes), OrderedDict(), 0
    for _, head, block in events:
        key = (head, block)
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = None
            if len(lru) > cap:
                lru.popitem(last=False)
    return misses * block_bytes


# name: ((b, hq, hkv, sq, sk), D + Dv, section heads or None): the bench's 192/128 cases in the
# default's order (sections of 40 MiB of K / V past a 320 MiB wave) and in FA4's at s2048, two
# GQA D = 128 fixed-length cases the tile counter was timed on (2026-12-04).
CASES = {
    "d192 b8 s2048 (global)": ((8, 128, 128, 2048, 2048), 320, None),
    "d192 b8 s2048 (sections of 32)": ((8, 128, 128, 2048, 2048), 320, 32),
    "d192 b2 s8192 (sections of 8)": ((2, 128, 128, 8192, 8192), 320, 8),
    "d192 b1 s16384 (sections of 4)": ((1, 128, 128, 16384, 16384), 320, 4),
    "d192 chunked sq2048 sk16384 (sections of 4)": ((1, 128, 128, 2048, 16384), 320, 4),
    "d128 b1 hq32 hkv8 sq2048 sk8192 (global)": ((1, 32, 8, 2048, 8192), 256, None),
    "d128 b2 hq32 hkv8 sq1024 sk16384 (global)": ((2, 32, 8, 1024, 16384), 256, None),
}


def table(l2_mibs: tuple[float, ...] = (50, 25)) -> dict[str, dict]:
    """Per case: GB of K / V read, and from HBM per deal and cache size."""
    out = {}
    for name, (shape, dims, section) in CASES.items():
        order = tiles(*shape, section)
        block = TILE * dims * 2
        row = {"read": sum(n for _, n in order) * block / 1e9}
        for deal in ("static", "greedy"):
            events = reads(order, deal)
            for mib in l2_mibs:
                row[(deal, mib)] = hbm_bytes(events, block, mib) / 1e9
        out[name] = row
    return out


def main() -> None:
    for name, row in table().items():
        cells = ", ".join(f"{d} {m} MiB {v:.2f}" for (d, m), v in
                          ((k, v) for k, v in row.items() if k != "read"))  # fmt: skip
        print(f"{name}: read {row['read']:.1f} GB; from HBM (GB): {cells}")


if __name__ == "__main__":
    main()
