"""e2m1 -> e4m3 widening of packed FP4 weights in registers (docs/gemm/NOTES.md "FP4 weights").

Four e2m1 codes (16 bits, the first K element in the low nibble; code = sign << 3 | magnitude
index, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) become one 32-bit register of four e4m3 bytes,
the first in the low byte (a WGMMA A fragment register: four consecutive K values):

    mag  = prmt(t0, t1, x & keep)          the magnitude indices select bytes of a table
                                           (keep = 0x7777; 0 flushes: index 0 is 0x00)
    neg  = prmt(x << 4, x, 0xD9C8)         sign-replicate mode on the bytes whose bit 7 is a
                                           code's sign (x << 4: codes 0 and 2; x: 1 and 3):
                                           0xFF per negative code, 0x00 per positive
    out  = mag | (neg & 0x80808080)        one LOP3

The table (t0 bytes 0..3, t1 bytes 4..7) holds the e4m3 encodings of the eight magnitudes times
2^d, d the sub-block's exponent shift (`fold`): e4m3's exponent field is bits 3..6, so the
shift adds d x 8 to every nonzero byte; for -5 <= d <= 6 no byte leaves [0x08, 0x7C] (no carry,
no borrow, no NaN encoding). A shift below -5 flushes the sub-block to zero: its selector mask
`keep` is 0, so every code selects byte 0 of t0, which is 0x00 whatever the shift (the table's
and the step's byte 0 are 0, and borrows only travel up); the sign stays (-0).
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# e4m3 encodings of the e2m1 magnitudes 0, 0.5, 1, 1.5 (T0) and 2, 3, 4, 6 (T1), low byte first
TABLE_LO = 0x3C383000
TABLE_HI = 0x4C484440
STEP_LO = 0x08080800  # one exponent step on T0's nonzero bytes (its byte 0 is the zero)
STEP_HI = 0x08080808
SHIFT_MIN = -5  # 0.5 x 2^-5 = 2^-6: e4m3's smallest normal
SHIFT_MAX = 6  # 6 x 2^6 = 384 < 448: e4m3's largest finite
HEADROOM = SHIFT_MAX  # the k-tile exponent sits this far below the largest sub-block's


@dsl_user_op
def prmt(a: Int32, b: Int32, sel: Int32, *, loc=None, ip=None) -> Int32:
    """PTX `prmt.b32` (default mode): byte i of the result is byte (sel >> 4i) & 7 of the pair
    {b, a} (a bytes 0..3, b bytes 4..7), or that byte's sign replicated where bit 4i + 3 of
    `sel` is set."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [
                Int32(a).ir_value(loc=loc, ip=ip),
                Int32(b).ir_value(loc=loc, ip=ip),
                Int32(sel).ir_value(loc=loc, ip=ip),
            ],
            "prmt.b32 $0, $1, $2, $3;",
            "=r,r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


KEEP = 0x7777  # the selector mask of a kept sub-block (the magnitude bits of four codes)
# result byte i <- the sign of code i: bytes 0 (x << 4: code 0), 4 (x: code 1), 1 (x << 4:
# code 2), 5 (x: code 3), each selector nibble's bit 3 set (sign-replicate)
SIGN_SELECT = 0xD9C8


# widen8's high half: result byte i <- the sign of code 4 + i: bytes 2 (x << 4: code 4), 6
# (x: code 5), 3 (x << 4: code 6), 7 (x: code 7)
SIGN_SELECT_HI = 0xFBEA
KEEP8 = 0x77777777  # a kept sub-block's selector mask for eight codes (`fold(..., eight=True)`)


def widen4(codes: Int32, table: tuple) -> Int32:
    """Four e2m1 codes (the low 16 bits of `codes`) -> four e4m3 bytes, through `table` =
    (t0, t1, keep) of their sub-block (`fold`)."""
    t0, t1, keep = table
    mag = prmt(t0, t1, codes & keep)
    # no constant operand: PRMT's first source is a register, a constant there is copied into
    # a fresh one per use (16 copies per k-tile)
    neg = prmt(codes << 4, codes, Int32(SIGN_SELECT))
    return mag | (neg & Int32(-0x7F7F7F80))  # 0x80808080 as an int32


def widen8(word: Int32, table: tuple) -> tuple:
    """Eight e2m1 codes (a 32-bit word, the first K element in the low nibble) -> two registers
    of four e4m3 bytes: `widen4` of the low 16 bits, then of the high 16 bits (the same bytes),
    with one selector mask, one shift and one sign source for both; `table` = (t0, t1, keep)
    from `fold(..., eight=True)` (keep covering all eight codes)."""
    t0, t1, keep = table
    sel = word & keep
    up = word << 4
    sign = Int32(-0x7F7F7F80)  # 0x80808080 as an int32
    lo = prmt(t0, t1, sel) | (prmt(up, word, Int32(SIGN_SELECT)) & sign)
    hi = prmt(t0, t1, sel >> 16) | (prmt(up, word, Int32(SIGN_SELECT_HI)) & sign)
    return lo, hi


@dsl_user_op
def as_float(bits: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 whose bit pattern is `bits`."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Int32(bits).ir_value(loc=loc, ip=ip)],
            "mov.b32 $0, $1;",
            "=f,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def fold(word: Int32, eight: bool = False):
    """One weight row's k-tile exponent word (four UE8M0 bytes, sub-block i in byte i) ->
    (the row's fp32 k-tile scale 2^(s - 127), the four sub-blocks' (t0, t1, keep)), with
    s = max(max_i e_i - HEADROOM, 1) and shift e_i - s per sub-block: t = TABLE + (e_i - s) x
    STEP, as (TABLE - s x STEP) + e_i x STEP (one multiply-add per word and sub-block), keep
    KEEP (KEEP8 with `eight`: `widen8`'s) for e_i - s >= SHIFT_MIN, else 0 (flushed)."""
    exps = [(word >> (8 * i)) & 0xFF for i in range(4)]
    top = exps[0]
    for e in exps[1:]:
        top = cutlass.max(top, e)
    s = cutlass.max(top - HEADROOM, 1)
    base_lo = Int32(TABLE_LO) - s * STEP_LO
    base_hi = Int32(TABLE_HI) - s * STEP_HI
    lowest = s + SHIFT_MIN
    kept = KEEP8 if eight else KEEP
    keeps = [cutlass.select_(e >= lowest, Int32(kept), Int32(0)) for e in exps]
    subs = [(base_lo + e * STEP_LO, base_hi + e * STEP_HI, k) for e, k in zip(exps, keeps)]
    return as_float(s << 23), subs
