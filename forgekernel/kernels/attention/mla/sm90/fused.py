"""The fused DSA prefill's epilogue arithmetic (decode.py's `fused` form, issue 22): the sink
weight, the UE8M0 group scale and the e4m3 pair cast, each the instruction sequence whose
torch model is `reference.dsa` (`quantize_fp8_groups`): bit for bit for the scale and the cast.

The scale of a group: s = max(amax, 1e-4) / 448 (fp32 max, div.rn: the reference's clamp and
division, correctly rounded), rounded up to a power of two by its bits, (b + 0x7FFFFF) &
0x7F800000: a power of two (mantissa 0) stays, anything else goes to the next exponent, the
reference's frexp rule (s >= 1e-4 / 448 is normal). Its inverse is exact, (254 << 23) - b, so
x * (1 / s) is x / s bit for bit. The cast: cvt.rn.satfinite.e4m3x2.f32, round to nearest even
with out-of-range values saturated to +-448 (the reference's clamp, then its RNE cast; NaN stays
NaN). A NaN amax takes the floor here (PTX max drops NaN) where the reference's clamp keeps it:
outside the contract (a NaN in out)."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from forgekernel.kernels.common.sm90.constants import LOG2E

FP8_GROUP = 32  # output channels per scale
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4  # reference.dsa FP8_AMAX_FLOOR
ROPE_OUT_FIRST = 512 - 64  # the output's RoPE columns: its last 64 of 512
_FLOOR_BITS = 0x38D1B717  # fp32(1e-4)
_E4M3_MAX_BITS = 0x43E00000  # 448.0


def _asm(ret, args, body: str, constraints: str, loc=None, ip=None):
    return llvm.inline_asm(
        ret, [a.ir_value(loc=loc, ip=ip) for a in args], body, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


@dsl_user_op
def ue8m0_scale(amax: Float32, *, loc=None, ip=None) -> Float32:
    """max(amax, 1e-4) / 448 rounded up to a power of two (module docstring)."""
    body = (
        "{ .reg .f32 t; .reg .b32 b; "
        f"max.f32 t, $1, 0f{_FLOOR_BITS:08X}; div.rn.f32 t, t, 0f{_E4M3_MAX_BITS:08X}; "
        "mov.b32 b, t; add.s32 b, b, 0x7FFFFF; and.b32 b, b, 0x7F800000; mov.b32 $0, b; }"
    )
    return Float32(_asm(T.f32(), [Float32(amax)], body, "=f,f", loc, ip))


@dsl_user_op
def pow2_inverse(scale: Float32, *, loc=None, ip=None) -> Float32:
    """1 / scale, exact for a normal power of two: its exponent field negated."""
    body = "{ .reg .b32 b; mov.b32 b, $1; sub.s32 b, 0x7F000000, b; mov.b32 $0, b; }"
    return Float32(_asm(T.f32(), [Float32(scale)], body, "=f,f", loc, ip))


@dsl_user_op
def e4m3x2(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Int32:
    """(lo, hi) cast to e4m3 (RNE, saturated to +-448) in the low 16 bits: lo the first byte
    (the lower column in memory)."""
    body = "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $2, $1; cvt.u32.u16 $0, h; }"
    return Int32(_asm(T.i32(), [Float32(lo), Float32(hi)], body, "=r,f,f", loc, ip))


def sink_weight(lse_log2: Float32, sink: Float32) -> Float32:
    """sigmoid(lse - sink) from the log2 LSE (a row that saw a key): exp(lse) / (exp(lse) +
    exp(sink)); 1 for a -inf sink, 0 for +inf."""
    return 1.0 / (1.0 + cute.math.exp2(sink * LOG2E - lse_log2, fastmath=True))
