"""fla's chunked varlen ops (`chunk_gated_delta_rule`, `chunk_kda`, their backwards) as
comparators that the bench's graph timing can capture, or else fall back from cleanly.

fla 0.6.0 turns cu_seqlens into chunk tables (`prepare_chunk_indices`, `prepare_chunk_offsets`,
`prepare_lens`) memoized by the identity of cu_seqlens (`fla.utils.tensor_cache`: the last
FLA_TENSOR_CACHE_SIZE = 4 argument tuples, first in first out). A miss reads the lengths on the
host (`repeat_interleave` sized by a device sum), which a capturing stream rejects. The bench
rotates up to 64 input sets, each with its own cu_seqlens: with more than 4 every call missed.
Under the graph timing's capture the miss failed the capture after fla had memoized
`prepare_lens` (the offsets' diff) computed inside it, a tensor whose kernel never ran; every
later call read those lengths and fla's chunk kernels faulted (kda_prefill 1x2048, 5 input
sets, H200 2026-12-02: an illegal memory access in stage graph, raised at a Triton launch).

Here every input set with the same offsets hands fla one shared cu_seqlens tensor (as a model's
layers share one), picked on the set's first call, which is eager (the bench calls every
candidate on every set before it times anything). After that fla's tables hit on every call and
its whole chunked pass is captured, its Triton autotuning done by the eager calls on the same
shapes: what the graph times is fla's kernels, the tables made once, as in a model's layers
after the first. A call while capturing on a cu_seqlens other than the one of fla's last eager
call (its tables are not known to be memoized) raises before fla runs: the capture then fails
cleanly with nothing memoized in it, and the bench times fla's eager launches instead (as it
does for the backward suites' fla, whose autograd backward is never captured: `call`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from forgekernel.bench.suite import Inputs
from forgekernel.ops._dispatch import capturing

SET_KEY = "fla_cu_seqlens"  # where an input set keeps its shared offsets
_shared: dict[tuple, torch.Tensor] = {}
_last_eager: list[torch.Tensor | None] = [None]  # cu_seqlens of fla's last eager call


def shared_offsets(inputs: Inputs, key: str = "cu_seqlens_long") -> torch.Tensor:
    """The one cu_seqlens tensor of every input set with the offsets of `inputs[key]`, kept in
    the set (SET_KEY) on its first call; that call must not be under capture (it reads them)."""
    if SET_KEY not in inputs:
        cu = inputs[key]
        if capturing(cu):
            raise RuntimeError("fla comparator: an input set's first call is under capture")
        inputs[SET_KEY] = _shared.setdefault((str(cu.device), tuple(cu.tolist())), cu)
    return inputs[SET_KEY]


def call(fn: Callable[..., Any], offsets: torch.Tensor, /, *args: Any, capturable: bool = True,
         **kwargs: Any) -> Any:  # fmt: skip
    """fn(*args, **kwargs), an fla call on the cu_seqlens `offsets` (`shared_offsets`): under
    capture only where `capturable` and fla's last eager call had the same offsets (its tables
    memoized), else a RuntimeError before fla runs. capturable False: a backward through
    autograd, whose ops run on the stream of their recorded forward (torch's stream semantics),
    not on the capturing one."""
    if capturing(offsets):
        if not capturable:
            raise RuntimeError(
                "fla comparator: autograd runs fla's backward on its forward's stream, not on "
                "the capturing stream"
            )
        if _last_eager[0] is not offsets:
            raise RuntimeError(
                "fla comparator under CUDA-graph capture on offsets its last eager call did not "
                "have: its chunk tables would be rebuilt, reading the lengths on the host"
            )
        return fn(*args, **kwargs)
    result = fn(*args, **kwargs)
    _last_eager[0] = offsets
    return result
