"""The bench's timing methods over `forgekernel.runtime.timing`, shared by the harness and the
sidecar child (`forgekernel.bench.sidecar`), so that a comparator timed in a process of its own
is timed exactly as one timed beside ours. Imports torch and the timer only: the sidecar child
must stay free of the CuTe DSL.

"graph": `time_interleaved` over every input set (CUDA-graph replays rotating past L2; the
warm-up touches every set, so that what a candidate caches per set on its first call never runs
in a timed region). "eager": `time_eager_flushed` on the first set alone (eager launches, L2
flushed before each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from forgekernel.runtime import timing

TIMING_METHODS = ("graph", "eager")


def time_method(
    method: str,
    fns: dict[str, Callable[..., Any]],
    sets: Sequence[Sequence[Any]],
    *,
    warmup: int,
    reps: int,
    eager_reps: int,
    timers: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
) -> dict[str, timing.Samples]:
    """Samples of every candidate fn(*set) with one of TIMING_METHODS. timers: (graph, eager)
    in place of (time_interleaved, time_eager_flushed): the harness passes its own names, which
    its CPU tests replace."""
    graph, eager = timers or (timing.time_interleaved, timing.time_eager_flushed)
    if method == "graph":
        return graph(fns, rotate=sets, warmup=max(warmup, len(sets)), reps=reps)
    if method == "eager":
        return eager(fns, rotate=sets[:1], warmup=warmup, reps=eager_reps)
    raise ValueError(f"timing method {method!r}: one of {TIMING_METHODS}")
