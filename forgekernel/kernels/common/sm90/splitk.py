"""Split-K: one output tile's reduction cut into parts that different CTAs compute, summed
exactly and deterministically by the part that finishes last. No atomics on the data and
nobody waits for another CTA (a part that is not last leaves), so any grid is safe.

Protocol, per part (every consumer thread of the CTA):
1. `park`: write the fp32 accumulator into the part's slot of the workspace, then one thread
   counts the part in the tile's flag (fetch-add, acquire-release, GPU scope) after a barrier
   over the consumer threads (every thread's writes precede the release); the part that
   brings the count to `parts` is the last: it clears the flag (the next launch finds it zero)
   and tells the others through shared memory.
2. the last part's threads `sum_parts`: every part's slot, in part order (part 0 first: the
   same sum whatever order the parts finished in), into the accumulator; then the epilogue.

Users: the convolutions' split K (a grid dimension of splits; part p of tile t in slot
p x tiles + t) and the GEMM's stream K (kernels/gemm/dense/sm90/kernel.py, the dense and the
FP8 GEMM: CTA c parks its first unit in slot 2c and its last in 2c + 1, so a tile's parts
p >= 1 lie at 2 (first + p) and part 0 at 2 first or 2 first + 1: `sum_parts`'s `head`).

Slot layout (the dense GEMM's stream-K layout, kernels/gemm/dense/sm90/kernel.py `_partial`):
element 4i + j of thread t's fragment at [i][t][j] of the slot, so that each warp's 16-byte
vectors are contiguous and each thread reads back exactly what the same thread of another
CTA wrote (every CTA's fragment layout is the same). A slot is fragment x threads floats.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90.atomics import atom_add_acq_rel_gpu


def slot_view(mWork: cute.Tensor, frag: int, threads: int, slot, thread) -> cute.Tensor:
    """Thread `thread`'s (of `threads`) view of `slot` of the fp32 workspace mWork, for a
    fragment of `frag` floats (a multiple of 4; every stride static and a multiple of 4: the
    16-byte vectors stay aligned)."""
    slots = cute.make_tensor(
        mWork.iterator,
        cute.make_layout(
            (4, frag // 4, threads, mWork.shape[0] // (frag * threads)),
            stride=(1, threads * 4, 4, frag * threads),
        ),
    )
    return slots[(None, None, thread, slot)]


@cute.jit
def park(acc, mWork, mFlags, where, threads: cutlass.Constexpr, thread, barrier, s_last):
    """Park this part's accumulator in its slot and count it in its tile's flag; True in every
    thread for the tile's last part. `where`: (slot, tile, parts); `thread`: this thread's
    index among the `threads` consumer threads (0 counts); `barrier` spans them; `s_last`: an
    Int32 of shared memory."""
    slot, tile, parts = where
    dst = slot_view(mWork, cute.size(acc), threads, slot, thread)
    cute.autovec_copy(cute.make_tensor(acc.iterator, dst.layout.shape), dst)
    # Every thread's partial is written before the fetch-add releases them.
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
def sum_parts(acc, mWork, slots, threads: cutlass.Constexpr, thread, head=None):
    """acc = the sum of the parts parked in slots first, first + step, ... (`slots`: (first,
    step, parts)), in that order, fp32; `head`, where given, is part 0's slot instead of
    `first`. Each later part is added a chunk of CHUNK floats at a time, so that a large
    accumulator (128 floats a thread for a 128x256 tile) does not need a second one beside it
    in registers; a fragment that is no multiple of CHUNK (tile_n 144: 72 floats a thread, 80:
    40) adds its last floats one 16-byte vector at a time (they were dropped: swapped stream
    K's wrong output of 2026-12-02 18:47)."""
    first, step, parts = slots
    frag = cute.size(acc)
    src = slot_view(mWork, frag, threads, first if head is None else head, thread)
    cute.autovec_copy(src, cute.make_tensor(acc.iterator, src.layout.shape))
    vecs = CHUNK // 4
    part = cute.make_rmem_tensor((4, vecs), cutlass.Float32)
    for p in range(1, parts):
        src = slot_view(mWork, frag, threads, first + p * step, thread)
        for c in cutlass.range_constexpr(frag // CHUNK):
            cute.autovec_copy(cute.local_tile(src, (4, vecs), (0, c)), part)
            for v in cutlass.range_constexpr(CHUNK):
                acc[c * CHUNK + v] = acc[c * CHUNK + v] + part[v]
        # the vectors past the last whole chunk (none where CHUNK divides the fragment)
        for i in cutlass.range_constexpr(frag // CHUNK * CHUNK // 4, frag // 4):
            tail = cute.make_rmem_tensor((4, 1), cutlass.Float32)
            cute.autovec_copy(cute.local_tile(src, (4, 1), (0, i)), tail)
            for j in cutlass.range_constexpr(4):
                acc[4 * i + j] = acc[4 * i + j] + tail[j]


CHUNK = 16  # floats of a later part added at a time (four 16-byte vectors)
