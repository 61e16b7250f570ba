"""The main kernel's warp roles, register split and named barriers (one place for the ids)."""

from __future__ import annotations

from enum import IntEnum

from forgekernel.kernels.common.sm90.barriers import FIRST_FREE

PRODUCER_WARP = 0  # warpgroup 0: TMA loads (producer.py)
DQ_WRITER_WARP = 1  # warpgroup 0: dQ reductions (dq_reduction.py); warps 2, 3 idle
# warpgroups 1, 2: the consumers (consumer.py, mma_step.py, epilogue.py)
# setmaxnreg: 240 x 256 consumer threads + 24 x 128 producer / dQ-writer threads <= 64 K
CONSUMER_REGS = 240
PRODUCER_REGS = 24


class Bar(IntEnum):
    """Named barriers. The dQ hand-over: the consumers arrive on FULL once the staging buffer
    holds their tile (the writer waits), the writer arrives on EMPTY once it is drained (the
    consumers wait); 128 or 256 consumer threads + the writer warp."""

    CONSUMERS = FIRST_FREE  # the 256 consumer threads
    DQ_FULL = 2  # joint hand-over; dq_split: 2 + warpgroup (2, 3)
    DQ_EMPTY = 4  # joint hand-over
    DQ_EMPTY_SPLIT = 6  # dq_split: 6 + warpgroup (6, 7)
