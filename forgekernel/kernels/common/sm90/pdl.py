"""Programmatic dependent launch (PDL), the device side: the one convention every kernel launched
with `use_pdl=True` keeps (the host side, the FORGEKERNEL_PDL switch and the compile key:
`runtime/pdl.py`).

A kernel launched with `.launch(..., use_pdl=True)` may start while the kernel before it in the
stream (its primary) still runs: its CTAs are scheduled once every CTA of the primary has executed
`griddepcontrol.launch_dependents` or exited. `griddepcontrol.wait` then blocks until the primary
grid has completed and its memory is visible (PTX ISA, griddepcontrol). The contract of a kernel
built with `pdl` on:

1. Every thread of every CTA executes `wait` on every path, before its first global read of any
   buffer an earlier kernel in the stream may write (inputs included: the previous op's output
   may be our q, its scratch our partials) and before its first global write of any buffer an
   earlier kernel may still read (a previous call's combine reads the partials the pass writes).
   Only work that touches no global tensor goes before it: shared-memory allocation, mbarrier
   init, TMA descriptor prefetch (the descriptors are kernel parameters), index arithmetic.
   A CTA that leaves (worklist items past the end) leaves after it: a grid completes only after
   its own primary then, so completion stays transitive down a chain of PDL launches (a grid
   whose CTAs never wait could complete before its primary, and its dependent's wait would not
   cover the kernel two launches back).
2. `launch_dependents` is a scheduling hint only (no memory effect, no ordering): the dependent's
   wait still waits for this grid's completion. A primary that never calls it triggers at its
   exit. Called at the top of a pass (after its `wait`): the dependent cannot start before every
   CTA of the pass has executed it, i.e. before the pass's last wave is resident, so the
   dependent's CTAs take only SM slots the pass no longer needs and block in their `wait`
   without issuing. A CTA's first call counts (later ones, by any thread of it, do nothing),
   so one role may issue it alone: the GEMM's and the convolutions' opt-in late trigger
   (kernels/gemm/dense/sm90/kernel.py `trigger`) is their consumer warpgroups' after their
   last mainloop.
3. Both compile away with `on` False (the compile key's pdl "off": `runtime/pdl.py`): that build
   is the kernel as it was before PDL, launched without the attribute.

Under CUDA-graph stream capture a PDL launch becomes a programmatic dependency edge of the graph
(CUDA 12.3+), so graphs replay it the same way."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import const_expr


def wait(on: bool) -> None:
    """`griddepcontrol.wait` where the kernel is built for PDL (`on`); nothing otherwise."""
    if const_expr(on):
        cute.arch.griddepcontrol_wait()


def launch_dependents(on: bool) -> None:
    """`griddepcontrol.launch_dependents` where the kernel is built for PDL (`on`)."""
    if const_expr(on):
        cute.arch.griddepcontrol_launch_dependents()
