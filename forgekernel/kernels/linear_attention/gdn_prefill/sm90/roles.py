"""Warp roles and named barriers of the chunked prefill kernel (`chunked_fwd.py`)."""

from __future__ import annotations

from enum import IntEnum

from forgekernel.kernels.common.sm90.barriers import FIRST_FREE
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import STATE_WGS


class Bar(IntEnum):
    """Named barriers (id 0 is __syncthreads)."""

    AUX = FIRST_FREE  # the aux warpgroup's 128 threads (inverse phases, scratch reuse)
    OUT = FIRST_FREE + 1  # OUT + w: state warpgroup w's 128 threads (its O tile)


PRODUCER_WARP = 0  # warpgroup 0: TMA loads
GATE_WARP = 1  # warpgroup 0: g, beta and the chunk's cumulative decay
# The q / k ring is released by lane 0 of every aux and state warp, the v ring by the state
# warps'.
QK_CONSUMER_WARPS = (1 + STATE_WGS) * THREADS_PER_WG // WARP_SIZE
V_CONSUMER_WARPS = STATE_WGS * THREADS_PER_WG // WARP_SIZE
