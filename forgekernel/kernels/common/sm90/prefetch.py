"""Bulk L2 prefetch as inline PTX (the DSL does not wrap `cp.async.bulk.prefetch.L2`).

Its own module rather than ptx.py: a kernel's sources are its import closure (the compile
cache's and the ledgers' key), so a toolkit addition that only one kernel uses lives where only
that kernel's key moves."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_prefetch_l2(src_gmem, nbytes: int, *, loc=None, ip=None) -> None:
    """cp.async.bulk.prefetch.L2 of `nbytes` (multiple of 16) from global: a hint, nothing to
    wait on (fire and forget; the later loads of those bytes hit L2)."""
    llvm.inline_asm(
        None,
        [src_gmem.llvm_ptr, Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
