"""DSA indexer backward configurations (DSL-free): the compiled variants and the shared-memory
plan of kernel.py (docs/attention/DSA_INDEXER_NOTES.md, "Backward kernel, built").

One CTA takes one query row t (grid (B S_q,)): the row's G (dL/dI of its top-k slots) and flat
key ids in shared memory (the prologue, TOPK_MAX slots at most), q[t] (64 heads x 128) in shared
memory, then the row's selected key rows in TILE-slot tiles through a STAGES-deep ring that the
producer warpgroup fills by cp.async; the two consumer warpgroups take alternate tiles (tile i:
warpgroup i % 2), so one's epilogue and dK reductions run under the other's WGMMAs.
"""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEADS = 64  # the WGMMAs' M of GEMM1 (S = q K^T) and GEMM3 (dq += dS K); the K of GEMM2
DIM = 128  # the key / query width (D)
CHUNK = 64  # columns of one 128-byte swizzle atom
NCHUNK = DIM // CHUNK  # 2
TILE = 64  # selected slots a tile: GEMM1's N, GEMM2's M, GEMM3's K
STAGES = 6  # ring depth (16 KB a stage)
LAG = 2  # tiles the producer keeps in flight before it signals the oldest (cp.async groups)
TOPK_MAX = 2048  # the row's G and ids in shared memory (16 KB); larger top-k: the interim path
CONSUMERS = 2
THREADS = (1 + CONSUMERS) * THREADS_PER_WG  # warpgroup 0 gathers
WARPS = THREADS // 32
PRODUCER_REGS = 24
CONSUMER_REGS = 240  # 24 x 128 + 240 x 256 = 64,512 of 65,536
BYTES = 2  # 16-bit inputs
# e^-100: cuDNN's CLIP_PROB_MIN (reference.dsa_indexer_bwd.CLIP_PROB_MIN), an fp32 denormal
CLIP_PROB_MIN = 3.720075976020836e-44


def q_bytes() -> int:
    return HEADS * DIM * BYTES


def stage_bytes() -> int:
    return TILE * DIM * BYTES


def ds_bytes() -> int:
    """Each consumer warpgroup's dS^T tile (TILE x HEADS, 16-bit): GEMM2's A operand."""
    return CONSUMERS * TILE * HEADS * BYTES


def exchange_bytes() -> int:
    """The end's hand-over of warpgroup 1's dq (fp32, 64 x 128) and dw partials (fp32, 64)."""
    return (HEADS * DIM + HEADS) * 4


def row_bytes() -> int:
    """G (fp32) and flat key ids (int32) of the row's TOPK_MAX slots, the prologue's partials."""
    return TOPK_MAX * 8 + 2 * WARPS * 4


def smem_bytes() -> int:
    barriers = 2 * STAGES * 8 + 64
    fields = q_bytes() + STAGES * stage_bytes() + ds_bytes() + exchange_bytes() + row_bytes()
    total = fields + barriers + 3 * 1024  # the swizzled fields' 1024-byte alignment
    if total > SMEM_CAPACITY:
        raise ValueError(f"shared memory plan {total} B exceeds {SMEM_CAPACITY}")
    return total


def params_for(dtype: str, heads: int = HEADS, reduce: bool = True, staged: bool = False) -> tuple:
    """Compile key: the 16-bit dtype (q, k, weights) and the heads (64 only); reduce False: the
    timing probe's build whose dK reductions never run (a runtime-false guard keeps their code
    and its shuffles; dK stays 0), which splits the L2 reductions' time from the rest; staged
    True: the candidate reduction form (kernel.py `_reduce_staged`: dK through the tile's dead
    stage, two full 256-byte rows a warp instruction) instead of the lane-pair swap."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if heads != HEADS:
        raise ValueError(f"the indexer backward kernel takes {HEADS} heads, got {heads}")
    keys = {"dtype": dtype, "heads": heads}
    if not reduce:
        keys["noreduce"] = True
    if staged:
        keys["staged"] = True
    return tuple(sorted(keys.items()))
