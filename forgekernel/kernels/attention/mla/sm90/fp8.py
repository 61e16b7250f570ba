"""FlashMLA's FP8 latent cache read by the MLA partial pass (decode.py, `fp8`): the e4m3 latent
columns are dequantized into the same swizzled 16-bit tile the 16-bit path's cp.async fills,
tile 0's from registers (global -> registers -> bf16 -> st.shared), every later tile's in place
from its own stage (below). The RoPE columns are bf16 in the cache and keep cp.async.

Format (config.FP8_ROW_BYTES = 656 bytes per token): [0, 512) the latent in e4m3, [512, 528)
four fp32 scales, one per 128 latent columns (powers of two), [528, 656) the RoPE columns in
bf16; the kernel takes the three as views (uint8 (P, ps, 512), fp32 (P, ps, 4), bf16 (P, ps,
64)) of the same rows.

Dequantization, per pair of e4m3 bytes -> one bf16x2 register (4 instructions):
    prmt  t = [b0, sign(b0), b1, sign(b1)]   (each byte sign-extended to 16 bits)
    shl   t = t << 4                         (the byte s eeee mmm at bits 11..4, copies of s
                                              at 15..12)
    and   t = t & 0x87F087F0                 (bf16 s 0000eeee mmm0000: the e4m3 exponent the
                                              low 4 bits of bf16's, its 3 mantissa bits the top
                                              ones of bf16's)
    mul.rn.bf16x2  out = t * m,  m = bf16(2^120 x scale)
t read as bf16 is the e4m3 value times 2^(7 - 127) = 2^-120 exactly, subnormals included (an
e4m3 subnormal, exponent field 0, is a bf16 subnormal with the same mantissa bits; 0x80 is -0).
The product e4m3 x scale is exact in bf16 for a power-of-two scale in [2^-124, 2^7] (bf16 has
fp32's exponent range and 8 significant bits, e4m3 4), so the multiply rounds nothing; m is
finite for scales up to 2^7 (|latent| <= 448 x 128 = 57344 under FlashMLA's quantizer, whose
smallest scale is 2^-13). The e4m3fn NaN codes 0x7F / 0xFF, which a saturating quantizer never
writes, read as +-480 x scale. tests/test_mla_decode.py models this sequence bit for bit in
torch over all 256 codes and the scales 2^-124 .. 2^7.

Tiles after tile 0 move by cp.async (decode.py `_issue_fp8`): a tile's 32 KB of e4m3 land in
the upper half of its own stage (the 16-bit tile's column blocks 4 .. 7, free until the
dequantization), its scales in a 1 KB buffer, and warpgroup 1 dequantizes them in place a turn
later in three phases (`staged_job`, `staged_raw_offset`; tests/test_mla_fp8_staged.py replays
the byte ranges): columns 0 .. 255 into blocks 0 .. 3 (the bytes read from blocks 4, 5); a
barrier; 256 .. 383 into blocks 4, 5 (read from block 6) while 384 .. 511 (block 7) go into
registers; a barrier; those into blocks 6, 7. Their rows are also prefetched into L2 a turn
before that (`prefetch_row_l2`, cp.async.bulk.prefetch: no register or shared memory). (This
replaced warpgroup 1 loading every tile's bytes into registers: MLA_NOTES.md, 2026-12-03.)"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    E4M3_TO_BF16_EXPONENT,
    FP8_CHUNK,
    FP8_ROW_BYTES,
    FP8_SCALE_COLUMNS,
)
from forgekernel.kernels.common.sm90.ptx import cvt_pair

BF16_CHUNK = 8  # bf16 elements per 16-byte shared-memory store (one swizzle chunk)
# where a tile's bytes wait in its stage (bytes from the stage's start): row r's
# 16-byte chunk c at STAGED_RAW_BASE + (c // 8) STAGED_RAW_BLOCK + 128 r + 16 (c % 8)
STAGED_RAW_BASE = 64 * 512  # TILE rows x D_LATENT bf16 columns / 2: the stage's upper half
STAGED_RAW_BLOCK = 64 * FP8_SCALE_COLUMNS  # one scale group of a tile, 8 KB
STAGED_ROW_BYTES = 128  # of one row within a scale group
STAGED_JOBS = (8, 4, 4)  # chunks per thread (128 threads) in each dequantization phase
_SELECT = ("0x9180", "0xB3A2")  # prmt: bytes 0, 1 / 2, 3 of the word, each sign-extended


@dsl_user_op
def e4m3x2_to_bf16x2(word: Int32, mult: Int32, upper: bool, *, loc=None, ip=None) -> Int32:
    """Bytes 0, 1 (upper: 2, 3) of `word`, e4m3, times the bf16x2 pair `mult` (2^120 x scale
    twice) as one bf16x2 register (the lower byte in the low half); see the module
    docstring."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(word).ir_value(loc=loc, ip=ip), Int32(mult).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b32 t;\n"
            f"prmt.b32 t, $1, 0, {_SELECT[int(upper)]};\n"
            "shl.b32 t, t, 4;\n"
            "and.b32 t, t, 0x87F087F0;\n"
            "mul.rn.bf16x2 $0, t, $2;\n}",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def prefetch_row_l2(row: cute.Tensor, *, loc=None, ip=None) -> None:
    """One FP8 cache row (all FP8_ROW_BYTES: latent, scales and RoPE; 16-byte aligned) into L2,
    asynchronously: no register or shared memory holds it, so the register loads a turn later
    wait for L2 instead of DRAM."""
    llvm.inline_asm(
        None,
        [row.iterator.llvm_ptr, Int32(FP8_ROW_BYTES).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


# the `lean` form's per-thread L2 prefetch: a row's FP8_ROW_BYTES from a 16-byte aligned start
# touch the 128-byte lines of start + 128 k, k < LINES_PER_ROW (640 + 16 = 656: the last line
# never lies past start + 640), two threads a row, LINES_PER_THREAD each
LINES_PER_ROW = 6
LINES_PER_THREAD = LINES_PER_ROW // 2


@dsl_user_op
def prefetch_lines_l2(row: cute.Tensor, half, *, loc=None, ip=None) -> None:
    """Lines 3 half .. 3 half + 2 of one FP8 cache row (16-byte aligned) into L2 by one thread
    (`prefetch.global.L2` of each line: per-thread addresses, where `prefetch_row_l2`'s bulk
    prefetch takes uniform ones, which ptxas loops over a warp's distinct rows one at a
    time)."""
    start = row.iterator + half * (LINES_PER_THREAD * 128)
    llvm.inline_asm(
        None,
        [start.llvm_ptr],
        "prefetch.global.L2 [$0];\nprefetch.global.L2 [$0+128];\nprefetch.global.L2 [$0+256];",
        "l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cute.jit
def bf16_multiplier(scale: Float32) -> Int32:
    """bf16x2 (2^120 x scale, 2^120 x scale): exact for a power-of-two scale <= 2^7."""
    m = scale * Float32(2.0**E4M3_TO_BF16_EXPONENT)
    return cvt_pair(m, m, True)


@cute.jit
def load_chunk(row: cute.Tensor, chunk, raw: cute.Tensor):
    """The 16 e4m3 bytes of latent columns [16 chunk, 16 chunk + 16) of one cache row (uint8,
    16-byte aligned) into `raw` (16 uint8 registers): one 16-byte global load."""
    ptr = cute.make_ptr(cutlass.Uint8, row.iterator.toint(), cute.AddressSpace.gmem,
                        assumed_align=16)  # fmt: skip
    src = cute.make_tensor(ptr + chunk * FP8_CHUNK, cute.make_layout(FP8_CHUNK))
    cute.autovec_copy(src, raw)


def row_scales(latent: cute.Tensor) -> cute.Tensor:
    """The fp32 scales (P, ps, 4) of FlashMLA's FP8 rows from their latent view `latent`
    (uint8 (P, ps, 512), strides in bytes, multiples of 16: ops.mla `fp8_cache_views`): bytes
    [512, 528) of the same rows, strides / 4 (host side, at the launch). The fused pass's FP8
    form (decode.py), whose scales' slot carries out_scale."""
    stride = latent.stride
    ptr = cute.recast_ptr(latent.iterator + D_LATENT, dtype=Float32)
    shape = (latent.shape[0], latent.shape[1], D_LATENT // FP8_SCALE_COLUMNS)
    lay = cute.make_layout(shape, stride=(stride[0] // 4, stride[1] // 4, 1))
    return cute.make_tensor(ptr, lay)


@cute.jit
def chunk_scale_index(chunk):
    """Which of a row's four scales covers 16-byte chunk `chunk` of its latent bytes."""
    return chunk // (FP8_SCALE_COLUMNS // FP8_CHUNK)


@cute.jit
def store_chunk(raw: cute.Tensor, mult: Int32, dst_row: cute.Tensor, chunk):
    """`raw` (16 e4m3 bytes of columns [16 chunk, 16 chunk + 16)) dequantized by `mult` into
    the 16-bit tile row `dst_row` (swizzled): two 16-byte shared-memory stores."""
    words = cute.recast_tensor(raw, Int32)
    for half in cutlass.range_constexpr(2):
        wide = cute.make_rmem_tensor(4, Int32)
        for k in cutlass.range_constexpr(2):
            word = words[2 * half + k]
            wide[2 * k] = e4m3x2_to_bf16x2(word, mult, False)
            wide[2 * k + 1] = e4m3x2_to_bf16x2(word, mult, True)
        dst = cute.local_tile(dst_row, (BF16_CHUNK,), (2 * chunk + half,))
        cute.autovec_copy(cute.recast_tensor(wide, dst_row.element_type), dst)


def staged_raw_offset(row, chunk):
    """The byte offset, from its stage's start, of tile row `row`'s 16-byte chunk
    `chunk` (latent columns [16 chunk, 16 chunk + 16)) while it waits for the dequantization."""
    group = chunk // (FP8_SCALE_COLUMNS // FP8_CHUNK)
    within = chunk % (FP8_SCALE_COLUMNS // FP8_CHUNK)
    return STAGED_RAW_BASE + group * STAGED_RAW_BLOCK + STAGED_ROW_BYTES * row + FP8_CHUNK * within


def staged_issue_job(tid, load):
    """(tile row, chunk) of warpgroup-1 thread `tid`'s cp.async `load` (0 .. 15):
    warp w's lanes 0-15 / 16-31 take rows 2w / 2w + 1 (+ 8 per pair of loads), half a row
    (256 contiguous bytes of the cache row) per instruction."""
    warp, lane = tid // 32, tid % 32
    return (load // 2) * 8 + 2 * warp + lane // 16, (load % 2) * 16 + lane % 16


def staged_job(phase: int, j: int, warp, lane):
    """(tile row, chunk) of job `j` of dequantization phase `phase` (0, 1, 2;
    STAGED_JOBS[phase] jobs) for warp `warp` (0 .. 3) of warpgroup 1, lane `lane`: phase 0
    chunks 0 .. 15 (lanes 0-15 / 16-31 on one row each), phases 1 / 2 chunks 16 .. 23 /
    24 .. 31 (8 lanes a row). Phase 2's bytes are read during phase 1."""
    if phase == 0:
        return j * 8 + 2 * warp + lane // 16, lane % 16
    return j * 16 + 4 * warp + lane // 8, 8 + 8 * phase + lane % 8
