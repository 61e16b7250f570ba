"""A CPU model of the indexer's two kernels (torch only), for the tests: the logits as the
epilogue sums them (fp32, the kernel's order) and the top-k exactly as topk.py walks it (keys,
parts, histogram rounds and their decisions, the ranks of the compaction), so that the
algorithm and its arithmetic are checked against the references on a CPU.

What it models:
- the logits' CTAs of prefill (`logits_ctas`): each one's first key, tiles and the start of
  every TMA box it loads, as `logits.py`'s `_range` and producer compute them;
- logits: q . k per (key, head) in fp64 (the tensor core's sum of 128 exact fp8 products; its
  rounding is not modelled), then per row and token: over head groups g = 0..7 of each quad
  lane (heads 8 g + 2 lane + e), two fp32 partial sums (e = 0, 1) of relu x w in g order,
  their sum, the butterfly over the quad ((l0 + l1) + (l2 + l3)), times the key's scale;
- top-k: the int32 order-preserving keys (-0 as +0; -inf and NaN hidden), the cluster's parts
  (ceil(n / cluster) rounded up to 4), the valid count / min / max, up to ROUNDS histogram
  rounds of (key >> shift) - (lo >> shift) over BINS bins with the suffix-scan decision, and
  the compaction's ranks from per-warp and per-CTA counts, then -1 padding.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    CACHE,
    HEADS,
    HIST_BITS,
    PAGE,
    TILE,
    key_origin,
)

BINS = 1 << HIST_BITS
ROUNDS = 3
WARPS = 16
HIDDEN = -(1 << 31)


# ---------------------------------------------------------------- logits


def logits_ctas(
    starts: torch.Tensor, ends: torch.Tensor, width: int, qtokens: int, per: int, splits: int
) -> list[dict]:
    """Prefill logits CTAs (split x, group y) as `_range` plans them: the group's rows (the
    last one repeated past the end), their key range [key0, key0 + TILE x total) with key0 =
    key_origin(smallest start), this split's tiles [first, first + count) of it, and `scale_box`,
    the start key of each of its 1-D k_scale TMA boxes (must be a multiple of 4: 16 bytes)."""
    rows = starts.shape[0]
    out = []
    for group in range(-(-rows // qtokens)):
        members = [min(group * qtokens + q, rows - 1) for q in range(qtokens)]
        lo = key_origin(max(min(int(starts[r]) for r in members), 0))
        hi = min(max(int(ends[r]) for r in members), width)
        total = max(hi - lo + TILE - 1, 0) // TILE
        for split in range(splits):
            first = split * per
            count = max(min(first + per, total) - first, 0)
            boxes = [lo + TILE * (first + i) for i in range(count)]
            out.append({"split": split, "group": group, "rows": members, "key0": lo,
                        "first": first, "count": count, "scale_box": boxes})  # fmt: skip
    return out


def logits_model(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """(rows, keys) fp32 as the epilogue computes them: q (rows, 64, 128) and k (keys, 128) any
    float dtype (fp8 included), weights (rows, 64), k_scale (keys,)."""
    dots = torch.einsum("rhd,nd->rnh", q.double(), k.double()).float()  # (rows, keys, 64)
    w = weights.float()
    act = dots.clamp(min=0.0) * w[:, None, :]
    # head 8 g + 2 lane + e -> (g, lane, e)
    act = act.unflatten(-1, (HEADS // 8, 4, 2))
    partial = torch.zeros(*act.shape[:2], 4, 2)
    for g in range(HEADS // 8):
        partial = partial + act[:, :, g]
    lanes = partial[..., 0] + partial[..., 1]  # (rows, keys, 4)
    total = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3])
    return total * k_scale.float()[None, :]


# ---------------------------------------------------------------- top-k


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 holding the kernel's int32 keys: larger value, larger key; -inf / NaN HIDDEN."""
    raw = values.float().contiguous().view(torch.int32).long()
    raw = torch.where(raw == HIDDEN, 0, raw)  # -0 is +0
    key = torch.where(raw < 0, raw ^ 0x7FFFFFFF, raw)
    hidden = torch.isnan(values) | (values == float("-inf"))
    return torch.where(hidden, HIDDEN, key)


def _shift(lo: int, hi: int) -> int:
    shift = 0
    for _ in range(32 - HIST_BITS):
        if (hi >> shift) - (lo >> shift) >= BINS:
            shift += 1
    return shift


def _round(keys: torch.Tensor, lo: int, hi: int, need: int, shift: int) -> tuple[int, ...]:
    """One histogram round: (lo, hi, need, inside) after it."""
    base = lo >> shift
    inside = keys[(keys >= lo) & (keys <= hi)]
    counts = torch.bincount((inside >> shift) - base, minlength=BINS)
    assert counts.numel() == BINS, "a bin past the histogram"
    top_down = counts.flip(0)
    cum = top_down.cumsum(0)
    found = ((cum - top_down < need) & (cum >= need)).nonzero()
    i = int(found[0])
    d, above = BINS - 1 - i, int(cum[i] - top_down[i])
    first = (base + d) << shift
    last = first + (1 << shift) - 1
    return max(first, lo), min(last, hi), need - above, int(top_down[i])


def select_state(keys: torch.Tensor, topk: int) -> tuple[int, int, int, int]:
    """(lo, hi, need, selected) after the rounds: keys > hi and the first `need` keys in
    [lo, hi] are selected, `selected` = min(topk, valid) in all."""
    valid = keys[keys != HIDDEN]
    count = valid.numel()
    lo = int(valid.min()) if count else (1 << 31) - 1
    hi = int(valid.max()) if count else HIDDEN
    need, inside = min(count, topk), count
    shift = _shift(lo, hi) if count else 0
    for _ in range(ROUNDS):
        if not (need < inside and lo < hi):
            break
        lo, hi, need, inside = _round(keys, lo, hi, need, shift)
        shift = max(shift - HIST_BITS, 0)
    assert (need == inside or lo == hi) or count <= topk, "unresolved after the rounds"
    return lo, hi, need, min(count, topk)


def _parts(n: int, cluster: int) -> list[tuple[int, int]]:
    """(first, count) of each CTA's part of a window of n values."""
    part = (-(-n // cluster) + 3) // 4 * 4
    bounds = [(r * part, max(0, min(r * part + part, n) - r * part)) for r in range(cluster)]
    assert all(m <= CACHE for _, m in bounds), "a part larger than the cache"
    return bounds


def _ranks(keys: torch.Tensor, lo: int, hi: int, cluster: int) -> tuple[torch.Tensor, ...]:
    """Per value of the window: (above hi, in [lo, hi], aboves before it, in-range before it),
    the counts built as the kernel builds them: per warp segment, then warps, then CTAs."""
    is_above, is_tie = keys > hi, (keys >= lo) & (keys <= hi)
    above_before = torch.zeros_like(keys)
    tie_before = torch.zeros_like(keys)
    cta_above = cta_tie = 0
    for first, m in _parts(keys.numel(), cluster):
        seg = -(-m // (WARPS * 32)) * 32
        warp_above, warp_tie = cta_above, cta_tie
        for w in range(WARPS):
            lo_i, hi_i = first + min(w * seg, m), first + min(w * seg + seg, m)
            a, t = is_above[lo_i:hi_i].long(), is_tie[lo_i:hi_i].long()
            above_before[lo_i:hi_i] = warp_above + a.cumsum(0) - a
            tie_before[lo_i:hi_i] = warp_tie + t.cumsum(0) - t
            warp_above += int(a.sum())
            warp_tie += int(t.sum())
        cta_above, cta_tie = warp_above, warp_tie
    return is_above, is_tie, above_before, tie_before


def topk_row_model(values: torch.Tensor, topk: int, cluster: int = 1) -> torch.Tensor:
    """int64 (topk,): window positions of the kernel's selection, ascending, -1 padded."""
    keys = order_keys(values)
    lo, hi, need, selected = select_state(keys, topk)
    is_above, is_tie, above_before, tie_before = _ranks(keys, lo, hi, cluster)
    out = torch.full((topk,), -1, dtype=torch.long)
    pos = torch.arange(keys.numel())
    take_above = is_above
    take_tie = is_tie & (tie_before < need)
    slot = torch.where(take_above, above_before + tie_before.clamp(max=need),
                       above_before + tie_before)  # fmt: skip
    chosen = take_above | take_tie
    slots = slot[chosen]
    assert slots.numel() == selected and torch.equal(slots.sort().values, torch.arange(selected))
    out[slots] = pos[chosen]
    return out


def topk_model(
    logits: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    topk: int,
    cluster: int = 1,
    table: torch.Tensor | None = None,
    next_n: int = 1,
) -> torch.Tensor:
    """int32 (rows, topk) as the top-k kernel writes it: per row the columns of its window
    [start, end) (clipped to the logits' width) selected, ascending, -1 padded; with a block
    table, column c of row r as the slot table[r // next_n, c // 64] * 64 + c % 64."""
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        start, end = max(int(starts[r]), 0), min(int(ends[r]), logits.shape[1])
        if end <= start:
            continue
        picked = topk_row_model(logits[r, start:end], topk, cluster)
        cols = torch.where(picked >= 0, picked + start, -1)
        if table is not None:
            pages = table[r // next_n].long()[cols.clamp(min=0) // PAGE]
            cols = torch.where(cols >= 0, pages * PAGE + cols % PAGE, -1)
        out[r] = cols.int()
    return out
