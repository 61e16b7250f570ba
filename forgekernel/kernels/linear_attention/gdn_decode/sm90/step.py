"""Gated delta rule decode / multi-token-prediction step (sm_90a): T tokens (1..4) of B
sequences through their fp32 state, updated in place (fla's conventions, the reference is
`reference.delta_rule.gated_delta_rule_step`):

    S <- exp(g_t) S                       (g per value head, or per key channel: KDA)
    u  = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T (scale q_t)

Grid (HV, B, V / COLUMNS), K_SPLIT x COLUMNS threads (the columns of S are independent: u_j
and o_j read column j only, so a head's columns spread over V / COLUMNS CTAs and a batch of
one still fills 32 SMs at HV = 8): thread (j, s) holds column j of S, rows s K / K_SPLIT ..
the 4-entry chunks s, s + K_SPLIT, s + 2 K_SPLIT, ... of the column (rows 4c .. 4c + 3 of
chunk c), in registers across the T tokens; the K_SPLIT threads of a column are adjacent lanes,
so every dot product over K is a partial sum and two shuffles. The state is
read once and written once (memory-bound: 64 KB each way per head at K = V = 128); with the
k-last layout (N, HV, V, K) a column is contiguous, so the interleaved chunks give every
16-byte load of a column's K_SPLIT lanes one contiguous 64-byte run (contiguous quarters per
thread left every load instruction 32 half-used sectors: 0.66x fla, 2026-12-01). Value head hv
reads q / k head hv // (HV / H). Sequence b uses state row state_indices[b] (a pool).

`gating` (FlashInfer-Bench's Gated DeltaNet, Qwen3-Next): the decay and beta come from the
projections, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), computed here (mG holds
a, mBeta holds b, both in q's dtype). `update_state` False leaves the state untouched (MTP
verification reads the intermediate states instead)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import (
    COLUMNS,
    K_SPLIT,
    L2NORM_EPS,
)

CHUNK = 4  # contiguous state entries per thread and load: 16 bytes of fp32


class GdnStepSm90:
    def __init__(
        self, k: int, v: int, *, per_channel, k_last, l2norm, intermediate, gating=False,
        update_state=True,
    ):  # fmt: skip
        if k % (K_SPLIT * 8) or v % COLUMNS:
            raise ValueError(
                f"K must be a multiple of {K_SPLIT * 8} and V of {COLUMNS}, got {k}, {v}"
            )
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
        self.kernel(mQ, mK, mV, mG, mBeta, mState, mRows, mO, mInter, mALog, mDtBias, scale).launch(
            grid=(mV.shape[2], mV.shape[0], self.v // COLUMNS),
            block=[K_SPLIT * COLUMNS, 1, 1],
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
        hv, b, col_block = cute.arch.block_idx()
        col = col_block * COLUMNS + tidx // K_SPLIT
        part = tidx % K_SPLIT
        R = self.rows
        head = hv // (mV.shape[2] // mQ.shape[2])
        row = mRows[b]
        s = cute.make_rmem_tensor(R, Float32)
        self._state_io(mState[row, hv, None, None], s, col, part, load=True)
        qf = cute.make_rmem_tensor(R, Float32)
        kf = cute.make_rmem_tensor(R, Float32)
        decay = cute.make_rmem_tensor(R, Float32)
        for t in cutlass.range(mQ.shape[1]):
            self._slice(mQ[b, t, head, None], qf, part)
            self._slice(mK[b, t, head, None], kf, part)
            if const_expr(self.l2norm):
                self._normalize(qf)
                self._normalize(kf)
            beta = Float32(0.0)
            if const_expr(self.gating):
                g, beta = self._gates(mG, mBeta, mALog, mDtBias, b, t, hv)
                decay.fill(cute.math.exp(g, fastmath=True))
            else:
                beta = mBeta[b, t, hv]
                if const_expr(self.per_channel):
                    self._slice(mG[b, t, hv, None], decay, part)
                    for i in cutlass.range_constexpr(R):
                        decay[i] = cute.math.exp(decay[i], fastmath=True)
                else:
                    decay.fill(cute.math.exp(mG[b, t, hv], fastmath=True))
            predicted = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                s[i] = s[i] * decay[i]
                predicted += s[i] * kf[i]
            predicted = cute.arch.warp_reduction_sum(predicted, threads_in_group=K_SPLIT)
            u = beta * (Float32(mV[b, t, hv, col]) - predicted)
            out = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                s[i] = s[i] + kf[i] * u
                out += s[i] * qf[i]
            out = cute.arch.warp_reduction_sum(out, threads_in_group=K_SPLIT)
            if part == 0:
                mO[b, t, hv, col] = (out * scale).to(mO.element_type)
            if const_expr(self.intermediate):
                self._state_io(mInter[row, t, hv, None, None], s, col, part, load=False)
        if const_expr(self.update_state):
            self._state_io(mState[row, hv, None, None], s, col, part, load=False)

    @cute.jit
    def _gates(self, mA, mB, mALog, mDtBias, b, t, hv):
        """(log decay, beta) from the projections: -exp(A_log) softplus(a + dt_bias) (softplus
        linear past 20, as torch's), sigmoid(b)."""
        x = Float32(mA[b, t, hv]) + mDtBias[hv]
        soft = x
        if x <= 20.0:
            soft = cute.math.log(1.0 + cute.math.exp(x, fastmath=True), fastmath=True)
        g = -cute.math.exp(mALog[hv], fastmath=True) * soft
        beta = 1.0 / (1.0 + cute.math.exp(-Float32(mB[b, t, hv]), fastmath=True))
        return g, beta

    @cute.jit
    def _slice(self, vec, dst, part):
        """This thread's R elements of a length-K row (`_mine`), as fp32."""
        raw = cute.make_rmem_tensor(self.rows, vec.element_type)
        cute.autovec_copy(self._mine(vec, part), self._as_chunks(raw))
        dst.store(raw.load().to(Float32))

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
    def _normalize(self, x):
        """x / sqrt(sum over the whole row of x^2 + eps), the row spread over K_SPLIT lanes."""
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(self.rows):
            sq += x[i] * x[i]
        sq = cute.arch.warp_reduction_sum(sq, threads_in_group=K_SPLIT)
        inv = cute.math.rsqrt(sq + L2NORM_EPS, fastmath=True)
        for i in cutlass.range_constexpr(self.rows):
            x[i] = x[i] * inv

    @cute.jit
    def _state_io(self, mS, s, col, part, load: bool):
        """This thread's rows (`_mine`) of column `col` of one head's state (K, V), or (V, K)
        k-last."""
        view = self._mine(mS[col, None] if const_expr(self.k_last) else mS[None, col], part)
        if const_expr(load):
            cute.autovec_copy(view, self._as_chunks(s))
        else:
            cute.autovec_copy(self._as_chunks(s), view)
