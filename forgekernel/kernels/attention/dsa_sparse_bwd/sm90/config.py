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
# red4s (the standard form at blocks 16 and 32): each consumer warp stages its 16 rows of a 64 x 64
# fp32 dkv block in shared memory (rows padded to 72 floats: 288 bytes, 16-byte aligned, the 64-bit
# stores of a half-warp's four rows on disjoint banks), reads them back two rows a 128-bit load
# (lane l: row 2 k + l // 16, columns 4 (l % 16) ..) and adds them by red.global.add.v4.f32: four
# full lines an instruction against the fragments' eight one-sector lines (red.global.add.v2).
STAGING_ROWS = 16
STAGING_STRIDE = 72
# Blocks whose standard build adds dkv by red4s: measured 2026-12-04 00:37 at
# t4096-kv8192-k2048, the launcher at H = 16 6.57 ms against red4's (dedicated staging) 7.00
# (v2 9.31), at H = 128 29.47 against the fragments' red.global.add.v2 38.37
# (docs/attention/DSA_BWD_NOTES.md "Probe 2026-12-04 00:37").
RED4S_BLOCKS = (16, 32)
# Blocks whose standard build runs red4s under xchg (the form `xchg4s`): measured 2026-12-04
# 04:23 at t4096-kv8192-k2048, the launcher at H = 16 6.064 ms against red4s's 6.597 (0.919), at
# H = 128 27.591 against 29.526 (0.934), dkv agreeing within 1e-6 (docs/attention/
# DSA_BWD_NOTES.md "Measured 2026-12-04 04:23"). red4s without xchg stays a candidate.
XCHG_BLOCKS = (16, 32)
# red4s places the staging in the current tile's stage (no extra shared memory: block 32's
# 221 KB leave no room for a dedicated 36 KB buffer). Once a consumer warpgroup's dq^T MMAs of the
# tile are done, the stage's column blocks DQ_BLOCKS[w] (64 x 64 16-bit each, 8 KB, contiguous: the
# stage layout's chunk mode has stride TILE x CHUNK elements) have no reader left in the tile: S^T
# / dP^T of both warpgroups finished before the FREE barrier, the other warpgroup's dq^T reads its
# own blocks, the dkv MMAs read P^T / dS^T / q / dO only, the row ids live outside the stage, and
# the producer refills the stage only after every consumer thread's empty arrival, which red4s
# moves to after the thread's last staging read of the tile. Warp v (0 .. 3) of warpgroup w stages
# at float offset RED4S_OFFSET[w] + v x STAGING_ROWS x STAGING_STRIDE of the stage.
#
# red4s with xchg (`xchg4s`, the standard form since 2026-12-04 04:23: launcher xchg=True,
# red4s=True): xchg changes only the phase before the PDS barrier. Warpgroup 0 reads the stage's
# nine column blocks (S^T = K q^T of all heads), warpgroup 1 blocks 0 .. 7 (dP^T = V dO^T); each
# waits for its own WGMMAs (wait_group 0) before the FREE barrier, which both pass before the
# exchange (XCHG / XREAD over an fp32 buffer aliasing P^T / dS^T, not the stage) and before PDS; the
# softmax reads the row ids (outside the stage). After PDS the warpgroups run the split form's code
# on the same operands: dq^T of DQ_BLOCKS[w], then dkv of DKV_BLOCKS[w]. So the dead column blocks
# and the time they die are the split form's: DQ_BLOCKS[w] of the tile's stage once warpgroup w's
# dq^T MMAs are done (the same 128-thread named barrier DQ_DONE + w after the threads' waits, the
# same offsets RED4S_OFFSET, each thread's empty arrival after its last staging loads). The next
# tile's S^T / dP^T MMAs read the other stage ((i + 1) % STAGES; STAGES = 2) and its exchange writes
# the P^T / dS^T bytes; the stage itself is refilled only after all 256 consumer threads' arrivals.
STAGE_CHUNK_FLOATS = TILE * CHUNK * BYTES // 4  # one 64 x 64 16-bit column block (8 KB)
RED4S_OFFSET = tuple(blocks[0] * STAGE_CHUNK_FLOATS for blocks in DQ_BLOCKS)


def red4s_room(w: int) -> tuple[int, int]:
    """(staging floats, dead floats) of consumer warpgroup w in a stage under red4s: its four
    warps' (16, 72) buffers against its dq^T column blocks (which must be contiguous)."""
    blocks = DQ_BLOCKS[w]
    if list(blocks) != list(range(blocks[0], blocks[0] + len(blocks))):
        raise ValueError(f"warpgroup {w}'s dq blocks {blocks} are not contiguous")
    warps = THREADS_PER_WG // 32
    return warps * STAGING_ROWS * STAGING_STRIDE, len(blocks) * STAGE_CHUNK_FLOATS


def standard_xchg(block: int, reduce: bool = True) -> bool:
    """Whether the build of `block` runs xchg when the caller names no form: the standard build
    of an XCHG_BLOCKS block (xchg4s, with `standard_red4s`); the probe's no-reduction builds keep
    the split form."""
    return block in XCHG_BLOCKS and reduce


def standard_red4s(block: int, reduce: bool = True) -> bool:
    """Whether the build of `block` adds dkv by red4s when the caller names no form: the
    standard build of a RED4S_BLOCKS block, with xchg (xchg4s) or without (red4s, the
    candidate); the probe's no-reduction builds keep the fragments' red.global.add.v2 code."""
    return block in RED4S_BLOCKS and reduce


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


def smem_bytes(block: int) -> int:
    return fixed_bytes(block) + stages(block) * stage_bytes()


def params_for(
    dtype: str, block: int, reduce: bool = True, xchg: bool = False, red4s: bool = False
) -> tuple:
    """Compile key: dtype and the heads of one CTA; reduce False: the timing probe's build whose
    dkv reductions never run (a runtime-false guard keeps their code; dkv stays 0), which
    splits MMA time from reduction time (scripts/time_dsa_bwd_kernel.py); xchg True: the
    S^T and dP^T are one warpgroup's each (kernel.py `xchg`); red4s True: dkv by
    red.global.add.v4.f32 from a per-warp staging in the tile's stage (kernel.py
    `_reduce_v4s`), False: the fragments' red.global.add.v2; xchg and red4s together: xchg4s,
    the standard form of both blocks (`standard_xchg`, `standard_red4s`; the RED4S_OFFSET
    comment has its hazards), red4s alone its candidate."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS}, got {block}")
    keys = {"dtype": dtype, "block": block}
    if not reduce:
        keys["noreduce"] = True
    if xchg:
        keys["xchg"] = True
    if red4s:
        keys["red4s"] = True
    return tuple(sorted(keys.items()))


# ---- h64: one gather a token at H >= 64 (kernel_h64.py; docs/attention/DSA_BWD_NOTES.md "H >= 64:
# one gather a token"), the launcher's default wherever H is a multiple of 64 (measured 2026-12-06
# 01:37 on the H100: 0.64-0.84 of the blocks-of-32 kernel's time on the suite's four H >= 64
# cases; DSA_BWD_NOTES.md "h64 adopted"). Two kernels: `kv` (one CTA a (token, 64 heads): S^T,
# dP^T, P^T, dS^T and the dkv blocks, no dq accumulator; dS (16-bit) into a (tokens, TILE x tiles,
# H) workspace) and `dq` (dq = dS K: the rows gathered again, dq^T of 64 heads in registers).
H64_BLOCK = 64  # heads of one CTA in both kernels (the WGMMAs' N in S^T / dP^T, the K of dkv)
H64_PARTS = ("kv", "dq", "fused")
# `kv`: S^T / dP^T are the stage's only readers, so one stage suffices if it is released right
# after their WGMMAs (the gather of tile i + 1 then runs under tile i's exchange, dkv MMAs and
# reductions); two would need 302 KB.
H64_KV_STAGES = 1
# `dq`: heads a CTA (64, or 128 where H allows: then the CTA takes one of three 192-column groups,
# so that the rows are gathered once a token instead of twice) and the 64-column dq^T blocks of
# each of three consumer warpgroups: at 64 heads three (64 x 64 fp32 = 32 registers a thread a
# block: 96 under 152; two warpgroups of {0..4} / {5..8}, 160 under 224, spilled 40 bytes,
# cuobjdump 2026-12-05), at 128 heads one (64 x 128: 64 registers).
H64_DQ_HEADS = (64, 128)
H64_DQ_CONSUMERS = 3
H64_DQ_CHUNKS_PER_WG = {64: 3, 128: 1}
H64_DQ_THREADS = (1 + H64_DQ_CONSUMERS) * THREADS_PER_WG
H64_DQ_CONSUMER_REGS = 152  # 56 x 128 + 152 x 384 = 65,536
H64_DQ_STAGES = 2

# `fused` (kernel_h64f.py, key h64 "fused"): the kv part with dq^T accumulated in the tile loop (no
# dq part, no dS workspace). dq^T of 64 heads is 576 x 64 fp32 = 144 registers a thread over the two
# consumer warpgroups, split by 64-column blocks: {0..3} (128) beside S^T / the dkv blocks {0..3, 8}
# on two accumulators, {4..8} (160) beside dP^T / dkv {4..7} on one (two spilled 128 B at 240,
# cuobjdump 2026-12-06); lse2 / Delta' move to shared memory (in the barrier block's spare bytes).
# setmaxnreg 24 / 240: 24 + 2 x 240 = 504 = 3 x 168, the launch allocation (setmaxnreg.inc takes
# only what .dec released: 32 / 240 would ask 1,024 registers the CTA never had). The producer fits
# 24 with its gather's rows outer (kernel_h64f.py `_issue_rows`; columns outer spilled 16 B); the
# consumers spilled 24 B at 232 (producer 40).
H64F_DQ_BLOCKS = ((0, 1, 2, 3), (4, 5, 6, 7, 8))
H64F_KV_ACCS = (2, 1)
H64F_PRODUCER_REGS = 24
H64F_CONSUMER_REGS = 240
H64F_SMEM_EXTRA = 2 * 64 * 4  # lse2 / Delta' of the 64 heads, fp32
# The fused kernel's grid is (H / 64, tokens): a token's head blocks are adjacent CTAs, dispatched
# together, so at H 128 the second one's gather and dkv reductions hit L2 (DSA_BWD_NOTES.md "Long
# caches: a token's head blocks together"). gridDim.y is at most 65,535: the launcher runs more
# tokens in launches of this many (row slices; read at call time).
H64F_GRID_TOKENS = 65535
# The sweep (the same section): v1 and the fused kernel on the index rows sorted by slot, in
# launches of one wave (SMs // CTAs a token): a wave's CTAs start together and walk their sorted
# lists in step, so at any moment they touch one band of the slots (~1/32 of them at top-2048),
# and a row's lines come from HBM about once a wave instead of once a visit. The launcher's
# default sweeps where the slots' rows and fp32 dkv rows (3,456 B a slot) exceed the L2 (50 MiB
# on H100 / H200) and a wave visits a row at least SWEEP_MIN_VISITS times on average. The first
# rule (twice the L2, 1.5 visits: the model's break-even against a wave's launch, ramp and tail)
# left two suite cases unswept where the H100 bench of 2026-12-06 17:10 measured the sweep faster:
# t4096-h64-kv16384 (the cache 1.1x the L2, 16.5 visits) 0.954x the unswept time, and
# t16384-h64-kv65536-k512 (1.03 visits) 0.905x; swept there too since (DSA_BWD_NOTES.md "The
# sweep rule refit"), with t8192-h16-kv32768 (8.3 visits, 1.80x the unswept), t32768-h16-kv65536
# (4.1, 1.80x) and t8192-h128-kv65536 (2.1, 1.41x). Unmeasured below the L2 (kv 8192): unswept.
SWEEP_ROW_BYTES = WIDTH * (BYTES + 4)
SWEEP_L2_BYTES = 50 << 20
SWEEP_MIN_VISITS = 1.0


def h64_supported(heads: int) -> bool:
    return heads > 0 and heads % H64_BLOCK == 0


def sweep_far(slots: int) -> bool:
    """The cache's rows and their dkv rows over the L2 (the sweep's first condition)."""
    return slots * SWEEP_ROW_BYTES > SWEEP_L2_BYTES


def sweep_reuses(slots: int, topk: int, wave_tokens: int) -> bool:
    """A wave of `wave_tokens` tokens visits a row at least SWEEP_MIN_VISITS times on average
    (the sweep's second condition)."""
    return wave_tokens * topk >= SWEEP_MIN_VISITS * slots


def sweep_tokens(sms: int, ctas: int) -> int:
    """Tokens a launch of the sweep: one wave of CTAs (`ctas` a token: H / 64 in the fused
    kernel, H / block in v1), one an SM."""
    return max(1, sms // ctas)


def h64_kv_bytes() -> int:
    """q (64 x 576), dO (64 x 512), one stage, P^T / dS^T (64 x 64 each), barriers and row ids:
    230,400 of the 232,448 an SM grants a block."""
    return (
        H64_BLOCK * (WIDTH + D_V) * BYTES
        + H64_KV_STAGES * stage_bytes()
        + 2 * TILE * H64_BLOCK * BYTES
        + BARRIER_BYTES
    )


def h64f_bytes() -> int:
    """The fused kernel's shared memory: the kv part's; lse2 / Delta' of the 64 heads (512 B)
    sit in its barrier block (2 x 8 B of mbarriers + 256 B of row ids + 512 <= 1,024)."""
    assert 2 * 8 + TILE * 4 + H64F_SMEM_EXTRA <= BARRIER_BYTES
    return h64_kv_bytes()


def h64_dq_heads(heads: int) -> int:
    """Heads a CTA of the dq part for a problem of `heads` (a multiple of 64)."""
    return 128 if heads % 128 == 0 else H64_BLOCK


def h64_dq_chunks(dq_heads: int) -> int:
    """64-column blocks a dq CTA gathers and accumulates (9 at 64 heads, 3 at 128)."""
    return H64_DQ_CHUNKS_PER_WG[dq_heads] * H64_DQ_CONSUMERS


def h64_dq_bytes(dq_heads: int = H64_BLOCK) -> int:
    """Per stage the gathered rows (the CTA's column blocks) and the tile's dS (64 positions x
    dq_heads), barriers."""
    rows = TILE * h64_dq_chunks(dq_heads) * CHUNK * BYTES
    return H64_DQ_STAGES * (rows + TILE * dq_heads * BYTES) + BARRIER_BYTES


def h64_workspace_rows(topk: int) -> int:
    """Rows (list positions) of the dS workspace a token: whole tiles (the tail's rows hold 0)."""
    return -(-topk // TILE) * TILE


# The dS workspace's cap: the launcher runs the tokens in chunks (kv then dq a chunk, on one
# workspace of the chunk's tokens) so that it never exceeds this. Unchunked it is topk x H x 2 B a
# token, 512 KiB at top-2048 H 128: 4 GiB at 8192 tokens, 16 GiB at 32768, more than the dq
# gradient itself (1.2 KiB x H a token). 1 GiB keeps >= 2048 tokens a chunk at top-2048 H 128
# (4096 kv CTAs, ~31 waves on 132 SMs: a chunk's tail wave costs <= ~3 %) and leaves the suite's H
# 64 cases (exactly 1 GiB) unchunked.
H64_WS_CAP_BYTES = 1 << 30


def h64_chunk_tokens(tokens: int, rows: int, heads: int, elem_bytes: int = BYTES) -> int:
    """Tokens a chunk of the h64 launches: as many as keep the (chunk, rows, heads) workspace
    within H64_WS_CAP_BYTES (read at call time), at least 1 (a single token's workspace may
    exceed the cap only past ~4M list positions at H 128), at most `tokens`."""
    per_token = rows * heads * elem_bytes
    return max(1, min(tokens, H64_WS_CAP_BYTES // per_token))


def params_h64(
    dtype: str, part: str, reduce: bool = True, shfl4: bool = True, dq_heads: int = H64_BLOCK
) -> tuple:
    """Compile key of an h64 kernel: dtype and part (`kv`, `dq`, or `fused`: kernel_h64f.py, the
    two in one); reduce False (kv, fused): the timing probe's build whose dkv reductions never
    run; shfl4 (kv only): dkv by
    red.global.add.v4.f32 after a butterfly shuffle (the standard form), False: kernel.py's
    fragments' red.global.add.v2 (the probe's comparison); dq_heads (dq only): heads a CTA,
    64 or 128 (`h64_dq_heads`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if part not in H64_PARTS:
        raise ValueError(f"part must be one of {H64_PARTS}, got {part!r}")
    keys = {"dtype": dtype, "block": H64_BLOCK, "h64": part}
    if not reduce:
        if part == "dq":
            raise ValueError("reduce=False applies to the kv and fused parts only")
        keys["noreduce"] = True
    if not shfl4:
        if part != "kv":
            raise ValueError("shfl4=False applies to the kv part only")
        keys["v2"] = True
    if dq_heads != H64_BLOCK:
        if part != "dq" or dq_heads not in H64_DQ_HEADS:
            raise ValueError(f"dq_heads applies to the dq part, one of {H64_DQ_HEADS}")
        keys["dq_heads"] = dq_heads
    return tuple(sorted(keys.items()))
