"""Values the compiler may not see through (inline PTX, volatile): a comparison against them is
not folded at compile time. (Its own module: ptx.py is imported by most kernels, whose source
hashes, and so their GPU evidence, a change there would reset.)"""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque_i32(value, *, loc=None, ip=None) -> Int32:
    """`value` through a volatile register move. A constant row bound below 9 lets the compiler
    prove half of a 64-row WGMMA accumulator's registers dead (rows r + 8 of every thread never
    stored); ptxas then serializes every WGMMA of the kernel."""
    v = llvm.inline_asm(
        T.i32(),
        [Int32(value).ir_value(loc=loc, ip=ip)],
        "mov.b32 $0, $1;",
        "=r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)
