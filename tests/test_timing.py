from __future__ import annotations

import time

import pytest
import torch

from forgekernel.runtime import timing


def test_rotation_sets():
    assert timing.rotation_sets(1e9, l2=50e6) == 1
    assert timing.rotation_sets(40e6, l2=50e6) == 5  # 4 x L2 / 40 MB
    assert timing.rotation_sets(10.0, l2=50e6) == 64  # capped


def test_median():
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    assert timing.median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_eager_launches_shrink_on_slow_cases():
    assert timing._eager_launches(0.01, reps=100, min_reps=20, budget_ms=300.0) == 100
    assert timing._eager_launches(10.0, reps=100, min_reps=20, budget_ms=300.0) == 30
    assert timing._eager_launches(100.0, reps=100, min_reps=20, budget_ms=300.0) == 20
    assert timing._eager_launches(100.0, reps=5, min_reps=20, budget_ms=300.0) == 5


def test_work_missing_only_when_the_eager_burst_was_device_bound():
    """The H200 run of 2026-12-01 rejected every small conv data gradient's graph: its eager
    bursts measured 0.3-0.9 ms of host time per call against 0.01-0.1 ms replays. A host-bound
    burst says nothing about the device; a device-bound one does."""
    # conv_dgrad n32-c64-56x56-k64-1x1: host 0.40 ms per call, events 0.40, replay 0.0125
    assert not timing.work_missing(eager_ms=0.4025, host_ms=0.40, graph_ms=0.0125)
    # a device-bound burst (host issued in 0.02 ms) whose replay is 4x faster: work escaped
    assert timing.work_missing(eager_ms=0.8, host_ms=0.02, graph_ms=0.2)
    # short launches: gaps between launches may explain any gap
    assert not timing.work_missing(eager_ms=0.1, host_ms=0.01, graph_ms=0.01)
    assert not timing.work_missing(eager_ms=0.8, host_ms=0.02, graph_ms=0.5)


def test_contended_when_a_burst_runs_slower_per_launch_than_one_launch():
    """The H200's call 4 of 2026-12-01 23:00 (a hung process on the GPU): FP8 GEMM 8192^3 took
    2.28 ms per launch in 10 ms replays against 1.04 ms launched alone; an unshared device runs
    a burst at the single launch's pace or faster (1.16 vs 1.11 ms at 20:35)."""
    assert timing.contended(alone_ms=1.0434, burst_ms=2.2837)
    assert not timing.contended(alone_ms=1.1085, burst_ms=1.1636)
    assert not timing.contended(alone_ms=0.2, burst_ms=0.12)  # gaps and a cold clock alone
    assert not timing.contended(alone_ms=0.0, burst_ms=1.0)  # nothing measured alone


def test_other_compute_pids_parses_nvidia_smi():
    out = "4242\n 17 \n\n[N/A]\n99\n"
    assert timing.other_compute_pids(out, own_pid=17) == [4242, 99]
    assert timing.other_compute_pids("", own_pid=17) == []


def test_host_us_per_call_on_the_cpu():
    """The real loop with a fake sync: calls counted, rounds interleaved, syncs bracket each."""
    log = []

    def slow():
        log.append("slow")
        time.sleep(200e-6)

    def fast():
        log.append("fast")

    res = timing.host_us_per_call(
        {"slow": slow, "fast": fast}, calls=10, warmup=2, rounds=3, sync=lambda: log.append("|")
    )
    assert set(res) == {"slow", "fast"} and all(len(v) == 3 for v in res.values())
    assert all(us >= 200 for us in res["slow"]) and timing.median(res["fast"]) < 100
    assert log.count("slow") == 2 + 3 * 10 and log.count("fast") == 2 + 3 * 10
    rounds = "".join("s" if x == "slow" else "f" if x == "fast" else x for x in log)
    # warm-up, sync, then per round: sync, the calls, sync; the order alternates by round
    assert rounds == "ssff|" + "|" + "s" * 10 + "||" + "f" * 10 + "||" + "f" * 10 + "||" + (
        "s" * 10 + "||" + "s" * 10 + "||" + "f" * 10 + "|"
    )


def test_device_bound_host_loop_is_flagged():
    """A sync that waits (the device still busy after the last call) shows in the total, not in
    the time to the last call's return."""
    res = timing.host_us_per_call(
        {"f": lambda: None}, calls=10, warmup=0, rounds=3, sync=lambda: time.sleep(2e-3)
    )["f"]
    assert len(res.issued) == 3 and timing.median(res.issued) < 100
    assert timing.median(res) >= 200 and res.device_bound()
    assert not timing.HostTimes([10.0, 11.0], [9.5, 10.0]).device_bound()


def test_host_us_per_call_passes_args():
    seen = []
    timing.host_us_per_call({"f": seen.append}, args=(7,), calls=3, warmup=1, rounds=1)
    assert seen == [7] * 4


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="timing needs a CUDA device")


@cuda
def test_time_ms_graph():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    s = timing.time_ms(lambda: torch.matmul(a, a, out=out), reps=5)
    assert len(s) == 5 and all(x > 0 for x in s)
    assert s.method == "cuda-graph" and s.launches >= 1
    # 2 * 2048^3 flops cannot run above ~2 PFLOP/s
    assert timing.median(s) > 2 * 2048**3 / 2e15 * 1e3


@cuda
def test_capture_failure_falls_back_to_bursts():
    a = torch.randn(256, 256, device="cuda")

    def syncs():
        torch.mm(a, a)
        torch.cuda.synchronize()  # not allowed while capturing

    s = timing.time_ms(syncs, reps=3)
    assert s.method == "event-burst" and "capture failed" in s.note and len(s) == 3
    torch.randn(4, device="cuda")  # the default generator survived the failed capture


@cuda
def test_interleaved_rotation():
    sets = [(torch.randn(1 << 20, device="cuda"),) for _ in range(3)]
    seen = []

    def copy(x):
        seen.append(x.data_ptr())
        return x * 2

    res = timing.time_interleaved({"a": copy, "b": lambda x: x + 1}, rotate=sets, reps=4)
    assert set(res) == {"a", "b"} and all(len(v) == 4 for v in res.values())
    assert res["a"].launches % 3 == 0
    assert {t[0].data_ptr() for t in sets} <= set(seen)


@cuda
def test_eager_flushed_times_device_not_host():
    """A call with 1 ms of host time before a tiny kernel: the GPU sleep keeps the device ahead,
    so the sample is the kernel's device time, far below the host time."""
    x = torch.zeros(1024, device="cuda")

    def host_heavy():
        time.sleep(1e-3)
        x.add_(1.0)

    res = timing.time_eager_flushed({"h": host_heavy, "t": lambda: x.mul_(1.0)}, reps=20)
    s = res["h"]
    assert s.method == "eager-flushed" and s.launches == 1 and "L2 flushed" in s.note
    assert len(s) == 20 and len(res["t"]) == 20
    assert timing.median(s) < 0.2  # ms; the host spends 1 ms per call


@cuda
def test_eager_flushed_reads_from_hbm():
    """A 16 MiB copy fits in L2; flushed, its read comes from HBM: slower than replays of the
    same copy with no rotation (L2-resident input), and its read never above ~5 TB/s (the
    writes may stay in L2)."""
    src = torch.randn(4 << 20, device="cuda")
    dst = torch.empty_like(src)
    flushed = timing.median(timing.time_eager_flushed({"c": lambda: dst.copy_(src)})["c"])
    warm = timing.median(timing.time_ms(lambda: dst.copy_(src)))
    assert flushed > warm
    assert src.numel() * 4 / (flushed * 1e-3) < 5.5e12


@cuda
def test_eager_flushed_rerun_and_budget():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    sets = [(a, torch.empty_like(a)) for _ in range(2)]
    res = timing.time_eager_flushed(
        {"mm": lambda x, o: torch.matmul(x, x, out=o)}, rotate=sets, reps=100, budget_ms=0.5
    )
    assert len(res["mm"]) == 20  # a 4096^3 matmul takes > 0.025 ms: min_reps launches
    for _, o in sets:
        o.fill_(float("nan"))
    res["mm"].rerun()
    torch.cuda.synchronize()
    assert not any(torch.isnan(o).any() for _, o in sets)


@cuda
def test_host_us_per_call_on_the_device():
    x = torch.zeros(16, device="cuda")
    us = timing.host_us_per_call({"add": lambda: x.add_(1.0)}, calls=200)["add"]
    assert len(us) == 5 and 0.5 < timing.median(us) < 500


@cuda
def test_device_contention_on_a_device_of_our_own():
    """Run alone on the device (as the bench must be), the burst keeps the lone launch's pace."""
    probe = timing.device_contention(n=2048, burst_ms=10.0)
    assert probe["alone_ms"] > 0 and probe["burst_ms"] > 0
    assert not probe["contended"], probe
