"""The merges of the WY inverse (phases 1, 2a, 2b of `inverse.py`'s docstring) with each 16 x
16 fp32 block product on the tensor cores: mma.sync m16n8k8 tf32, one pass (the standard form
since the H200 run of 2026-12-03 06:21: the GDN prefill 0.680x the FFMA form's time, median of 6
cases, the KDA prefill 0.954x; docs/linear_attention/NOTES.md, "Measured 2026-12-03 06:21").

Why: the aux warpgroup's chunk is one latency-bound instruction stream per warp (warp 3, the
last at every barrier: with the merges on the CUDA cores ~1.8 k instructions a chunk, ~1 k of
them the inverse; five 16 x 16 block products of ~170 instructions each: 128 FFMA, 36 LDS.128).
Here a product is four mma.sync m16n8k8 tf32 (two 8-column halves by two 8-deep k steps), the
operands read from the scratch in the PTX fragment layouts (lane = 4 g + t: a (g, t), (g + 8,
t), (g, t + 4), (g + 8, t + 4); b (t, g), (t + 4, g)), rounded to tf32 (to nearest), fp32
accumulation: ~40 instructions a lane on a chain of two MMAs (~52 a product). A lane's 8
results are the C fragments: rows g, g + 8, columns 8 n + 2 t, + 1 (n: the half).

Accuracy (CPU model, tests/test_gdn_prefill_aux.py, tf32 rounding emulated lane by lane): T
within 6.6e-4 of max |T| of fp64 (no decay, keys alike), 9.3e-5 on the suite's gates, under a
third of the bf16 rounding of T diag(beta); FlashInfer's sm90 prefill forms its inverse in fp16
on the tensor cores. Measured and dropped (NOTES): the FFMA merges, 3xTF32 (hi / lo split,
~fp32 accuracy, 12 MMAs a product: median 0.790x against tf32's 0.680x, 1.004x on 4 x 8192
hv32).

Barriers and in-place order: a warp's own `sync_warp` between a block read and its overwrite,
the aux warpgroup's named barrier between phases.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import BLOCK
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse import block

# cvt.rna.tf32.f32 is no sm_90 instruction: ptxas expands it to ~8 with predicate juggling
# (the first build spilled 104 B at 104 registers). Rounded here by two integer operations:
# + half an ulp of tf32 (bit 12), then the low 13 bits cleared (to nearest, ties away; finite
# values below fp32's largest, as the scratch holds).
_ROUND = "mov.b32 r, {x}; add.u32 r, r, 4096; and.b32 {hi}, r, -8192;"


@dsl_user_op
def to_tf32(x: Float32, *, loc=None, ip=None) -> Int32:
    """x rounded to tf32 (mma.sync alone would truncate: twice the error, biased)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "{ .reg .b32 r; " + _ROUND.format(x="$1", hi="$0") + " }",
            "=r,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def mma_tf32_16x8x8(a, b, c, *, loc=None, ip=None) -> tuple:
    """d = a b + c by mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: a four tf32
    registers, b two, c and d four fp32 (the fragment layouts of the module docstring)."""
    ops = [Int32(v).ir_value(loc=loc, ip=ip) for v in (*a, *b)]
    ops += [Float32(v).ir_value(loc=loc, ip=ip) for v in c]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        ops,
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, "
        "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4))


MMA_K = 8  # mma.sync m16n8k8: k per step, columns per half
A_OFFSETS = ((0, 0), (8, 0), (0, 4), (8, 4))  # a fragment's (row, column) from (g, t)


@cute.jit
def mma_block_product(
    acc: cute.Tensor, x: cute.Tensor, y: cute.Tensor, lane: Int32,
    first: cutlass.Constexpr[bool],
):  # fmt: skip
    """acc (+)= x y of 16 x 16 fp32 blocks on the tensor cores; acc[4 n + i]: the C fragment of
    columns 8 n .. 8 n + 7 (module docstring)."""
    g = lane // 4
    t = lane % 4
    if const_expr(first):
        acc.fill(0.0)
    for s in cutlass.range_constexpr(BLOCK // MMA_K):
        a = [to_tf32(x[g + dr, MMA_K * s + t + dc]) for dr, dc in A_OFFSETS]
        for n in cutlass.range_constexpr(BLOCK // MMA_K):
            b = [to_tf32(y[MMA_K * s + t + dk, MMA_K * n + g]) for dk in (0, 4)]
            c = mma_tf32_16x8x8(a, b, tuple(acc[4 * n + i] for i in range(4)))
            for i in cutlass.range_constexpr(4):
                acc[4 * n + i] = c[i]


@cute.jit
def store_fragments(
    acc: cute.Tensor, dst: cute.Tensor, lane: Int32, negate: cutlass.Constexpr[bool]
):
    """A lane's C fragments (rows g, g + 8; columns 8 n + 2 t, + 1) into a 16 x 16 block."""
    g = lane // 4
    t = lane % 4
    for n in cutlass.range_constexpr(BLOCK // MMA_K):
        for hr in cutlass.range_constexpr(2):
            out = cute.make_rmem_tensor(2, Float32)
            for e in cutlass.range_constexpr(2):
                v = acc[4 * n + 2 * hr + e]
                out[e] = -v if const_expr(negate) else v
            row = dst[g + MMA_K * hr, None]
            cute.autovec_copy(out, cute.local_tile(row, (2,), (MMA_K // 2 * n + t,)))


@cute.jit
def invert_merge_mma(sW: cute.Tensor, sX: cute.Tensor, atid: Int32, bar):
    """Phases 1, 2a, 2b after `inverse.invert_diagonal`: sW -> T = (I + L)^-1 in place (zero
    above stays zero). atid: the aux warpgroup's thread index; bar: its named barrier."""
    w = cute.arch.make_warp_uniform(atid // 32)
    lane = atid % 32
    frags = 2 * (BLOCK // MMA_K) * 2  # a lane's share of a 16 x 16 result: 8 values
    bar.arrive_and_wait()

    kept = cute.make_rmem_tensor(frags, Float32)  # warps 2, 3: X_w0 between phases 1 and 2a
    acc = cute.make_rmem_tensor(frags, Float32)
    if w >= 2:
        mma_block_product(acc, block(sW, w, 1), block(sW, 1, 1), lane, True)
        store_fragments(acc, block(sX, w - 2, 1), lane, False)
        mma_block_product(kept, block(sW, w, 0), block(sW, 0, 0), lane, True)
    else:
        b = 2 * w
        z = block(sW, b + 1, b)  # L_{b+1,b}, then L T_bb, then T_{b+1,b}
        mma_block_product(acc, z, block(sW, b, b), lane, True)
        cute.arch.sync_warp()
        store_fragments(acc, z, lane, False)
        cute.arch.sync_warp()
        mma_block_product(acc, block(sW, b + 1, b + 1), z, lane, True)
        cute.arch.sync_warp()
        store_fragments(acc, z, lane, True)
    bar.arrive_and_wait()

    if w >= 2:
        mma_block_product(kept, block(sW, w, 1), block(sW, 1, 0), lane, False)
        store_fragments(kept, block(sX, w - 2, 0), lane, False)
    bar.arrive_and_wait()

    i = 2 + w // 2
    j = w % 2
    mma_block_product(acc, block(sW, i, 2), block(sX, 0, j), lane, True)
    if w >= 2:
        mma_block_product(acc, block(sW, 3, 3), block(sX, 1, j), lane, False)
    store_fragments(acc, block(sW, i, j), lane, True)
    bar.arrive_and_wait()
