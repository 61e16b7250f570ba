"""Gated delta rule decode / multi-token-prediction step (sm_90a), the staged kernel: T tokens
(1..4, dynamic) of B sequences through their fp32 state, updated in place (fla's conventions,
the reference is `reference.delta_rule.gated_delta_rule_step`). It serves k-first states and
k-last ones whose heads are not compact; compact k-last states run the row-streaming kernel
(step_rows.py: whole 512-byte rows per warp access, no barrier, T baked in).

    S <- exp(g_t) S                       (g per value head, or per key channel: KDA)
    u  = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T (scale q_t)

Grid (H, B, HV / H x V / COLUMNS), K_SPLIT x COLUMNS threads (the columns of S are independent:
u_j and o_j read column j only, so a head's columns spread over V / COLUMNS CTAs and a batch of
one still fills 32 SMs at HV = 8): thread (j, s) holds column j of S, the 4-entry chunks s,
s + K_SPLIT, s + 2 K_SPLIT, ... of the column (rows 4c .. 4c + 3 of chunk c), in registers
across the T tokens; the K_SPLIT threads of a column are lanes COLUMNS_PER_WARP apart (l, l + 8,
l + 16, l + 24: lanes l and l ^ 1 then read the same q / k address, which halves the cost of a
16-byte shared load), so every dot product over K is a partial sum and two shuffles. The state
is read once and written once (memory-bound: 64 KB each way per head at K = V = 128); with the
k-last layout (N, HV, V, K) a column is contiguous, so the interleaved chunks give every
16-byte load of a column's K_SPLIT lanes one contiguous 64-byte run. Value head hv reads q / k
head hv // (HV / H). Sequence b uses state row state_indices[b] (a pool).

The state's loads go out first; while they are in flight the CTA stages every token's inputs
in shared memory (`_stage`, one memory round trip for all T tokens, every load issued before any
is used): warp t takes token t's q and k rows (fp32, the l2norm and the scale folded in, and
their dot product k.q), thread t the token's decay exp(g) and beta, thread i the v of column
i % COLUMNS of token i / COLUMNS. The token loop then reads shared memory only (16-byte
broadcast loads), and per token makes one pass for both dot products and one for the update,
with a single reduction between them:

    p = (D S)^T k,  r = (D S)^T q     (S the old state, D = exp(g_t))
    u = beta (v - p),  o = r + (k.q) u,  S <- D S + k u^T

(o = S_new^T q expanded: no pass over the new state, no second reduction). A per-head decay
multiplies the two sums; per key channel (KDA) the staging gives the rows d k and d q. The
update reads k (and d) from shared memory again rather than keeping them: 70 registers, 7 CTAs
of 128 threads per SM, 112 KB of state in flight.

`gating` (FlashInfer-Bench's Gated DeltaNet, Qwen3-Next): the decay and beta come from the
projections, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), computed in the staging
(mG holds a, mBeta holds b, both in q's dtype). `update_state` False leaves the state untouched
(MTP verification reads the intermediate states instead)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.memory import SmemAllocator

from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import (
    COLUMNS,
    K_SPLIT,
    L2NORM_EPS,
    MAX_TOKENS,
    THREADS,
    WARPS,
)

COLUMNS_PER_WARP = 32 // K_SPLIT  # lane l: column l % COLUMNS_PER_WARP, part l // it
ACCUMULATORS = 2  # independent partial sums per dot product (FFMA latency)
CHUNK = 4  # contiguous state entries per thread and load: 16 bytes of fp32


class GdnStepSm90:
    def __init__(
        self, k: int, v: int, *, per_channel, k_last, l2norm, intermediate, gating=False,
        update_state=True,
    ):  # fmt: skip
        if k % (K_SPLIT * 8) or v % COLUMNS or k % 32:
            raise ValueError(
                f"K must be a multiple of {K_SPLIT * 8} and V of {COLUMNS}, got {k}, {v}"
            )
        if MAX_TOKENS > min(WARPS, K_SPLIT):  # a warp per token's rows, a v per thread
            raise ValueError("the staging takes at most min(WARPS, K_SPLIT) tokens")
        self.k, self.v = k, v
        self.rows = k // K_SPLIT
        self.per_channel = per_channel
        self.k_last = k_last
        self.l2norm = l2norm
        self.intermediate = intermediate
        self.gating = gating
        self.update_state = update_state
        if gating and per_channel:
            raise ValueError("the projection gating gives one decay per value head")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mState: cute.Tensor,
        mRows: cute.Tensor,
        mO: cute.Tensor,
        mInter: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (B, T, H, K); mV (B, T, HV, V); mG fp32 (B, T, HV) or (B, T, HV, K); mBeta
        fp32 (B, T, HV); mState fp32 (N, HV, V, K) (k_last) or (N, HV, K, V); mRows int32 (B,);
        mO (B, T, HV, V); mInter fp32 (N, T, HV, ...) in the state's layout, or None; gating:
        mG, mBeta the projections a, b (B, T, HV) in q's dtype, mALog, mDtBias fp32 (HV,)."""
        rows_len = WARPS * self.k  # row w written by warp w (token min(w, T - 1))
        decay_len = rows_len if const_expr(self.per_channel) else THREADS
        dk_len = rows_len if const_expr(self.per_channel) else 4

        @cute.struct
        class Shared:  # token t's rows at t * K; the per-token scalars at t
            q: cute.struct.Align[cute.struct.MemRange[Float32, rows_len], 16]
            k: cute.struct.Align[cute.struct.MemRange[Float32, rows_len], 16]
            dk: cute.struct.Align[cute.struct.MemRange[Float32, dk_len], 16]
            decay: cute.struct.Align[cute.struct.MemRange[Float32, decay_len], 16]
            beta: cute.struct.Align[cute.struct.MemRange[Float32, THREADS], 16]
            kq: cute.struct.Align[cute.struct.MemRange[Float32, WARPS], 16]
            v: cute.struct.Align[cute.struct.MemRange[Float32, THREADS], 16]

        self.shared = Shared
        self.kernel(mQ, mK, mV, mG, mBeta, mState, mRows, mO, mInter, mALog, mDtBias, scale).launch(
            grid=(mQ.shape[2], mV.shape[0], mV.shape[2] // mQ.shape[2] * (self.v // COLUMNS)),
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mState: cute.Tensor,
        mRows: cute.Tensor,
        mO: cute.Tensor,
        mInter: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        # CTA (head, b, (hv % group) * V / COLUMNS + column block): no division by a dynamic
        # group size ahead of the first load.
        head, b, z = cute.arch.block_idx()
        blocks = self.v // COLUMNS
        col_block = z % blocks
        hv = head * (cute.arch.grid_dim()[2] // blocks) + z // blocks
        lane = tidx % 32
        local = tidx // 32 * COLUMNS_PER_WARP + lane % COLUMNS_PER_WARP  # among the COLUMNS
        col = col_block * COLUMNS + local
        part = lane // COLUMNS_PER_WARP
        R = self.rows
        row = mRows[b]
        s = cute.make_rmem_tensor(R, Float32)
        self._state_io(mState[row, hv, None, None], s, col, part, load=True)
        st = self._stage(mQ, mK, mV, mG, mBeta, mALog, mDtBias, scale, b, head, hv, col_block,
                         tidx)  # fmt: skip
        sQ, sK, sDK, sDecay, sBeta, sKQ, sV = st
        x = cute.make_rmem_tensor(R, Float32)  # the row of the dot product or the update
        y = cute.make_rmem_tensor(R, Float32)
        for t in cutlass.range(mQ.shape[1]):
            # p = (D S)^T k, r = (D S)^T q with D = exp(g): per key channel, the rows d k and
            # d q; per head, k and q, the decay applied to the sums.
            cute.autovec_copy(self._mine((sDK if const_expr(self.per_channel) else sK)[None, t],
                                         part), self._as_chunks(x))  # fmt: skip
            cute.autovec_copy(self._mine(sQ[None, t], part), self._as_chunks(y))
            p = [Float32(0.0)] * ACCUMULATORS  # partial sums: independent FFMA chains
            r = [Float32(0.0)] * ACCUMULATORS
            for i in cutlass.range_constexpr(R):
                a = i // CHUNK % ACCUMULATORS
                p[a] += s[i] * x[i]
                r[a] += s[i] * y[i]
            p = self._column_sum(sum(p[1:], p[0]))
            r = self._column_sum(sum(r[1:], r[0]))
            decay = Float32(1.0)
            if const_expr(not self.per_channel):
                decay = sDecay[t]
                p = p * decay
                r = r * decay
            u = sBeta[t] * (sV[local + t * COLUMNS] - p)
            if part == 0:
                mO[b, t, hv, col] = (r + sKQ[t] * u).to(mO.element_type)
            # S <- D S + k u^T, k (and d) read again rather than kept from the pass above: 32
            # registers fewer (70: 7 CTAs per SM). The warp sync keeps the compiler from
            # merging the two loads of k.
            cute.arch.sync_warp()
            cute.autovec_copy(self._mine(sK[None, t], part), self._as_chunks(x))
            if const_expr(self.per_channel):
                cute.autovec_copy(self._mine(sDecay[None, t], part), self._as_chunks(y))
            for i in cutlass.range_constexpr(R):
                if const_expr(self.per_channel):
                    s[i] = s[i] * y[i] + x[i] * u
                else:
                    s[i] = s[i] * decay + x[i] * u
            if const_expr(self.intermediate):
                self._state_io(mInter[row, t, hv, None, None], s, col, part, load=False)
        if const_expr(self.update_state):
            self._state_io(mState[row, hv, None, None], s, col, part, load=False)

    @cute.jit
    def _column_sum(self, x):
        """The sum of x over the K_SPLIT lanes of a column (lanes COLUMNS_PER_WARP apart)."""
        offset = 16
        while offset >= COLUMNS_PER_WARP:
            x = x + cute.arch.shuffle_sync_bfly(x, offset=offset)
            offset //= 2
        return x

    @cute.jit
    def _stage(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, scale, b, head, hv, col_block, tidx):
        """Every token's inputs into shared memory (see the module docstring). Tokens t >= T
        get a copy of token T - 1's (clamped indices, never read): no store is conditional, so
        that no load is sunk into a branch and all of them are in flight together."""
        storage = SmemAllocator().allocate(self.shared)
        kd = self.k
        rows = cute.make_layout((kd, WARPS))
        sQ, sK, sDK = (storage.q.get_tensor(rows), storage.k.get_tensor(rows),
                       storage.dk.get_tensor(rows))  # fmt: skip
        sDecay = storage.decay.get_tensor(rows if const_expr(self.per_channel) else
                                          cute.make_layout((THREADS,)))  # fmt: skip
        sBeta = storage.beta.get_tensor(cute.make_layout((THREADS,)))
        sKQ = storage.kq.get_tensor(cute.make_layout((WARPS,)))
        sV = storage.v.get_tensor(cute.make_layout((THREADS,)))
        T = mQ.shape[1]
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        tw = cutlass.min(warp, T - 1)  # warp w: token w's rows
        q_raw = self._load_row(mQ[b, tw, head, None], lane)
        k_raw = self._load_row(mK[b, tw, head, None], lane)
        g_raw = self._load_row(mG[b, tw, hv, None], lane) if const_expr(self.per_channel) else None
        tt = cutlass.min(tidx, T - 1)  # thread t: token t's scalars
        a_or_g = Float32(mG[b, tt, hv]) if const_expr(not self.per_channel) else Float32(0.0)
        b_or_beta = Float32(mBeta[b, tt, hv])
        # thread i: v of column i % COLUMNS of token i / COLUMNS
        v_raw = mV[b, cutlass.min(tidx // COLUMNS, T - 1), hv, col_block * COLUMNS + tidx % COLUMNS]

        qx = self._row_f32(q_raw, self.l2norm, scale)
        kx = self._row_f32(k_raw, self.l2norm, None)
        kq = Float32(0.0)
        for i in cutlass.range_constexpr(kd // 32):
            kq += qx[i] * kx[i]
        kq = cute.arch.warp_reduction_sum(kq)
        self._store_row(kx, sK[None, warp], lane)
        if const_expr(self.per_channel):  # d = exp(g); the rows d, d k and d q
            gx = self._row_f32(g_raw, False, None)
            for i in cutlass.range_constexpr(kd // 32):
                gx[i] = cute.math.exp(gx[i], fastmath=True)
                kx[i] = gx[i] * kx[i]
                qx[i] = gx[i] * qx[i]
            self._store_row(gx, sDecay[None, warp], lane)
            self._store_row(kx, sDK[None, warp], lane)
        self._store_row(qx, sQ[None, warp], lane)
        if lane == 0:
            sKQ[warp] = kq
        g, beta = a_or_g, b_or_beta
        if const_expr(self.gating):
            g, beta = self._gates(a_or_g, b_or_beta, mALog[hv], mDtBias[hv])
        sBeta[tidx] = beta
        if const_expr(not self.per_channel):
            sDecay[tidx] = cute.math.exp(g, fastmath=True)
        sV[tidx] = Float32(v_raw)
        cute.arch.sync_threads()
        return sQ, sK, sDK, sDecay, sBeta, sKQ, sV

    @cute.jit
    def _load_row(self, row, lane):
        """Lane `lane`'s K / 32 contiguous entries of a length-K row, as they are."""
        per_lane = self.k // 32
        raw = cute.make_rmem_tensor(per_lane, row.element_type)
        cute.autovec_copy(cute.logical_divide(row, cute.make_layout(per_lane))[(None, lane)], raw)
        return raw

    @cute.jit
    def _row_f32(self, raw, l2norm: bool, scale):
        """A lane's entries of a row in fp32, over the row's l2 norm (a warp reduction) if
        l2norm, times `scale` if given."""
        per_lane = self.k // 32
        x = cute.make_rmem_tensor(per_lane, Float32)
        x.store(raw.load().to(Float32))
        if const_expr(l2norm or scale is not None):
            factor = Float32(1.0)
            if const_expr(l2norm):
                sq = Float32(0.0)
                for i in cutlass.range_constexpr(per_lane):
                    sq += x[i] * x[i]
                sq = cute.arch.warp_reduction_sum(sq)
                factor = cute.math.rsqrt(sq + L2NORM_EPS, fastmath=True)
            if const_expr(scale is not None):
                factor = factor * scale
            for i in cutlass.range_constexpr(per_lane):
                x[i] = x[i] * factor
        return x

    @cute.jit
    def _store_row(self, x, dst, lane):
        """A lane's fp32 entries (`_load_row`'s positions) into a shared row."""
        per_lane = self.k // 32
        cute.autovec_copy(x, cute.logical_divide(dst, cute.make_layout(per_lane))[(None, lane)])

    @cute.jit
    def _gates(self, a, b, a_log, dt_bias):
        """(log decay, beta) from the projections: -exp(A_log) softplus(a + dt_bias) (softplus
        linear past 20, as torch's), sigmoid(b)."""
        x = a + dt_bias
        soft = x
        if x <= 20.0:
            soft = cute.math.log(1.0 + cute.math.exp(x, fastmath=True), fastmath=True)
        g = -cute.math.exp(a_log, fastmath=True) * soft
        beta = 1.0 / (1.0 + cute.math.exp(-b, fastmath=True))
        return g, beta

    @cute.jit
    def _mine(self, vec, part):
        """Thread `part`'s R entries of a length-K vector: chunks of CHUNK, chunk c K_SPLIT +
        part for c = 0 .. R / CHUNK - 1, as a (CHUNK, R / CHUNK) view."""
        chunks = cute.logical_divide(vec, cute.make_layout((CHUNK, K_SPLIT)))
        return chunks[(None, part), None]

    @cute.jit
    def _as_chunks(self, regs):
        """An (R,) register tensor seen as (CHUNK, R / CHUNK), the shape of `_mine`'s views."""
        return cute.make_tensor(regs.iterator, cute.make_layout((CHUNK, self.rows // CHUNK)))

    @cute.jit
    def _state_io(self, mS, s, col, part, load: bool):
        """This thread's rows (`_mine`) of column `col` of one head's state (K, V), or (V, K)
        k-last."""
        view = self._mine(mS[col, None] if const_expr(self.k_last) else mS[None, col], part)
        if const_expr(load):
            cute.autovec_copy(view, self._as_chunks(s))
        else:
            cute.autovec_copy(self._as_chunks(s), view)
