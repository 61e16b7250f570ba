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
BARRIER_BYTES = 1024  # the ring's full / empty mbarriers and the totals, rounded up
# Producer: chunk c's arrival is signalled once chunk c + LAG is issued (cp.async groups
# complete in order, so waiting for all but the newest LAG groups proves chunk c landed).
LAG = 3
L1_EPS = 1e-10  # cuDNN-frontend's L1 normalization: target = S / (sum S + 1e-10)
BYTES = 2  # 16-bit inputs


def q_bytes(heads: int) -> int:
    return heads * WIDTH * BYTES


def slot_bytes() -> int:
    return TILE * CHUNK * BYTES


def resident(heads: int) -> int:
    """CTAs per SM the plan aims at: two while Q is small (their tails and Q loads overlap)."""
    return 2 if heads <= 32 else 1


def ring_slots(heads: int) -> int:
    """Slots of the ring: what shared memory leaves beside Q for `resident` CTAs, at most
    MAX_SLOTS."""
    room = SMEM_CAPACITY // resident(heads) - q_bytes(heads) - BARRIER_BYTES
    return min(MAX_SLOTS, room // slot_bytes())


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
