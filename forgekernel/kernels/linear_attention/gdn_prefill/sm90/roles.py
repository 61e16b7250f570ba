"""Warp roles and named barriers of the chunked prefill kernel (`chunked_fwd.py`)."""

from __future__ import annotations

from enum import IntEnum

from forgekernel.kernels.common.sm90.barriers import FIRST_FREE
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE


class Bar(IntEnum):
    """Named barriers (id 0 is __syncthreads)."""

    AUX = FIRST_FREE  # the aux warpgroup's 128 threads (inverse phases, scratch reuse)
    OUT = FIRST_FREE + 1  # OUT + w: the CTA's state warpgroup w's 128 threads (its O tile)
    AUX2 = FIRST_FREE + 3  # the second aux warpgroup's (a split CTA's: config.aux_wgs)


def aux_barrier_id(a):
    """Aux warpgroup a's named barrier (a: 0 or 1, a device value)."""
    return int(Bar.AUX) + a * (int(Bar.AUX2) - int(Bar.AUX))


PRODUCER_WARP = 0  # warpgroup 0: TMA loads
GATE_WARP = 1  # warpgroup 0: g, beta and the chunk's cumulative decay
T_WARP = 2  # warpgroup 0, the `t_pre` form only: TMA loads of the precomputed T diag(beta)
O_WARP = 3  # warpgroup 0, with `o_warp` (the t_pre form, or the standard form's key): O tiles out
O_FULL_ARRIVALS = THREADS_PER_WG  # every state thread, after its stmatrix and proxy fence
O_EMPTY_ARRIVALS = WARP_SIZE  # every lane of the O warp, once the tile has been read


def gate_warp_witnesses_qk(aux_wgs: int) -> bool:
    """Whether the gate warp waits (in chunk order, without arriving) on the q / k ring's full
    barrier of chunk c before it commits chunk c's gates, and the aux warpgroups wait for their
    gate stage before their q / k wait. Needed with two aux warpgroups: QK_STAGES is odd, so
    the chunk a stage held before c (c - 3) belongs to the other aux warpgroup, which an aux
    warpgroup never waited on; an mbarrier parity wait names the current or the preceding
    phase only, and if c - 3's TMA had not landed yet, the wait for c (parity of c - 3's phase
    plus one) would pass at once on the stage still holding c - 3 (and its release would count
    toward c - 3's empty phase). The gate warp sees every chunk in order, so once it has seen c
    land, the aux warpgroup's parity wait names the preceding phase (tests/
    test_gdn_prefill_rings.py replays the parities with TMA landings out of order)."""
    return aux_wgs > 1


def qk_consumer_warps(state_wgs: int) -> int:
    """The q / k ring is released by lane 0 of every aux and state warp."""
    return (1 + state_wgs) * THREADS_PER_WG // WARP_SIZE


def v_consumer_warps(state_wgs: int) -> int:
    """The v ring is released by lane 0 of every state warp."""
    return state_wgs * THREADS_PER_WG // WARP_SIZE
