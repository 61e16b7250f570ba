"""Split-K's reduce-add form: each part adds its fp32 accumulator into its tile's one slot
(kept zero between launches, as the flags) and the tile's last part reads that slot alone; a
sum in arrival order, not bitwise repeatable (its users fall back to splitk.py's ordered
`park` / `sum_parts` under torch's deterministic algorithms). splitk.py's slot layout and flag
protocol; kept apart from splitk.py so that the GEMMs, which import splitk only, keep their
sources (the convolutions use both).

Protocol, per part (every consumer thread of the CTA):
1. `add_part`: every consumer thread adds its fp32 accumulator into the tile's one slot
   (`red.global.add.v4.f32`, relaxed, from the registers), then counts the part as `park` does
   (barrier, then thread 0's acquire-release fetch-add: its release orders every thread's adds
   before it, as `park`'s stores); the slot is zero before the tile's first part.
2. the last part's threads `take_sum`: acc = the slot (every part added, its own too; the
   fetch-add's acquire orders the loads after them), then zero it, as the flag (the next
   launch's parts add into zero; launches on one stream and a graph's replays run in order).
The weight gradient's reduce split (conv/sm90/wgrad.py) adds its staged tile with one bulk
reduce-add instead; the convolutions' stream K (conv/sm90/kernel.py), whose ring is the next
unit's by then, from the registers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90.atomics import atom_add_acq_rel_gpu
from forgekernel.kernels.common.sm90.splitk import slot_view


@cute.jit
def add_part(acc, mWork, mFlags, where, threads: cutlass.Constexpr, thread, barrier, s_last):
    """The reduce-add form's `park`: add this part's fp32 accumulator into its tile's sum slot
    (zero before the tile's first part) with `red.global.add.v4.f32` from the registers, then
    count the part in the tile's flag; True in every thread for the tile's last part (which
    then `take_sum`s). `where`: (slot, tile, parts); the rest as `park`."""
    slot, tile, parts = where
    dst = slot_view(mWork, cute.size(acc), threads, slot, thread)
    for i in cutlass.range_constexpr(cute.size(acc) // 4):
        quad = cute.make_tensor(acc.iterator + 4 * i, cute.make_layout(4)).load()
        cute.arch.red(dst[(None, i)].iterator, quad, op="add", dtype=cutlass.Float32,
                      sem="relaxed", scope="gpu")  # fmt: skip
    # Every thread's additions are issued before the fetch-add releases them.
    barrier.arrive_and_wait()
    if thread == 0:
        arrived = atom_add_acq_rel_gpu(mFlags.iterator + tile, 1)
        last = arrived == parts - 1
        if last:
            mFlags[tile] = 0
        s_last[0] = cutlass.Int32(last)
    barrier.arrive_and_wait()
    return s_last[0] != 0


@cute.jit
def take_sum(acc, mWork, slot, threads: cutlass.Constexpr, thread):
    """The reduce-add form's last part: acc = its tile's sum slot (every part added), which it
    then zeroes (the next launch's parts add into zero; the flags' protocol)."""
    src = slot_view(mWork, cute.size(acc), threads, slot, thread)
    cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
    zero = cute.make_rmem_tensor(src.layout.shape, cutlass.Float32)
    zero.fill(0.0)
    cute.autovec_copy(zero, src)
