"""One warpgroup's WGMMA over all k-blocks of its operands, committed as one group."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    tA: cute.Tensor,
    tB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wg_wait: cutlass.Constexpr[int],
):
    """acc (+)= A B over all k-blocks of tA / tB, one commit group; then wait until at most
    `wg_wait` groups are in flight (no wait if negative). A fresh MMA atom per call: its
    ACCUMULATE field is set inside the unrolled k loop, which a dynamic caller loop would
    otherwise carry."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)
