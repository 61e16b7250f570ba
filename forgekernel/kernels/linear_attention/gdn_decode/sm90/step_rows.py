"""Gated delta rule decode / MTP step on a k-last state (sm_90a): T tokens (1..4, baked in) of B
sequences through their fp32 state (N, HV, V, K), updated in place (fla's conventions, the
reference is `reference.delta_rule.gated_delta_rule_step`):

    S <- exp(g_t) S                       (g per value head, or per key channel: KDA)
    u  = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T (scale q_t)

The step is a stream of the state (64 KB each way per head at K = V = 128), so the kernel is
organized around the state's accesses: every warp load and store instruction moves one whole
512-byte row S[j, :] of the (V, K) storage (lane l: entries 4l .. 4l + 3, one 16-byte access),
and the state's loads are the first the kernel issues (no index load ahead of them unless the
rows come from a pool, no barrier, no shared memory). Grid (HV / H x V / 32, H, B), the CTAs of
a head adjacent (consecutive CTAs stream consecutive 16 KB of the state); each of a CTA's 4
warps holds 8 rows (ROWS_PER_WARP) in registers across the T tokens (32 fp32 per lane).

Each lane also needs only its 4 entries of q_t and k_t: one 8-byte load each per token, every
token's inputs loaded right after the state's and reduced while the state is in flight: the l2
norms and k.q as full-warp sums, the gates (FlashInfer-Bench's projections, g = -exp(A_log)
softplus(a + dt_bias), beta = sigmoid(b), when `gating`) per lane. The norms and the scale stay
out of the rows: with raw q, k (D = exp(g_t), per head a scalar, per key channel d k / d q per
lane),

    p = |k|^-1 (D S)^T k,  r = scale |q|^-1 (D S)^T q      (one pass over the old state)
    u = beta (v - p),  o = r + (k.q) u,  S <- D S + k (|k|^-1 u)^T

(o = S_new^T q expanded: no pass over the new state). Per token a lane makes 8 + 8 partial dot
products of 4 entries; a reduce-scatter across the warp (offsets 16, 8, 4: each lane keeps half
of its sums and adds its partner's copy of that half, 8 + 4 + 2 shuffles; then offsets 2, 1)
leaves row j's p and r on lanes 4j .. 4j + 3, which compute u and o; 8 index shuffles give every
lane the 8 u. 26 shuffles per warp and token, no barrier. `update_state` False leaves the state
untouched (MTP verification reads the intermediate states, written after every token when
`intermediate`). Sequence b uses state row state_indices[b] with `pool`, else row b; value head
hv reads q / k head hv // (HV / H)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import (
    L2NORM_EPS,
    ROW_WARPS,
    ROWS_PER_WARP,
)

LANE_ENTRIES = 4  # K entries per lane and row: one 16-byte access, K = 32 x 4


def _tree_sum(values: list):
    """The sum of traced values as a tree (its latency after the last one arrives: log2 n)."""
    while len(values) > 1:
        pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = pairs + values[len(pairs) * 2 :]
    return values[0]


class GdnStepRowsSm90:
    def __init__(
        self, k: int, v: int, *, tokens: int, per_channel, l2norm, intermediate, gating=False,
        update_state=True, pool=True, rows_per_warp=ROWS_PER_WARP,
    ):  # fmt: skip
        if rows_per_warp & (rows_per_warp - 1) or not 2 <= rows_per_warp <= 32:
            raise ValueError("rows_per_warp must be a power of two, 2 to 32")  # (1: no halves)
        self.rpw = rows_per_warp  # state rows per warp (in registers: 4 rpw fp32 per lane)
        self.cta_rows = ROW_WARPS * rows_per_warp
        self.row_lanes = 32 // rows_per_warp  # lanes that hold a row's sums after the reduction
        if k != 32 * LANE_ENTRIES or v % self.cta_rows:
            raise ValueError(f"K must be {32 * LANE_ENTRIES} and V a multiple of "
                             f"{self.cta_rows}, got {k}, {v}")  # fmt: skip
        if gating and per_channel:
            raise ValueError("the projection gating gives one decay per value head")
        if not 1 <= tokens <= self.row_lanes:  # lane l carries token l % row_lanes's scalars
            raise ValueError(f"tokens must be 1..{self.row_lanes}, got {tokens}")
        self.k, self.v, self.tokens = k, v, tokens
        self.per_channel = per_channel
        self.l2norm = l2norm
        self.intermediate = intermediate
        self.gating = gating
        self.update_state = update_state
        self.pool = pool

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mState: cute.Tensor,
        mRows: cute.Tensor | None,
        mO: cute.Tensor,
        mInter: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (B, T, H, K); mV (B, T, HV, V); mG fp32 (B, T, HV) or (B, T, HV, K); mBeta
        fp32 (B, T, HV); mState fp32 (N, HV, V, K); mRows int32 (B,) (pool) or None; mO (B, T,
        HV, V); mInter fp32 (N, T, HV, V, K) or None; gating: mG, mBeta the projections a, b
        (B, T, HV) in q's dtype, mALog, mDtBias fp32 (HV,)."""
        blocks = self.v // self.cta_rows
        self.kernel(mQ, mK, mV, mG, mBeta, mState, mRows, mO, mInter, mALog, mDtBias, scale).launch(
            grid=(mV.shape[2] // mQ.shape[2] * blocks, mQ.shape[2], mV.shape[0]),
            block=[ROW_WARPS * 32, 1, 1],
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
        mRows: cute.Tensor | None,
        mO: cute.Tensor,
        mInter: cute.Tensor | None,
        mALog: cute.Tensor | None,
        mDtBias: cute.Tensor | None,
        scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        x, head, b = cute.arch.block_idx()
        blocks = self.v // self.cta_rows  # CTA x: (hv % group) * blocks + row block (no division
        hv = head * (cute.arch.grid_dim()[0] // blocks) + x // blocks  # by a dynamic group)
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        first = x % blocks * self.cta_rows + warp * self.rpw  # the warp's first row
        row = b
        if const_expr(self.pool):
            row = mRows[b]
        s = cute.make_rmem_tensor((LANE_ENTRIES, self.rpw), Float32)
        self._rows_io(mState[row, hv, None, None], s, first, lane, load=True)
        # Every token's inputs, issued behind the state's loads and reduced while they fly. The
        # scalars one token per lane: lane l takes token min(l % row_lanes, T - 1), the v of its
        # row and the decay and beta (the gating computed there: once per token and lane); the
        # other lanes get them by shuffles. The rows: each lane its 4 entries of every token's.
        mine = first + lane // self.row_lanes  # the row whose u / o this lane computes
        own = cutlass.min(lane % self.row_lanes, self.tokens - 1)
        v_own = Float32(mV[b, own, hv, mine])
        g_own = Float32(0.0)
        if const_expr(not self.per_channel):
            g_own = Float32(mG[b, own, hv])
        beta_own = Float32(mBeta[b, own, hv])
        a_log = Float32(0.0)
        dt_bias = Float32(0.0)
        if const_expr(self.gating):
            a_log, dt_bias = mALog[hv], mDtBias[hv]
        rows = []
        for t in cutlass.range_constexpr(self.tokens):
            rows.append(self._token_rows(mQ, mK, mG, b, t, head, hv, lane))
        # Every input load feeds the sums' starting zero, selected by a condition the compiler
        # cannot decide (b >= B: never), so that none of them is scheduled behind the state's
        # first use (a late one costs a round trip after the state arrives).
        words = [v_own, g_own, beta_own, a_log, dt_bias]
        for t in cutlass.range_constexpr(self.tokens):
            words += [rows[t][0][0], rows[t][1][0]]
            if const_expr(self.per_channel):
                words.append(rows[t][2][0])
        zero = cutlass.select_(b >= mV.shape[0], _tree_sum(words), Float32(0.0))
        decay_own, beta_own = self._scalars(g_own, beta_own, a_log, dt_bias)
        rows = [self._prepare(*r, scale) for r in rows]  # norms, k.q; d per key channel
        for t in cutlass.range_constexpr(self.tokens):
            qx, kx, d_row, q_factor, k_factor, kq = rows[t]
            v_mine, decay, beta = v_own, decay_own, beta_own
            if const_expr(self.tokens > 1):
                v_mine = cute.arch.shuffle_sync(v_own, offset=lane // self.row_lanes
                                                * self.row_lanes + t)  # fmt: skip
                beta = cute.arch.shuffle_sync(beta_own, offset=t)
                if const_expr(not self.per_channel):
                    decay = cute.arch.shuffle_sync(decay_own, offset=t)
            if const_expr(self.per_channel):
                decay = d_row
            p, r = self._row_sums(s, qx, kx, decay if const_expr(self.per_channel) else None,
                                  lane, zero)  # fmt: skip
            k_factor_d = k_factor
            if const_expr(not self.per_channel):
                k_factor_d = k_factor * decay
                q_factor = q_factor * decay
            u = beta * (v_mine - p * k_factor_d)
            if lane % self.row_lanes == 0:
                mO[b, t, hv, mine] = (r * q_factor + kq * u).to(mO.element_type)
            w = u * k_factor  # S <- D S + k w^T with the raw k
            for j in cutlass.range_constexpr(self.rpw):
                wj = cute.arch.shuffle_sync(w, offset=j * self.row_lanes)
                for i in cutlass.range_constexpr(LANE_ENTRIES):
                    d = decay[i] if const_expr(self.per_channel) else decay
                    s[i, j] = s[i, j] * d + kx[i] * wj
            if const_expr(self.intermediate):
                self._rows_io(mInter[row, t, hv, None, None], s, first, lane, load=False)
        if const_expr(self.update_state):
            self._rows_io(mState[row, hv, None, None], s, first, lane, load=False)

    @cute.jit
    def _scalars(self, g, beta, a_log, dt_bias):
        """(decay exp(g), beta) from the loaded g and beta, or with gating the projections a
        and b; per key channel (the decay is a row there, `_token_rows`) decay 1."""
        decay = Float32(1.0)
        if const_expr(not self.per_channel):
            if const_expr(self.gating):
                g, beta = self._gates(g, beta, a_log, dt_bias)
            decay = cute.math.exp(g, fastmath=True)
        return decay, beta

    @cute.jit
    def _token_rows(self, mQ, mK, mG, b, t, head, hv, lane):
        """This lane's 4 entries of token t's q and k (fp32, raw), and per key channel of its
        log decay (else None)."""
        qx = self._lane_f32(mQ[b, t, head, None], lane)
        kx = self._lane_f32(mK[b, t, head, None], lane)
        g = None
        if const_expr(self.per_channel):
            g = self._lane_f32(mG[b, t, hv, None], lane)
        return qx, kx, g

    @cute.jit
    def _prepare(self, qx, kx, g, scale):
        """(q, k, the decay row exp(g) per key channel (else None), the q / k factors and k.q
        of `_norms`) of one token."""
        q_factor, k_factor, kq = self._norms(qx, kx, scale)
        if const_expr(self.per_channel):
            for i in cutlass.range_constexpr(LANE_ENTRIES):
                g[i] = cute.math.exp(g[i], fastmath=True)
        return qx, kx, g, q_factor, k_factor, kq

    @cute.jit
    def _lane_f32(self, vec, lane):
        """Entries 4 lane .. 4 lane + 3 of a length-K vector, as fp32."""
        raw = cute.make_rmem_tensor(LANE_ENTRIES, vec.element_type)
        cute.autovec_copy(self._lane_part(vec, lane), raw)
        x = cute.make_rmem_tensor(LANE_ENTRIES, Float32)
        x.store(raw.load().to(Float32))
        return x

    @cute.jit
    def _lane_part(self, vec, lane):
        return cute.logical_divide(vec, cute.make_layout(LANE_ENTRIES))[(None, lane)]

    @cute.jit
    def _norms(self, qx, kx, scale):
        """(scale |q|^-1, |k|^-1, k.q of the normalized and scaled rows); without l2norm
        (scale, 1, scale k.q). Full-warp sums over the raw rows."""
        kq = Float32(0.0)
        for i in cutlass.range_constexpr(LANE_ENTRIES):
            kq += kx[i] * qx[i]
        kq = cute.arch.warp_reduction_sum(kq)
        q_factor = scale
        k_factor = Float32(1.0)
        if const_expr(self.l2norm):
            qq = Float32(0.0)
            kk = Float32(0.0)
            for i in cutlass.range_constexpr(LANE_ENTRIES):
                qq += qx[i] * qx[i]
                kk += kx[i] * kx[i]
            qq = cute.arch.warp_reduction_sum(qq)
            kk = cute.arch.warp_reduction_sum(kk)
            q_factor = scale * cute.math.rsqrt(qq + L2NORM_EPS, fastmath=True)
            k_factor = cute.math.rsqrt(kk + L2NORM_EPS, fastmath=True)
        return q_factor, k_factor, kq * q_factor * k_factor

    @cute.jit
    def _row_sums(self, s, qx, kx, d, lane, zero):
        """(S k)_j and (S q)_j (per key channel S (d k), S (d q)) over the warp's rows, reduced
        across the warp: lane l returns row l / row_lanes's two sums. A reduce-scatter: at
        offset o the lanes with bit o set keep the upper half of their rows, the others the
        lower, each adding the partner's copy of the half it keeps; rows j and j + rpw / 2
        are halved as soon as their sums exist (fewer live registers)."""
        half = self.rpw // 2
        upper = (lane & 16) != 0
        p, r = [], []
        for j in cutlass.range_constexpr(half):
            lo_p, lo_r = self._dots(s, j, qx, kx, d, zero)
            hi_p, hi_r = self._dots(s, j + half, qx, kx, d, zero)
            p.append(self._keep_half(lo_p, hi_p, upper, 16))
            r.append(self._keep_half(lo_r, hi_r, upper, 16))
        levels = self.rpw.bit_length() - 1
        for level in cutlass.range_constexpr(1, levels):
            offset = 16 >> level
            upper = (lane & offset) != 0
            n = self.rpw >> (level + 1)
            p = [self._keep_half(p[i], p[i + n], upper, offset) for i in range(n)]
            r = [self._keep_half(r[i], r[i + n], upper, offset) for i in range(n)]
        sp, sr = p[0], r[0]
        for level in cutlass.range_constexpr(levels, 5):  # the lanes that share a row
            sp = sp + cute.arch.shuffle_sync_bfly(sp, offset=16 >> level)
            sr = sr + cute.arch.shuffle_sync_bfly(sr, offset=16 >> level)
        return sp, sr

    @cute.jit
    def _dots(self, s, j, qx, kx, d, zero):
        """This lane's parts of (S k)_j and (S q)_j (per key channel with d k, d q), summed
        from `zero`."""
        p = zero
        r = zero
        for i in cutlass.range_constexpr(LANE_ENTRIES):
            kd, qd = kx[i], qx[i]
            if const_expr(d is not None):
                kd, qd = kd * d[i], qd * d[i]
            p += s[i, j] * kd
            r += s[i, j] * qd
        return p, r

    @cute.jit
    def _keep_half(self, lo, hi, upper, offset):
        """hi if upper else lo, plus the partner lane's (at `offset`) copy of the same row."""
        send = cutlass.select_(upper, lo, hi)
        keep = cutlass.select_(upper, hi, lo)
        return keep + cute.arch.shuffle_sync_bfly(send, offset=offset)

    @cute.jit
    def _gates(self, a, b, a_log, dt_bias):
        """(log decay, beta) from the projections: -exp(A_log) softplus(a + dt_bias) (softplus
        linear past 20, as torch's), sigmoid(b); no branch, no IEEE division."""
        x = a + dt_bias
        soft = cute.math.log(1.0 + cute.math.exp(x, fastmath=True), fastmath=True)
        soft = cutlass.select_(x > 20.0, x, soft)
        g = -cute.math.exp(a_log, fastmath=True) * soft
        beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-b, fastmath=True))
        return g, beta

    @cute.jit
    def _rows_io(self, mS, s, first, lane, load: bool):
        """The warp's rows first .. first + rpw - 1 of one head's (V, K) state, lane
        `lane`'s 4 entries of each: one 512-byte access per row and warp."""
        for j in cutlass.range_constexpr(self.rpw):
            part = self._lane_part(mS[first + j, None], lane)
            if const_expr(load):
                cute.autovec_copy(part, s[None, j])
            else:
                cute.autovec_copy(s[None, j], part)
