"""Distributed shared memory of a thread-block cluster, as inline PTX: the DSL's generic load
takes no shared::cluster address (nvvm.load.ext accepts address spaces 0, 1, 3 only)."""

from __future__ import annotations

from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_peer_i32(smem_ptr, rank, *, loc=None, ip=None) -> Int32:
    """The int32 at `smem_ptr` (this CTA's shared memory) in CTA `rank` of the cluster: mapa
    to the peer's window, then ld.shared::cluster. Order it after a cluster barrier."""
    v = llvm.inline_asm(
        T.i32(),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n .reg .b32 peer;\n mapa.shared::cluster.u32 peer, $1, $2;\n"
        " ld.shared::cluster.b32 $0, [peer];\n}",
        "=r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)
