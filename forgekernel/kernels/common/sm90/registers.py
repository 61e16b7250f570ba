"""setmaxnreg with its direction taken from the launch's register count.

`setmaxnreg.dec` releases registers down to its count and `.inc` takes them from the CTA's pool
up to it; the direction must match the count the warp holds (ptxas' count at the launch, before
any setmaxnreg). A `.dec` to more than the warp holds is an illegal instruction: the fused GDN
backward's `wg_split` keys launch at 128 registers and warpgroup 3 ran `.dec 136`
(USETMAXREG.DEALLOC.CTAPOOL 0x88), CUDA error 715 at that instruction on the H100, by warpgroup
3's threads (compute-sanitizer, 2026-12-07; docs/linear_attention/NOTES.md "next/ws-illegal").
"""

from __future__ import annotations

import cutlass.cute as cute


def set_max_registers(count: int, launch: int) -> None:
    """The executing warpgroup's registers a thread set to `count` from `launch` (the kernel's
    count at the launch): setmaxnreg.inc above it, .dec below it, nothing at it. Every warp of
    the warpgroup must call it (PTX)."""
    if count > launch:
        cute.arch.setmaxregister_increase(count)
    elif count < launch:
        cute.arch.setmaxregister_decrease(count)
