"""Kimi Delta Attention forward, the first (token-parallel) pass on sm_90a: one CTA (128
threads) per (global chunk, value head) writes the chunk's state-independent operands for the
recurrence kernel (`recurrence.py`), as `reference.kda_chunked.chunk_operands` defines them and
`operands.py` lays them out (rows past the sequence exact zeros). The "rows8" layout, the only
first pass since 2026-12-03 (docs/linear_attention/NOTES.md, "KDA first pass re-laid out" and
"rows8 adopted as the only first pass"; the one-channel-a-thread WGMMA kernel before it is
described there).

The factorization in exp2 forms (G2 = log2(e) cumsum(g), sub-chunk references r_I = G2 at
token 16 I + 8, a = G2 - r_I(i), E_IJ = 2^(r_I - r_J) <= 1); the ownership: thread (warp w,
lane) owns the 8 tokens 8 tg .. 8 tg + 7 (tg = 2 w + lane // 16) of the 8 channels 8 cg .. 8 cg
+ 7 (cg = lane % 16), so warp w is sub-chunk w (its factors warp-uniform: no selects) and every
global access is a 16-byte vector, a warp's instruction two whole 256-byte rows (g: two 16-byte
loads of fp32, 512-byte rows):

    loads    g into registers, k and q by cp.async into the thread's own 16 bytes of 64-row
             shared tiles (read back token by token: held in registers they spilled), all 32
             issued at once, g read once (the kernel before read it 3 times)
    G2       log2(e) cumsum(g): 8 running sums in registers, the lower half-warp's totals by a
             butterfly shuffle, the warps' totals and offsets through shared memory (one
             barrier); every thread rebuilds base_J, r_J, G2_C in one order, so r_w is G2 at
             token 16 w + 8 bit for bit (a = 0 there)
    tokens   a = G2 - r_w; Kl = k 2^a, Kr = k 2^-a, Ql = scale q 2^a (2^a once for both), Kg =
             Kl 2^r, Kd = Kr 2^(G2_C - r), Qg = Ql 2^r to global; Kl, Ql into A tiles w and
             4 + w; Kr E_Iw (E_ww = 1) into the B tiles (I, w), I >= w
    L, P     block (I, J), I >= J: L_IJ = Kl_I (Kr_J E_IJ)^T, P_IJ = Ql_I (Kr_J E_IJ)^T, 16 x
             16 x 128 each by mma.sync m16n8k16 bf16 (32 a block pair), per 16 channels one
             ldmatrix.x4 per operand (the A fragments in register order: no moves; B shared by
             L and P); warp w takes blocks v, v + 4, v + 8 of the 10, v = 3 - w (2, 2, 3, 3:
             the warps with more B copies fewer blocks); L masked
             (j < i) times beta_i into the fp32 scratch, P (j <= i) into a bf16 tile
    T        GDN's inverse: `invert_diagonal` + `invert_merge_mma` (tf32)
    out      P and T diag(beta) from shared memory, 16-byte stores, a warp's 4 whole rows;
             blocks above the diagonal as 0

With `bwd` (a compile-key flag, named in the key only when on) two more outputs for the KDA
backward's WY kernel (reference/kda_bwd_wy.py `wy_tiles`' tt and G): big_g = G = ln 2 G2 fp32
(R, HV, K), stored from the G2 sums as they are formed (no new live range), and tt = T^T
unscaled bf16 (R, HV, 64), T read down its columns from the fp32 scratch after the out stage
(before it the scratch holds T, the out stage scaling only its copies). Rows past the sequence
exact zeros in both (T's padded diagonal of ones masked). And mP holds P^T instead of P (row i
of the chunk is column i of P, read down sP's columns as tt's from the scratch): the only
reader of the bwd key's P is the backward's kernel 1, which takes P^T token-major; written so
here, its transposing copy (a 2-byte-strided gather, 363 us at 4 x 8192 H16 on the H100) is
gone. And W = T_beta Kg and u = T_beta V (bf16 (R, HV, 128), v (T, HV, 128) a new input; kernel
1's and the WY kernel's operands, two cuBLAS GEMMs and a memset a value head before, 353 us
there): Kg's rows (as this CTA stored them) and V's by cp.async into the B tiles once the
products are done, in flight under the inverse; after the out stage 80 mma.sync a warp from
T_beta's fragments (T x beta from the scratch, t_beta's bits) and the tiles by ldmatrix.trans
(`_store_wu`). Shared memory unchanged.

E on the B side: the kernel before rounded Kl E_IJ (A, J < I) and Kr (B) to bf16, this one Kl
(A) and Kr E_IJ (B): the same product, the same two bf16 roundings, placed on the other operand
(both underflow only where 2^(G_i - G_j) is below 2^-68 of the product). That keeps 4 + 4
unscaled A tiles and 10 B tiles (no Ql held over the L products, L and P in one pass). The
operand tiles' 16-byte chunks are XOR-swizzled by row % 8: the producers' row stores and the
ldmatrix phases are conflict-free.

Rows past the sequence: k = q = g = beta = 0 (loads clamped to its last token, zeroed on use),
so their rows and columns of every output are exact zeros. With l2norm the launcher normalizes
q and k first (torch).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import LN2, LOG2E, THREADS_PER_WG
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    BLOCK,
    W_STRIDE,
    X_STRIDE,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import invert_diagonal
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma import invert_merge_mma
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import Bar
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK

SUB = 16  # tokens per sub-chunk (one reference each): one warp
NSUB = CHUNK // SUB
TOK = 8  # tokens a thread
VEC = 8  # channels a thread (16 bytes of 16-bit)
GROUPS = 16  # channel groups: lanes of a half-warp
TILES = NSUB * (NSUB + 1) // 2  # the lower triangle's blocks (I >= J)
P_STRIDE = CHUNK + 8  # bf16 per row of the P tile (fragment stores conflict-free)
KSTEPS = 8  # mma k steps of 16 over K = 128
X_AT = CHUNK * W_STRIDE  # fp32 words: sX after sW, sP after sX, in one region
P_AT = X_AT + 2 * BLOCK * X_STRIDE
AUX_WORDS = P_AT + CHUNK * P_STRIDE // 2
assert AUX_WORDS * 4 <= 2 * NSUB * SUB * 128 * 2  # sW, sX, sP fit over the A tiles
CTAS_PER_SM = 3  # by shared memory (the tiles, 73 KB) and registers (<= 168: launch bound)


def tile_of(i, j):
    """Index of block (I, J), I >= J, in row order."""
    return i * (i + 1) // 2 + j


@dsl_user_op
def mma_bf16_16x8x16(a, b, c, *, loc=None, ip=None) -> tuple:
    """d = a b + c by mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: a four packed bf16
    pairs, b two, c and d four fp32."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
    ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        ops,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
        "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def ldsm_x4(addr: Int32, trans: bool = False, *, loc=None, ip=None) -> tuple:
    """ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: four 8 x 8 16-bit matrices, lanes 8 i ..
    8 i + 7 giving matrix i's row addresses (16 bytes each); returns the lane's word of each
    (trans: of the transposed matrix, rows 2 (lane % 4), + 1 of column lane // 4: an mma B
    fragment from a k-major tile). Volatile: kept in order with the barriers around the tiles it
    reads."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
        "{$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def cp_async_16(dst_smem, src_gmem, *, loc=None, ip=None) -> None:
    """cp.async.ca of 16 bytes global -> shared (pointers)."""
    llvm.inline_asm(
        None,
        [dst_smem.toint(loc=loc, ip=ip).ir_value(), src_gmem.llvm_ptr],
        "cp.async.ca.shared.global [$0], [$1], 16;",
        "r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class KdaIntraSm90:
    """The first pass; see the module docstring."""

    def __init__(self, k: int, bwd: bool = False):
        if k != 128:
            raise ValueError(f"K must be 128 (16 groups of 8 channels), got {k}")
        self.k = k
        self.bwd = bwd  # also write tt, big_g, P^T, W and u (the module docstring)

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
        mTT: cute.Tensor | None,
        mBigG: cute.Tensor | None,
        mV: cute.Tensor | None,
        mW: cute.Tensor | None,
        mU: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mQ, mK (T, H, K) 16-bit; mG fp32 (T, HV, K); mBeta fp32 (T, HV); mTok0, mLen int32
        (NC,) each chunk's first token and valid length; outputs as `operands.py` (mTT bf16
        (R, HV, 64), mBigG fp32 (R, HV, K) with `bwd`, else None; with `bwd` mV (T, HV, V =
        128) 16-bit the input, mW, mU bf16 (R, HV, 128) W = T_beta Kg and u = T_beta V)."""
        kd = self.k

        @cute.struct
        class SharedStorage:
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            # A tiles: Kl of sub-chunks 0..3, then Ql of 0..3; B tiles: Kr_J E_IJ, I >= J
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * NSUB * SUB * kd], 128]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, TILES * SUB * kd], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            mQ, mK, mG, mBeta, mTok0, mLen, mQg, mKg, mKd, mT, mP, mD, mTT, mBigG, mV, mW, mU,
            scale,
        ).launch(
            grid=(mTok0.shape[0], mG.shape[1], 1),
            block=[THREADS_PER_WG, 1, 1],
            stream=stream,
            min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=100,  # percent: the whole 228 KB (and no device query)
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
        mTT: cute.Tensor | None,
        mBigG: cute.Tensor | None,
        mV: cute.Tensor | None,
        mW: cute.Tensor | None,
        mU: cute.Tensor | None,
        scale: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        gc, hv, _ = cute.arch.block_idx()
        kd = self.k
        storage = SmemAllocator().allocate(self.shared_storage)
        sm = {
            "beta": storage.sBeta.get_tensor(cute.make_layout(CHUNK)),
            # [w][f]: warp w's totals, lower half's totals, upper half's first running sums: in
            # the B tiles, written only after the barrier that ends the scan's reads
            "scan": storage.sB.get_tensor(cute.make_layout((kd, 3, NSUB), stride=(1, kd, 3 * kd)),
                                          dtype=Float32),
            # after the products (a barrier after their last read): sW, sX, sP over the A tiles
            "w": storage.sA.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)),
                                       dtype=Float32),
            "x": cute.make_tensor(cute.recast_ptr(storage.sA.data_ptr(), dtype=Float32) + X_AT,
                                  cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1))),
            "p": cute.make_tensor(storage.sA.data_ptr() + 2 * P_AT,
                                  cute.make_layout((CHUNK, CHUNK), stride=(P_STRIDE, 1))),
            "a": storage.sA.get_tensor(cute.make_layout((SUB, kd, 2 * NSUB),
                                                        stride=(kd, 1, SUB * kd))),
            "b": storage.sB.get_tensor(cute.make_layout((SUB, kd, TILES),
                                                        stride=(kd, 1, SUB * kd))),
        }  # fmt: skip
        tok0 = mTok0[gc]
        valid = mLen[gc]
        # a chunk of length 0 (past the last real one) has nothing to write
        if valid > 0:
            self._chunk(mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, mTT, mBigG, mV, mW, mU,
                        scale, sm, tid, gc, hv, tok0, valid)  # fmt: skip

    @cute.jit
    def _chunk(self, mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, mTT, mBigG, mV, mW, mU, scale,
               sm, tid, gc, hv, tok0, valid):  # fmt: skip
        bar = named_barrier(Bar.AUX, THREADS_PER_WG)
        w = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        half = lane // GROUPS
        cg = lane % GROUPS
        head = hv // (mG.shape[1] // mQ.shape[1])
        row0 = gc * CHUNK
        r_first = SUB * w + TOK * half  # the thread's first token in the chunk
        if tid < CHUNK:
            t = tok0 + cutlass.min(tid, valid - 1)
            sm["beta"][tid] = cutlass.select_(tid < valid, Float32(mBeta[t, hv]), Float32(0.0))

        # g, k and q of the thread's 8 tokens loaded at once: g into registers, k and q by
        # cp.async into the A tile slots (Kl's, Ql's) the thread itself overwrites with Kl, Ql
        # after reading them back token by token (held in registers they spilled)
        gl = []
        for s in cutlass.range_constexpr(TOK):
            t, inside = self._token(tok0, valid, r_first + s)
            for x in cutlass.range_constexpr(2):
                src = mK[t, head, None] if const_expr(x == 0) else mQ[t, head, None]
                dst = self._at(sm["a"][None, None, NSUB * x + w], TOK * half + s, cg ^ s)
                cp_async_16(dst.iterator, cute.local_tile(src, (VEC,), (cg,)).iterator)
            graw = self._raw(mG[t, hv, None], cg, Float32)
            gl.append([cutlass.select_(inside, graw[e] * LOG2E, Float32(0.0)) for e in range(VEC)])
        cute.arch.cp_async_commit_group()

        # G2 = (base_w + off) + run: running sums in registers; off the lower half-warp's
        # totals (upper half; 0 below), base_w the warps' before w (shared memory); the
        # reference r_w = G2 at token 16 w + 8, rebuilt by every thread in the same order
        run = [gl[0]]
        for s in cutlass.range_constexpr(1, TOK):
            run.append([run[s - 1][e] + gl[s][e] for e in range(VEC)])
        lower = [cute.arch.shuffle_sync_bfly(run[TOK - 1][e], GROUPS) for e in range(VEC)]
        if half == 1:
            for f, vals in enumerate((
                [lower[e] + run[TOK - 1][e] for e in range(VEC)], lower, run[0]
            )):  # fmt: skip
                frag = cute.make_rmem_tensor(VEC, Float32)
                for e in cutlass.range_constexpr(VEC):
                    frag[e] = vals[e]
                cute.autovec_copy(frag, cute.local_tile(sm["scan"][None, f, w], (VEC,), (cg,)))
        bar.arrive_and_wait()
        base, refs = [], []
        acc = [Float32(0.0)] * VEC
        for j in cutlass.range_constexpr(NSUB):
            part = []
            for f in cutlass.range_constexpr(3):
                frag = cute.make_rmem_tensor(VEC, Float32)
                cute.autovec_copy(cute.local_tile(sm["scan"][None, f, j], (VEC,), (cg,)), frag)
                part.append(frag)
            base.append(acc)
            refs.append([(acc[e] + part[1][e]) + part[2][e] for e in range(VEC)])
            acc = [acc[e] + part[0][e] for e in range(VEC)] if j > 0 else [
                part[0][e] for e in range(VEC)
            ]  # fmt: skip
        bar.arrive_and_wait()  # every scan read done: the B tiles it sits in are written next
        gc2 = acc
        off = [cutlass.select_(half == 1, lower[e], Float32(0.0)) for e in range(VEC)]
        start = [self._pick([base[j][e] for j in range(NSUB)], w) + off[e] for e in range(VEC)]
        ref_w = [self._pick([refs[j][e] for j in range(NSUB)], w) for e in range(VEC)]
        if const_expr(self.bwd):  # G2's sums as a_s below forms them (the same adds, shared)
            self._store_big_g(mBigG, start, run, row0 + r_first, hv, cg, r_first, valid)
        # a = G2 - r_w, formed once (its 64 values replace G2's in registers)
        a_s = [[(start[e] + run[s][e]) - ref_w[e] for e in range(VEC)] for s in range(TOK)]
        pow_r = [cute.math.exp2(ref_w[e], fastmath=True) for e in range(VEC)]
        pow_cr = [cute.math.exp2(gc2[e] - ref_w[e], fastmath=True) for e in range(VEC)]
        # E_Iw = 2^(r_I - r_w), I > w (<= 1), on Kr_w's copies (B side); unused for I <= w
        e_iw = [[cute.math.exp2(refs[i][e] - ref_w[e], fastmath=True) for e in range(VEC)]
                for i in range(1, NSUB)]  # fmt: skip
        if tid < GROUPS:
            dec = cute.make_rmem_tensor(VEC, Float32)
            for e in cutlass.range_constexpr(VEC):
                dec[e] = cute.math.exp2(gc2[e], fastmath=True)
            cute.autovec_copy(dec, cute.local_tile(mD[gc, hv, None], (VEC,), (cg,)))

        cute.arch.cp_async_wait_group(0)
        # k and q sides token by token (2^a shared by both sides):
        # Kl, Ql into their A tiles, Kr E_Iw into the B tiles (I, w), I >= w
        for s in cutlass.range_constexpr(TOK):
            i = r_first + s
            r = TOK * half + s
            _, inside = self._token(tok0, valid, i)
            c = cg ^ s  # the row's swizzle: chunk ^ (row % 8), row = 8 half + s
            xk, xq = (
                self._fp32(self._raw16(self._at(sm["a"][None, None, NSUB * x + w], r, c), inside,
                                       mK.element_type))
                for x in range(2)
            )  # fmt: skip
            kl, kr, kg, kdd, ql, qg = [], [], [], [], [], []
            for e in cutlass.range_constexpr(VEC):
                a = a_s[s][e]
                ea = cute.math.exp2(a, fastmath=True)
                kl.append(xk[e] * ea)
                kr.append(xk[e] * cute.math.exp2(-a, fastmath=True))
                kg.append(kl[e] * pow_r[e])
                kdd.append(kr[e] * pow_cr[e])
                ql.append(xq[e] * scale * ea)
                qg.append(ql[e] * pow_r[e])
            self._store(kg, cute.local_tile(mKg[row0 + i, hv, None], (VEC,), (cg,)))
            self._store(kdd, cute.local_tile(mKd[row0 + i, hv, None], (VEC,), (cg,)))
            self._store(qg, cute.local_tile(mQg[row0 + i, hv, None], (VEC,), (cg,)))
            self._store(kl, self._at(sm["a"][None, None, w], r, c))
            self._store(ql, self._at(sm["a"][None, None, NSUB + w], r, c))
            self._store(kr, self._at(sm["b"][None, None, tile_of(w, 0) + w], r, c))
            for ii in cutlass.range_constexpr(1, NSUB):
                if ii > w:
                    vals = [kr[e] * e_iw[ii - 1][e] for e in range(VEC)]
                    self._store(vals, self._at(sm["b"][None, None, tile_of(ii, 0) + w], r, c))
        bar.arrive_and_wait()
        self._products(sm, w, bar)
        if const_expr(self.bwd):  # the B tiles are free (the products' barrier): Kg, V into them
            self._load_kg_v(mKg, mV, sm, row0, hv, tok0, valid, w, half, cg, r_first)
        bar.arrive_and_wait()
        # L is complete in sW (every warp wrote its blocks before the barrier above)
        invert_diagonal(sm["w"], tid)
        invert_merge_mma(sm["w"], sm["x"], tid, bar)  # ends with a barrier: sP visible too
        self._store_out(sm, mP, mT, row0, hv, tid)
        if const_expr(self.bwd):  # the scratch still holds T (the out stage scaled copies)
            cute.arch.cp_async_wait_group(0)
            bar.arrive_and_wait()  # every thread's Kg, V rows landed
            self._store_columns(sm["w"], mTT, row0, hv, tid, valid)
            self._store_columns(sm["p"], mP, row0, hv, tid, valid)  # P^T in mP
            self._store_wu(sm, mW, mU, mV.element_type, row0, hv, tid)

    @cute.jit
    def _store_big_g(self, mBigG, start, run, row, hv, cg, r_first, valid):
        """G = ln 2 (start + run) of the thread's 8 tokens (rows row ..) and 8 channels, fp32
        (two 16-byte stores a token), 0 past the sequence (where G2 holds G_last)."""
        for s in cutlass.range_constexpr(TOK):
            inside = r_first + s < valid
            vals = cute.make_rmem_tensor(VEC, Float32)
            for e in cutlass.range_constexpr(VEC):
                vals[e] = cutlass.select_(inside, (start[e] + run[s][e]) * LN2, Float32(0.0))
            cute.autovec_copy(vals, cute.local_tile(mBigG[row + s, hv, None], (VEC,), (cg,)))

    @cute.jit
    def _store_columns(self, tile, mOut, row0, hv, tid, valid):
        """A lower block-triangular (64, 64) shared tile transposed to global, bf16: row i of
        mOut is column i of `tile`, read down the column (8 scalar loads a 16-byte store): T^T
        (unscaled, from the fp32 scratch) into tt, and with `bwd` P^T (the bf16 sP) into mP,
        the KDA backward's kernel-1 operand as it reads it (no transposing copy after). Thread
        (warp w, lane) takes row i = 16 w + lane // 2 and, at step u, column group 2 u + lane %
        2 (tokens j of block u): a warp's store 16 whole 32-byte sectors, its loads 2-way bank
        conflicts (W_STRIDE = 72 words, P_STRIDE = 72 bf16); blocks u < w (above the diagonal)
        and rows past the sequence (T's padded diagonal; P's are zero there already) 0."""
        w = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        i = SUB * w + lane // 2
        inside = i < valid
        for u in cutlass.range_constexpr(NSUB):
            c = 2 * u + lane % 2
            keep = inside & (w <= u)
            col = [Float32(tile[VEC * c + e, i]) for e in range(VEC)]
            vals = [cutlass.select_(keep, col[e], Float32(0.0)) for e in range(VEC)]
            self._store(vals, cute.local_tile(mOut[row0 + i, hv, None], (VEC,), (c,)))

    @cute.jit
    def _load_kg_v(self, mKg, mV, sm, row0, hv, tok0, valid, w, half, cg, r_first):
        """The chunk's Kg rows (as the token loop stored them: each thread reads back its own
        16-byte pieces, in program order after its stores) and V rows (clamped to the sequence:
        T_beta's columns past it are exact zeros) by cp.async into B tiles w (Kg) and 4 + w (V),
        the token loop's rows and swizzle; in flight under the inverse."""
        for s in cutlass.range_constexpr(TOK):
            i = r_first + s
            t, _ = self._token(tok0, valid, i)
            for x in cutlass.range_constexpr(2):
                src = mKg[row0 + i, hv, None] if const_expr(x == 0) else mV[t, hv, None]
                dst = self._at(sm["b"][None, None, NSUB * x + w], TOK * half + s, cg ^ s)
                cp_async_16(dst.iterator, cute.local_tile(src, (VEC,), (cg,)).iterator)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _store_wu(self, sm, mW, mU, vtype, row0, hv, tid):
        """W = T_beta Kg and u = T_beta V (bf16, what the backward's torch bmm wrote before
        next/kda-wu: the same bf16 operands, fp32 sums in the mma's order) by mma.sync
        m16n8k16: warp w takes channels 32 w .. 32 w + 31 of both, 16 at a time (two n tiles,
        one ldmatrix.trans x4 of the Kg or V tile a k step), all four row blocks at once (32
        accumulators), k step J feeding row blocks I >= J (T_beta block lower triangular: 10
        of 16 blocks), 80 mma a warp. The A fragments of T_beta's 10 blocks (40 registers) built
        once from the fp32 scratch T times beta (the out stage's product and bf16 rounding:
        t_beta's bits); with the row blocks in the inner loop each B fragment is loaded once
        (row blocks outer, ptxas merged the repeated loads into 64 live registers: 32 B
        spilled). Rows past the sequence: T_beta's rows there are zero, so W's and u's are. The
        C fragments stored 8 bytes a lane (`_store_fragments`)."""
        w = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        x = lane % 8
        row_t = x + 8 * ((lane // 8) % 2)
        hi = lane // 16
        a = [[self._tb_fragment(sm, bi, bj, g, t) for bj in range(bi + 1)] for bi in range(NSUB)]
        # (product o, channel half p) a rolled iteration: unrolled, ptxas issued all 16 B loads
        # at once (64 registers more: 104 B spilled at the launch bound 168)
        for step in cutlass.range(4, unroll=1):
            o = step // 2
            c = (4 * w + 2 * (step % 2) + hi) ^ x
            acc = [Float32(0.0)] * 32  # row block bi, n tile nh: 4 at 8 bi + 4 nh
            for bj in cutlass.range_constexpr(NSUB):
                tile = sm["b"][None, None, NSUB * o + bj]
                b = ldsm_x4(self._at(tile, row_t, c).iterator.toint(), True)
                if const_expr(vtype is not BFloat16):  # the fp16 key's V (o = 1)
                    b = [cutlass.select_(o == 1, self._as_bf16x2(word, vtype), word)
                         for word in b]  # fmt: skip
                for bi in cutlass.range_constexpr(bj, NSUB):
                    for nh in cutlass.range_constexpr(2):
                        at = 8 * bi + 4 * nh
                        d = mma_bf16_16x8x16(
                            a[bi][bj],
                            (b[2 * nh], b[2 * nh + 1]),
                            tuple(acc[at + q] for q in range(4)),
                        )
                        for q in cutlass.range_constexpr(4):
                            acc[at + q] = d[q]
            col0 = 32 * w + 16 * (step % 2)
            if o == 0:
                self._store_fragments(acc, mW, row0, hv, g, t, col0)
            else:
                self._store_fragments(acc, mU, row0, hv, g, t, col0)

    @cute.jit
    def _store_fragments(self, acc, dst, row0, hv, g, t, col0):
        """`_store_wu`'s 32 accumulators (row block bi, n tile nh at 8 bi + 4 nh: rows g, g + 8,
        columns col0 + 2 t + 8 nh, + 1) into dst's rows as bf16, 8 bytes a lane: lanes t, t ^ 1
        swap one bf16 pair (one shuffle a row), the even lane storing n tile 0's columns 2 t ..
        2 t + 3, the odd one n tile 1's 2 t + 6 .. 2 t + 9, so that a warp's store is 8 rows x
        32 bytes, whole sectors (col0 a multiple of 16 channels); 4-byte pair stores wrote half
        sectors, twice the store instructions."""
        odd = t % 2 == 1
        for bi in cutlass.range_constexpr(NSUB):
            for hr in cutlass.range_constexpr(2):
                pairs = cute.make_rmem_tensor(4, Float32)
                for nh in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        pairs[2 * nh + e] = acc[8 * bi + 4 * nh + 2 * hr + e]
                half = cute.make_rmem_tensor(4, BFloat16)
                half.store(pairs.load().to(BFloat16))
                words = cute.recast_tensor(half, Int32)  # n tile 0's pair, n tile 1's
                mine, theirs = words[0], words[1]
                got = cute.arch.shuffle_sync_bfly(cutlass.select_(odd, mine, theirs), 1)
                out = cute.make_rmem_tensor(2, Int32)
                out[0] = cutlass.select_(odd, got, mine)
                out[1] = cutlass.select_(odd, theirs, got)
                col = col0 + 2 * t + cutlass.select_(odd, Int32(6), Int32(0))
                i = SUB * bi + g + 8 * hr
                cute.autovec_copy(
                    cute.recast_tensor(out, BFloat16),
                    cute.local_tile(dst[row0 + i, hv, None], (4,), (col // 4,)),
                )

    @cute.jit
    def _tb_fragment(self, sm, bi, bj, g, t) -> tuple:
        """The mma A fragment of T_beta's block (bi, bj): rows g, g + 8 x columns 2 t, + 1 and
        2 t + 8, + 9 (register order), each T (fp32 scratch) x beta_j rounded to bf16 as the out
        stage rounds t_beta."""
        words = []
        for dc in cutlass.range_constexpr(2):
            for dr in cutlass.range_constexpr(2):
                i = SUB * bi + g + 8 * dr
                j = SUB * bj + 2 * t + 8 * dc
                tw = cute.make_rmem_tensor(2, Float32)
                tb = cute.make_rmem_tensor(2, Float32)
                cute.autovec_copy(cute.local_tile(sm["w"][i, None], (2,), (j // 2,)), tw)
                cute.autovec_copy(cute.local_tile(sm["beta"], (2,), (j // 2,)), tb)
                v = cute.make_rmem_tensor(2, Float32)
                for e in cutlass.range_constexpr(2):
                    v[e] = tw[e] * tb[e]
                half = cute.make_rmem_tensor(2, BFloat16)
                half.store(v.load().to(BFloat16))
                words.append(cute.recast_tensor(half, Int32)[0])
        return tuple(words)

    @cute.jit
    def _as_bf16x2(self, word, dtype) -> Int32:
        """A packed pair of `dtype` (fp16: the fp16 key's V) rounded to a bf16 pair."""
        src = cute.make_rmem_tensor(1, Int32)
        src[0] = word
        vals = cute.recast_tensor(src, dtype)
        f = cute.make_rmem_tensor(2, Float32)
        for e in cutlass.range_constexpr(2):
            f[e] = Float32(vals[e])
        half = cute.make_rmem_tensor(2, BFloat16)
        half.store(f.load().to(BFloat16))
        return cute.recast_tensor(half, Int32)[0]

    @cute.jit
    def _raw(self, row: cute.Tensor, cg, dtype) -> cute.Tensor:
        """Channels 8 cg .. 8 cg + 7 of a 128-channel global row: one 16-byte load (two for
        fp32), kept packed until used."""
        raw = cute.make_rmem_tensor(VEC, dtype)
        cute.autovec_copy(cute.local_tile(row, (VEC,), (cg,)), raw)
        return raw

    @cute.jit
    def _token(self, tok0, valid, i):
        """(the token row to read for chunk row i, clamped to the sequence; whether inside)."""
        return tok0 + cutlass.min(i, valid - 1), i < valid

    @cute.jit
    def _raw16(self, chunk: cute.Tensor, inside, dtype) -> cute.Tensor:
        """8 16-bit channels (a 16-byte chunk, read as `dtype`), zeroed past the sequence on the
        packed words."""
        raw = cute.make_rmem_tensor(VEC, dtype)
        cute.autovec_copy(cute.recast_tensor(chunk, dtype), raw)
        words = cute.recast_tensor(raw, Int32)
        for e in cutlass.range_constexpr(VEC // 2):
            words[e] = cutlass.select_(inside, words[e], Int32(0))
        return raw

    @cute.jit
    def _fp32(self, raw: cute.Tensor) -> list:
        """A 16-bit load's 8 values as fp32."""
        return [Float32(raw[e]) for e in range(VEC)]

    @cute.jit
    def _store(self, vals: list, dst: cute.Tensor):
        """8 fp32 as bf16 into a 16-byte destination."""
        frag = cute.make_rmem_tensor(VEC, BFloat16)
        v = cute.make_rmem_tensor(VEC, Float32)
        for e in cutlass.range_constexpr(VEC):
            v[e] = vals[e]
        frag.store(v.load().to(BFloat16))
        cute.autovec_copy(frag, dst)

    @cute.jit
    def _at(self, tile: cute.Tensor, r, c) -> cute.Tensor:
        """16-byte chunk c (already swizzled: c ^ (r % 8)) of row r of a (16, 128) operand
        tile."""
        return cute.local_tile(tile[r, None], (VEC,), (c,))

    @cute.jit
    def _pick(self, values, b) -> Float32:
        """values[b] for a run-time (warp-uniform) index b."""
        out = values[0]
        for c in cutlass.range_constexpr(1, NSUB):
            out = cutlass.select_(b == c, values[c], out)
        return Float32(out)

    @cute.jit
    def _products(self, sm, w, bar):
        """Warp w's blocks v, v + 4, v + 8 (v = 3 - w: warps 3, 2 take three, warps 1, 0, whose
        B copies are more, two) of the 10 (I, J), I >= J, of L and P at once: L_IJ =
        Kl_I (Kr_J E_IJ)^T (beta_i, j < i, into sW), P_IJ = Ql_I (Kr_J E_IJ)^T (j <= i, bf16
        into sP), the B fragments shared. Step s (channels 16 s .. 16 s + 15) by one
        ldmatrix.x4 per A (rows 0-7, 8-15 x chunks 2 s, 2 s + 1: the A fragment in register
        order) and one of B (tokens 0-7 x chunks 2 s, 2 s + 1, then 8-15: both n halves). The
        results stay in registers over a barrier: sW and sP lie over the A tiles."""
        lane = opaque_tid_x() % 32  # read here: its address terms not live over the token loop
        g = lane // 4
        t = lane % 4
        x = lane % 8  # the row's swizzle (row % 8) of the row this lane addresses
        row_a = x + 8 * ((lane // 8) % 2)
        row_b = x + 8 * (lane // 16)
        hi_a = lane // 16
        hi_b = (lane // 8) % 2
        per = 3  # blocks a warp at most
        accs = cute.make_rmem_tensor((16, per), Float32)  # [0, 8): L's fragments, [8, 16): P's
        for n in cutlass.range_constexpr(per):
            idx = (NSUB - 1 - w) + NSUB * n
            if idx < TILES:
                bi, bj = self._block(idx)
                acc = [Float32(0.0)] * 16
                tl = sm["a"][None, None, bi]
                tp = sm["a"][None, None, NSUB + bi]
                tb = sm["b"][None, None, idx]
                for s in cutlass.range_constexpr(KSTEPS):
                    ca = (2 * s + hi_a) ^ x
                    a_l = ldsm_x4(self._at(tl, row_a, ca).iterator.toint())
                    a_p = ldsm_x4(self._at(tp, row_a, ca).iterator.toint())
                    b = ldsm_x4(self._at(tb, row_b, (2 * s + hi_b) ^ x).iterator.toint())
                    for nh in cutlass.range_constexpr(2):
                        bb = (b[2 * nh], b[2 * nh + 1])
                        for o, a in ((0, a_l), (8, a_p)):
                            c4 = tuple(acc[o + 4 * nh + q] for q in range(4))
                            d = mma_bf16_16x8x16(a, bb, c4)
                            for q in cutlass.range_constexpr(4):
                                acc[o + 4 * nh + q] = d[q]
                for q in cutlass.range_constexpr(16):
                    accs[q, n] = acc[q]
        bar.arrive_and_wait()  # every warp's tile reads done: sW, sP may overwrite them
        for n in cutlass.range_constexpr(per):
            idx = (NSUB - 1 - w) + NSUB * n
            if idx < TILES:
                bi, bj = self._block(idx)
                self._block_out(sm, [accs[q, n] for q in range(8)], bi, bj, g, t, True)
                self._block_out(sm, [accs[8 + q, n] for q in range(8)], bi, bj, g, t, False)

    @cute.jit
    def _block(self, idx):
        """(I, J) of lower-triangle block idx (row order)."""
        bi = Int32(0)  # idx in [I (I + 1) / 2, (I + 1) (I + 2) / 2)
        for c in cutlass.range_constexpr(1, NSUB):
            bi = bi + cutlass.select_(idx >= tile_of(c, 0), Int32(1), Int32(0))
        return bi, idx - bi * (bi + 1) // 2

    @cute.jit
    def _block_out(self, sm, acc, bi, bj, g, t, is_l: cutlass.Constexpr[bool]):
        """C fragments (rows g, g + 8; columns 8 nh + 2 t, + 1) of block (bi, bj), masked."""
        for hr in cutlass.range_constexpr(2):
            r = g + 8 * hr
            i = SUB * bi + r
            beta = sm["beta"][i]
            for nh in cutlass.range_constexpr(2):
                c0 = 8 * nh + 2 * t
                j = SUB * bj + c0
                pair = cute.make_rmem_tensor(2, Float32)
                for e in cutlass.range_constexpr(2):
                    v = acc[4 * nh + 2 * hr + e]
                    if const_expr(is_l):
                        pair[e] = cutlass.select_(j + e < i, v * beta, Float32(0.0))
                    else:
                        pair[e] = cutlass.select_(j + e <= i, v, Float32(0.0))
                if const_expr(is_l):
                    cute.autovec_copy(pair, cute.local_tile(sm["w"][i, None], (2,), (j // 2,)))
                else:
                    half = cute.make_rmem_tensor(2, BFloat16)
                    half.store(pair.load().to(BFloat16))
                    cute.autovec_copy(half, cute.local_tile(sm["p"][i, None], (2,), (j // 2,)))

    @cute.jit
    def _store_out(self, sm, mP, mT, row0, hv, tid):
        """P and T diag(beta) to global (bf16, 16-byte stores): 8-column group p % 8 of row
        p // 8, p = tid + 128 u, so that a warp's store is 4 whole 128-byte rows; the blocks
        above the diagonal (never written in shared memory) as 0."""
        groups = CHUNK // VEC
        for u in cutlass.range_constexpr(CHUNK * groups // THREADS_PER_WG):
            p = tid + THREADS_PER_WG * u
            i = p // groups
            c = p % groups
            keep = (c * VEC) // SUB <= i // SUB
            if const_expr(not self.bwd):  # bwd: P^T by `_store_columns` instead
                pv = cute.make_rmem_tensor(VEC, BFloat16)
                cute.autovec_copy(cute.local_tile(sm["p"][i, None], (VEC,), (c,)), pv)
                pw = cute.recast_tensor(pv, Int32)
                for e in cutlass.range_constexpr(VEC // 2):
                    pw[e] = cutlass.select_(keep, pw[e], Int32(0))
                cute.autovec_copy(pv, cute.local_tile(mP[row0 + i, hv, None], (VEC,), (c,)))
            tw = cute.make_rmem_tensor(VEC, Float32)
            tb = cute.make_rmem_tensor(VEC, Float32)
            cute.autovec_copy(cute.local_tile(sm["w"][i, None], (VEC,), (c,)), tw)
            cute.autovec_copy(cute.local_tile(sm["beta"], (VEC,), (c,)), tb)
            vals = [cutlass.select_(keep, tw[e] * tb[e], Float32(0.0)) for e in range(VEC)]
            self._store(vals, cute.local_tile(mT[row0 + i, hv, None], (VEC,), (c,)))
