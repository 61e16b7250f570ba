"""DSA score recompute configurations (DSL-free): the compiled variants and the shared-memory
plan of kernel.py.

A CTA takes one query token and all H of its heads. Q sits in shared memory as NCHUNK K-chunks
of (H, CHUNK) (the WGMMA's B operand, H = its N); the top-k rows stream through a ring of
`ring_slots(H)` slots, each one K-chunk (TILE keys x CHUNK columns) of one key tile (the A
operand, M = TILE keys: swap-AB, so that the head sum is a row reduction of the accumulator).
Chunk c of the walk is key tile c // NCHUNK, columns (c % NCHUNK) * CHUNK ..; it lands in slot
c % slots, phase (c // slots) % 2. Consumer warpgroup w takes the tiles w, w + CONSUMERS, ...
"""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEADS = (16, 32, 64, 128)  # query heads (all of a token's, one CTA): the WGMMA's N
WIDTH = 576  # the latent row: 512 compressed + 64 RoPE columns
CHUNK = 64  # columns of a K-chunk: 128 bytes, one 128-byte swizzle row
NCHUNK = WIDTH // CHUNK  # 9 chunks per key tile
TILE = 64  # keys per tile: the WGMMA's M (one warpgroup)
CONSUMERS = 2  # consumer warpgroups, alternating key tiles (one's epilogue under the other's MMA)
THREADS = (1 + CONSUMERS) * THREADS_PER_WG  # warpgroup 0 gathers
MAX_SLOTS = 16
# A consumer's first wait of a tile is for chunk c0, while chunk c0 - slots (the slot's previous
# round) may belong to the other warpgroup's tile: unless it is already committed, the parity
# wait would pass on that older phase. It is committed (commits are in order) when it is no later
# than the warpgroup's own last chunk, c0 - NCHUNK (CONSUMERS - 1) - 1: so at least MIN_SLOTS.
MIN_SLOTS = NCHUNK * (CONSUMERS - 1) + 1
BARRIER_BYTES = 1024  # the ring's full / empty mbarriers and the totals, rounded up
L1_EPS = 1e-10  # cuDNN-frontend's L1 normalization: target = S / (sum S + 1e-10)
BYTES = 2  # 16-bit inputs


def q_bytes(heads: int) -> int:
    return heads * WIDTH * BYTES


def slot_bytes() -> int:
    return TILE * CHUNK * BYTES


def _slots_at(heads: int, ctas: int) -> int:
    room = SMEM_CAPACITY // ctas - q_bytes(heads) - BARRIER_BYTES
    return min(MAX_SLOTS, room // slot_bytes())


def resident(heads: int) -> int:
    """CTAs per SM the plan aims at: two where their rings still hold MIN_SLOTS (their tails
    and Q loads overlap), else one."""
    return 2 if _slots_at(heads, 2) >= MIN_SLOTS else 1


def ring_slots(heads: int) -> int:
    """Slots of the ring: what shared memory leaves beside Q for `resident` CTAs, at most
    MAX_SLOTS (at least MIN_SLOTS: the plan raises otherwise)."""
    slots = _slots_at(heads, resident(heads))
    if slots < MIN_SLOTS:
        raise ValueError(f"{heads} heads leave {slots} ring slots, fewer than {MIN_SLOTS}")
    return slots


def lag(heads: int) -> int:
    """The producer signals chunk c once chunk c + lag is issued (cp.async groups complete in
    order: waiting for all but the newest `lag` groups proves chunk c landed), so lag + 1
    chunks are in flight per CTA (8 KB each: 48-72 KB, what HBM's latency x an SM's share of
    its bandwidth asks). Half the ring: the other half holds landed chunks the consumers may
    take while the producer waits for a free slot. lag <= slots - 2, or it deadlocks: a
    consumer frees a chunk's slot once the next chunk's MMA is issued, so the producer waiting
    for that slot must have signalled the next chunk already (emulate.run_protocol shows it)."""
    return ring_slots(heads) // 2


def smem_bytes(heads: int) -> int:
    """The kernel's shared memory (1024-byte aligned parts)."""
    return q_bytes(heads) + ring_slots(heads) * slot_bytes() + BARRIER_BYTES


def params_for(dtype: str, heads: int, length: bool = False) -> tuple:
    """Compile key: dtype, heads (all of a token's), `length` with a topk_length tensor."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if heads not in HEADS:
        raise ValueError(f"heads must be one of {HEADS}, got {heads}")
    keys = {"dtype": dtype, "heads": heads}
    if length:
        keys["length"] = True
    return tuple(sorted(keys.items()))
