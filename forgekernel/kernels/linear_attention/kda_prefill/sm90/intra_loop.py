"""Stage 1 of the fused KDA forward (docs/linear_attention/NOTES.md, "A fused KDA forward:
design", section 5): the first pass (`intra.py`, rows8) as the fused kernel's aux role alone.
Opt-in and not in the op: `compile.py` does not import this file (outside the kernels' hash).

One CTA (128 threads, the aux warpgroup) per (sequence, value head) walks the sequence's chunks
in order and writes the same operands as `intra.py`, in the same layout (`operands.py`: global
chunk first[n] + c), so that the GPU test compares the two outputs directly. Against rows8:

    loop     per chunk rows8's stages (loads, G2 scan, token loop, L and P, the inverse, the
             output), one CTA barrier more at the top (the last chunk's output reads sW, sP,
             which lie over the A tiles that the next q, k land in)
    g        one chunk ahead: the next chunk's 16 LDG.128 a thread issued after the products,
             in flight under the inverse (64 registers; issued before the products, with L's
             and P's 48 accumulators live, 352 B spilled against 256 B here)
    B tiles  only the four diagonal Kr_J (16 KB, rows8 kept the ten Kr_J E_IJ: 40 KB); E_IJ =
             2^(r_I - r_J) as a bf16 table (10 blocks x 128 channels, 1 on the diagonal)
             written by warp J after the scan, applied to the B fragments in registers: two
             LDS.32 and four HMUL2.BF16 a k step a block, shared by L and P. The rounding is
             `reference.kda_fused.aux_chunk`'s: bf16(bf16(Kr) bf16(E)) (its CPU replay)

q and k still come by cp.async (the design's TMA into the A tiles is left for stage 2, where a
producer warp exists to issue it). Rows past the sequence: as `intra.py`.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from forgekernel.kernels.common.sm90.barriers import named_barrier
from forgekernel.kernels.common.sm90.constants import LOG2E, THREADS_PER_WG
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
from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra import (
    AUX_WORDS,
    GROUPS,
    KSTEPS,
    NSUB,
    P_AT,
    P_STRIDE,
    SUB,
    TILES,
    TOK,
    VEC,
    X_AT,
    KdaIntraSm90,
    cp_async_16,
    ldsm_x4,
    mma_bf16_16x8x16,
    tile_of,
)

# One CTA a (sequence, head): 73 KB - 24 KB of B tiles + 2.5 KB of E; registers <= 168 keep
# three CTAs an SM (the bound intra.py launches with), so a GPU run at 64 / 128 CTAs is one CTA
# an SM either way.
CTAS_PER_SM = 1


@dsl_user_op
def mul_bf16x2(a, b, *, loc=None, ip=None) -> Int32:
    """mul.rn.bf16x2 of two packed bf16 pairs (HMUL2.BF16: one rounding of the exact
    product)."""
    res = llvm.inline_asm(
        T.i32(),
        [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.bf16x2 $0, $1, $2;",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(res)


@dsl_user_op
def cp_async_4_zfill(dst_smem, src_gmem, src_bytes, *, loc=None, ip=None) -> None:
    """cp.async.ca of 4 bytes global -> shared, src_bytes (0 or 4) read, the rest zero-filled
    (dst_smem a shared address as an integer, src_gmem an LLVM pointer)."""
    llvm.inline_asm(
        None,
        [Int32(dst_smem).ir_value(loc=loc, ip=ip), src_gmem,
         Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        "cp.async.ca.shared.global [$0], [$1], 4, $2;",
        "r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


@dsl_user_op
def opaque_ctaid_y(*, loc=None, ip=None) -> Int32:
    """blockIdx.y read where it is used (volatile: not hoisted out of the chunk loop)."""
    v = llvm.inline_asm(
        T.i32(),
        [],
        "mov.u32 $0, %ctaid.y;",
        "=r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)


class KdaIntraLoopSm90(KdaIntraSm90):
    """The aux role alone as a chunk loop; see the module docstring. Reuses `KdaIntraSm90`'s
    helpers (loads, stores, the masked block output, the P / T store). prefetch_g: g one
    chunk ahead (the design) or at the chunk's start (rows8's order); recompute_addresses: the
    thread's address math redone each chunk (no spills, more instructions; see the loop). The
    default since the H200 run of 2026-12-03 16:55: 9.17 against 11.84 us a chunk at 64 CTAs,
    10.43 against 13.04 at 128 (the held form's 57 LDL a chunk miss L1). own_scratch: the
    inverse's scratch and sP in their own 32 KB instead of over the A tiles (as the fused
    design has them), so that each block path writes its outputs right after its products: no
    barrier between, 16 accumulators live instead of 48, and the block paths a rolled loop
    (2 or 3 a warp, branched, not predicated: one copy of their code instead of three)."""

    def __init__(self, k: int, prefetch_g: bool = True, recompute_addresses: bool = True,
                 own_scratch: bool = False):  # fmt: skip
        super().__init__(k)
        self.prefetch_g = prefetch_g
        self.recompute_addresses = recompute_addresses
        self.own_scratch = own_scratch

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mFirst: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mT: cute.Tensor,
        mP: cute.Tensor,
        mD: cute.Tensor,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """As `KdaIntraSm90.__call__` but per sequence: mCu (N + 1,) int32 the token offsets,
        mFirst (N,) int32 each sequence's first global chunk (`operands.chunk_tables`)."""
        kd = self.k

        @cute.struct
        class SharedStorage:
            sBeta: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK], 16]
            sZero: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]  # recompute_addresses
            # E_IJ, bf16, block (I, J) in row order (tile_of), the diagonal ones 1
            sE: cute.struct.Align[cute.struct.MemRange[BFloat16, TILES * kd], 16]
            # own_scratch: sW, sX, sP here (else over sA; then 16 B in sA's alignment padding)
            sS: cute.struct.Align[
                cute.struct.MemRange[Float32, AUX_WORDS if self.own_scratch else 4],
                128 if self.own_scratch else 16,
            ]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, 2 * NSUB * SUB * kd], 128]
            # the diagonal Kr_J only
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, NSUB * SUB * kd], 128]

        self.shared_storage = SharedStorage
        self.kernel(
            mQ, mK, mG, mBeta, mCu, mFirst, mQg, mKg, mKd, mT, mP, mD, scale,
        ).launch(
            grid=(mFirst.shape[0], mG.shape[1], 1),
            block=[THREADS_PER_WG, 1, 1],
            stream=stream,
            min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=100,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mCu: cute.Tensor,
        mFirst: cute.Tensor,
        mQg: cute.Tensor,
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mT: cute.Tensor,
        mP: cute.Tensor,
        mD: cute.Tensor,
        scale: Float32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        n, hv, _ = cute.arch.block_idx()
        kd = self.k
        storage = SmemAllocator().allocate(self.shared_storage)
        scratch = storage.sS if cutlass.const_expr(self.own_scratch) else storage.sA
        sm = {
            "beta": storage.sBeta.get_tensor(cute.make_layout(CHUNK)),
            "zero": storage.sZero.get_tensor(cute.make_layout(4)),
            "e": storage.sE.get_tensor(cute.make_layout((TILES, kd // 2), stride=(kd // 2, 1)),
                                       dtype=Int32),
            "scan": storage.sB.get_tensor(cute.make_layout((kd, 3, NSUB), stride=(1, kd, 3 * kd)),
                                          dtype=Float32),
            "w": scratch.get_tensor(cute.make_layout((CHUNK, CHUNK), stride=(W_STRIDE, 1)),
                                    dtype=Float32),
            "x": cute.make_tensor(cute.recast_ptr(scratch.data_ptr(), dtype=Float32) + X_AT,
                                  cute.make_layout((2 * BLOCK, 2 * BLOCK), stride=(X_STRIDE, 1))),
            "p": cute.make_tensor(cute.recast_ptr(scratch.data_ptr(), dtype=BFloat16) + 2 * P_AT,
                                  cute.make_layout((CHUNK, CHUNK), stride=(P_STRIDE, 1))),
            "a": storage.sA.get_tensor(cute.make_layout((SUB, kd, 2 * NSUB),
                                                        stride=(kd, 1, SUB * kd))),
            "b": storage.sB.get_tensor(cute.make_layout((SUB, kd, NSUB),
                                                        stride=(kd, 1, SUB * kd))),
        }  # fmt: skip
        bos = mCu[n]
        length = mCu[n + 1] - bos
        nchunks = (length + CHUNK - 1) // CHUNK
        first = mFirst[n]
        w = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        r_first = SUB * w + TOK * (lane // GROUPS)
        cg = lane % GROUPS
        # g of the thread's 8 tokens, raw fp32, one chunk ahead (rows clamped to the sequence)
        gbuf = cute.make_rmem_tensor((VEC, TOK), Float32)
        if cutlass.const_expr(self.recompute_addresses):
            if tid == 0:
                sm["zero"][0] = Int32(0)  # visible after the loop's first barrier
        if nchunks > 0:  # an empty sequence has no row to clamp to
            if cutlass.const_expr(self.prefetch_g):
                self._load_g(mG, gbuf, hv, bos, cutlass.min(length, CHUNK), r_first, cg)
            for c in cutlass.range(nchunks, unroll=1):
                # the next chunk's (the last one's again on the last iteration: a reload)
                nxt = cutlass.min(c + 1, nchunks - 1) * CHUNK
                self._chunk_loop(mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, scale, sm, tid,
                                 first + c, hv, bos + c * CHUNK,
                                 cutlass.min(length - c * CHUNK, CHUNK), gbuf, bos + nxt,
                                 cutlass.min(length - nxt, CHUNK))  # fmt: skip

    @cute.jit
    def _load_g(self, mG, gbuf, hv, tok0, valid, r_first, cg):
        """The 8 tokens' g rows (channels 8 cg ..) of the chunk at tok0 into gbuf: 16 LDG.128,
        raw (zeroed past the sequence when consumed)."""
        for s in cutlass.range_constexpr(TOK):
            t = tok0 + cutlass.min(r_first + s, valid - 1)
            cute.autovec_copy(cute.local_tile(mG[t, hv, None], (VEC,), (cg,)), gbuf[None, s])

    @cute.jit
    def _chunk_loop(self, mQ, mK, mG, mBeta, mQg, mKg, mKd, mT, mP, mD, scale, sm, tid, gc, hv,
                    tok0, valid, gbuf, tok_next, valid_next):  # fmt: skip
        bar = named_barrier(Bar.AUX, THREADS_PER_WG)
        bar.arrive_and_wait()  # the last chunk's output reads of sW, sP (over the A tiles) done
        # threadIdx and the head read in the loop (volatile): LLVM then keeps the address math
        # derived from them inside it (spills 392 -> 352 B, g ahead before L and P); ptxas still
        # hoists the S2R reads themselves (one each before the loop) and holds what it derives
        # from them. recompute_addresses adds a zero read from shared memory each chunk, which
        # ptxas cannot hoist: 24 B spilled instead of 256, 4,264 instructions instead of 4,083,
        # and 22 % faster on the H200 (the class docstring)
        tid = opaque_tid_x()
        hv = opaque_ctaid_y()
        if cutlass.const_expr(self.recompute_addresses):
            zero = sm["zero"][0]
            tid = tid + zero
            hv = hv + zero
        w = cute.arch.make_warp_uniform(tid // 32)
        lane = tid % 32
        half = lane // GROUPS
        cg = lane % GROUPS
        head = hv // (mG.shape[1] // mQ.shape[1])
        row0 = gc * CHUNK
        r_first = SUB * w + TOK * half
        # beta by cp.async in q and k's group (zero-filled past the sequence): as LDG -> STS the
        # STS held the warp for a global latency each chunk (the one exposed load of the SASS
        # model, 356 cycles at 700), and an LDG into a register a chunk ahead shared ptxas's
        # scoreboard with the inverse's LDS (372 cycles waited there)
        if tid < CHUNK:
            t = tok0 + cutlass.min(tid, valid - 1)
            src = mBeta.iterator + cute.crd2idx((t, hv), mBeta.layout)
            cp_async_4_zfill((sm["beta"].iterator + tid).toint(), src.llvm_ptr,
                             cutlass.select_(tid < valid, Int32(4), Int32(0)))  # fmt: skip

        if cutlass.const_expr(not self.prefetch_g):
            self._load_g(mG, gbuf, hv, tok0, valid, r_first, cg)
        gl = []
        for s in cutlass.range_constexpr(TOK):
            t, inside = self._token(tok0, valid, r_first + s)
            for x in cutlass.range_constexpr(2):
                src = mK[t, head, None] if cutlass.const_expr(x == 0) else mQ[t, head, None]
                dst = self._at(sm["a"][None, None, NSUB * x + w], TOK * half + s, cg ^ s)
                cp_async_16(dst.iterator, cute.local_tile(src, (VEC,), (cg,)).iterator)
            gl.append([cutlass.select_(inside, gbuf[e, s] * LOG2E, Float32(0.0))
                       for e in range(VEC)])  # fmt: skip
        cute.arch.cp_async_commit_group()

        # the G2 scan as intra.py
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
        a_s = [[(start[e] + run[s][e]) - ref_w[e] for e in range(VEC)] for s in range(TOK)]
        pow_r = [cute.math.exp2(ref_w[e], fastmath=True) for e in range(VEC)]
        pow_cr = [cute.math.exp2(gc2[e] - ref_w[e], fastmath=True) for e in range(VEC)]
        if half == 0:
            self._store_e(sm, refs, ref_w, w, cg)
        if tid < GROUPS:
            dec = cute.make_rmem_tensor(VEC, Float32)
            for e in cutlass.range_constexpr(VEC):
                dec[e] = cute.math.exp2(gc2[e], fastmath=True)
            cute.autovec_copy(dec, cute.local_tile(mD[gc, hv, None], (VEC,), (cg,)))

        cute.arch.cp_async_wait_group(0)
        # Kl, Ql into their A tiles, Kr into the diagonal B tile w only
        for s in cutlass.range_constexpr(TOK):
            i = r_first + s
            r = TOK * half + s
            _, inside = self._token(tok0, valid, i)
            c = cg ^ s
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
            self._store(kr, self._at(sm["b"][None, None, w], r, c))
        bar.arrive_and_wait()
        self._products_diag(sm, w, bar)
        # the next chunk's g, in flight under the inverse
        if cutlass.const_expr(self.prefetch_g):
            self._load_g(mG, gbuf, hv, tok_next, valid_next, r_first, cg)
        bar.arrive_and_wait()
        invert_diagonal(sm["w"], tid)
        invert_merge_mma(sm["w"], sm["x"], tid, bar)
        self._store_out(sm, mP, mT, row0, hv, tid)

    @cute.jit
    def _store_e(self, sm, refs, ref_w, w, cg):
        """E_Iw = 2^(r_I - r_w) (bf16, channels 8 cg ..) for I > w, 1 for I = w, into the
        table: warp w owns column block w."""
        for ii in cutlass.range_constexpr(NSUB):
            if ii >= w:
                vals = [cutlass.select_(ii == w, Float32(1.0),
                                        cute.math.exp2(refs[ii][e] - ref_w[e], fastmath=True))
                        for e in range(VEC)]  # fmt: skip
                frag = cute.make_rmem_tensor(VEC, BFloat16)
                v = cute.make_rmem_tensor(VEC, Float32)
                for e in cutlass.range_constexpr(VEC):
                    v[e] = vals[e]
                frag.store(v.load().to(BFloat16))
                dst = cute.local_tile(sm["e"][tile_of(ii, 0) + w, None], (VEC // 2,), (cg,))
                cute.autovec_copy(cute.recast_tensor(frag, Int32), dst)

    @cute.jit
    def _block_path(self, sm, idx, bi, bj, frags) -> list:
        """L_IJ's and P_IJ's 16 accumulators a lane ([0, 8) L, [8, 16) P) of block idx = (bi,
        bj): 8 k steps of ldmatrix.x4 for Kl_I, Ql_I, Kr_J, E_IJ on the B fragments, 4 HMMA."""
        lane, g, t, x, row_a, row_b, hi_a, hi_b = frags
        acc = [Float32(0.0)] * 16
        tl = sm["a"][None, None, bi]
        tp = sm["a"][None, None, NSUB + bi]
        tb = sm["b"][None, None, bj]
        for s in cutlass.range_constexpr(KSTEPS):
            ca = (2 * s + hi_a) ^ x
            a_l = ldsm_x4(self._at(tl, row_a, ca).iterator.toint())
            a_p = ldsm_x4(self._at(tp, row_a, ca).iterator.toint())
            braw = ldsm_x4(self._at(tb, row_b, (2 * s + hi_b) ^ x).iterator.toint())
            e0 = sm["e"][idx, 8 * s + t]
            e1 = sm["e"][idx, 8 * s + 4 + t]
            b = [mul_bf16x2(braw[q], e0 if q % 2 == 0 else e1) for q in range(4)]
            for nh in cutlass.range_constexpr(2):
                bb = (b[2 * nh], b[2 * nh + 1])
                for o, a in ((0, a_l), (8, a_p)):
                    c4 = tuple(acc[o + 4 * nh + q] for q in range(4))
                    d = mma_bf16_16x8x16(a, bb, c4)
                    for q in cutlass.range_constexpr(4):
                        acc[o + 4 * nh + q] = d[q]
        return acc

    @cute.jit
    def _products_diag(self, sm, w, bar):
        """`KdaIntraSm90._products` with the B fragments read from the diagonal tile Kr_J and
        multiplied by E_IJ (two table words a lane and k step: channels 16 s + 2 t, + 1 for
        b[0], b[2] and 16 s + 8 + 2 t, + 1 for b[1], b[3])."""
        lane = opaque_tid_x() % 32
        g = lane // 4
        t = lane % 4
        x = lane % 8
        row_a = x + 8 * ((lane // 8) % 2)
        row_b = x + 8 * (lane // 16)
        hi_a = lane // 16
        hi_b = (lane // 8) % 2
        frags = (lane, g, t, x, row_a, row_b, hi_a, hi_b)
        if cutlass.const_expr(self.own_scratch):
            # warps 3, 2 three block paths, warps 1, 0 two; each written out at once (the
            # outputs do not lie over the tiles other warps still read)
            for n in cutlass.range(2 + cutlass.select_(w >= 2, Int32(1), Int32(0)), unroll=1):
                idx = (NSUB - 1 - w) + NSUB * n
                bi, bj = self._block(idx)
                acc = self._block_path(sm, idx, bi, bj, frags)
                self._block_out(sm, acc[:8], bi, bj, g, t, True)
                self._block_out(sm, acc[8:], bi, bj, g, t, False)
            return
        per = 3
        accs = cute.make_rmem_tensor((16, per), Float32)
        for n in cutlass.range_constexpr(per):
            idx = (NSUB - 1 - w) + NSUB * n
            if idx < TILES:
                bi, bj = self._block(idx)
                acc = self._block_path(sm, idx, bi, bj, frags)
                for q in cutlass.range_constexpr(16):
                    accs[q, n] = acc[q]
        bar.arrive_and_wait()
        for n in cutlass.range_constexpr(per):
            idx = (NSUB - 1 - w) + NSUB * n
            if idx < TILES:
                bi, bj = self._block(idx)
                self._block_out(sm, [accs[q, n] for q in range(8)], bi, bj, g, t, True)
                self._block_out(sm, [accs[8 + q, n] for q in range(8)], bi, bj, g, t, False)
