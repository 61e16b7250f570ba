from __future__ import annotations

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
