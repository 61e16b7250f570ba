"""Named barriers in the unaligned form (`barrier.sync` / `barrier.arrive`, no .aligned), for a
barrier whose waiting threads of one phase wait at different instructions: two roles' code
each with its own `bar.sync` of one hand-over (the fused GDN backward's DS_READY: the state
warpgroup arrives, the gradient warpgroup and the finish warps each wait in their own loop).

`bar.sync` is `barrier.sync.aligned`: it promises that a phase's waiters execute the same
instruction. Broken, it works on the hardware (both forms assemble to the same BAR.SYNC), but
ptxas lists only the unaligned form's offsets in the cubin (EIATTR_COOP_GROUP_INSTR_OFFSETS),
and compute-sanitizer's synccheck reports "Barrier error detected. Divergent thread(s) in
block" at the second instruction's waiters and aborts the kernel (H100, 2026-12-06: 160
errors at the fused GDN backward's +0x2fd0, "unspecified launch failure" after). A barrier
whose phases each have one waiting instruction (any number of arrivals elsewhere) keeps
barriers.py's `named_barrier`. The DSL's own `NamedBarrier.wait_unaligned` emits the aligned
`bar.sync` (nvidia-cutlass-dsl 4.8.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.pipeline as pipeline
from cutlass import Int32
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op


@dataclass(frozen=True)
class UnalignedBarrier(pipeline.NamedBarrier):
    """`named_barrier`'s object with `arrive` / `arrive_and_wait` in the unaligned form."""

    @dsl_user_op
    def arrive(self, *, loc=None, ip=None) -> None:
        self.arrive_unaligned(loc=loc, ip=ip)

    @dsl_user_op
    def arrive_and_wait(self, *, loc=None, ip=None) -> None:
        nvvm.barrier_cta_sync(
            Int32(self.barrier_id).ir_value(loc=loc, ip=ip),
            thread_count=Int32(self.num_threads).ir_value(loc=loc, ip=ip),
            aligned=False,
            loc=loc,
            ip=ip,
        )


def unaligned_barrier(barrier_id, num_threads) -> UnalignedBarrier:
    """Barrier `barrier_id` (an IntEnum member or an int) over `num_threads` threads, waited at
    more than one instruction a phase (see the module docstring)."""
    return UnalignedBarrier(barrier_id=int(barrier_id), num_threads=num_threads)
