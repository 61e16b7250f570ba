"""DSA indexer backward configurations (DSL-free): the compiled variants and the shared-memory
plan of kernel.py (docs/attention/DSA_INDEXER_NOTES.md, "Backward kernel, built").

One CTA takes one query row t (grid (B S_q,)): the row's G (dL/dI of its top-k slots) and flat
key ids in shared memory (the prologue, TOPK_MAX slots at most), q[t] (64 heads x 128) in shared
memory, then the row's selected key rows in TILE-slot tiles through a STAGES-deep ring that the
producer warpgroup fills by cp.async. Two plans (`Plan`, `plan`):
- the standard one, one CTA an SM: two consumer warpgroups take alternate tiles (tile i:
  warpgroup i % 2), so one's epilogue and dK reductions run under the other's WGMMAs;
- `pair` (a candidate), two CTAs an SM of one producer and one consumer warpgroup each: the
  other CTA's tiles fill the tensor cores under a CTA's epilogue, reductions, and also its
  prologue and dq / dw stores (which the standard plan leaves exposed, one row a CTA); GEMM2 one
  64-column chunk at a time (one dK accumulator: 216 registers a consumer thread).
"""

from __future__ import annotations

from dataclasses import dataclass

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG

# bf16 only (cuDNN's contract too): fp16's dS falls into its subnormals and flushes to 0 once
# grad_loss carries the usual 1 / (B S_q) (2026-12-04 review, emulated at top-k 2048: dq 6 % of
# its largest entry off at 64 rows, 87 % at 4096, 100 % at 32768; bf16 0.3 % throughout), so
# fp16 callers take the op's interim fp32 path
DTYPES = ("bfloat16",)
HEADS = 64  # the WGMMAs' M of GEMM1 (S = q K^T) and GEMM3 (dq += dS K); the K of GEMM2
DIM = 128  # the key / query width (D)
CHUNK = 64  # columns of one 128-byte swizzle atom
NCHUNK = DIM // CHUNK  # 2
TILE = 64  # selected slots a tile: GEMM1's N, GEMM2's M, GEMM3's K
LAG = 2  # tiles the producer keeps in flight before it signals the oldest (cp.async groups)
TOPK_MAX = 2048  # the row's G and ids in shared memory (16 KB); larger top-k: the interim path
BYTES = 2  # 16-bit inputs
# e^-100: cuDNN's CLIP_PROB_MIN (reference.dsa_indexer_bwd.CLIP_PROB_MIN), an fp32 denormal
CLIP_PROB_MIN = 3.720075976020836e-44


@dataclass(frozen=True)
class Plan:
    """A CTA's warp roles, ring and register split."""

    consumers: int  # consumer warpgroups (warpgroup 0 gathers)
    stages: int  # ring depth (16 KB a stage), even with two consumers (a stage keeps its reader)
    producer_regs: int
    consumer_regs: int
    ctas: int  # CTAs an SM (min_blocks_per_mp)

    @property
    def threads(self) -> int:
        return (1 + self.consumers) * THREADS_PER_WG

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def per_thread(self) -> int:
        """The prologue's slots a thread."""
        return (TOPK_MAX + self.threads - 1) // self.threads

    @property
    def dk_chunks(self) -> int:
        """GEMM2's accumulators live at once (pair: one, the chunks in turn)."""
        return NCHUNK if self.consumers == 2 else 1


# 24 x 128 + 240 x 256 = 64,512 of 65,536 (one CTA); pair: 2 x (40 + 216) x 128 = 65,536
STANDARD = Plan(consumers=2, stages=6, producer_regs=24, consumer_regs=240, ctas=1)
PAIR = Plan(consumers=1, stages=4, producer_regs=40, consumer_regs=216, ctas=2)
# the standard plan's figures, as the tests and the launcher name them
CONSUMERS, STAGES, THREADS = STANDARD.consumers, STANDARD.stages, STANDARD.threads


def plan(pair: bool = False) -> Plan:
    return PAIR if pair else STANDARD


def q_bytes() -> int:
    return HEADS * DIM * BYTES


def stage_bytes() -> int:
    return TILE * DIM * BYTES


def ds_bytes(p: Plan = STANDARD) -> int:
    """Each consumer warpgroup's dS^T tile (TILE x HEADS, 16-bit): GEMM2's A operand."""
    return p.consumers * TILE * HEADS * BYTES


def exchange_floats(p: Plan = STANDARD) -> int:
    """The end's hand-over of warpgroup 2's dq (64 x 128) and dw (64) partials, fp32 (one float
    as a placeholder with one consumer)."""
    return HEADS * DIM + 2 * THREADS_PER_WG if p.consumers == 2 else 1


def row_bytes(p: Plan = STANDARD) -> int:
    """G (fp32) and flat key ids (int32) of the row's TOPK_MAX slots, the prologue's partials."""
    return TOPK_MAX * 8 + 2 * p.warps * 4


def smem_bytes(p: Plan = STANDARD) -> int:
    barriers = 2 * p.stages * 8 + 64
    fields = (q_bytes() + p.stages * stage_bytes() + ds_bytes(p) + 4 * exchange_floats(p)
              + row_bytes(p))  # fmt: skip
    total = fields + barriers + 3 * 1024  # the swizzled fields' 1024-byte alignment
    if p.ctas * (total + 1024) > 233472:  # the SM's 228 KB, 1 KB reserved a CTA
        raise ValueError(f"shared memory plan {p.ctas} x {total} B exceeds an SM's")
    if total > SMEM_CAPACITY:
        raise ValueError(f"shared memory plan {total} B exceeds {SMEM_CAPACITY}")
    return total


def params_for(
    dtype: str, heads: int = HEADS, reduce: bool = True, staged: bool = False, pair: bool = False
) -> tuple:
    """Compile key: the 16-bit dtype (q, k, weights) and the heads (64 only); reduce False: the
    timing probe's build whose dK reductions never run (a runtime-false guard keeps their code
    and its shuffles; dK stays 0), which splits the L2 reductions' time from the rest; staged
    True: the candidate reduction form (kernel.py `_reduce_staged`: dK through the tile's dead
    stage, two full 256-byte rows a warp instruction) instead of the lane-pair swap; pair True:
    the candidate plan of two CTAs an SM (`PAIR`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if heads != HEADS:
        raise ValueError(f"the indexer backward kernel takes {HEADS} heads, got {heads}")
    keys = {"dtype": dtype, "heads": heads}
    if not reduce:
        keys["noreduce"] = True
    if staged:
        keys["staged"] = True
    if pair:
        keys["pair"] = True
    return tuple(sorted(keys.items()))
