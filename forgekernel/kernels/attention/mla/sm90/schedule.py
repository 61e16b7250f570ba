"""The device-side work list of the seesaw pass (candidate, FORGEKERNEL_MLA_WORKLIST=1), DSL-free:
what the scheduling kernel (worklist.py, one CTA before the pass) computes, written out in
Python as its reference (tests/test_mla_worklist.py replays both against each other and against
the width-sized plan), and the layout of the list it writes.

The host sizes its plan by the page table's width (config.tile_split_plan: S splits of P tiles
for every unit, launched whether or not a unit has keys there). The list keeps that plan's S
as a bound and chooses the tiles per split on the device from the units' real key counts:

  tiles_u = min(ceil(kv_end_u / TILE), W) (kv_end as the pass's `_unit`: the sequence's length,
  or its causal bound for a block of query tokens; 0 for an empty sequence or a block past its
  end; W the table's width in tiles, the op's bound on the lengths: a length past the table is
  outside the op's contract, and the list then reaches no further than the width plan would)
  per     = the tiles per split in [lo, hi] minimizing waves(per) x (per + SPLIT_OVERHEAD_TILES),
            ties to the larger per (fewer items), where items(per) = sum_u ceil(tiles_u / per),
            waves = ceil(items x head_blocks / slots), lo = max(fewest, ceil(max_u tiles_u /
            S)) (no unit more than S splits: the partials hold S), hi = max(max_u tiles_u, lo)

which is tile_split_plan's cost over the items that have keys: for a batch whose every unit
has the table's width of keys it is that plan's choice exactly (same cost, same ties, the
plan's per inside [lo, hi]). The items are the (unit, split) pairs with keys, split s of unit
u covering tiles [s per, min((s + 1) per, tiles_u)), in the width plan's launch order (split
major, units in order within a split): a uniform batch's list is the width plan's grid, CTA
for CTA. A ragged batch loses the CTAs of no keys (the width plan's empty splits) and gets a
per sized by its own lengths.

The list: int32 (CAPACITY + 1, 2), CAPACITY = units x S (every unit's S splits: the bound the
host launches the pass's grid for), row 0 = (keys per split, items), row 1 + i = (unit,
split) of item i; rows past the items are not written. The pass's CTA x (head block fastest)
reads item x // head_blocks and leaves at once past the items. The scheduling kernel also
fills the partial LSEs (S, rows, Hq) with -inf: a (split, row) no item writes then weighs 0 in
the combine (paged/sm90/combine.py skips a weight-0 split's O, whatever its row holds), so the
combine is unchanged."""

from __future__ import annotations

from collections.abc import Sequence

from forgekernel.kernels.attention.mla.sm90.config import SPLIT_OVERHEAD_TILES, TILE

HEADER = 1  # rows of the list before its items: (keys per split, items)


def capacity(units: int, splits: int) -> int:
    """Items the list can hold: every unit's `splits` (the width plan's grid, in items)."""
    return max(1, units) * max(1, splits)


def unit_tiles(
    seqlens: Sequence[int],
    width: int,
    cu_seqlens_q: Sequence[int] | None = None,
    causal: bool = True,
    q_blocks: int = 1,
    qtokens: int = 1,
) -> list[int]:
    """Tiles of keys per unit, at most `width` (the table's, in tiles): kv_end as the pass's
    `_unit` (one unit a sequence without cu_seqlens_q; else q_blocks units a sequence, block k
    of its query tokens), in TILE keys."""
    return [min(-(-max(kv_end, 0) // TILE), width) for kv_end in
            kv_ends(seqlens, cu_seqlens_q, causal, q_blocks, qtokens)]  # fmt: skip


def kv_ends(
    seqlens: Sequence[int],
    cu_seqlens_q: Sequence[int] | None = None,
    causal: bool = True,
    q_blocks: int = 1,
    qtokens: int = 1,
) -> list[int]:
    """Each unit's key bound, as the pass's `_unit`."""
    if cu_seqlens_q is None:
        return [int(sk) for sk in seqlens]
    tiles = []
    for b, sk in enumerate(seqlens):
        q_all = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        for k in range(q_blocks):
            token0 = k * qtokens
            sq = max(min(q_all - token0, qtokens), 0)
            kv_end = sk - q_all + token0 + sq if causal else sk
            tiles.append(int(kv_end) if sq > 0 else 0)
    return tiles


def items_of(tiles: Sequence[int], per: int) -> int:
    """Items (splits with keys) of all units at `per` tiles a split."""
    return sum(-(-t // per) for t in tiles)


def bounds(tiles: Sequence[int], splits: int, fewest: int) -> tuple[int, int]:
    """[lo, hi] of the tiles per split the device searches."""
    top = max(tiles, default=0)
    lo = max(fewest, -(-top // max(splits, 1)), 1)
    return lo, max(top, lo)


def choose_per(tiles: Sequence[int], head_blocks: int, splits: int, fewest: int, slots: int) -> int:
    """The tiles per split (module docstring): minimal waves x (per + overhead), ties to the
    larger per."""
    lo, hi = bounds(tiles, splits, fewest)
    best, best_per = None, lo
    for per in range(lo, hi + 1):
        waves = -(-items_of(tiles, per) * head_blocks // slots)
        cost = waves * (per + SPLIT_OVERHEAD_TILES)
        if best is None or cost <= best:
            best, best_per = cost, per
    return best_per


def work_list(tiles: Sequence[int], per: int, splits: int) -> list[tuple[int, int]]:
    """The (unit, split) items with keys, split major (the width plan's launch order)."""
    return [(u, s) for s in range(splits) for u, t in enumerate(tiles) if s * per < t]


def plan(
    tiles: Sequence[int], head_blocks: int, splits: int, fewest: int, slots: int
) -> tuple[int, list[tuple[int, int]]]:
    """(keys per split, items): what the scheduling kernel writes into the list."""
    per = choose_per(tiles, head_blocks, splits, fewest, slots)
    return per * TILE, work_list(tiles, per, splits)


def key_ranges(
    kv_ends: Sequence[int], per_keys: int, items: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int]]:
    """(unit, first key, end key) of each item, as the pass derives them (t0 = split x per,
    t1 = min(t0 + per, kv_end))."""
    return [(u, s * per_keys, min(s * per_keys + per_keys, kv_ends[u])) for u, s in items]


# ---------------------------------------------------------------- a decode step's schedule
# (`ranges`: launch.make_schedule, the scheduling kernel's `ranges` form). No bound from the
# width plan's splits: the partials are indexed by item, so the list holds RANGED_CAPACITY items
# (a wave of slots, plus one remainder a unit) and the per is searched from `fewest` over the
# whole batch's tiles, a candidate whose items exceed the capacity out of the search. Items go
# unit by unit (a unit's splits in order), and each query row gets its unit's (first item,
# items, query token) for the combine.


def ranged_capacity(units: int, slots: int) -> int:
    """Items the schedule's list holds: a wave of `slots` CTAs' items plus one a unit (every
    per >= total tiles / slots fits: sum ceil(t / per) <= total / per + units)."""
    return max(1, slots + units)


def ranged_per(tiles: Sequence[int], head_blocks: int, fewest: int, slots: int, cap: int) -> int:
    """The tiles per split: `choose_per`'s cost over [max(fewest, 1), max tiles], candidates of
    more than `cap` items excluded (the largest per always fits: one item a unit)."""
    lo = max(fewest, 1)
    hi = max(max(tiles, default=0), lo)
    best, best_per = None, lo
    for per in range(lo, hi + 1):
        items = items_of(tiles, per)
        if items > cap:
            continue
        cost = -(-items * head_blocks // slots) * (per + SPLIT_OVERHEAD_TILES)
        if best is None or cost <= best:
            best, best_per = cost, per
    return best_per


def ranged_plan(
    tiles: Sequence[int], head_blocks: int, fewest: int, slots: int, cap: int
) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]:
    """(keys per split, items unit by unit, each unit's (first item, items))."""
    per = ranged_per(tiles, head_blocks, fewest, slots, cap)
    items, ranges = [], []
    for u, t in enumerate(tiles):
        n = -(-t // per)
        ranges.append((len(items), n))
        items += [(u, s) for s in range(n)]
    return per * TILE, items, ranges


def row_ranges(
    ranges: Sequence[tuple[int, int]],
    rows: int,
    cu_seqlens_q: Sequence[int] | None = None,
    q_blocks: int = 1,
    qtokens: int = 1,
) -> list[tuple[int, int, int] | None]:
    """Each query row's (first item, items, query token), as the scheduling kernel writes them
    (None: a row no unit has, never written; `rows` = the table's rows)."""
    out: list[tuple[int, int, int] | None] = [None] * rows
    for u, (first, n) in enumerate(ranges):
        if cu_seqlens_q is None:
            out[u] = (first, n, 0)
            continue
        b, k = divmod(u, q_blocks)
        row0 = cu_seqlens_q[b] + k * qtokens
        for t in range(max(min(cu_seqlens_q[b + 1] - row0, qtokens), 0)):
            out[row0 + t] = (first, n, t)
    return out
