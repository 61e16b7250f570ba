"""Distributed shared memory of a thread-block cluster, as inline PTX: the DSL's generic load
takes no shared::cluster address (nvvm.load.ext accepts address spaces 0, 1, 3 only), and its
`store_async_dsmem` converts its values as integers (no fp32 payload) and maps both addresses
again at every store."""

from __future__ import annotations

from cutlass import Float32, Int32
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


@dsl_user_op
def peer_address(smem_ptr, rank, *, loc=None, ip=None) -> Int32:
    """`smem_ptr` (this CTA's shared memory) as the shared::cluster address of the same offset
    in CTA `rank` (mapa): a peer's window is contiguous, so offsets add to it."""
    v = llvm.inline_asm(
        T.i32(),
        [smem_ptr.toint(loc=loc, ip=ip).ir_value(), Int32(rank).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(v)


@dsl_user_op
def store_peer_f32x4(addr: Int32, vals, mbar_addr: Int32, *, loc=None, ip=None) -> None:
    """Four fp32 `vals` to the 16-byte aligned shared::cluster address `addr` (`peer_address`),
    st.async: completes 16 bytes of the transaction count of the peer's mbarrier at
    `mbar_addr` (its shared::cluster address), which its waiters armed (expect_tx) and wait
    on, as for a TMA load; nothing to wait for on this side."""
    llvm.inline_asm(
        None,
        [
            Int32(addr).ir_value(loc=loc, ip=ip),
            *(Float32(x).ir_value(loc=loc, ip=ip) for x in vals),
            Int32(mbar_addr).ir_value(loc=loc, ip=ip),
        ],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [$0], {$1, $2, $3, $4}, "
        "[$5];",
        "r,f,f,f,f,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
