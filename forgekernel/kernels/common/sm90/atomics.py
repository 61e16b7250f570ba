"""Global-memory atomics the DSL does not wrap, as inline PTX (the acquire load and release
add of a flag are in `ptx.py`)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def atom_add_acq_rel_gpu(ptr, val, *, loc=None, ip=None) -> Int32:
    """The int at `ptr` before adding `val` to it (acquire-release, GPU scope)."""
    v = llvm.inline_asm(
        T.i32(),
        [ptr.llvm_ptr, Int32(val).ir_value(loc=loc, ip=ip)],
        "atom.add.acq_rel.gpu.global.s32 $0, [$1], $2;",
        "=r,l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)
