"""Kimi Delta Attention forward, the first (token-parallel) pass on sm_90a: one CTA (one
warpgroup, 128 threads) per (global chunk, value head) writes the chunk's state-independent
operands for the recurrence kernel (`recurrence.py`), as `reference.kda_chunked.chunk_operands`
defines them and `operands.py` lays them out (rows past the sequence exact zeros).

Thread t owns key channel t. With G2 = log2(e) cumsum(g) over the chunk (a running sum, run
three times: for the references, the k side, the q side), sub-chunk references r_I = G2 at
token 16 I + 8, a = G2 - r_I(i) (at most 8 steps):

    Kl = k 2^a, Ql = scale q 2^a, Kr = k 2^-a                 (one exp2 each way a token)
    Kg = Kl 2^r_I, Qg = Ql 2^r_I, Kd = Kr 2^(G2_C - r_I)      -> global (bf16), D = 2^G2_C
    A_J = Kl * E_{I(i) J} (rows I >= J; 0 above), E_IJ = 2^(r_I - r_J) <= 1
                                                              -> shared tile J (bf16)
    L[:, J] = A_J Kr_J^T                        4 SS WGMMAs 64 x 16 x K, one commit group
    L = beta_i L (j < i) -> fp32 scratch; then the q side into the same four tiles:
    P[:, J] = (Ql * E) Kr_J^T (j <= i)          4 more WGMMAs
    T = (I + L)^-1 (GDN's: the diagonal blocks on the CUDA cores, `gdn_prefill/sm90/
    inverse`, the merges by mma.sync tf32, `inverse_mma.invert_merge_mma`);
    P -> global (bf16); T diag(beta) -> global (bf16).

Loads: per sub-chunk, its 16 tokens' g (and k or q) are loaded before any of its math and
stores (`_load_sub`); the k and q sides load sub-chunk b + 1 at the top of sub-chunk b (the
values carried by the run-time loop; the q side's first under the k-side WGMMAs), so that 32
loads a thread fly under a sub-chunk's math (one channel a thread: 2-byte q / k loads, 64
contiguous bytes a warp, whole sectors).

Rows past the sequence (i >= len) read nothing: k = q = g = beta = 0 there, so their rows
and columns of every output are exact zeros. With l2norm the launcher normalizes q and k
first (torch).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    BLOCK,
    W_STRIDE,
    X_STRIDE,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import Bar
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK

SUB = 16  # tokens per sub-chunk (one reference each)
NSUB = CHUNK // SUB


def _columns_of(e_tab):
    """E by columns over all four rows: [J][b] = E_bJ for J < b, 1 for J = b, 0 for J > b."""
    return [[e_tab[b][j] if j < b else Float32(1.0 if j == b else 0.0) for b in range(NSUB)]
            for j in range(NSUB)]  # fmt: skip


class KdaIntraSm90:
    """The first pass; see the module docstring."""

    def __init__(self, k: int):
        if k != 128:
            raise ValueError(f"K must be 128 (one channel a thread), got {k}")
        self.k = k

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mTok0: cute.Tensor,
        mLen: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mT: cute.Tensor,
        mP: cute.Tensor,
        mD: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (T, H, K) 16-bit; mG fp32 (T, HV, K); mBeta fp32 (T, HV); mTok0, mLen int32
        (NC,) each chunk's first token and valid length; outputs as `operands.py`."""
        k_major = OperandMajorMode.K
        self.mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, k_major, k_major, Float32, (1, 1, 1), (CHUNK, SUB)
        )
        row = LayoutEnum.ROW_MAJOR
        # four A tiles (64 x K), one per column block J; Kr as four (16 x K) B tiles
        self.sA_layout = sm90_utils.make_smem_layout_a(row, (CHUNK, SUB, self.k), BFloat16,
                                                       NSUB)  # fmt: skip
        self.sB_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, SUB, self.k), BFloat16,
                                                       NSUB)  # fmt: skip

        @cute.struct
        class SharedStorage:
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sW: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * W_STRIDE], 16]
            sX: cute.struct.Align[cute.struct.MemRange[Float32, 2 * BLOCK * X_STRIDE], 16]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(self.sB_layout)], 1024]

        self.shared_storage = SharedStorage
        self.kernel(
            mQ, mK, mG, mBeta, mTok0, mLen, mQg, mKg, mKd, mT, mP, mD, scale, self.mma,
            self.sA_layout, self.sB_layout,
        ).launch(
            grid=(mTok0.shape[0], mG.shape[1], 1),
            block=[THREADS_PER_WG, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mTok0: cute.Tensor,
        mLen: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mT: cute.Tensor,
        mP: cute.Tensor,
        mD: cute.Tensor,
        scale: Float32,
        mma: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
    ):
        ch, _, _ = cute.arch.thread_idx()
        gc, hv, _ = cute.arch.block_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sBeta = storage.sBeta.get_tensor(cute.make_layout(CHUNK))
        sW = storage.sW.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)))
        sX = storage.sX.get_tensor(cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1)))
        bar = named_barrier(Bar.AUX, THREADS_PER_WG)

        tok0 = mTok0[gc]
        valid = mLen[gc]
        # a chunk of length 0 (past the last real one: the launcher's grid is an upper bound
        # of chunks built without reading the offsets on the host) has nothing to write
        if valid > 0:
            self._chunk(mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, scale, mma, sA, sB, sBeta,
                        sW, sX, bar, ch, gc, hv, tok0, valid)  # fmt: skip

    @cute.jit
    def _chunk(self, mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, scale, mma, sA, sB, sBeta,
               sW, sX, bar, ch, gc, hv, tok0, valid):  # fmt: skip
        """Chunk gc of value head hv (tokens tok0 .. tok0 + valid, valid >= 1): the module
        docstring's math."""
        head = hv // (mG.shape[1] // mQ.shape[1])
        row0 = gc * CHUNK
        if ch < CHUNK:
            inside = ch < valid
            t = tok0 + cutlass.min(ch, valid - 1)
            sBeta[ch] = cutlass.select_(inside, Float32(mBeta[t, hv]), Float32(0.0))

        # pass 0: the references r_b = G2 at token 16 b + 8 and G2_C (a running sum; the k and
        # q passes below run it again: g re-read from L2 instead of 64 live registers). Every
        # pass loads a sub-chunk's 16 tokens before their math and stores (`_load_sub`): SASS
        # issues pass 0's 64 loads at once, and the k / q sides' loads of sub-chunk b + 1 at the
        # top of sub-chunk b, before its stores, where the token loops of before had one load in
        # flight (the next token's behind this one's stores)
        run = Float32(0.0)
        ref = []
        for b in cutlass.range_constexpr(NSUB):
            gs, _ = self._load_sub(None, mG, tok0, valid, hv, 0, ch, b)
            for s in cutlass.range_constexpr(SUB):
                run = run + gs[s]
                if const_expr(s == SUB // 2):
                    ref.append(run)
        gc2 = run
        mD[gc, hv, ch] = cute.math.exp2(gc2, fastmath=True)
        pow_r = [cute.math.exp2(r, fastmath=True) for r in ref]
        pow_cr = [cute.math.exp2(gc2 - r, fastmath=True) for r in ref]
        # E[b][J] = 2^(r_b - r_J) for J < b (<= 1: r decreases along the chunk)
        e_tab = [[cute.math.exp2(ref[b] - ref[j], fastmath=True) for j in range(b)]
                 for b in range(NSUB)]  # fmt: skip
        # the k and q passes loop over the sub-chunks at run time, the sub-chunk's factors
        # picked by b (unrolled at compile time: 255 registers and 2.5 KB spilled, mostly 64-bit
        # values, the tokens' addresses shared by the three passes; at run time: 164, none; with
        # the next sub-chunk's 32 values carried: 208, none). The last iteration loads 16 tokens
        # past the chunk, clamped to its last token (cache hits, unused)
        e_rows = _columns_of(e_tab)

        # k side: Kg, Kd to global; Kr (B tiles) and Kl * E (A tiles) to shared memory
        run = Float32(0.0)
        gn, kn = self._load_sub(mK, mG, tok0, valid, hv, head, ch, 0)
        for b in cutlass.range(NSUB, unroll=1):
            gs, ks = gn, kn
            gn, kn = self._load_sub(mK, mG, tok0, valid, hv, head, ch, b + 1)
            ref_b, pow_rb, pow_crb = (self._pick(x, b) for x in (ref, pow_r, pow_cr))
            e_row = [self._pick(e, b) for e in e_rows]
            for s in cutlass.range_constexpr(SUB):
                i = SUB * b + s
                run = run + gs[s]
                a = run - ref_b
                kl = ks[s] * cute.math.exp2(a, fastmath=True)
                kr = ks[s] * cute.math.exp2(-a, fastmath=True)
                mKg[row0 + i, hv, ch] = (kl * pow_rb).to(BFloat16)
                mKd[row0 + i, hv, ch] = (kr * pow_crb).to(BFloat16)
                sB[s, ch, b] = kr.to(BFloat16)
                self._put_scaled(sA, i, ch, kl, e_row)
        cute.arch.fence_view_async_shared()
        bar.arrive_and_wait()
        acc_shape = mma.get_slice(0).partition_shape_C((CHUNK, SUB))
        accs = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(NSUB)]
        self._products(mma, sA, sB, accs)
        gn, qn = self._load_sub(mQ, mG, tok0, valid, hv, head, ch, 0)  # under the WGMMAs
        warpgroup.wait_group(0)
        coords = softmax.acc_coords(mma, ch, (CHUNK, SUB))
        for j in cutlass.range_constexpr(NSUB):
            self._lower_to_scratch(mma, accs[j], coords, sW, sBeta, ch, j)
        bar.arrive_and_wait()  # the k-side WGMMAs are done with the A tiles

        # q side: Qg to global, Ql * E into the same A tiles
        run = Float32(0.0)
        for b in cutlass.range(NSUB, unroll=1):
            gs, qs = gn, qn
            gn, qn = self._load_sub(mQ, mG, tok0, valid, hv, head, ch, b + 1)
            ref_b, pow_rb = (self._pick(x, b) for x in (ref, pow_r))
            e_row = [self._pick(e, b) for e in e_rows]
            for s in cutlass.range_constexpr(SUB):
                i = SUB * b + s
                run = run + gs[s]
                ql = qs[s] * scale * cute.math.exp2(run - ref_b, fastmath=True)
                mQg[row0 + i, hv, ch] = (ql * pow_rb).to(BFloat16)
                self._put_scaled(sA, i, ch, ql, e_row)
        cute.arch.fence_view_async_shared()
        bar.arrive_and_wait()
        accp = [cute.make_rmem_tensor(acc_shape, Float32) for _ in range(NSUB)]
        self._products(mma, sA, sB, accp)
        # the inverse after the wait: under the WGMMAs ptxas serialized every one of them
        # (C7514; GDN's aux overlaps them, with one accumulator in flight)
        warpgroup.wait_group(0)
        cute.arch.sync_warp()
        invert_diagonal(sW, ch)
        invert_merge_mma(sW, sX, ch, bar)
        for j in cutlass.range_constexpr(NSUB):
            self._store_p(accp[j], coords, mP, row0, hv, j)
        self._store_t_beta(sW, sBeta, mT, row0, hv, ch)

    @cute.jit
    def _g(self, mG, tok0, valid, hv, ch, i) -> Float32:
        """log2(e) g of token i of the chunk for this channel; 0 past the sequence."""
        t = tok0 + cutlass.min(i, valid - 1)
        return Float32(cutlass.select_(i < valid, Float32(mG[t, hv, ch]), Float32(0.0))) * LOG2E

    @cute.jit
    def _load_sub(self, mX, mG, tok0, valid, hv, head, ch, b):
        """Sub-chunk b's 16 tokens for this channel, every load issued before any use: (log2(e)
        g, x) as lists of 16 fp32, x from mX (k or q; None: g only, x empty); 0 past the
        sequence (the loads themselves clamped to its last token)."""
        gs, xs = [], []
        for s in cutlass.range_constexpr(SUB):
            i = SUB * b + s
            gs.append(self._g(mG, tok0, valid, hv, ch, i))
            if const_expr(mX is not None):
                t = tok0 + cutlass.min(i, valid - 1)
                xs.append(cutlass.select_(i < valid, Float32(mX[t, head, ch]), Float32(0.0)))
        return gs, xs

    @cute.jit
    def _pick(self, values, b) -> Float32:
        """values[b] for a run-time sub-chunk index b (three selects)."""
        out = values[0]
        for c in cutlass.range_constexpr(1, NSUB):
            out = cutlass.select_(b == c, values[c], out)
        return Float32(out)

    @cute.jit
    def _put_scaled(self, sA, i, ch, x, e_row):
        """Row i of the four A tiles (sub-chunk b): x E_{bJ}, with E_{bJ} = 1 for J = b and 0
        for J > b (e_row: E_{b.})."""
        for j in cutlass.range_constexpr(NSUB):
            sA[i, ch, j] = (x * e_row[j]).to(BFloat16)

    @cute.jit
    def _products(self, mma, sA, sB, accs):
        """accs[J] = A_J Kr_J^T (64 x 16 over K), one commit group."""
        thr = mma.get_slice(0)
        tA = thr.make_fragment_A(thr.partition_A(sA))
        tB = thr.make_fragment_B(thr.partition_B(sB))
        for j in cutlass.range_constexpr(NSUB):
            gemm(mma, accs[j], tA[None, None, None, j], tB[None, None, None, j], True, -1)

    @cute.jit
    def _lower_to_scratch(self, mma, acc, coords, sW, sBeta, tid, j):
        """Column block j of L = beta_i (K K^T)_ij for j < i, else 0, into the fp32 scratch."""
        t0, row_base, col_base = coords
        a = rows_cols(acc)
        diff = SUB * j + col_base - row_base
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            bi = sBeta[row_base + t0[r, 0][0]]
            for c in cutlass.range_constexpr(cute.size(a, mode=[1])):
                off = t0[r, 0][0] - t0[r, c][1]
                a[r, c] = cutlass.select_(diff < off, a[r, c] * bi, Float32(0.0))
        part = mma.get_slice(tid).partition_C(cute.local_tile(sW, (CHUNK, SUB), (0, j)))
        part.store(acc.load())

    @cute.jit
    def _store_p(self, acc, coords, mP, row0, hv, j):
        """Column block j of P (j <= i, else 0) to global, bf16."""
        t0, row_base, col_base = coords
        a = rows_cols(acc)
        diff = SUB * j + col_base - row_base
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            i = row_base + t0[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(a, mode=[1])):
                off = t0[r, 0][0] - t0[r, c][1]
                val = Float32(cutlass.select_(diff <= off, a[r, c], Float32(0.0)))
                mP[row0 + i, hv, SUB * j + col_base + t0[r, c][1]] = val.to(BFloat16)

    @cute.jit
    def _store_t_beta(self, sW, sBeta, mT, row0, hv, tid):
        """T diag(beta) to global, bf16: thread t row t // 2, columns 32 (t % 2) ..."""
        i = tid // 2
        half = (tid % 2) * (CHUNK // 2)
        for c in cutlass.range_constexpr(CHUNK // 2):
            j = half + c
            mT[row0 + i, hv, j] = (sW[i, j] * sBeta[j]).to(BFloat16)
