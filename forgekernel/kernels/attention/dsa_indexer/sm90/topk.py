"""The lightning indexer's top-k for Hopper (sm_90a): per row of fp32 logits, the `topk` largest
values of its window of columns [start, end), exactly, as column ids (paged: cache slots
block_table[b, col // 64] * 64 + col % 64) in ascending column order, then -1 padding.

Keys: each value x as an order-preserving uint32 (x + 0.0, so -0 is +0; sign bit clear: bits
| 2^31, set: ~bits); -inf and NaN take key 0 and are never selected ("hidden", as the
reference's -inf). V = the row's valid values; min(topk, V) are selected.

One row per cluster of `cluster` CTAs (grid (cluster x rows,)); CTA r holds the r-th part of
the window (ceil(n / cluster) rounded up to 4 values, at most CACHE) in shared memory, brought
in by one bulk copy (its start aligned down to 16 bytes: rows are 16-byte aligned). Every pass
after that reads shared memory only; the CTAs exchange small summaries through distributed
shared memory after a cluster barrier (one CTA: a CTA barrier), and every CTA takes the same
decisions from the same totals.

1. Keys in place; count, smallest and largest valid key (warp reductions, shared atomics),
   exchanged: V, lo, hi. need = min(topk, V).
2. While need < (values in [lo, hi]) and lo < hi, at most 3 rounds: a histogram of
   (key - lo) >> shift over 2048 bins (shift: the fewest bits that fit hi - lo in 11), summed
   over the cluster; a suffix scan finds the bin d holding the need-th largest; the values above
   it are selected for good (need -= their count) and [lo, hi] shrinks to the bin. Two
   histogram buffers alternate: one cluster barrier a round.
3. Selected: every key > hi, and the first `need` keys in [lo, hi] in column order (ties).
   Each warp counts its segment's two kinds (ballots), the counts are scanned over warps and
   then over the cluster's CTAs, and a second walk writes each selected column at its rank.

Invariant of 2 (the CPU model in emulate.py replays it): keys > hi number topk' - need, where
topk' = min(topk, V), and [lo, hi] holds at least need keys.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, const_expr
from cutlass.memory import SmemAllocator

from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    CACHE,
    HIST_BITS,
    PAGE,
    TOPK_THREADS,
)
from forgekernel.kernels.common.sm90.cluster import load_peer_i32
from forgekernel.kernels.common.sm90.ptx import bulk_g2s

BINS = 1 << HIST_BITS
WARPS = TOPK_THREADS // 32
BINS_PER_THREAD = BINS // TOPK_THREADS
ROUNDS = 3  # 11 + 11 + 10 bits: 32-bit keys
HIDDEN = -(1 << 31)  # the key of -inf, NaN and of nothing
BIGGEST = (1 << 31) - 1
ABS_MASK = (1 << 31) - 1
POS_INF = 0x7F800000
NEG_INF = -(1 << 31) + 0x7F800000  # 0xFF800000 as int32


class IndexerTopkSm90:
    """Exact top-k per row (module docstring), `cluster` CTAs a row, paged slots or columns."""

    def __init__(self, cluster: int, paged: bool):
        self.cluster = cluster
        self.paged = paged

    @cute.jit
    def __call__(
        self,
        mLogits: cute.Tensor,
        mTable: cute.Tensor | None,
        mSeqLens: cute.Tensor | None,
        mKStart: cute.Tensor | None,
        mKEnd: cute.Tensor | None,
        mOut: cute.Tensor,
        next_n: Int32,
        stream: cuda.CUstream,
    ):
        """mLogits (rows, width) fp32, rows 16-byte aligned; mOut (rows, topk) int32. Paged:
        row r is token r % next_n of sequence r // next_n, window [0, seq_lens - next_n + 1 +
        r % next_n), ids through mTable (B, max_pages); contiguous: windows [mKStart, mKEnd)
        (rows,), ids the columns."""
        if const_expr(self.paged != (mTable is not None)):
            raise ValueError("a paged compile takes the block table, a contiguous one k_start")

        @cute.struct
        class SharedStorage:
            bar: cute.struct.MemRange[cutlass.Int64, 1]
            stats: cute.struct.MemRange[Int32, 4]  # valid count, smallest, largest key
            totals: cute.struct.MemRange[Int32, 2]  # the CTA's keys above hi, in [lo, hi]
            decision: cute.struct.MemRange[Int32, 4]
            warp_sums: cute.struct.MemRange[Int32, WARPS]
            warp_counts: cute.struct.MemRange[Int32, 2 * WARPS]
            hist: cute.struct.MemRange[Int32, 2 * BINS]
            cache: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, CACHE + 8], 128]

        self.shared_storage = SharedStorage
        self.kernel(mLogits, mTable, mSeqLens, mKStart, mKEnd, mOut, next_n).launch(
            grid=[self.cluster * mOut.shape[0], 1, 1],  # rows on x: y stops at 65535
            block=[TOPK_THREADS, 1, 1],
            cluster=[self.cluster, 1, 1],
            stream=stream,
        )

    # ---------------------------------------------------------------- device code
    @cute.kernel
    def kernel(self, mLogits, mTable, mSeqLens, mKStart, mKEnd, mOut, next_n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        row = bx // self.cluster
        rank = Int32(0)
        if const_expr(self.cluster > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = SmemAllocator().allocate(self.shared_storage)
        cache = storage.cache.get_tensor(cute.make_layout(CACHE + 8))
        keys = cute.make_tensor(
            cute.recast_ptr(cache.iterator, dtype=Int32), cute.make_layout(CACHE + 8)
        )
        hist = storage.hist.get_tensor(cute.make_layout((BINS, 2), stride=(1, BINS)))
        stats = storage.stats.get_tensor(cute.make_layout(4))
        totals = storage.totals.get_tensor(cute.make_layout(2))
        bar = storage.bar.data_ptr()

        start, end = self._window(mLogits, mSeqLens, mKStart, mKEnd, row, next_n)
        n = cutlass.max(end - start, 0)
        part = ((n + self.cluster - 1) // self.cluster + 3) // 4 * 4
        a = start + rank * part
        m = cutlass.max(cutlass.min(a + part, end) - a, 0)
        a_al = a // 4 * 4
        off = a - a_al
        nbytes = Int32(0)
        if m > 0:
            nbytes = ((a + m + 3) // 4 * 4 - a_al) * 4

        for i in cutlass.range(tidx, 2 * BINS, TOPK_THREADS, unroll=1):
            hist[i % BINS, i // BINS] = 0
        if tidx == 0:
            stats[0] = 0
            stats[1] = BIGGEST
            stats[2] = HIDDEN
            totals[0] = 0
            totals[1] = 0
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
            if nbytes > 0:
                src = mLogits[row, None].iterator + a_al
                bulk_g2s(cache.iterator, src, nbytes, bar)
        cute.arch.mbarrier_wait(bar, 0)

        count, lo, hi = self._keys(keys, stats, off, m, tidx)
        topk = mOut.shape[1]
        need = cutlass.min(count, topk)
        inside = count  # keys in [lo, hi]
        lo, hi, need, inside = self._refine(
            keys, hist, storage, (off, m), (lo, hi, need, inside), tidx
        )
        selected = cutlass.min(count, topk)
        self._write(keys, storage, (off, m, a, rank), (lo, hi, need, selected), mTable, mOut,
                    row, next_n, tidx)  # fmt: skip
        if const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # no CTA leaves while a peer may read its shared memory

    @cute.jit
    def _window(self, mLogits, mSeqLens, mKStart, mKEnd, row, next_n):
        """[start, end) of the row's columns, clipped to the logits' width."""
        start = Int32(0)
        end = Int32(0)
        if const_expr(self.paged):
            end = mSeqLens[row // next_n] - (next_n - 1 - row % next_n)
        else:
            start = cutlass.max(mKStart[row], 0)
            end = mKEnd[row]
        return start, cutlass.min(end, mLogits.shape[1])

    @cute.jit
    def _sync(self):
        """Shared memory written before is visible to the cluster's (or CTA's) threads after."""
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def _peer(self, t: cute.Tensor, idx, rank):
        """The int32 t[idx] of CTA `rank` of the cluster (this CTA's own when there is one)."""
        value = Int32(t[idx])
        if const_expr(self.cluster > 1):
            value = load_peer_i32(t.iterator + idx, rank)
        return value

    @cute.jit
    def _keys(self, keys, stats, off, m, tidx):
        """Values -> keys in place (read as their bits); (valid count, smallest, largest key) of
        the cluster's row."""
        count = Int32(0)
        smallest = Int32(BIGGEST)
        largest = Int32(HIDDEN)
        for i in cutlass.range(tidx, m, TOPK_THREADS, unroll=4):
            raw = Int32(keys[off + i])
            key = Int32(HIDDEN)
            if ((raw & ABS_MASK) <= POS_INF) & (raw != NEG_INF):  # not NaN, not -inf
                if raw == HIDDEN:
                    raw = Int32(0)  # -0 is +0
                if raw < 0:
                    raw = raw ^ ABS_MASK
                key = raw
                count += 1
                smallest = cutlass.min(smallest, key)
                largest = cutlass.max(largest, key)
            keys[off + i] = key
        count = cute.arch.warp_redux_sync(count, "add")
        smallest = cute.arch.warp_redux_sync(smallest, "min")
        largest = cute.arch.warp_redux_sync(largest, "max")
        if tidx % 32 == 0:
            cute.arch.atomic_add(stats.iterator, count)
            cute.arch.atomic_min(stats.iterator + 1, smallest)
            cute.arch.atomic_max(stats.iterator + 2, largest)
        self._sync()
        count = Int32(0)
        smallest = Int32(BIGGEST)
        largest = Int32(HIDDEN)
        for p in cutlass.range_constexpr(self.cluster):
            count += self._peer(stats, 0, p)
            smallest = cutlass.min(smallest, self._peer(stats, 1, p))
            largest = cutlass.max(largest, self._peer(stats, 2, p))
        return count, smallest, largest

    @cute.jit
    def _refine(self, keys, hist, storage, part, state, tidx):
        """Step 2 of the module docstring: (lo, hi, need, keys in [lo, hi])."""
        off, m = part
        lo, hi, need, inside = state
        warp_sums = storage.warp_sums.get_tensor(cute.make_layout(WARPS))
        decision = storage.decision.get_tensor(cute.make_layout(4))
        shift = Int32(0)
        for _ in cutlass.range_constexpr(32 - HIST_BITS):
            if (Int64(hi) >> Int64(shift)) - (Int64(lo) >> Int64(shift)) >= BINS:
                shift += 1
        for level in cutlass.range_constexpr(ROUNDS):
            if (need < inside) & (lo < hi):
                buf = level % 2
                base = lo >> shift
                for i in cutlass.range(tidx, m, TOPK_THREADS, unroll=4):
                    key = Int32(keys[off + i])
                    if (key >= lo) & (key <= hi):
                        slot = hist.iterator + ((key >> shift) - base + buf * BINS)
                        cute.arch.atomic_add(slot, Int32(1))
                self._sync()
                # this thread's bins, from the top: BINS - 1 - 4 t - k, k = 0..3
                counts = cute.make_rmem_tensor(BINS_PER_THREAD, Int32)
                mine = Int32(0)
                for k in cutlass.range_constexpr(BINS_PER_THREAD):
                    b = BINS - 1 - BINS_PER_THREAD * tidx - k
                    c = Int32(0)
                    for p in cutlass.range_constexpr(self.cluster):
                        c += self._peer(hist, b + buf * BINS, p)
                    counts[k] = c
                    mine += c
                # the buffer of the next round was last read before this round's barrier
                for i in cutlass.range(tidx, BINS, TOPK_THREADS, unroll=1):
                    hist[i, 1 - buf] = 0
                above = self._exclusive_scan(mine, warp_sums, tidx)
                for k in cutlass.range_constexpr(BINS_PER_THREAD):
                    if (above < need) & (above + counts[k] >= need):
                        decision[0] = BINS - 1 - BINS_PER_THREAD * tidx - k
                        decision[1] = above
                        decision[2] = counts[k]
                    above += counts[k]
                cute.arch.sync_threads()
                first = Int64(base + decision[0]) << Int64(shift)
                last = first + (Int64(1) << Int64(shift)) - 1
                need -= decision[1]
                inside = decision[2]
                lo = Int32(cutlass.max(first, Int64(lo)))
                hi = Int32(cutlass.min(last, Int64(hi)))
                shift = cutlass.max(shift - HIST_BITS, 0)
        return lo, hi, need, inside

    @cute.jit
    def _exclusive_scan(self, value, warp_sums, tidx):
        """The sum of `value` over the CTA's threads before this one (thread order)."""
        lane = tidx % 32
        warp = tidx // 32
        inclusive = value
        for s in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << s, mask_and_clamp=0)
            if lane >= (1 << s):
                inclusive += other
        if lane == 31:
            warp_sums[warp] = inclusive
        cute.arch.sync_threads()
        before = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            if w < warp:
                before += warp_sums[w]
        return before + inclusive - value

    @cute.jit
    def _write(self, keys, storage, part, state, mTable, mOut, row, next_n, tidx):
        """Step 3: the selected columns at their ranks, then -1 padding."""
        off, m, a, rank = part
        lo, hi, need, selected = state
        counts = storage.warp_counts.get_tensor(cute.make_layout((WARPS, 2)))
        totals = storage.totals.get_tensor(cute.make_layout(2))
        lane = tidx % 32
        warp = tidx // 32
        seg = (m + WARPS * 32 - 1) // (WARPS * 32) * 32
        w0 = warp * seg
        w1 = cutlass.min(w0 + seg, m)
        above = Int32(0)
        ties = Int32(0)
        for base in cutlass.range(w0, w1, 32, unroll=1):
            i = base + lane
            key = Int32(HIDDEN)
            if i < w1:
                key = Int32(keys[off + i])
            above += cute.arch.popc(cute.arch.vote_ballot_sync(key > hi))
            ties += cute.arch.popc(cute.arch.vote_ballot_sync((key >= lo) & (key <= hi)))
        if lane == 0:
            counts[warp, 0] = above
            counts[warp, 1] = ties
            cute.arch.atomic_add(totals.iterator, above)
            cute.arch.atomic_add(totals.iterator + 1, ties)
        self._sync()
        above = Int32(0)
        ties = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            if w < warp:
                above += counts[w, 0]
                ties += counts[w, 1]
        for p in cutlass.range_constexpr(self.cluster):
            if p < rank:
                above += self._peer(totals, 0, p)
                ties += self._peer(totals, 1, p)
        if const_expr(self.cluster > 1):
            cute.arch.cluster_arrive()  # peers' totals read: the exit barrier's arrival
        below = (Uint32(1) << Uint32(lane)) - Uint32(1)
        for base in cutlass.range(w0, w1, 32, unroll=1):
            i = base + lane
            key = Int32(HIDDEN)
            if i < w1:
                key = Int32(keys[off + i])
            is_above = key > hi
            is_tie = (key >= lo) & (key <= hi)
            bits_above = Uint32(cute.arch.vote_ballot_sync(is_above))
            bits_tie = Uint32(cute.arch.vote_ballot_sync(is_tie))
            rank_above = above + Int32(cute.arch.popc(bits_above & below))
            rank_tie = ties + Int32(cute.arch.popc(bits_tie & below))
            col = a + i
            if is_above:
                mOut[row, rank_above + cutlass.min(rank_tie, need)] = self._id(
                    mTable, row, next_n, col
                )
            if is_tie & (rank_tie < need):
                mOut[row, rank_above + rank_tie] = self._id(mTable, row, next_n, col)
            above += Int32(cute.arch.popc(bits_above))
            ties += Int32(cute.arch.popc(bits_tie))
        # padding: positions [selected, topk), spread over the cluster's threads
        for j in cutlass.range(selected + rank * TOPK_THREADS + tidx, mOut.shape[1],
                               self.cluster * TOPK_THREADS, unroll=1):  # fmt: skip
            mOut[row, j] = -1

    @cute.jit
    def _id(self, mTable, row, next_n, col):
        """The id written for column `col`: a cache slot when paged, else the column."""
        out = col
        if const_expr(self.paged):
            out = mTable[row // next_n, col // PAGE] * PAGE + col % PAGE
        return out
