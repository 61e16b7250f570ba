"""What every host launcher needs of the device and of its tensors, torch only (no DSL): the
SM count (persistent grids), the dtype names compile keys use, the one TMA-ready path
(inputs TMA can read in place, outputs it can write in place, else compact copies) and the
side streams (`side_by_side`: independent launches at once)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Multiprocessors of the device (132 on H100 SXM and H200, 114 on H100 PCIe): the
    persistent kernels' grid."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dtype_name(dtype: torch.dtype) -> str:
    """The name compile keys use for a 16-bit dtype ("float16", "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def tma_ready(t: torch.Tensor) -> bool:
    """Last dim contiguous, a 16-byte-aligned base and every other stride a 16-byte multiple,
    size-1 dims included (what TMA can address, and what the compiled kernels assume)."""
    # Called on every operand of every launch: one stride() call and a plain loop (a generator
    # over repeated stride() calls cost 0.78 us per tensor on the CPU, this 0.39-0.45).
    *outer, last = t.stride()
    if last != 1 or t.data_ptr() % 16:
        return False
    elems16 = 16 // t.element_size()
    for s in outer:
        if s % elems16:
            return False
    return True


def as_tma_ready(t: torch.Tensor) -> torch.Tensor:
    """An input: `t` itself when TMA can read it in place, the same memory with its size-1
    dims' strides made 16-byte multiples when only those were off, else a compact aligned copy
    (never misread)."""
    if tma_ready(t):
        return t
    restrided = _unit_dims_restrided(t)
    if restrided is not None and tma_ready(restrided):
        return restrided
    return t.clone(memory_format=torch.contiguous_format)


def _unit_dims_restrided(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as a view whose size-1 dims take the stride a compact layout gives them (the next
    inner dim's stride x size): a size-1 dim's stride addresses nothing, but the compiled
    kernels declare every stride a 16-byte multiple (torch leaves e.g. a (K, C, 1, 1) weight,
    channels-last by both definitions, with unit strides there). None when there is no size-1
    dim to fix."""
    sizes, strides = t.shape, list(t.stride())
    if 1 not in sizes[:-1]:
        return None
    inner = 1
    for i in range(t.dim() - 1, -1, -1):
        if sizes[i] == 1:
            strides[i] = inner
        inner = strides[i] * sizes[i]
    return t.as_strided(sizes, strides, t.storage_offset())


def tma_target(t: torch.Tensor, *, contiguous: bool = False, keep: bool = False) -> torch.Tensor:
    """An output: `t` itself when the kernel can write it in place (TMA-ready, and contiguous
    when asked), else a compact buffer whose result the launcher copies into `t`; keep: the
    buffer starts as a copy of `t` (kernels that leave some rows alone, as the masked and
    grouped GEMMs' padding rows, give them back unchanged)."""
    if tma_ready(t) and (not contiguous or t.is_contiguous()):
        return t
    if keep:
        return t.clone(memory_format=torch.contiguous_format)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def copy_back(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> None:
    """What the kernel wrote into `tma_target` buffers, into the caller's outputs."""
    for out, dst in zip(outputs, targets):
        if dst is not out:
            out.copy_(dst)


_CURRENT = contextlib.nullcontext()


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`torch.cuda.device(device)` when it is not the current device already, else a no-op
    context: building, entering and leaving torch's context costs microseconds per launch for
    nothing in the usual one-device process (CPU tensors, index None, get the no-op)."""
    index = device.index
    if index is None or index == torch.cuda.current_device():
        return _CURRENT
    return torch.cuda.device(device)


@functools.cache
def _side_stream(device_index: int, which: int = 0) -> torch.cuda.Stream:
    """The process's side stream `which` on a device (a fixed few: creating a stream a call
    costs microseconds and would leave one per captured graph)."""
    return torch.cuda.Stream(device_index)


def side_by_side(device: torch.device, *launches: Callable[[], Any]) -> tuple:
    """(launches[0](), ..., launches[-1]()): each but the last on a side stream of its own, the
    last on the current one, all at once; off CUDA one after the other. The forks and the joins
    are stream waits (events), so a CUDA-graph capture records every branch (a side stream joins
    the capture at its fork and leaves it at its join) and a custom op may run it under
    torch.compile. The side streams start after everything queued on the current one and the
    current one goes on after all of their work: tensors made before the call are read on the
    side streams and freed after them in stream order; a side launch's tensors, made on its
    stream, are marked as used on the current one (`record_stream`), so that the allocator never
    hands their memory to that stream while the current one still reads them. No launch may
    write what another reads."""
    if device.type != "cuda":
        return tuple(launch() for launch in launches)
    index = torch.cuda.current_device() if device.index is None else device.index
    main = torch.cuda.current_stream(index)
    sides = [_side_stream(index, i) for i in range(len(launches) - 1)]
    results = []
    for side, launch in zip(sides, launches):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            results.append(launch())
    results.append(launches[-1]())
    for side, got in zip(sides, results):
        main.wait_stream(side)
        for t in got if isinstance(got, (tuple, list)) else (got,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(main)
    return tuple(results)
