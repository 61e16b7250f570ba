"""The one timing function: device time per launch, from pipelined back-to-back launches.
Shared by `forgekernel bench` and the opt-in autotune (`forgekernel.tune_gemm`), so it lives
below both.

Each candidate's launches are captured N at a time into a CUDA graph, launch i using input set
i % len(rotate), and the graph's replays are timed with CUDA events: one sample = replay time
/ N. Where capture fails (a launch that syncs, or launches off the current stream) the
candidate falls back to event-timed bursts of N eager launches; `Samples.method` says which.
Candidates timed together are interleaved replay by replay, in alternating order, so clock and
thermal drift hit all of them alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

DEFAULT_L2_BYTES = 60 * 2**20
ArgSet = Sequence[Any]


class Samples(list):
    """Per-launch milliseconds, one per timed replay or burst, and how they were measured.

    `rerun()` issues the timed work once more (the graph replay or the burst), so a caller can
    check that what was timed really wrote its outputs.
    """

    def __init__(
        self,
        values: Sequence[float] = (),
        *,
        method: str = "",
        launches: int = 0,
        note: str = "",
        rerun: Callable[[], None] | None = None,
    ):
        super().__init__(values)
        self.method, self.launches, self.note = method, launches, note
        self.rerun = rerun


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def l2_bytes() -> int:
    """L2 size of the current CUDA device (60 MB when it cannot be read)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        size = getattr(props, "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def rotation_sets(
    bytes_per_set: float, *, l2: int | None = None, factor: float = 4.0, cap: int = 64
) -> int:
    """Input sets needed so that one pass over them touches `factor` times the L2 size."""
    n = math.ceil(factor * (l2 or l2_bytes()) / max(bytes_per_set, 1.0))
    return max(1, min(cap, n))


def _release_default_generator() -> None:
    """Undo what a failed capture leaves behind in the default CUDA generator.

    torch ends the generator's capture mode only after a successful cudaStreamEndCapture; after a
    failed one every later torch.randn on the device raises "Offset increment outside graph
    capture" (seen with torch 2.11 on the H200). A cloned state keeps seed and offset.
    """
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


class _Candidate:
    """One callable prepared for timing: warmed up, then captured into a graph if possible."""

    def __init__(self, fn: Callable[..., Any], rotate: Sequence[ArgSet]):
        self.fn, self.rotate = fn, rotate
        self.launches, self.graph = len(rotate), None
        self.method, self.note = "event-burst", ""
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def burst(self) -> None:
        for i in range(self.launches):
            self.fn(*self.rotate[i % len(self.rotate)])

    def timed(self, launch: Callable[[], None]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        return start, end

    def prepare(self, warmup: int, target_ms: float, max_launches: int) -> None:
        for i in range(warmup):
            self.fn(*self.rotate[i % len(self.rotate)])
        self.launches = max(3, len(self.rotate))
        start, end = self.timed(self.burst)
        end.synchronize()
        eager_ms = start.elapsed_time(end) / self.launches
        n = math.ceil(target_ms / max(eager_ms, 1e-4))
        n = max(1, min(max_launches, n))
        self.launches = math.ceil(n / len(self.rotate)) * len(self.rotate)
        self.capture(eager_ms)

    def capture(self, eager_ms: float) -> None:
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin()
                try:
                    self.burst()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()  # the first replay uploads the graph
            start, end = self.timed(graph.replay)
            end.synchronize()
        except Exception as e:  # any capture failure means: time eager bursts instead
            _release_default_generator()
            torch.cuda.synchronize()
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.note = f"graph capture failed ({type(e).__name__}: {first_line})"
            return
        graph_ms = start.elapsed_time(end) / self.launches
        # A launch outside the capture stream runs eagerly during capture and leaves the graph
        # without its work; above 0.2 ms per launch, CPU overhead cannot explain a 2x gap.
        if eager_ms > 0.2 and graph_ms < 0.5 * eager_ms:
            self.note = f"graph replay {graph_ms:.4f} ms vs eager {eager_ms:.4f} ms: work missing"
            return
        self.graph, self.method = graph, "cuda-graph"

    def launch(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.burst()

    def record(self) -> None:
        self.events.append(self.timed(self.launch))

    def samples(self) -> Samples:
        ms = [s.elapsed_time(e) / self.launches for s, e in self.events]
        return Samples(
            ms, method=self.method, launches=self.launches, note=self.note, rerun=self.launch
        )


def time_interleaved(
    fns: dict[str, Callable[..., Any]],
    *,
    rotate: Sequence[ArgSet] | None = None,
    warmup: int = 5,
    reps: int = 30,
    target_ms: float = 10.0,
    max_launches: int = 256,
    preroll: bool = False,
) -> dict[str, Samples]:
    """Per-launch ms samples for each candidate, timed round by round in alternating order.

    Each candidate is called as fn(*args) for args in `rotate` (all the same input sets);
    one sample is the mean over a graph replay (or burst) of about `target_ms`. `preroll`:
    each sample is preceded by one untimed replay of the same candidate, so that it starts in
    that candidate's own steady state (clocks, power) rather than its predecessor's.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA device")
    rotate = list(rotate) if rotate else [()]
    cands = {name: _Candidate(fn, rotate) for name, fn in fns.items()}
    for cand in cands.values():
        cand.prepare(warmup, target_ms, max_launches)
    order = list(cands.values())
    for r in range(reps):
        for cand in order if r % 2 == 0 else reversed(order):
            if preroll:
                cand.launch()
            cand.record()
    torch.cuda.synchronize()
    return {name: cand.samples() for name, cand in cands.items()}


def time_ms(
    fn: Callable[..., Any],
    *,
    rotate: Sequence[ArgSet] | None = None,
    warmup: int = 5,
    reps: int = 30,
    target_ms: float = 10.0,
) -> Samples:
    """Per-launch ms samples of fn(*args), args cycling through `rotate` (None: fn())."""
    return time_interleaved(
        {"fn": fn}, rotate=rotate, warmup=warmup, reps=reps, target_ms=target_ms
    )["fn"]
