"""The paged decode's combine pass (kernels/attention/paged/sm90/combine.py) in torch, for the
CPU replays of the split-KV kernels (paged GQA, MLA, DSA): O = sum_s 2^(lse_s - lse) O_s,
lse = log2 sum_s 2^lse_s returned natural; O 0 and LSE -inf where no split saw a key; a split
of weight 0 (no keys) adds 0 whatever its partial row holds (stale, even NaN).

`combine_lanes` replays the kernel's own schedule (`PagedCombineSm90`): which thread group adds
which split in which order (blocks of UNROLL, the index clamped past the end, SPLIT_CAP splits
of weights at a time), the groups' sums added in group order, and which CTA (`spread`) writes
which column chunk, so the CPU tests check its index arithmetic and edge cases."""

from __future__ import annotations

import math

import torch


def combine_splits(op: torch.Tensor, lp: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """op (splits, rows, H, D) normalized partial O, lp (splits, rows, H) log2 LSE -> out, lse."""
    top = lp.max(0).values
    w = torch.where(top > -math.inf, torch.exp2(lp - top), 0.0)
    total = w.sum(0)
    rows = torch.where((w > 0)[..., None], op, 0.0)
    o = (w[..., None] * rows).sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    out.copy_(torch.where((total > 0)[..., None], o, 0.0).to(out.dtype))
    lse.copy_(torch.where(total > 0, (top + torch.log2(total)) * math.log(2), -math.inf))


def group_order(splits: int, groups: int, group: int, unroll: int, cap: int) -> list[int]:
    """The splits thread group `group` adds, in order, as `_accumulate` / `_load_block` index
    them: per chunk of `cap` splits, blocks k of `unroll`, split (k unroll + u) groups + group,
    clamped to the chunk's last and weighted 0 past it (left out here)."""
    order = []
    for c0 in range(0, splits, cap):
        n = min(splits - c0, cap)
        blocks = -(-n // (groups * unroll))
        for k in range(blocks):
            for u in range(unroll):
                i = (k * unroll + u) * groups + group
                if i < n:
                    order.append(c0 + i)
    return order


def spread_of(units: int, chunks: int, wave: int) -> int:
    """`PagedCombineSm90.__call__`'s grid z: CTAs a (row, head) takes, its column chunks'."""
    return max(min(wave // max(units, 1), chunks), 1)


def combine_lanes(op: torch.Tensor, lp: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """`combine_splits` by the kernel's schedule, fp32 (its sums in its order)."""
    from forgekernel.kernels.attention.paged.sm90 import combine as kc
    from forgekernel.kernels.attention.paged.sm90.config import THREADS

    splits, rows, heads, d = op.shape
    kernel = kc.PagedCombineSm90(d)
    spread = spread_of(rows * heads, kernel.chunks, kc.WAVE_CTAS)
    lp, op = lp.float(), op.float()
    top = lp.max(0).values if splits else torch.full((rows, heads), -math.inf)
    finite = top > -math.inf
    w = torch.where(finite, torch.exp2(lp - torch.where(finite, top, 0.0)), 0.0)
    total = w.sum(0) if splits else torch.zeros(rows, heads)
    sums = torch.zeros(kernel.groups, rows, heads, d)
    for g in range(kernel.groups):
        acc = torch.zeros(rows, heads, d)
        for s in group_order(splits, kernel.groups, g, kc.UNROLL, kc.SPLIT_CAP):
            ws = w[s][..., None]
            acc = acc + ws * torch.where(ws > 0, op[s], 0.0)
        sums[g] = acc
    o = sums[0]
    for g in range(1, kernel.groups):
        o = o + sums[g]
    o = torch.where((total > 0)[..., None], o / torch.where(total > 0, total, 1.0)[..., None], 0.0)
    written = torch.zeros(d, dtype=torch.int32)
    for first in range(spread):  # each CTA of a row its chunks first, first + spread, ...
        for chunk in range(first, kernel.chunks, spread):
            written[chunk * kernel.cols : (chunk + 1) * kernel.cols] += 1
    assert torch.equal(written, torch.ones_like(written)), "a column written not exactly once"
    assert kernel.groups * kernel.vecs == THREADS
    out.copy_(o.to(out.dtype))
    lse.copy_(torch.where(total > 0, (top + torch.log2(total)) * math.log(2), -math.inf))
