"""Paged attention decode (sm_90a), split-KV: the plan's bookkeeping and the combine pass.

The partial pass (decode.py) runs on grid (splits, Hq / H, B): split s of sequence b covers
keys [s * per, min((s + 1) * per, seqlen)), per = max(per_split, ceil(seqlen / splits)) (the
sequence's own length over the splits, never under per_split), and writes, per query row, O
normalized (fp32) and its LSE in log2 units, -inf where it saw no key (`write_split`, from its
warps' running max, sum and O in shared memory). Speculative decoding / MTP: sequence b brings
sq = cu_seqlens_q[b + 1] - cu_seqlens_q[b] query tokens (q packed (total_q, Hq, D)), token i
seeing keys j <= sk - sq + i when causal (bottom-right); partial outputs are per query row,
(splits, total_q, Hq, D).

Combine pass (`PagedCombineSm90`): O = sum_s 2^(lse_s - top) O_s / sum_s 2^(lse_s - top), top
= max_s lse_s, lse = top + log2 sum_s 2^(lse_s - top); O 0 and LSE -inf where no split saw a
key; LSE returned natural (x ln 2). A plan of one split skips it: the partial pass writes the
final O and LSE itself (`write_split`)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm as _nvvm
from cutlass.memory import SmemAllocator

from forgekernel.kernels.attention.paged.sm90.combine_form import WARP_COLS
from forgekernel.kernels.attention.paged.sm90.config import THREADS, WARPS
from forgekernel.kernels.common.sm90 import fake, pdl
from forgekernel.kernels.common.sm90.constants import LN2, NUM_SMS_H100_H200


@cute.jit
def write_split(
    merge, outs, split, rows, head0, heads: cutlass.Constexpr[int],
    g_rows: cutlass.Constexpr[int], d_: cutlass.Constexpr[int], tidx,
):  # fmt: skip
    """The warps' (max in log2 units, sum, unnormalized O) of the CTA's rows, in shared memory
    as `merge` = (m (WARPS, >= G), lsum (WARPS, >= G), O (WARPS, >= G, D)), combined into this
    split's normalized O and log2 LSE: -inf and 0 where no warp saw a key. Row g is query
    token g // heads of the sequence (rows = (its first row, its tokens sq)), head
    head0 + g % heads; rows of tokens past sq are not written. outs = (mOp, mLp, mO, mLSE,
    direct): direct != 0 (a plan of one split) writes the final O in its dtype and the natural
    LSE into mO, mLSE, with no combine pass after; else the partials into mOp, mLp."""
    sm, sl, so = merge
    mOp, mLp, mO, mLSE, direct = outs
    q_off, sq = rows
    for i in cutlass.range(tidx, g_rows * d_, THREADS):
        g = i // d_
        d = i - g * d_
        top = sm[0, g]
        for w in cutlass.range_constexpr(1, WARPS):
            top = cute.arch.fmax(top, sm[w, g])
        total = Float32(0.0)
        acc = Float32(0.0)
        if top != -Float32.inf:
            for w in cutlass.range_constexpr(WARPS):
                c = cute.math.exp2(sm[w, g] - top, fastmath=True)
                total += sl[w, g] * c
                acc += so[w, g, d] * c
        token = q_off + g // heads
        head = head0 + g % heads
        out = Float32(0.0)
        lse = -Float32.inf
        if total > 0.0:
            out = acc / total
            lse = top + cute.math.log2(total, fastmath=True)
        if g // heads < sq:
            if direct != 0:
                mO[token, head, d] = out.to(mO.element_type)
                if d == 0:
                    mLSE[token, head] = lse * LN2
            else:
                mOp[split, token, head, d] = out
                if d == 0:
                    mLp[split, token, head] = lse


# The combine's shape. A CTA takes one (row, head); its THREADS threads are groups of COLS / 4
# (a warp at D >= 128, half a warp at D 64), each thread one 16-byte vector of a split's COLS
# columns, group g adding splits g, g + groups, ... UNROLL at a time (software-pipelined: see
# `_accumulate`), the groups' sums then added in group order through shared memory. A row's
# D / COLS column chunks are spread over `spread` CTAs (grid z), each walking chunks z, z +
# spread, ...: as many as fit one wave of WAVE_CTAS with the rows x heads (b1-h16 at D 512:
# 64 CTAs where one CTA a row pulled 256 KB of partials through each of 16 SMs at 128 splits;
# b16-h128: 2048 CTAs, one a row, the LSE pass not repeated 4 times). SPLIT_CAP splits'
# weights fit in shared memory at once; more go a chunk at a time.
COLS = 128
# 54 registers at D 512 (64 with `_few`'s early loads), 61 at D 64 / 128 (8: 86 at D 512)
UNROLL = 4
# A row of at most FEW x FEW_ROUNDS splits at D >= WARPS x COLS (MLA's 512) takes `_few`: each
# warp its own column chunks over every split, FEW splits' 16-byte vectors in flight a round, the
# weights by shuffles, no shared memory, no barrier (16 splits: the schedule's rows at b8-h16 x
# 16k, the ragged batch's long rows, b1 x 4k's plan, which took the CTA path's three block
# reductions and its barriers)
FEW = 8
FEW_ROUNDS = 2

# A row of at most HELD x groups splits at D 64 / 128 (one column chunk) takes `_hold`: each
# group's partial rows (HELD 16-byte vectors a thread) loaded right after the PDL wait, beside
# the LSEs, not behind the three reductions: the b1 plans' 30 (16-bit) and 45 (FP8) splits
# at D 128 (4 groups), 96 at D 64 (8 groups)
HELD = 12
SPLIT_CAP = 256
WAVE_CTAS = NUM_SMS_H100_H200 * 8  # 8 CTAs an SM at <= 64 registers x 128 threads


def partials_o() -> cute.Tensor:
    """The combine's compile-time view of the partial O (splits, rows, Hq, D) fp32: sizes and
    outer strides dynamic, rows 16-byte aligned (the launchers' scratch: runtime/scratch.py
    carves each buffer from a 16-byte boundary, D a multiple of 4), for its 16-byte loads."""
    shape = tuple(cute.sym_int32() for _ in range(4))
    return fake.rowmajor(cutlass.Float32, shape, divisibility=4)


@cute.jit
def _block_reduce(value, op, s_red, tidx):
    """`op` (max or add) of `value` over the CTA's THREADS threads, the result in every thread;
    s_red: WARPS floats of shared memory no other reduction uses while this one runs."""
    value = cute.arch.warp_reduction(value, op)
    if tidx % 32 == 0:
        s_red[tidx // 32] = value
    cute.arch.sync_threads()
    value = s_red[0]
    for w in cutlass.range_constexpr(1, WARPS):
        value = op(value, s_red[w])
    return value


@cute.jit
def _weight(lse, top):
    """A split's weight 2^(lse - top): 0 for a split of no keys, and for every split where no
    split saw a key (top -inf: -inf - -inf would be NaN)."""
    w = Float32(0.0)
    if top != -Float32.inf:
        w = cute.math.exp2(lse - top, fastmath=True)
    return w


class PagedCombineSm90:
    """The combine pass: grid (Hq, rows, spread), THREADS threads; see the module docstring for
    what it computes and COLS for how the threads share the work.

    1. Every thread reads splits tidx, tidx + THREADS, ... of the row's LSE (all in flight: no
       chain over the splits), keeps them in shared memory, and the CTA reduces their max
       (shuffles, then WARPS values in shared memory); each thread then turns its splits into
       weights 2^(lse - top) in place and the CTA sums them (fp32, the same max shift as the
       partial pass's merge).
    2. Per column chunk: group g walks its splits up to the last that saw a key (the first
       pass's third reduction), acc += w_s O_s in fp32, a split of weight 0 among them adding
       0 (its partial row may be stale: never read into the sum). Past SPLIT_CAP
       splits the weights are remade a chunk of splits at a time from the LSEs.
    3. The groups' sums meet in shared memory; thread c < COLS adds column c's in group order,
       divides by the sum of weights and stores it in the output dtype; one thread the LSE.

    One split: weight exp2(0) = 1, sum 1, O_0 + 0 ... = O_0, LSE lse_0 x ln 2: what the direct
    forms write (tests/gpu/test_mla_gpu.py's bit-for-bit comparison).

    pdl (common/sm90/pdl.py): launched as a dependent of the partial pass; its shared-memory
    views and indices set up, it waits for the pass before its first read of the LSEs, then
    lets its own dependent (the next call's pass) be scheduled."""

    def __init__(self, head_dim: int, pdl: bool = True, held: bool = True):
        self.d = head_dim
        self.pdl = pdl
        self.singles = False  # PagedCombineRangesSm90's
        self.cols = min(head_dim, COLS)
        # `_hold`'s loads where a row's splits fit (one column chunk only); False: the
        # partial rows loaded after the reductions (the paged leaf's candidate ramp "serial")
        self.held = held
        self.chunks = head_dim // self.cols
        self.vecs = self.cols // 4  # a group's threads: one 16-byte vector of a split each
        self.groups = THREADS // self.vecs
        if head_dim % self.cols or THREADS % self.vecs:
            raise ValueError(f"head dim {head_dim}: a multiple of {COLS}, or 64")

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """mOp fp32 (splits, rows, Hq, D), rows 16-byte aligned (base and strides); mLp fp32
        (splits, rows, Hq) log2; mO (rows, Hq, D) 16-bit, rows contiguous; mLSE fp32 (rows, Hq)
        (any strides: (Hq, rows) storage seen transposed), natural log. rows: B, or total_q
        with query tokens."""
        self._launch((mOp, mLp, mO, mLSE), mO, stream)

    @cute.jit
    def _launch(self, args, mO, stream):
        """The kernel on `args` over grid (Hq, rows, spread)."""

        @cute.struct
        class Shared:
            w: cute.struct.Align[cute.struct.MemRange[Float32, SPLIT_CAP], 16]
            acc: cute.struct.Align[cute.struct.MemRange[Float32, 4 * THREADS], 16]
            red: cute.struct.MemRange[Float32, 3 * WARPS]  # the max's, the last's, the sum's

        self.shared = Shared
        units = cutlass.max(mO.shape[0] * mO.shape[1], 1)
        spread = cutlass.max(cutlass.min(WAVE_CTAS // units, self.chunks), 1)
        self.kernel(*args).launch(
            grid=(mO.shape[1], mO.shape[0], spread),
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
        _, b, _ = cute.arch.block_idx()
        self._combine(mOp, mLp, mO, mLSE, b, None)

    @cute.jit
    def _combine(self, mOp, mLp, mO, mLSE, b, mRows):
        """Row b's combine (the class docstring); mRows (PagedCombineRangesSm90's, read after
        the PDL wait: the scheduling kernel may be the pass's own predecessor) row b = (first
        item, items, query token) of the row's unit in the partials' leading mode; None: every
        split of row b."""
        tidx, _, _ = cute.arch.thread_idx()
        head, _, first = cute.arch.block_idx()
        _, _, spread = cute.arch.grid_dim()
        storage = SmemAllocator().allocate(self.shared)
        sW = storage.w.get_tensor(cute.make_layout(SPLIT_CAP))
        sAcc = storage.acc.get_tensor(cute.make_layout((self.cols, self.groups)))
        sRed = storage.red.get_tensor(cute.make_layout((WARPS, 3), stride=(1, WARPS)))
        splits = mLp.shape[0]
        gL = mLp[None, b, head]
        gO = mOp[None, b, head, None]
        # held (the paged leaf's D 64 / 128): the next pass scheduled before this combine's
        # wait, so that its CTAs take the slots the pass's exit frees and run their pre-wait L2
        # prefetches (decode.py `_prefetch_guess`) under the pass's tail and this combine. No
        # slot is taken from a CTA not yet started: this grid is scheduled once the pass's last
        # wave is resident, the next pass once all of this grid is (common/sm90/pdl.py, 2)
        early = self.held and self.chunks == 1
        if const_expr(early):
            pdl.launch_dependents(self.pdl)
        pdl.wait(self.pdl)  # the partials, out / lse and the rows: the pass's, or earlier calls'
        if const_expr(not early):
            pdl.launch_dependents(self.pdl)
        if const_expr(mRows is not None):
            item0, splits, token = mRows[b, 0], Int32(mRows[b, 1]), mRows[b, 2]
            if const_expr(self.singles):
                if splits == 1:  # the pass wrote this row (the same for the whole CTA): gone
                    _nvvm.exit()
            gL = cute.domain_offset((item0,), mLp[None, token, head])
            gO = cute.domain_offset((item0, 0), mOp[None, token, head, None])

        if const_expr(self.chunks >= WARPS):
            if splits <= FEW * FEW_ROUNDS:  # the row's count, the same for the whole CTA
                self._few(gL, gO, mO, mLSE, b, head, splits, tidx)
                _nvvm.exit()  # its stores issued; no barrier below is reached by any thread

        held, hold = None, Int32(0)
        if const_expr(self.held and self.chunks == 1):
            held = cute.make_rmem_tensor((4, HELD), Float32)
            if splits <= HELD * self.groups:  # the row's count: uniform over the CTA
                hold = Int32(1)
                g = tidx // self.vecs
                self._hold(gO, splits, g, tidx - g * self.vecs, held)

        top = -Float32.inf
        last = Float32(-1.0)  # the last split that saw a key (exact in fp32 below 2^24)
        for s in cutlass.range(tidx, splits, THREADS):
            lse = gL[s]
            if s < SPLIT_CAP:
                sW[s] = lse
            top = cute.arch.fmax(top, lse)
            if lse != -Float32.inf:
                last = Float32(s)
        top = _block_reduce(top, cute.arch.fmax, sRed[None, 0], tidx)
        # only splits up to the last with keys are read: past it every weight is 0 (a plan
        # sized by a wide table leaves a short sequence's later splits empty)
        used = Int32(_block_reduce(last, cute.arch.fmax, sRed[None, 1], tidx)) + 1
        total = Float32(0.0)
        for s in cutlass.range(tidx, splits, THREADS):  # each thread its own splits' slots
            lse = Float32(0.0)
            if s < SPLIT_CAP:
                lse = sW[s]
            else:
                lse = gL[s]
            w = _weight(lse, top)
            if s < SPLIT_CAP:
                sW[s] = w
            total += w
        # (its barrier also hands every thread the weights)
        total = _block_reduce(total, lambda x, y: x + y, sRed[None, 2], tidx)

        group = tidx // self.vecs
        vec = tidx - group * self.vecs
        for chunk in cutlass.range(first, self.chunks, spread):
            acc = cute.make_rmem_tensor(4, Float32)
            acc.fill(0.0)
            if total > 0.0:  # uniform over the CTA: no split saw a key, nothing to read
                walk = (gO, gL, sW, top, used, chunk, first)
                if const_expr(held is None):
                    self._walk(acc, walk, group, vec, tidx)
                else:
                    if hold != 0:
                        self._add_held(acc, held, sW, splits, group)
                    else:
                        self._walk(acc, walk, group, vec, tidx)
            cute.autovec_copy(acc, cute.local_tile(sAcc[None, group], (4,), (vec,)))
            cute.arch.sync_threads()
            if tidx < self.cols:
                o = sAcc[tidx, 0]
                for g in cutlass.range_constexpr(1, self.groups):
                    o = o + sAcc[tidx, g]
                out = Float32(0.0)
                if total > 0.0:
                    out = o / total
                mO[b, head, chunk * self.cols + tidx] = out.to(mO.element_type)
            cute.arch.sync_threads()  # sAcc read before the next chunk writes it
        if tidx == 0 and first == 0:
            lse = -Float32.inf
            if total > 0.0:
                lse = (top + cute.math.log2(total, fastmath=True)) * LN2
            mLSE[b, head] = lse

    @cute.jit
    def _few(self, gL, gO, mO, mLSE, b, head, splits, tidx):
        """Row b's combine where it has at most FEW x FEW_ROUNDS splits (D >= WARPS x COLS): each
        warp's first column chunk (chunk first + warp x spread) of splits 0 .. FEW - 1 is loaded
        first, every such split's 16-byte vector in flight at once, beside lane s < splits' read
        of split s's LSE (the weights are not needed to issue the loads: one round trip to L2
        where the LSE's and then O's were two in a row); each warp then reduces the max and the
        weights' sum by shuffles (every warp alike) and adds acc += w_s O_s in split order, w_s
        from lane s (a split of weight 0 adds 0: its row is not trusted, selected out), splits
        FEW .. 2 FEW - 1 loaded after the first round's sums where the row has them; stepping
        spread x WARPS chunks (at MLA's D 512 a warp has one chunk); out = acc / sum, 0 and LSE
        -inf where no split saw a key. The sums in split order: the warp form's bits. One split:
        0 + 1 x O_0, LSE lse_0 x ln 2 (the direct forms' bits)."""
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        _, _, first = cute.arch.block_idx()
        _, _, spread = cute.arch.grid_dim()
        vals = cute.make_rmem_tensor((4, FEW), Float32)
        chunk = first + warp * spread
        self._few_loads(gO, 0, splits, chunk * self.vecs + lane, vals)
        lse = -Float32.inf
        if lane < splits:
            lse = gL[lane]
        top = cute.arch.warp_reduction(lse, cute.arch.fmax)
        w = _weight(lse, top)
        total = cute.arch.warp_reduction(w, lambda x, y: x + y)
        acc = cute.make_rmem_tensor(4, Float32)
        outs = cute.make_rmem_tensor(4, mO.element_type)
        while chunk < self.chunks:
            vec = chunk * self.vecs + lane
            acc.fill(0.0)
            self._few_add(acc, vals, w, 0)
            for r in cutlass.range_constexpr(1, FEW_ROUNDS):
                if splits > r * FEW:  # the row's count: uniform over the warp
                    self._few_loads(gO, r * FEW, splits, vec, vals)
                    self._few_add(acc, vals, w, r * FEW)
            for j in cutlass.range_constexpr(4):
                out = Float32(0.0)
                if total > 0.0:
                    out = acc[j] / total
                outs[j] = out.to(mO.element_type)
            cute.autovec_copy(outs, cute.local_tile(mO[b, head, None], (4,), (vec,)))
            chunk += spread * WARPS
            if const_expr(self.chunks > WARPS):  # D 512: every warp's only chunk was the first
                self._few_loads(gO, 0, splits, chunk * self.vecs + lane, vals)
        if tidx == 0 and first == 0:
            out_lse = -Float32.inf
            if total > 0.0:
                out_lse = (top + cute.math.log2(total, fastmath=True)) * LN2
            mLSE[b, head] = out_lse

    @cute.jit
    def _few_loads(self, gO, s0, splits, vec, vals):
        """vals[:, s] = split s0 + s's 16-byte vector `vec` of the row, s0 + s < splits, where
        the vector is inside the row (a warp past its last chunk loads nothing); 0 elsewhere."""
        vals.fill(0.0)
        if vec < self.d // 4:
            for s in cutlass.range_constexpr(FEW):
                if s0 + s < splits:
                    cute.autovec_copy(
                        cute.local_tile(gO[s0 + s, None], (4,), (vec,)), vals[None, s]
                    )

    @cute.jit
    def _few_add(self, acc, vals, w, s0):
        """acc += w_s O_s over splits s0 .. s0 + FEW - 1 in order (vals[:, s - s0] = O_s), w_s
        from lane s; a split of weight 0 adds 0 whatever its row holds."""
        for s in cutlass.range_constexpr(FEW):
            ws = cute.arch.shuffle_sync(w, s0 + s)
            for j in cutlass.range_constexpr(4):
                o = cutlass.select_(ws > 0.0, vals[j, s], Float32(0.0))
                acc[j] = acc[j] + ws * o

    @cute.jit
    def _walk(self, acc, walk, group, vec, tidx):
        """acc += w_s O_s over the group's splits up to the last with keys, loaded as it goes
        (`_accumulate`), SPLIT_CAP splits' weights at a time."""
        gO, gL, sW, top, used, chunk, first = walk
        for c0 in cutlass.range(0, used, SPLIT_CAP):
            n = cutlass.min(used - c0, SPLIT_CAP)
            # sW holds splits [0, SPLIT_CAP)'s weights until a later chunk's replace them
            if c0 > 0 or (chunk != first and used > SPLIT_CAP):
                cute.arch.sync_threads()  # every thread done with the last weights
                for s in cutlass.range(tidx, n, THREADS):
                    sW[s] = _weight(gL[c0 + s], top)
                cute.arch.sync_threads()
            self._accumulate(acc, (gO, sW, c0, n), group, chunk * self.vecs + vec)

    @cute.jit
    def _hold(self, gO, splits, group, vec, held):
        """This thread's 16-byte vector of the group's splits group, group + groups, ... (at
        most HELD of them, the row's splits <= HELD x groups) into held, all loads issued
        before any use; past the row's splits nothing is read."""
        for k in cutlass.range_constexpr(HELD):
            s = k * self.groups + group
            if s < splits:
                cute.autovec_copy(cute.local_tile(gO[s, None], (4,), (vec,)), held[None, k])

    @cute.jit
    def _add_held(self, acc, held, sW, splits, group):
        """acc += w_s O_s over `_hold`'s splits in split order (`_accumulate`'s sums): the
        weights from shared memory, a split of weight 0 (no keys: its row may be stale, even
        NaN) or past the row's splits adding 0."""
        for k in cutlass.range_constexpr(HELD):
            s = k * self.groups + group
            if s < splits:
                w = sW[s]
                for j in cutlass.range_constexpr(4):
                    o = held[j, k]
                    if w == 0.0:
                        o = Float32(0.0)
                    acc[j] = acc[j] + w * o

    @cute.jit
    def _accumulate(self, acc, where, group, vec):
        """acc += w_s O_s[4 vec : 4 vec + 4] over this group's splits of the chunk, in split
        order. where = (gO (splits, D), sW, first split c0, splits n of the chunk). Blocks of
        UNROLL splits a group, software-pipelined: block k + 1's loads are issued before block
        k's FMAs, which use registers loaded an iteration earlier. (Loads and FMAs of one block
        in one iteration: ptxas interleaves them, each FMA chain waiting on its load before the
        next load issues, 1-2 loads in flight; `cutlass.range`'s unroll keeps an exit test
        between its copies: one.) Past the chunk's end the index clamps to its last split,
        weight 0; the last iteration reloads its own block (L1)."""
        gO, sW, c0, n = where
        blocks = cute.ceil_div(n, self.groups * UNROLL)
        ws = cute.make_rmem_tensor(UNROLL, Float32)
        vals = cute.make_rmem_tensor((4, UNROLL), Float32)
        cur_ws = cute.make_rmem_tensor(UNROLL, Float32)
        cur = cute.make_rmem_tensor((4, UNROLL), Float32)
        self._load_block((gO, sW, c0, n), 0, group, vec, (ws, vals))
        for k in cutlass.range(blocks):
            for u in cutlass.range_constexpr(UNROLL):
                cur_ws[u] = ws[u]
                for j in cutlass.range_constexpr(4):
                    cur[j, u] = vals[j, u]
            ahead = cutlass.min(k + 1, blocks - 1)
            self._load_block((gO, sW, c0, n), ahead, group, vec, (ws, vals))
            for u in cutlass.range_constexpr(UNROLL):
                for j in cutlass.range_constexpr(4):
                    o = cur[j, u]
                    if cur_ws[u] == 0.0:  # a split of no keys: its row may be stale, even NaN
                        o = Float32(0.0)
                    acc[j] = acc[j] + cur_ws[u] * o

    @cute.jit
    def _load_block(self, where, k, group, vec, dst):
        """Block k's UNROLL splits of this group (split k x groups x UNROLL + u x groups +
        group, clamped to the chunk's last): weights from shared memory (0 past the end) and
        one 16-byte load of partial O each, into dst = (ws, vals)."""
        gO, sW, c0, n = where
        ws, vals = dst
        for u in cutlass.range_constexpr(UNROLL):
            i = (k * UNROLL + u) * self.groups + group
            at = cutlass.min(i, n - 1)
            w = sW[at]
            if i >= n:
                w = Float32(0.0)
            ws[u] = w
            cute.autovec_copy(cute.local_tile(gO[c0 + at, None], (4,), (vec,)), vals[None, u])


class _RangesForm:
    """What the two forms' ranges classes share: the call with mRows (PagedCombineRangesSm90's
    docstring) and `singles`, mixed in before the form's class."""

    def __init__(self, head_dim: int, pdl: bool = True, singles: bool = False,
                 held: bool = True):  # fmt: skip
        super().__init__(head_dim, pdl)
        self.singles = singles
        self.held = held  # the CTA form's (`PagedCombineSm90`); the warp form has no such path

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mRows: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """PagedCombineSm90's, and mRows (PagedCombineRangesSm90's docstring); mO's rows <=
        mRows' rows."""
        self._launch((mOp, mLp, mO, mLSE, mRows), mO, stream)


class PagedCombineRangesSm90(_RangesForm, PagedCombineSm90):
    """The combine over item-indexed partials (the MLA decode schedule's, compile key ranges):
    mOp fp32 (items, tokens, Hq, D), mLp (items, tokens, Hq), and mRows int32 (rows', 3): row
    r's unit's (first item, items, query token); row r reduces items [first, first + items) of
    its token, in item order (a unit's items are its splits in order: the same sums as the
    split form's over the same splits). Items 0: O 0 and LSE -inf, nothing read.

    singles (the paged pass's ranges form, decode.py): a row of one item was written, O and
    LSE, by its pass CTA; the combine leaves it (its CTAs exit after reading the range). MLA's
    ranges pass writes every item's partial: False."""

    @cute.kernel
    def kernel(
        self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mRows: cute.Tensor,
    ):  # fmt: skip
        _, b, _ = cute.arch.block_idx()
        self._combine(mOp, mLp, mO, mLSE, b, mRows)


# The warp form: combine_form.py says where it is taken (`takes_warps`) and why.


class PagedCombineWarpsSm90:
    """The combine, one warp a (row, head): grid (ceil(rows x Hq / WARPS)), THREADS threads;
    unit u = (row u // Hq, head u % Hq), adjacent warps adjacent heads of a row (their partial
    rows adjacent in memory). Per unit:

    1. lanes read splits lane, lane + 32, ... of the LSE: the max, the last split with a key
       and (a second walk) the sum of the weights 2^(lse - top), by shuffles;
    2. splits 0 .. last in order, acc += w_s O_s in fp32, each lane its D / 128 16-byte vectors
       (columns 128 k + 4 lane ..), the weight read again from the LSE (one broadcast load); a
       split of weight 0 among them adds 0 (its row is not trusted: selected out, not
       multiplied); 4 splits' loads in flight (`cutlass.range` unroll);
    3. out = acc / sum in the output dtype, 0 and LSE -inf where no split saw a key; lane 0 the
       natural LSE.

    One split: 0 + 1 x O_0 = O_0, LSE lse_0 x ln 2 (the direct forms' bits, as the CTA form).
    Called as PagedCombineSm90; PagedCombineWarpsRangesSm90 as PagedCombineRangesSm90 (mRows,
    the unit's item range, read after the PDL wait). pdl: as PagedCombineSm90's."""

    def __init__(self, head_dim: int, pdl: bool = True):
        if head_dim % WARP_COLS:  # (combine_form.WARP_COLS)
            raise ValueError(f"the warp form takes head dims that are multiples of {WARP_COLS}")
        self.d = head_dim
        self.pdl = pdl
        self.singles = False  # PagedCombineWarpsRangesSm90's
        self.vectors = head_dim // WARP_COLS  # a lane's 16-byte vectors

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        """PagedCombineSm90's arguments."""
        self._launch((mOp, mLp, mO, mLSE, None), mO, stream)

    @cute.jit
    def _launch(self, args, mO, stream):
        """The kernel on `args` over one warp a (row, head)."""
        units = mO.shape[0] * mO.shape[1]
        self.kernel(*args).launch(
            grid=(cute.ceil_div(cutlass.max(units, 1), WARPS), 1, 1),
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(
        self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
        mRows: cute.Tensor | None,
    ):  # fmt: skip
        tidx, _, _ = cute.arch.thread_idx()
        x, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        hq = mO.shape[1]
        unit = x * WARPS + cute.arch.make_warp_uniform(tidx // 32)
        pdl.wait(self.pdl)  # the partials, out / lse and the rows: the pass's, or earlier calls'
        pdl.launch_dependents(self.pdl)
        if unit < mO.shape[0] * hq:
            b = unit // hq
            head = unit - b * hq
            splits = mLp.shape[0]
            gL = mLp[None, b, head]
            gO = mOp[None, b, head, None]
            if const_expr(mRows is not None):
                item0, splits, token = mRows[b, 0], Int32(mRows[b, 1]), mRows[b, 2]
                if const_expr(self.singles):
                    if splits == 1:  # the pass wrote this row: the warp leaves (no barrier)
                        _nvvm.exit()
                gL = cute.domain_offset((item0,), mLp[None, token, head])
                gO = cute.domain_offset((item0, 0), mOp[None, token, head, None])
            top = -Float32.inf
            last = Float32(-1.0)  # the last split that saw a key (exact in fp32 below 2^24)
            for s in cutlass.range(lane, splits, 32):
                lse = gL[s]
                top = cute.arch.fmax(top, lse)
                if lse != -Float32.inf:
                    last = Float32(s)
            top = cute.arch.warp_reduction(top, cute.arch.fmax)
            used = Int32(cute.arch.warp_reduction(last, cute.arch.fmax)) + 1
            total = Float32(0.0)
            for s in cutlass.range(lane, used, 32):
                total += _weight(gL[s], top)
            total = cute.arch.warp_reduction(total, lambda a, c: a + c)
            acc = cute.make_rmem_tensor((4, self.vectors), Float32)
            acc.fill(0.0)
            vals = cute.make_rmem_tensor((4, self.vectors), Float32)
            for s in cutlass.range(used, unroll=4):
                w = _weight(gL[s], top)
                for k in cutlass.range_constexpr(self.vectors):
                    tile = cute.local_tile(gO[s, None], (4,), (k * 32 + lane,))
                    cute.autovec_copy(tile, vals[None, k])
                for k in cutlass.range_constexpr(self.vectors):
                    for j in cutlass.range_constexpr(4):
                        o = cutlass.select_(w > 0.0, vals[j, k], Float32(0.0))
                        acc[j, k] = acc[j, k] + w * o
            outs = cute.make_rmem_tensor((4, self.vectors), mO.element_type)
            for k in cutlass.range_constexpr(self.vectors):
                for j in cutlass.range_constexpr(4):
                    out = Float32(0.0)
                    if total > 0.0:
                        out = acc[j, k] / total
                    outs[j, k] = out.to(mO.element_type)
            row = mO[b, head, None]
            for k in cutlass.range_constexpr(self.vectors):
                cute.autovec_copy(outs[None, k], cute.local_tile(row, (4,), (k * 32 + lane,)))
            if lane == 0:
                lse = -Float32.inf
                if total > 0.0:
                    lse = (top + cute.math.log2(total, fastmath=True)) * LN2
                mLSE[b, head] = lse


class PagedCombineWarpsRangesSm90(_RangesForm, PagedCombineWarpsSm90):
    """The warp form over item-indexed partials (PagedCombineRangesSm90's arguments, and its
    `singles`)."""
