"""Scratch buffers a launcher reuses across calls: what a call needs only while its kernels run
(the split-KV partial outputs and LSEs that a combine reduces, an LSE the caller does not take),
kept per (name, dtype, device, stream) instead of a `torch.empty` per call (issue 17: a CUDA
allocation is ~2-4 us of host time on the H200's host, two per split-KV decode).

Why reuse is safe: a buffer is handed out only to calls on the stream it was made for, and the
work of one stream runs in issue order, so call 2's kernels overwrite call 1's scratch only
after call 1's kernels read it; this is the guarantee torch's caching allocator gives a block
freed and reallocated on one stream. Streams never share a buffer (two decodes running at once
on two streams get two). A buffer that grows is dropped, never written again by this module:
the allocator reuses its memory on the same stream only, in order.

CUDA-graph capture: nothing cached is handed out while the current stream captures; the call
gets a fresh `torch.empty`, which comes from the graph's private pool, so the graph owns its
scratch (a replay on any stream cannot race an eager call on the cached buffer), and nothing
made during a capture is cached for eager calls.

Never hand a scratch buffer back to the caller: the next call on the stream overwrites it.

`flags`: int32 arrival counters that the kernels using them leave zero when they finish (the
stream-K GEMMs' and convolutions' tile flags): zeroed once per (name, device, stream) and reused
by every later launch on that stream. Inside a capture they are the capture's own (keyed by its
id, so the graph zero-fills them once per replay, not once per captured call, and never shares
them with eager calls); the capture's entries stay cached (a few hundred bytes each)."""

from __future__ import annotations

from typing import Protocol

import torch

# (name, dtype, device, stream) -> (flat buffer, {shape or shapes: its views of the buffer})
_SLOTS: dict[tuple, tuple[torch.Tensor, dict[tuple, tuple[torch.Tensor, ...]]]] = {}
_FLAGS: dict[tuple, torch.Tensor] = {}  # (name, device, stream[, capture id]) -> zero int32
MAX_SLOTS = 256  # then every buffer is dropped (a process cycling through streams)
MAX_SHAPES = 64  # views per buffer (a server's changing batch sizes), then its views rebuilt
ALIGN_BYTES = 16  # where each of `scratches`' tensors starts (TMA and bulk copies need it)


def scratch(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A (shape, dtype) tensor on `device` for the current stream's next kernels, contents
    undefined; the same memory again on the next call with this name on this stream. `name`
    keeps a call's buffers apart (two of one shape and dtype must not alias). Inside a
    CUDA-graph capture: a fresh tensor of the graph's pool. Call it with `device` current (the
    launchers do, under `on_device`): the capture check reads the current device's stream."""
    stream = current_stream(device)
    if stream is None:
        return torch.empty(shape, dtype=dtype, device=device)
    key = (name, dtype, device, stream)
    slot = _SLOTS.get(key)
    if slot is not None:
        views = slot[1].get(shape)
        if views is not None:
            return views[0]
    return _carve(key, slot, shape, (shape,), dtype, device)[0]


def scratches(
    name: str, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """`scratch` for the tensors of one launch at once (a split-KV pass's partial outputs and
    LSEs): views of one buffer, one after another, each contiguous from a 16-byte boundary; one
    stream query and one lookup for them all (one of each per tensor before: 0.6 us a launch of
    two on the CPU)."""
    stream = current_stream(device)
    if stream is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
    key = (name, dtype, device, stream)
    slot = _SLOTS.get(key)
    if slot is not None:
        views = slot[1].get(shapes)
        if views is not None:
            return views
    return _carve(key, slot, shapes, shapes, dtype, device)


def scratch_views(name: str, layout: Layout, dtype: torch.dtype, device: torch.device) -> tuple:
    """`layout.views(buffer)` of a (layout.numel,) `scratch` buffer, made once per buffer and
    layout and kept with the buffer (dropped with it): a launcher's several workspaces carved
    out of one buffer cost a dict lookup per call instead of a view each (~0.7-1 us apiece on
    the CPU). Same rules as `scratch` (while the stream captures: views of a fresh tensor)."""
    stream = current_stream(device)
    if stream is None:
        return layout.views(torch.empty(layout.numel, dtype=dtype, device=device))
    key = (name, dtype, device, stream)
    slot = _SLOTS.get(key)
    if slot is not None:
        views = slot[1].get(layout)
        if views is not None:
            return views
    flat = scratch(name, (layout.numel,), dtype, device)  # grows the slot's buffer if short
    cached = _SLOTS[key][1]
    if len(cached) >= MAX_SHAPES:
        cached.clear()
    views = cached[layout] = layout.views(flat)
    return views


class Layout(Protocol):
    """What `scratch_views` carves out of a buffer: its size and its views (hashable: the
    views are cached per layout)."""

    numel: int

    def views(self, buffer: torch.Tensor) -> tuple: ...


def current_stream(device: torch.device) -> int | None:
    """The key of the stream `device`'s next kernels run on: its raw handle (0 off CUDA), None
    while that stream captures a CUDA graph (the caller must not share memory then)."""
    if device.type != "cuda":
        return 0
    if torch._C._cuda_isCurrentStreamCapturing():
        return None
    # the raw handle: torch.cuda.current_stream builds a Stream object (microseconds); a device
    # without an index ("cuda") is the current one, as torch reads it
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch._C._cuda_getCurrentRawStream(index)


def _carve(key, slot, entry, shapes, dtype, device) -> tuple[torch.Tensor, ...]:
    """The slow path: the slot's buffer, grown when it is short, viewed as `shapes` one after
    another (each from an ALIGN_BYTES boundary), the views kept under `entry`."""
    align = max(1, ALIGN_BYTES // dtype.itemsize)
    spans, end = [], 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= s
        spans.append((end, numel))
        end += -(-numel // align) * align
    if slot is None or slot[0].numel() < end:
        if len(_SLOTS) >= MAX_SLOTS:
            _SLOTS.clear()
        size = end if slot is None else max(end, slot[0].numel())
        slot = _SLOTS[key] = (torch.empty(size, dtype=dtype, device=device), {})
    flat, views = slot
    if len(views) >= MAX_SHAPES:
        views.clear()
    carved = tuple(flat[at : at + n].view(shape) for (at, n), shape in zip(spans, shapes))
    views[entry] = carved
    return carved


def flags(name: str, numel: int, device: torch.device) -> torch.Tensor:
    """At least `numel` int32 zeros for the current stream's next kernel, which must leave them
    zero; the same tensor again on the next call with this name on this stream (grown: a new
    one, the old one's memory back to the allocator in stream order). Call it with `device`
    current, as `scratch`."""
    if device.type != "cuda":
        key = (name, device, 0)
    else:
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        key = (name, device, stream)
        if torch._C._cuda_isCurrentStreamCapturing():
            key = (*key, _capture_id(stream))
    buf = _FLAGS.get(key)
    if buf is None or buf.numel() < numel:
        if len(_FLAGS) >= MAX_SLOTS and key not in _FLAGS:
            _FLAGS.clear()
        size = max(numel, 256 if buf is None else buf.numel())
        buf = _FLAGS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def _capture_id(stream: int) -> int:
    """The id of the capture under way on `stream` (unique in the process)."""
    from cuda.bindings import runtime

    err, _, capture = runtime.cudaStreamGetCaptureInfo(stream)[:3]
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"cudaStreamGetCaptureInfo: {err}")
    return int(capture)


def release() -> None:
    """Drop every cached buffer (their memory goes back to torch's caching allocator)."""
    _SLOTS.clear()
    _FLAGS.clear()
