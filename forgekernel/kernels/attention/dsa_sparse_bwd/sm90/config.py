"""DSA sparse attention backward configurations (DSL-free): the compiled variants and the
shared-memory plan of kernel.py (docs/attention/DSA_BWD_NOTES.md, "Kernel v1").

A CTA takes one query token and a block of BLOCK heads of it (grid (tokens, H / BLOCK)): the
gathered rows are the WGMMAs' M (TILE = 64 rows a stage), the block's heads their N. q
(BLOCK, 576) and dO (BLOCK, 512) stay in shared memory; the gathered rows stream through
`STAGES` whole-tile stages (64 x 576, 72 KB each). Every listed row is gathered once per head
block: at H = 64 / 128 (two / four blocks of 32) the gather and the dkv reductions are paid
two / four times (v1's simplification: dq^T of 32 heads is 80 fp32 registers a thread, 64
heads would be 160).
"""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
BLOCKS = (16, 32)  # heads per CTA (the WGMMAs' N); H = 16 takes 16, H % 32 == 0 takes 32
WIDTH = 576  # the latent row: 512 compressed (V) + 64 RoPE columns
D_V = 512
CHUNK = 64  # columns of one 128-byte swizzle atom
NCHUNK = WIDTH // CHUNK  # 9
TILE = 64  # gathered rows a stage: the WGMMAs' M
CONSUMERS = 2
THREADS = (1 + CONSUMERS) * THREADS_PER_WG  # warpgroup 0 gathers
PRODUCER_REGS = 56
CONSUMER_REGS = 224  # 56 x 128 + 224 x 256 = 64,512 of 65,536
BARRIER_BYTES = 1024  # full / empty mbarriers and the stages' row ids, rounded up
BYTES = 2  # 16-bit inputs

# Work split of a tile between the consumer warpgroups, in 64-column blocks: dkv block c is
# two MMAs (dS^T q_c + P^T dO_c) for c < 8 and one (the RoPE block 8), dq^T block b one. Each
# warpgroup issues 13 64 x 64 x BLOCK(-deep) units: the first takes dkv {0..3, 8} and dq
# {0..3}, the second dkv {4..7} and dq {4..8}.
DKV_BLOCKS = ((0, 1, 2, 3, 8), (4, 5, 6, 7))
DQ_BLOCKS = ((0, 1, 2, 3), (4, 5, 6, 7, 8))
# `bulk` candidate: each consumer warp stages its 16 rows of a 64 x 64 fp32 dkv block in shared
# memory (rows padded to 72 floats: 288 bytes, 16-byte aligned, the 64-bit stores of a
# half-warp's four rows on disjoint banks) and lanes 0..15 add one row each to the accumulator
# by `cp.reduce.async.bulk .add.f32` (256 bytes: two full lines, issued by the TMA unit).
BULK_ROWS = 16
BULK_STRIDE = 72
BULK_WARPS = CONSUMERS * THREADS_PER_WG // 32
# The blocks where the dedicated (16, 72)-per-warp staging fits beside the stages (the bulk /
# red4 / red4p candidates): block 32 has no room for it (221 + 36 KB).
RED4_BLOCKS = (16,)
# Blocks whose standard build adds dkv by red4s (red4's 128-bit reductions, staged in the
# tile's released stage: below): measured 2026-12-04 00:37 at t4096-kv8192-k2048, the launcher
# at H = 16 6.57 ms against red4's 7.00 (v2 9.31), at H = 128 29.47 against the fragments'
# red.global.add.v2 38.37 (docs/attention/DSA_BWD_NOTES.md "Probe 2026-12-04 00:37").
RED4S_BLOCKS = (16, 32)
# `red4p` candidate (block 16): the consumer warps only stage their dkv blocks (the red4
# staging, the rows' ids in each staging row's padding) and the producer warpgroup's warps
# RED4P_GATHER .. 3 read them back and issue the red.global.add.v4.f32, so that the consumers'
# MMAs run under the reductions; warps 0 .. RED4P_GATHER - 1 gather (64 threads, 8 rows a
# thread). Reducer warp r serves the consumer warps r, r + R, r + 2 R, ... (R = the reducers:
# two of each consumer warpgroup at R = 2, 18 dkv blocks a tile each).
RED4P_GATHER = 2
RED4P_REDUCERS = THREADS_PER_WG // 32 - RED4P_GATHER
# `red4s` (the standard form at blocks 16 and 32): red4's staging placed in the current tile's stage
# instead of a dedicated buffer. Once a consumer warpgroup's dq^T MMAs of the tile are done, the
# stage's column blocks DQ_BLOCKS[w] (64 x 64 16-bit each, 8 KB, contiguous: the stage layout's
# chunk mode has stride TILE x CHUNK elements) have no reader left in the tile: S^T / dP^T of both
# warpgroups finished before the FREE barrier, the other warpgroup's dq^T reads its own blocks, the
# dkv MMAs read P^T / dS^T / q / dO only, the row ids live outside the stage, and the producer
# refills the stage only after every consumer thread's empty arrival, which red4s moves to after the
# thread's last staging read of the tile. Warp v (0 .. 3) of warpgroup w stages at float offset
# RED4S_OFFSET[w] + v x BULK_ROWS x BULK_STRIDE of the stage.
STAGE_CHUNK_FLOATS = TILE * CHUNK * BYTES // 4  # one 64 x 64 16-bit column block (8 KB)
RED4S_OFFSET = tuple(blocks[0] * STAGE_CHUNK_FLOATS for blocks in DQ_BLOCKS)


def red4s_room(w: int) -> tuple[int, int]:
    """(staging floats, dead floats) of consumer warpgroup w in a stage under red4s: its four
    warps' (16, 72) buffers against its dq^T column blocks (which must be contiguous)."""
    blocks = DQ_BLOCKS[w]
    if list(blocks) != list(range(blocks[0], blocks[0] + len(blocks))):
        raise ValueError(f"warpgroup {w}'s dq blocks {blocks} are not contiguous")
    warps = THREADS_PER_WG // 32
    return warps * BULK_ROWS * BULK_STRIDE, len(blocks) * STAGE_CHUNK_FLOATS


def standard_red4s(
    block: int,
    reduce: bool = True,
    xchg: bool = False,
    bulk: bool = False,
    red4: bool = False,
    red4p: bool = False,
    gather64: bool = False,
) -> bool:
    """Whether the build of `block` with these candidate flags adds dkv by red4s: the standard
    build of a RED4S_BLOCKS block; the probe's no-reduction, xchg, bulk, red4, red4p and
    gather64 builds keep their own forms (red4s with xchg was never built)."""
    return block in RED4S_BLOCKS and reduce and not (xchg or bulk or red4 or red4p or gather64)


def block_heads(heads: int) -> int:
    """The heads of one CTA for a problem of `heads` query heads (ValueError when none fits)."""
    if heads == 16:
        return 16
    if heads > 0 and heads % 32 == 0:
        return 32
    raise ValueError(f"the sparse backward kernel takes 16 heads or a multiple of 32, got {heads}")


def fixed_bytes(block: int) -> int:
    """q, dO, and P^T / dS^T (64 x block each) in shared memory."""
    return block * (WIDTH + D_V) * BYTES + 2 * TILE * block * BYTES + BARRIER_BYTES


def stage_bytes() -> int:
    return TILE * WIDTH * BYTES


def stages(block: int) -> int:
    """Whole-tile stages that fit beside the fixed parts (2 at both blocks: 182 / 220 KB)."""
    n = (SMEM_CAPACITY - fixed_bytes(block)) // stage_bytes()
    if n < 2:
        raise ValueError(f"{block} heads a CTA leave room for {n} stages, fewer than 2")
    return min(n, 2)


def bulk_bytes() -> int:
    """The `bulk` / `red4` / `red4p` candidates' staging: one (16, 72) fp32 buffer per consumer warp
    (36 KB)."""
    return BULK_WARPS * BULK_ROWS * BULK_STRIDE * 4


def smem_bytes(block: int, staged: bool = False) -> int:
    """staged: with the bulk / red4 / red4p candidates' staging buffers (red4p's 16 staging
    mbarriers fit in BARRIER_BYTES)."""
    return fixed_bytes(block) + stages(block) * stage_bytes() + (bulk_bytes() if staged else 0)


def params_for(
    dtype: str,
    block: int,
    reduce: bool = True,
    xchg: bool = False,
    bulk: bool = False,
    red4: bool = False,
    red4p: bool = False,
    gather64: bool = False,
    handshake: bool = False,
    red4s: bool = False,
) -> tuple:
    """Compile key: dtype and the heads of one CTA; reduce False: the timing probe's build whose
    dkv reductions never run (a runtime-false guard keeps their code; dkv stays 0), which
    splits MMA time from reduction time (scripts/time_dsa_bwd_kernel.py); xchg True: the
    candidate whose S^T and dP^T are one warpgroup's each (kernel.py `xchg`); bulk True: the
    candidate whose dkv blocks go through shared memory to `cp.reduce.async.bulk` (kernel.py
    `_reduce_bulk`; block 16 only: block 32's 221 KB leave no room for the 36 KB staging);
    red4 True: the probe candidate with the same staging read back into red.global.add.v4.f32
    by the warps themselves (kernel.py `_reduce_v4`; block 16 only); red4p True: the candidate
    whose consumers only stage and whose producer warpgroup's reducer warps issue those
    red.global.add.v4.f32 (kernel.py `_stage_p` / `_serve`; block 16 only). Two probe-only
    diagnostics of red4p (block 16, docs/attention/DSA_BWD_NOTES.md "red4p diagnostics"):
    gather64 True: this build with red4p's gather (warps 0 .. RED4P_GATHER - 1 alone, the other
    producer warps idle); handshake True (with red4p, reduce False): the reducer warps only wait
    for each staged block and release it (no staging reads, no reductions). red4s True: the
    standard form (`standard_red4s`): red4's reductions staged in the current tile's stage (no
    extra shared memory; blocks 16 and 32; kernel.py `_reduce_v4s`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    if bulk + red4 + red4p + red4s > 1:
        raise ValueError("bulk, red4, red4p and red4s are forms of the same reductions: pick one")
    if gather64 and (red4p or red4s or block not in RED4_BLOCKS):
        raise ValueError("gather64: a diagnostic of block 16's builds other than red4p / red4s")
    if handshake and (not red4p or reduce):
        raise ValueError("handshake: a red4p diagnostic without reductions (reduce=False)")
    staged = bulk or red4 or red4p
    if staged and smem_bytes(block, staged) > SMEM_CAPACITY:
        name = "bulk" if bulk else "red4" if red4 else "red4p"
        raise ValueError(
            f"{name}: {smem_bytes(block, staged)} bytes of shared memory at block {block}"
        )
    keys = {"dtype": dtype, "block": block}
    if not reduce:
        keys["noreduce"] = True
    if xchg:
        keys["xchg"] = True
    if bulk:
        keys["bulk"] = True
    if red4:
        keys["red4"] = True
    if red4p:
        keys["red4p"] = True
    if gather64:
        keys["gather64"] = True
    if handshake:
        keys["handshake"] = True
    if red4s:
        keys["red4s"] = True
    return tuple(sorted(keys.items()))
