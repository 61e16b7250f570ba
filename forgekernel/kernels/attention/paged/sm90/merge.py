"""Paged attention decode (sm_90a), split-KV: the combine fused into the partial pass. The split
of a (sequence, head block) that finishes last merges every split's partial O and LSE into the
output, so a plan of several splits is one launch (was: a combine kernel after the partial
pass, a second graph node and its own chain of L2 round trips: PAGED_NOTES.md, "Batch <= 4,
long KV").

Protocol (kernels/common/sm90/splitk.py's): every split writes its partials (`write_split`),
the CTA syncs, one thread counts the split in the unit's flag (fetch-add, acquire-release, GPU
scope); the split that brings the count to `splits` is the last: it clears the flag (the next
launch finds it zero) and, after a second CTA barrier, its threads read every split's
partials. Nobody waits for another CTA, so any grid is safe; the merge runs the splits in
order 0, 1, ... whichever finished last (bitwise the same result every run). The partials'
cache lines are shared between units (mLp's 32 heads of a split and row in one 128-byte
line), and another unit's merge on the same SM may have read a line before this unit's last
split wrote it: the fetch-add's acquire invalidates the SM's L1 (SASS: CCTL.IVALL right after
the ATOMG), so the reads after it come from L2, where every released write is."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from forgekernel.kernels.attention.paged.sm90.config import THREADS, WARPS
from forgekernel.kernels.common.sm90.atomics import atom_add_acq_rel_gpu
from forgekernel.kernels.common.sm90.constants import LN2

# Loads of partial O a thread keeps in flight in the merge (its elements x the split loop's
# unrolling, at most UNROLL splits): 32 floats (16 KB per CTA a round trip) where registers
# are free (16-bit caches: 135-237 registers, no cap); 16 under the FP8 pass's register cap
# (min_blocks_per_mp), where 32 spilled (8 bytes at D 128, 192 at D 64 with one head).
IN_FLIGHT = {False: 32, True: 16}  # by fp8
UNROLL = 8


@cute.jit
def last_split(mFlags, unit, splits, tidx, s_last) -> cutlass.Boolean:
    """True in every thread of the CTA whose split is the unit's last to arrive. The caller's
    partials are written (by every thread) before the call; `s_last`: an Int32 of shared
    memory."""
    cute.arch.sync_threads()  # every thread's partials precede the release
    if tidx == 0:
        arrived = atom_add_acq_rel_gpu(mFlags.iterator + unit, 1)
        last = arrived == splits - 1
        if last:
            mFlags[unit] = 0
        s_last[0] = Int32(last)
    cute.arch.sync_threads()
    return s_last[0] != 0


@cute.jit
def merge_splits(
    mOp, mLp, mO, mLSE, rows, head0, heads: cutlass.Constexpr[int],
    g_rows: cutlass.Constexpr[int], d_: cutlass.Constexpr[int], tidx, stats,
    fp8: cutlass.Constexpr[bool],
):  # fmt: skip
    """The CTA's rows merged over every split into the output: O = sum_s 2^(lse_s - lse) O_s,
    lse = log2 sum_s 2^lse_s (natural in mLSE); 0 and -inf where no split saw a key. mOp fp32
    (splits, rows, Hq, D), mLp fp32 (splits, rows, Hq) log2; row g is query token
    rows[0] + g // heads (of rows[1] tokens: rows past them are skipped), head head0 +
    g % heads. `stats`: (top, total) fp32 (>= G,) of shared memory; fp8: the FP8 pass's
    (`IN_FLIGHT`).

    First each row's max and sum of 2^lse: warp w takes rows w, w + WARPS, ..., its lanes the
    splits (32 loads at a time). Then O: thread t takes elements t, t + THREADS, ... of the
    G x D rows, and the split loop is unrolled so that `IN_FLIGHT` loads of partial O are in
    flight (30 splits at G 4, D 128, 16-bit: 4 round trips)."""
    q_off, sq = rows
    s_top, s_total = stats
    splits = mLp.shape[0]
    lane = tidx % 32
    warp_idx = tidx // 32
    for g in cutlass.range(warp_idx, g_rows, WARPS):
        token = q_off + g // heads
        head = head0 + g % heads
        top = -Float32.inf
        if g // heads < sq:
            for s in cutlass.range(lane, splits, 32):
                top = cute.arch.fmax(top, mLp[s, token, head])
        top = cute.arch.warp_reduction_max(top)
        total = Float32(0.0)
        if top != -Float32.inf:
            for s in cutlass.range(lane, splits, 32):
                total += cute.math.exp2(mLp[s, token, head] - top, fastmath=True)
        total = cute.arch.warp_reduction_sum(total)
        if lane == 0:
            s_top[g] = top
            s_total[g] = total
    cute.arch.sync_threads()

    n = -(-g_rows * d_ // THREADS)  # elements per thread
    unroll = min(UNROLL, max(1, IN_FLIGHT[fp8] // n))  # splits per round trip
    acc = cute.make_rmem_tensor(n, Float32)
    tops = cute.make_rmem_tensor(n, Float32)
    acc.fill(0.0)
    for j in cutlass.range_constexpr(n):
        g = (tidx + j * THREADS) // d_
        tops[j] = -Float32.inf
        if tidx + j * THREADS < g_rows * d_:
            tops[j] = s_top[g]
    # a round: every load of `unroll` splits issued, then used (ptxas kept 2-3 loads in flight
    # when each load sat beside its use in an unrolled loop)
    o_part = cute.make_rmem_tensor((unroll, n), Float32)
    l_part = cute.make_rmem_tensor((unroll, n), Float32)
    for r in cutlass.range(cute.ceil_div(splits, unroll), unroll=1):
        for u in cutlass.range_constexpr(unroll):
            s = r * unroll + u
            for j in cutlass.range_constexpr(n):
                i = tidx + j * THREADS
                g = i // d_
                o_part[u, j] = 0.0
                l_part[u, j] = -Float32.inf
                if s < splits and tops[j] != -Float32.inf:
                    token = q_off + g // heads
                    head = head0 + g % heads
                    l_part[u, j] = mLp[s, token, head]
                    o_part[u, j] = mOp[s, token, head, i - g * d_]
        for u in cutlass.range_constexpr(unroll):
            for j in cutlass.range_constexpr(n):
                if tops[j] != -Float32.inf:
                    w = cute.math.exp2(l_part[u, j] - tops[j], fastmath=True)
                    acc[j] += w * o_part[u, j]
    for j in cutlass.range_constexpr(n):
        i = tidx + j * THREADS
        g = i // d_
        d = i - g * d_
        if i < g_rows * d_:
            if g // heads < sq:
                token = q_off + g // heads
                head = head0 + g % heads
                total = s_total[g]
                out = Float32(0.0)
                lse = -Float32.inf
                if total > 0.0:
                    out = acc[j] / total
                    lse = (tops[j] + cute.math.log2(total, fastmath=True)) * LN2
                mO[token, head, d] = out.to(mO.element_type)
                if d == 0:
                    mLSE[token, head] = lse
