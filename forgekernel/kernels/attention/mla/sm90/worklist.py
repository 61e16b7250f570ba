"""The scheduling kernel of the seesaw pass's work list (candidate, FORGEKERNEL_MLA_WORKLIST=1):
one CTA, run on the stream before the pass, that reads seqlens_k (and cu_seqlens_q) on the
device and writes the list the pass's `worklist` compile takes its (unit, split, keys per
split) from. What it computes, and the list's layout, are schedule.py's (its Python
reference); no host read of the lengths, so a CUDA graph captures it as one more kernel node.

THREADS threads:
1. all threads fill the partial LSEs (flat, S x rows x Hq floats) with -inf (a (split, row) no
   item writes weighs 0 in the combine);
2. the units' largest tile count (block max), the search bounds [lo, hi];
3. the tiles per split: thread t costs candidates lo + t, lo + t + THREADS, ... (each a walk
   over the units: items = sum ceil(tiles_u / per)), keeping its cheapest (ties to its larger
   per); the block's minimal cost, then the largest per of that cost (two block reductions);
4. warp 0 writes the items split by split, units in order within a split (a ballot and its
   population counts place each unit's item), and row 0 = (keys per split, items).

`ranges` (a decode step's schedule, `launch.make_schedule`; schedule.py's `ranged_plan`): no
bound from the width plan's splits: lo = fewest, a candidate whose items exceed the list's
capacity (slots + units) costs BIG; no LSE fill (the combine reads only the items a row's unit
has); warp 0 writes the items unit by unit (a unit's splits in order; its first item an
exclusive scan over the warp's lanes) and each query row's (first item, items, query token) into
mLp's slot, int32 (rows', 3).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.memory import SmemAllocator

from forgekernel.kernels.attention.mla.sm90.config import SPLIT_OVERHEAD_TILES, TILE
from forgekernel.kernels.attention.mla.sm90.schedule import HEADER
from forgekernel.kernels.attention.mla.sm90.units import unit_bounds
from forgekernel.kernels.common.sm90 import pdl
from forgekernel.kernels.common.sm90.constants import WARP_SIZE

THREADS = 128
WARPS = THREADS // WARP_SIZE
BIG = 1 << 30  # above any cost (waves x (per + overhead) stays far below)


class MlaWorklistSm90:
    """The scheduling kernel; qtokens > 1: the packed form (units = blocks of query tokens,
    cu_seqlens_q given), as the pass's `_unit`. pdl (common/sm90/pdl.py): it waits at its top
    (seqlens_k may be the previous kernel's output; a previous call's combine may still read
    the partial LSEs it fills), then lets the pass be scheduled: the pass's CTAs, waiting on
    this one CTA, are resident when it ends."""

    def __init__(self, qtokens: int = 1, ranges: bool = False, pdl: bool = True):
        self.qt = qtokens
        self.ranges = ranges
        self.pdl = pdl

    @cute.jit
    def __call__(
        self,
        mSeq: cute.Tensor,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        q_blocks: Int32,
        head_blocks: Int32,
        splits: Int32,
        fewest: Int32,
        slots: Int32,
        width: Int32,
        mWork: cute.Tensor,
        mLp: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mSeq int32 (B,); mCuQ int32 (B + 1,) or None (qtokens 1); causal, q_blocks as the
        pass's; head_blocks: CTAs a unit's item launches; splits: the width plan's S (no unit
        gets more); fewest: the plan's fewest tiles a split; slots: CTAs a wave; width: the
        table's width in tiles (no unit counts more: schedule.py). mWork int32
        (capacity + HEADER, 2) (schedule.py), mLp fp32 (S x rows x Hq,) the partial LSEs, flat."""
        if const_expr((mCuQ is None) != (self.qt == 1)):
            raise ValueError("cu_seqlens_q comes with qtokens > 1, and only then")

        @cute.struct
        class Shared:
            red: cute.struct.MemRange[Int32, 3 * WARPS]

        self.shared = Shared
        args = (mSeq, mCuQ, causal, q_blocks, head_blocks, splits, fewest, slots, width)
        self.kernel(*args, mWork, mLp).launch(
            grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl
        )

    @cute.kernel
    def kernel(
        self,
        mSeq: cute.Tensor,
        mCuQ: cute.Tensor | None,
        causal: Int32,
        q_blocks: Int32,
        head_blocks: Int32,
        splits: Int32,
        fewest: Int32,
        slots: Int32,
        width: Int32,
        mWork: cute.Tensor,
        mLp: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP_SIZE)
        lane = tidx % WARP_SIZE
        storage = SmemAllocator().allocate(self.shared)
        sRed = storage.red.get_tensor(cute.make_layout((WARPS, 3), stride=(1, WARPS)))
        units = mSeq.shape[0] * q_blocks
        pdl.wait(self.pdl)
        pdl.launch_dependents(self.pdl)

        if const_expr(not self.ranges):
            for i in cutlass.range(tidx, mLp.shape[0], THREADS):
                mLp[i] = -cutlass.Float32.inf

        top = Int32(0)
        for u in cutlass.range(tidx, units, THREADS):
            top = cutlass.max(top, self._tiles(mSeq, mCuQ, causal, q_blocks, width, u))
        top = self._block(top, cutlass.max, sRed[None, 0], tidx)
        lo = cutlass.max(cutlass.max(fewest, (top + splits - 1) // splits), 1)
        if const_expr(self.ranges):
            lo = cutlass.max(fewest, 1)
        hi = cutlass.max(top, lo)

        best, best_per = Int32(BIG), lo
        for per in cutlass.range(lo + tidx, hi + 1, THREADS):
            items = Int32(0)
            for u in cutlass.range(units):
                t = self._tiles(mSeq, mCuQ, causal, q_blocks, width, u)
                items += (t + per - 1) // per
            waves = (items * head_blocks + slots - 1) // slots
            cost = waves * (per + SPLIT_OVERHEAD_TILES)
            if const_expr(self.ranges):
                if items > mWork.shape[0] - HEADER:  # past the list's capacity
                    cost = Int32(BIG)
            if cost <= best:  # ascending per: ties to the larger
                best, best_per = cost, per
        least = self._block(best, cutlass.min, sRed[None, 1], tidx)
        mine = Int32(-1)
        if best == least:
            mine = best_per
        per = self._block(mine, cutlass.max, sRed[None, 2], tidx)

        if const_expr(self.ranges):
            if warp == 0:
                self._write_ranges((mSeq, mCuQ, causal, q_blocks, width), per, mWork, mLp, lane)
        elif warp == 0:
            count = Int32(0)
            below = (Int32(1) << lane) - 1  # the lanes before this one
            for s in cutlass.range(splits):
                first = s * per
                for u0 in cutlass.range(0, units, WARP_SIZE):
                    u = u0 + lane
                    t = Int32(0)
                    if u < units:
                        t = self._tiles(mSeq, mCuQ, causal, q_blocks, width, u)
                    has = first < t
                    ballot = cute.arch.vote_ballot_sync(has)
                    if has:
                        at = HEADER + count + cute.arch.popc(ballot & below)
                        mWork[at, 0] = u
                        mWork[at, 1] = s
                    count += cute.arch.popc(ballot)
            if lane == 0:
                mWork[0, 0] = per * TILE
                mWork[0, 1] = count

    @cute.jit
    def _write_ranges(self, units_of, per, mWork, mRows, lane):
        """Warp 0 (ranges): the items unit by unit, splits in order, and each query row's
        (first item, items, query token); row 0 = (keys per split, items)."""
        mSeq, mCuQ, causal, q_blocks, width = units_of
        units = mSeq.shape[0] * q_blocks
        count = Int32(0)
        for u0 in cutlass.range(0, units, WARP_SIZE):
            u = u0 + lane
            n = Int32(0)
            if u < units:
                n = (self._tiles(mSeq, mCuQ, causal, q_blocks, width, u) + per - 1) // per
            scan = n  # inclusive over the lanes
            for k in cutlass.range_constexpr(5):
                below = cute.arch.shuffle_sync_up(scan, 1 << k)
                if lane >= (1 << k):
                    scan += below
            first = count + scan - n
            if u < units:
                for s in cutlass.range(n):
                    mWork[HEADER + first + s, 0] = u
                    mWork[HEADER + first + s, 1] = s
                self._unit_rows(mRows, mCuQ, q_blocks, u, first, n)
            count += cute.arch.shuffle_sync(scan, WARP_SIZE - 1)
        if lane == 0:
            mWork[0, 0] = per * TILE
            mWork[0, 1] = count

    @cute.jit
    def _unit_rows(self, mRows, mCuQ, q_blocks, unit, first, n):
        """(first, n, token) into the rows of `unit`'s query tokens: row unit (one query a
        sequence), else block unit % q_blocks of its sequence's packed rows."""
        if const_expr(mCuQ is None):
            mRows[unit, 0] = first
            mRows[unit, 1] = n
            mRows[unit, 2] = 0
        else:
            b = unit // q_blocks
            token0 = (unit - b * q_blocks) * self.qt
            row0 = mCuQ[b] + token0
            sq = cutlass.max(cutlass.min(mCuQ[b + 1] - row0, self.qt), 0)
            for t in cutlass.range(sq):
                mRows[row0 + t, 0] = first
                mRows[row0 + t, 1] = n
                mRows[row0 + t, 2] = t

    @cute.jit
    def _tiles(self, mSeq, mCuQ, causal, q_blocks, width, unit):
        """Tiles of keys of `unit`: kv_end as the pass's `_unit`, in TILE keys, at most width."""
        kv_end = unit_bounds(mSeq, mCuQ, causal, q_blocks, self.qt, unit)[4]
        return cutlass.min((cutlass.max(kv_end, 0) + TILE - 1) // TILE, width)

    @cute.jit
    def _block(self, value, op, s_red, tidx):
        """`op` of `value` over the CTA (shuffles, then WARPS values in shared memory of this
        reduction's own: no barrier before the next reduction's writes)."""
        value = cute.arch.warp_reduction(value, op)
        if tidx % WARP_SIZE == 0:
            s_red[tidx // WARP_SIZE] = value
        cute.arch.sync_threads()
        value = s_red[0]
        for w in cutlass.range_constexpr(1, WARPS):
            value = op(value, s_red[w])
        return value
