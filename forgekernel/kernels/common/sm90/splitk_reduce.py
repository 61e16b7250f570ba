"""Split-K's reduce-add form: each part adds its fp32 tile into its tile's one slot (kept zero
between launches, as the flags) and the tile's last part reads that slot alone; a sum in arrival
order, not bitwise repeatable (its users fall back to splitk.py's ordered `park` / `sum_parts`
under torch's deterministic algorithms). splitk.py's slot layout and flag protocol; kept apart
from splitk.py so that the GEMMs, which import splitk only, keep their sources.

The weight gradient's reduce split (conv/sm90/wgrad.py `_reduce_part`) adds its staged tile with
one bulk reduce-add and counts the part; the tile's last part then `take_sum`s: acc = the slot
(every part added, its own too; the count's acquire orders the loads after them), then zeroes
it, as the flag (the next launch's parts add into zero; launches on one stream and a graph's
replays run in order). The convolutions' stream K, which added from the registers
(`add_part`), was measured slower and dropped (2026-12-04 04:44, docs/conv/NOTES.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90.splitk import slot_view


@cute.jit
def take_sum(acc, mWork, slot, threads: cutlass.Constexpr, thread):
    """The reduce-add form's last part: acc = its tile's sum slot (every part added), which it
    then zeroes (the next launch's parts add into zero; the flags' protocol)."""
    src = slot_view(mWork, cute.size(acc), threads, slot, thread)
    cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
    zero = cute.make_rmem_tensor(src.layout.shape, cutlass.Float32)
    zero.fill(0.0)
    cute.autovec_copy(zero, src)
