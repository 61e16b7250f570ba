"""FP8 (e4m3) K and V tiles of the paged decode's partial pass, widened in registers.

The tiles stay bytes in shared memory and are read by ldmatrix as if they were 16-bit tiles of
half the width (a "virtual" tile: 16-bit column c = bytes 2c, 2c + 1), so that every ldmatrix
word holds 4 e4m3 bytes. Each word is widened in registers into the 16-bit MMA operands, and
the register order the bytes arrive in is absorbed by two fixed permutations rather than by
shuffles (config.FP8_Q_SLOT, config.FP8_O_COLUMN):

- K (B operand of S = Q K^T, non-transposed ldmatrix): the word of key n, 16-byte segment s,
  thread quad index t holds dims 16s + 4t .. 16s + 4t + 3, widened to two pairs (dims 4t,
  4t + 1 and 4t + 2, 4t + 3) that the MMA reads as reduction indices 2t, 2t + 1 and
  2t + 8, 2t + 9 of the segment's K = 16 step. The same permutation applied to Q's columns in
  shared memory (dim 16s + 4t + 2i + j stored at 16s + 8i + 2t + j) leaves S = Q K^T exact.
- V (B operand of O += P V, transposed ldmatrix): the word holds keys 2t, 2t + 1 of dims
  16s + 2g, 16s + 2g + 1 (g = lane / 4); a byte permute gives the key pairs of both dims, the
  B operands of two 8-column MMA blocks: block 2s + e's column n is dim 16s + 2n + e. O's
  registers thus hold permuted columns, put back in place when O is staged for the merge.

Widening is exact: e4m3 values are f16 values (cvt.rn.f16x2.e4m3x2) and bf16 values (the bits
placed into a bf16 with bias 127 - 7 = 120 and multiplied by 2^120, subnormals included; an
e4m3 NaN becomes 480). P V runs in f16 for either query dtype (V is exact in f16, P in [0, 1]
gains 3 bits over bf16); S = Q K^T runs in q's dtype."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from forgekernel.kernels.attention.paged.sm90.config import FP8_O_COLUMN, FP8_Q_SLOT
from forgekernel.kernels.common.sm90.warp_mma import COPY_BITS, swizzled_rows

# byte permutes (prmt.b32 selectors, a nibble per result byte, 8 + i: byte i's sign repeated)
# and the bf16 widening's constants (`e4m3_pair_bf16`)
BF16_SELECT = (0x9180, 0xB3A2)  # bytes 0, 1 / 2, 3 each sign-extended to 16 bits
BF16_SHIFT = 4  # e4m3's exponent LSB (bit 3) onto bf16's (bit 7)
BF16_MASK = 0x87F087F0  # per half: the sign, e4m3's 4 exponent + 3 mantissa bits
BF16_E4M3_BIAS = 0x7B807B80  # 2^120 twice, bf16x2: bias 127 - 7
KEY_PAIRS = 0x3120  # bytes 0, 2, 1, 3: a V word's keys of one dim side by side


def byte_tiles(rows: int, d: int, stages: int):
    """(rows, d / 2, stages) 16-bit view of `rows` x d e4m3 bytes per stage, rows contiguous,
    16-byte chunks XOR-swizzled by the row: conflict-free ldmatrix and cp.async."""
    width = d // 2
    if width >= 64:
        return swizzled_rows(rows, width, stages)
    # 64-byte rows: two rows per 128-byte line, chunks swizzled by the line (mod 4)
    atom = cute.make_composed_layout(
        cute.make_swizzle(2, 3, 3), 0, cute.make_layout((8, width), stride=(width, 1))
    )
    return cute.tile_to_shape(atom, (rows, width, stages), (0, 1, 2))


def row_copy(dtype, width: int, threads: int) -> cute.TiledCopy:
    """cp.async of 16 bytes over (rows, width) 16-bit views of byte rows, two chunks of a row
    per thread (of a row's width / 8 chunks, j and j + width / 16: a warp's copy covers 32
    whole bytes of each of its rows or more): half the rows per thread of
    `warp_mma.tiled_row_copy`, so half the page lookups and row addresses."""
    chunk = COPY_BITS // dtype.width
    per_row = width // chunk // 2
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
        num_bits_per_copy=COPY_BITS,
    )  # fmt: skip
    return cute.make_tiled_copy_tv(
        atom,
        cute.make_ordered_layout((threads // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, chunk)),
    )


def q_pair_slots(d: int):
    """Pair c of a query row (dims 2c, 2c + 1) -> its pair slot in shared memory (FP8_Q_SLOT
    in pairs: dim 16s + 4t + 2i stored at 16s + 8i + 2t)."""
    (_, i, t), (_, si, st) = FP8_Q_SLOT
    return cute.make_layout((i, t, d // 16), stride=(si // 2, st // 2, 8))


def o_columns(d: int):
    """An 8-column MMA block's virtual column v = 8 * block + n -> O's dim (FP8_O_COLUMN)."""
    (n, e), (sn, se) = FP8_O_COLUMN
    return cute.make_layout((n, e, d // 16), stride=(sn, se, 16))


def _asm(word: Int32, body: str, loc=None, ip=None) -> Int32:
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Int32(word).ir_value(loc=loc, ip=ip)],
            body,
            "=r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def e4m3_pair_f16(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """Bytes 0, 1 (high: 2, 3) of `word` as an f16x2 (byte 0 / 2 in the low half)."""
    half = "hi" if high else "lo"
    body = f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; cvt.rn.f16x2.e4m3x2 $0, {half}; }}"
    return _asm(word, body, loc, ip)


@dsl_user_op
def e4m3_pair_bf16(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """Bytes 0, 1 (high: 2, 3) of `word` as a bf16x2: each byte sign-extended to 16 bits,
    shifted so that its exponent and mantissa sit in the bf16's (bias 120), masked, times
    2^120 (exact; e4m3 subnormals pass through bf16 subnormals)."""
    body = (
        "{ .reg .b32 t, s; "
        f"prmt.b32 t, $1, 0, {BF16_SELECT[int(high)]:#x}; shl.b32 t, t, {BF16_SHIFT}; "
        f"and.b32 t, t, {BF16_MASK:#x}; mov.b32 s, {BF16_E4M3_BIAS:#x}; mul.rn.bf16x2 $0, t, s; }}"
    )
    return _asm(word, body, loc, ip)


@dsl_user_op
def e4m3_keys_f16(word: Int32, odd: bool, *, loc=None, ip=None) -> Int32:
    """Bytes 0, 2 (odd: 1, 3) of `word` as an f16x2 (byte 0 / 1 in the low half): a
    transposed-ldmatrix word of V holds two keys x two dims, the MMA wants a dim's two keys."""
    half = "hi" if odd else "lo"
    body = (
        "{ .reg .b32 t; .reg .b16 lo, hi; "
        f"prmt.b32 t, $1, 0, {KEY_PAIRS:#x}; mov.b32 {{lo, hi}}, t; "
        f"cvt.rn.f16x2.e4m3x2 $0, {half}; }}"
    )
    return _asm(word, body, loc, ip)


@cute.jit
def widen_k(virtual: cute.Tensor, real: cute.Tensor):
    """K's B operand: the virtual tile's fragment ((2, 2), N blocks, D / 32 steps), each
    register a word of one key's 16-byte segment 2 * step + reg, into the real fragment
    ((2, 2), N blocks, D / 16 steps) of q's dtype (segment s = K step s)."""
    words = cute.recast_tensor(virtual, Int32)
    out = cute.recast_tensor(real, Int32)
    bf16 = const_expr(real.element_type is cutlass.BFloat16)
    blocks = cute.size(virtual, mode=[1])
    for kv in cutlass.range_constexpr(cute.size(virtual, mode=[2])):
        for nb in cutlass.range_constexpr(blocks):
            for h in cutlass.range_constexpr(2):
                w = words[h + 2 * nb + 2 * blocks * kv]
                s = 2 * kv + h
                for hi in cutlass.range_constexpr(2):
                    if const_expr(bf16):
                        out[hi + 2 * nb + 2 * blocks * s] = e4m3_pair_bf16(w, hi == 1)
                    else:
                        out[hi + 2 * nb + 2 * blocks * s] = e4m3_pair_f16(w, hi == 1)


@cute.jit
def widen_v(virtual: cute.Tensor, real: cute.Tensor):
    """V's B operand: the virtual (D / 2, keys) tile's fragment ((2, 2), D / 16 blocks, 1),
    register kh of block s a word of keys 8kh + 2t, + 1 and dims 16s + 2g, + 1, into the f16
    fragment ((2, 2), D / 8 blocks, 1): block 2s + e takes dims 16s + 2n + e."""
    words = cute.recast_tensor(virtual, Int32)
    out = cute.recast_tensor(real, Int32)
    for s in cutlass.range_constexpr(cute.size(virtual, mode=[1])):
        for kh in cutlass.range_constexpr(2):
            w = words[kh + 2 * s]
            for e in cutlass.range_constexpr(2):
                out[kh + 2 * (2 * s + e)] = e4m3_keys_f16(w, e == 1)
