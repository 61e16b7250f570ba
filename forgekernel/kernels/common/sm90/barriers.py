"""Named barriers (`bar.sync id, threads`). Id 0 is `__syncthreads`; each kernel lists its own
ids as an `IntEnum` starting at FIRST_FREE, so that a newcomer reads every barrier of a kernel
in one place:

    class Bar(IntEnum):
        EPILOGUE = FIRST_FREE   # all consumer threads
        TURN = 2                # 2, 3: warpgroup 0's, 1's turn to issue

These are the aligned forms (`bar.sync` / `bar.arrive`): a phase's waiting threads all wait at
one instruction. A barrier waited on from two roles' code in one phase takes
unaligned_barrier.py's form instead (synccheck aborts the kernel on the aligned one).
"""

from __future__ import annotations

import cutlass.pipeline as pipeline

SYNC_THREADS = 0
FIRST_FREE = 1
MAX_BARRIERS = 16  # hardware named barriers per CTA


def named_barrier(barrier_id, num_threads) -> pipeline.NamedBarrier:
    """`barrier_id` (an IntEnum member, possibly plus an offset, or an id computed on the
    device such as `Bar.TURN + wg`) over `num_threads` threads."""
    if isinstance(barrier_id, int):  # IntEnum members are ints: pass the plain value
        barrier_id = int(barrier_id)
    return pipeline.NamedBarrier(barrier_id=barrier_id, num_threads=num_threads)
