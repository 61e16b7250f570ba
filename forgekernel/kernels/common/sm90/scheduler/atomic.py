"""Dynamic persistent tiles: one CTA per multiprocessor takes tiles from a global counter.

CTA c starts on tile c; each later tile is grid + the counter's old value, bumped by one lane
of the CTA's producer warp once the current tile's loads are issued. Tiles of uneven work
(causal key blocks, GQA groups, varlen sequences) then fill the multiprocessors as they free
up, and a tile's first loads overlap the previous tile's last steps. The counter is an int32
in global memory, zeroed before the launch; the tile ids' order and their decoding into
coordinates are the kernel's.

The producer hands each tile id to the CTA's other warps through a small shared-memory ring
(`TileRing`, STAGES slots, one mbarrier pair each): a warp takes the next id when it starts
its next tile, so the producer runs up to STAGES tiles ahead. After its last tile the producer
publishes a sentinel (any id >= the tile count) that ends every taker's loop:

    producer warp                              every other warp (`takers` of them)
    tile = first_tile()                        tile, st = take(ring, st, lane)
    while tile < num_tiles:                    while tile < num_tiles:
        st = publish(ring, st, tile, lane)         ... the tile's work ...
        ... the tile's loads ...                   tile, st = take(ring, st, lane)
        tile = next_tile(counter, lane, grid)
    publish(ring, st, num_tiles, lane)

(`publish` / `take` are functions, not methods: a DSL `while` treats an object whose methods
it calls as loop-carried state.)

The kernel's shared storage declares the ring's fields:
    tile_barriers: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
    tile_ids: cute.struct.MemRange[Int32, STAGES]
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32

from forgekernel.kernels.common.sm90 import pipeline as pipes

STAGES = 2  # tile ids in flight from the producer to the other warps


class TileRing:
    """The producer warp's tile ids to `takers` warps (lane 0 of each releases a slot)."""

    def __init__(self, barriers, ids, takers: int):
        self.pipe = pipes.async_pipeline(barriers, STAGES, takers)
        self.ids = ids.get_tensor(cute.make_layout(STAGES))

    @staticmethod
    def producer_state():
        return pipes.producer_state(STAGES)

    @staticmethod
    def consumer_state():
        return pipes.consumer_state(STAGES)


@cute.jit
def publish(ring: TileRing, state, tile: Int32, lane: Int32):
    """Producer warp: `tile` into the ring's next slot (waits until every taker has read the id
    that slot held STAGES tiles ago); returns the advanced state."""
    pipe, ids = ring.pipe, ring.ids  # (a DSL `if` treats an object it writes into as state)
    pipe.producer_acquire(state)
    if lane == 0:
        ids[state.index] = tile
        pipe.producer_commit(state)
    state.advance()
    return state


@cute.jit
def take(ring: TileRing, state, lane: Int32):
    """A taking warp: (the next tile id, the advanced state); ids >= the tile count: none
    left."""
    pipe = ring.pipe
    pipe.consumer_wait(state)
    tile = cute.arch.make_warp_uniform(ring.ids[state.index])
    cute.arch.sync_warp()
    if lane == 0:
        pipe.consumer_release(state)
    state.advance()
    return tile, state


def first_tile() -> Int32:
    """The CTA's first tile: its index in the (1-D) grid."""
    return Int32(cute.arch.block_idx()[0])


@cute.jit
def next_tile(counter, lane: Int32, num_ctas: Int32) -> Int32:
    """Producer warp: the CTA's next tile, num_ctas + the counter's old value (lane 0 bumps the
    counter, relaxed: the tile id orders nothing else), broadcast to the warp. `counter`: a
    pointer to the zeroed global int32."""
    taken = Int32(0)
    if lane == 0:
        taken = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(taken, 0) + num_ctas
