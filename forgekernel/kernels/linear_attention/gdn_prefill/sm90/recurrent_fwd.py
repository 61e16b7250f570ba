"""Gated DeltaNet forward over varlen sequences, token by token (sm_90a): the interim device
kernel of the prefill op, correct at every length but not the chunked tensor-core kernel the
op is for (docs/linear_attention/NOTES.md, "Prefill: the chunked WGMMA kernel", has its
design; what is missing is said there). Per value head hv of sequence n, state S (K, V) fp32:

    S <- exp(g_t) S;   u = beta_t (v_t - S^T k_t);   S <- S + k_t u^T;   o_t = scale S^T q_t

(q, k l2-normalized first with l2norm). Grid (HV, N, V / COLUMNS), K_SPLIT x COLUMNS threads:
the columns of S are independent (u_j and o_j read column j only), so thread (j, s) keeps rows
s, s + K_SPLIT, ... (4-entry chunks interleaved over the K_SPLIT lanes) of column j in
registers for the whole sequence, and a dot product over K is a partial sum and two shuffles.
The sequence's tokens are strictly sequential here: T steps of ~2 K / K_SPLIT FMAs per thread,
which is what the chunked form (64 tokens per step, on WGMMA) removes."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import L2NORM_EPS

K_SPLIT = 4  # lanes per state column
COLUMNS = 32  # state columns per CTA (128 threads)
VEC = 4  # contiguous entries per lane and load (16 bytes of fp32)


class GdnRecurrentFwdSm90:
    def __init__(self, k: int, v: int, *, k_last: bool, l2norm: bool, initial_state: bool):
        if k % (K_SPLIT * VEC * 2) or v % COLUMNS:
            raise ValueError(f"K must be a multiple of {K_SPLIT * VEC * 2}, V of {COLUMNS}")
        self.k, self.v = k, v
        self.rows = k // K_SPLIT
        self.k_last = k_last
        self.l2norm = l2norm
        self.initial_state = initial_state

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (T, H, K); mV, mO (T, HV, V); mG, mBeta fp32 (T, HV); mCu int32 (N + 1,);
        mInit (or None) and mFinal fp32 (N, HV, K, V), or (N, HV, V, K) with k_last."""
        self.kernel(mQ, mK, mV, mG, mBeta, mInit, mCu, mO, mFinal, scale).launch(
            grid=(mV.shape[1], mFinal.shape[0], self.v // COLUMNS),
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
        mInit: cute.Tensor | None,
        mCu: cute.Tensor,
        mO: cute.Tensor,
        mFinal: cute.Tensor,
        scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        hv, n, col_block = cute.arch.block_idx()
        col = col_block * COLUMNS + tidx // K_SPLIT
        part = tidx % K_SPLIT
        head = hv // (mV.shape[1] // mQ.shape[1])
        s = cute.make_rmem_tensor(self.rows, Float32)
        if const_expr(self.initial_state):
            self._state_io(mInit[n, hv, None, None], s, col, part, load=True)
        else:
            s.fill(0.0)
        qf = cute.make_rmem_tensor(self.rows, Float32)
        kf = cute.make_rmem_tensor(self.rows, Float32)
        for t in cutlass.range(Int32(mCu[n]), Int32(mCu[n + 1])):
            self._slice(mQ[t, head, None], qf, part)
            self._slice(mK[t, head, None], kf, part)
            if const_expr(self.l2norm):
                self._normalize(qf)
                self._normalize(kf)
            decay = cute.math.exp(mG[t, hv], fastmath=True)
            predicted = Float32(0.0)
            for i in cutlass.range_constexpr(self.rows):
                s[i] = s[i] * decay
                predicted += s[i] * kf[i]
            predicted = cute.arch.warp_reduction_sum(predicted, threads_in_group=K_SPLIT)
            u = mBeta[t, hv] * (Float32(mV[t, hv, col]) - predicted)
            out = Float32(0.0)
            for i in cutlass.range_constexpr(self.rows):
                s[i] = s[i] + kf[i] * u
                out += s[i] * qf[i]
            out = cute.arch.warp_reduction_sum(out, threads_in_group=K_SPLIT)
            if part == 0:
                mO[t, hv, col] = (out * scale).to(mO.element_type)
        self._state_io(mFinal[n, hv, None, None], s, col, part, load=False)

    @cute.jit
    def _slice(self, vec, dst, part):
        """This lane's entries of a length-K row (`_mine`), as fp32."""
        raw = cute.make_rmem_tensor(self.rows, vec.element_type)
        cute.autovec_copy(self._mine(vec, part), self._as_chunks(raw))
        dst.store(raw.load().to(Float32))

    @cute.jit
    def _mine(self, vec, part):
        """Lane `part`'s entries of a length-K vector: VEC-entry chunks part, part + K_SPLIT, ...
        as a (VEC, rows / VEC) view (a column's lanes read one contiguous run per load)."""
        chunks = cute.logical_divide(vec, cute.make_layout((VEC, K_SPLIT)))
        return chunks[(None, part), None]

    @cute.jit
    def _as_chunks(self, regs):
        return cute.make_tensor(regs.iterator, cute.make_layout((VEC, self.rows // VEC)))

    @cute.jit
    def _normalize(self, x):
        """x / sqrt(sum x^2 + eps) over the whole row, spread over the K_SPLIT lanes."""
        sq = Float32(0.0)
        for i in cutlass.range_constexpr(self.rows):
            sq += x[i] * x[i]
        sq = cute.arch.warp_reduction_sum(sq, threads_in_group=K_SPLIT)
        inv = cute.math.rsqrt(sq + L2NORM_EPS, fastmath=True)
        for i in cutlass.range_constexpr(self.rows):
            x[i] = x[i] * inv

    @cute.jit
    def _state_io(self, mS, s, col, part, load: bool):
        """This lane's rows of column `col` of one head's state (K, V), or (V, K) k-last."""
        view = self._mine(mS[col, None] if const_expr(self.k_last) else mS[None, col], part)
        if const_expr(load):
            cute.autovec_copy(view, self._as_chunks(s))
        else:
            cute.autovec_copy(self._as_chunks(s), view)
