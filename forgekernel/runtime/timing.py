"""The one timing function: device time per launch, from pipelined back-to-back launches.
Shared by `forgekernel bench` and the opt-in autotune (`forgekernel.tune_gemm`), so it lives
below both.

Each candidate's launches are captured N at a time into a CUDA graph, launch i using input set
i % len(rotate), and the graph's replays are timed with CUDA events: one sample = replay time
/ N. Where capture fails (a launch that syncs, or launches off the current stream) the
candidate falls back to event-timed bursts of N eager launches; `Samples.method` says which.
Candidates timed together are interleaved replay by replay, in alternating order, so clock and
thermal drift hit all of them alike. A replay far faster than the eager burst means launches
escaped the capture (they ran eagerly, off the capture stream) only when that burst was bound by
the device: a call whose host time exceeds its device time (a launcher with many small ops)
makes the burst measure the host, and its replay is rightly faster (what graphs are for).

The second method, `time_eager_flushed`, times what an eager caller's kernel costs on a cold
cache: before each launch a buffer of twice the L2 size is written, so inputs come from HBM,
and each launch is timed alone with CUDA events (one sample = one launch). A GPU-side sleep
before each flush keeps the device ahead of the host, so the sample is device time, not the
host time of the call. `host_us_per_call` measures that host time: a CPU-timed loop of
back-to-back eager calls, synchronized only at its end.

`device_contention` tells whether the device is shared while we time: another context on the
GPU (a process left spinning by a hung kernel, another tenant) gets time slices, so any window
of several ms (a graph replay of ~10 ms, one long kernel) runs at about 1 / (contexts) of the
speed while a short launch mostly fits in one of our slices. That was the H200 run of
2026-12-01 23:00 (call 4, after mla_decode's bench hung): every suite's graph replays took
~2x its eager launches, ours and cuDNN's alike, and every kernel over ~4 ms took 2.0x its time
of the 20:35 run in both methods (gemm_fp8 16384x7168x18432: 4.51 -> 9.02 ms). The probe times
one compute-bound matmul alone and in a back-to-back burst of ~`burst_ms`: alone the device
needs no less time per launch than in the burst, so a burst much slower per launch means lost
slices.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import time
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


def work_missing(eager_ms: float, host_ms: float, graph_ms: float) -> bool:
    """Whether a graph replay of `graph_ms` per launch, against an eager burst of `eager_ms`
    per launch (CUDA events) whose host issued each launch in `host_ms`, means that launches
    escaped the capture (ran eagerly off the capture stream, leaving the graph without their
    work). Only a device-bound burst (the host done well before the device) measured device
    time; above 0.2 ms per launch, launch gaps cannot explain a 2x faster replay. A host-bound
    burst (a launcher of many small ops: the conv data gradient's 0.3-0.9 ms of host time per
    call on the H200, 2026-12-01) says nothing about the device: its replay is rightly faster,
    and the bench checks the replay's outputs itself."""
    device_bound = eager_ms > 1.5 * host_ms
    return device_bound and eager_ms > 0.2 and graph_ms < 0.5 * eager_ms


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
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        self.burst()
        host_ms = (time.perf_counter() - t0) * 1e3 / self.launches
        end.record()
        end.synchronize()
        eager_ms = start.elapsed_time(end) / self.launches
        n = math.ceil(target_ms / max(eager_ms, 1e-4))
        n = max(1, min(max_launches, n))
        self.launches = math.ceil(n / len(self.rotate)) * len(self.rotate)
        self.capture(eager_ms, host_ms)

    def capture(self, eager_ms: float, host_ms: float = 0.0) -> None:
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
        if work_missing(eager_ms, host_ms, graph_ms):
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


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles per ms of `torch.cuda._sleep` (the second of two runs: the first loads
    the module)."""
    cycles, per_ms = 1_000_000, 1.0
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return per_ms


def _host_ms_per_call(fn: Callable[..., Any], rotate: Sequence[ArgSet], calls: int) -> float:
    """Median host time of one call of fn (no synchronize: the enqueue, not the kernel)."""
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(*rotate[i % len(rotate)])
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times)


def _eager_launches(est_ms: float, reps: int, min_reps: int, budget_ms: float) -> int:
    """Launches per candidate: `reps`, fewer for slow cases so one candidate takes about
    `budget_ms`, never fewer than `min_reps`."""
    return max(min(min_reps, reps), min(reps, math.ceil(budget_ms / max(est_ms, 1e-4))))


def time_eager_flushed(
    fns: dict[str, Callable[..., Any]],
    *,
    rotate: Sequence[ArgSet] | None = None,
    warmup: int = 5,
    reps: int = 100,
    min_reps: int = 20,
    budget_ms: float = 300.0,
    flush_bytes: int | None = None,
) -> dict[str, Samples]:
    """Per-launch ms samples of eager launches on a cold L2, candidates interleaved.

    Each sample: a GPU sleep (twice the slowest candidate's host time per call, so the host
    has enqueued the launch before the device reaches it), a write of `flush_bytes` (default
    2 x L2) that evicts the inputs, then one launch between two CUDA events. Launches per
    candidate: `reps`, fewer (not below `min_reps`) where `reps` would exceed `budget_ms`.
    A candidate that synchronizes inside its call defeats the sleep and includes host time.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA device")
    rotate = list(rotate) if rotate else [()]
    flush = torch.empty(flush_bytes or 2 * l2_bytes(), dtype=torch.uint8, device="cuda")
    host_ms = 0.0
    for fn in fns.values():
        for i in range(max(warmup, len(rotate))):
            fn(*rotate[i % len(rotate)])
        host_ms = max(host_ms, _host_ms_per_call(fn, rotate, max(3, warmup)))
    cover_ms = min(2.0 * host_ms + 0.02, 10.0)
    sleep_cycles = int(cover_ms * _sleep_cycles_per_ms())

    def sample(fn: Callable[..., Any], args: ArgSet) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        flush.zero_()
        start.record()
        fn(*args)
        end.record()
        return start, end

    probe = [sample(fn, rotate[0]) for fn in fns.values()]
    torch.cuda.synchronize()
    est_ms = max((s.elapsed_time(e) for s, e in probe), default=0.0)
    n = _eager_launches(est_ms, reps, min_reps, budget_ms)
    events: dict[str, list] = {name: [] for name in fns}
    order = list(fns)
    for r in range(n):
        for name in order if r % 2 == 0 else reversed(order):
            events[name].append(sample(fns[name], rotate[r % len(rotate)]))
    torch.cuda.synchronize()
    note = f"L2 flushed ({flush.numel() >> 20} MiB written before each launch)"

    def rerun(fn: Callable[..., Any]) -> Callable[[], None]:
        def every_set() -> None:
            for args in rotate:
                fn(*args)

        return every_set

    return {
        name: Samples(
            [s.elapsed_time(e) for s, e in events[name]],
            method="eager-flushed",
            launches=1,
            note=note,
            rerun=rerun(fns[name]),
        )
        for name in fns
    }


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostTimes(list):
    """Host microseconds per call, one per round, up to the sync after the last call; `issued`:
    the same rounds up to the return of the last call, before that sync."""

    def __init__(self, values: Sequence[float] = (), issued: Sequence[float] = ()):
        super().__init__(values)
        self.issued = list(issued)

    def device_bound(self, slack: float = 1.2) -> bool:
        """The final sync waited for the device: the loop measured device time, not host
        time (the launch queue holds the 200 calls, so `issued` stays host time)."""
        return median(self) > slack * median(self.issued) + 2.0


def host_us_per_call(
    fns: dict[str, Callable[..., Any]],
    *,
    args: ArgSet = (),
    calls: int = 200,
    warmup: int = 20,
    rounds: int = 5,
    sync: Callable[[], None] = _synchronize,
) -> dict[str, HostTimes]:
    """Host microseconds per eager call of each candidate, one figure per round.

    A round: `sync()`, then `calls` back-to-back calls fn(*args) timed with time.perf_counter
    up to a `sync()` after the last. On a problem tiny enough that the device finishes each
    launch before the host has issued the next, the figure is the call's host time
    (validation, dispatch, launch); `HostTimes.device_bound` says when it was not. Rounds
    interleave the candidates in alternating order.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn(*args)
    sync()
    totals: dict[str, list[float]] = {name: [] for name in fns}
    issued: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            fn = fns[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            issued[name].append((t1 - t0) / calls * 1e6)
            totals[name].append((t2 - t0) / calls * 1e6)
    return {name: HostTimes(totals[name], issued[name]) for name in fns}


CONTENDED_RATIO = 1.4  # burst time per launch / alone time per launch above which time was lost


def contended(alone_ms: float, burst_ms: float, ratio: float = CONTENDED_RATIO) -> bool:
    """Whether a back-to-back burst taking `burst_ms` per launch, against `alone_ms` for the same
    launch timed alone, lost device time to another context: a burst only removes launch gaps
    and warms caches, so per launch it is never much slower on a device of our own."""
    return alone_ms > 0 and burst_ms > ratio * alone_ms


def other_compute_pids(smi_csv: str, own_pid: int) -> list[int]:
    """PIDs in `nvidia-smi --query-compute-apps=pid --format=csv,noheader` output other than
    ours (blank lines and non-numeric entries, e.g. "[N/A]" in a container, skipped)."""
    pids = (line.strip() for line in smi_csv.splitlines())
    return [int(p) for p in pids if p.isdigit() and int(p) != own_pid]


def _other_compute_processes() -> list[int] | None:
    """Other processes with a context on the GPUs (None where nvidia-smi cannot say)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return other_compute_pids(out.stdout, os.getpid())


def device_contention(*, n: int = 4096, alone: int = 9, burst_ms: float = 30.0) -> dict[str, Any]:
    """Probe whether the current device is shared: an n x n x n bf16 matmul timed alone (median
    of `alone` launches, each after a sync) and in a burst of about `burst_ms`. Returns
    {"alone_ms", "burst_ms", "ratio", "contended", "other_pids"} (other_pids: None where
    nvidia-smi cannot list them; a container may list none even when shared: the ratio is the
    verdict)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the contention probe needs a CUDA device")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    times = []
    for _ in range(alone):
        torch.cuda.synchronize()
        times.append(time_one(lambda: torch.mm(a, b, out=c)))
    alone_ms = median(times)
    launches = max(3, math.ceil(burst_ms / max(alone_ms, 1e-3)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        torch.mm(a, b, out=c)
    end.record()
    end.synchronize()
    per_launch = start.elapsed_time(end) / launches
    return {
        "alone_ms": round(alone_ms, 4),
        "burst_ms": round(per_launch, 4),
        "ratio": round(per_launch / max(alone_ms, 1e-6), 3),
        "contended": contended(alone_ms, per_launch),
        "other_pids": _other_compute_processes(),
    }


def time_one(launch: Callable[[], Any]) -> float:
    """Milliseconds of one launch between two CUDA events (synchronized)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
