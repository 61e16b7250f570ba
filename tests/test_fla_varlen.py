"""bench/suites/fla_varlen.py on the CPU, with a stand-in for fla 0.6.0's identity-memoized
chunk tables (`fla.utils.tensor_cache`: the last 4 argument tuples, first in first out; a miss
reads the lengths on the host) and CUDA-graph capture simulated: rotating through 5 input sets
(kda_prefill 1x2048's count on the H200) every call of the sets' own offsets missed, and the
first captured call read the host; with the shared offsets every call after the first hits."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from forgekernel.bench.suites import fla_varlen

CACHE_SIZE = 4  # fla 0.6.0's FLA_TENSOR_CACHE_SIZE default


class FakeFla:
    """fla's chunked op as far as its tables go: memoized by the identity of cu_seqlens, a miss
    reads the lengths on the host (not allowed while `capture` is on)."""

    def __init__(self):
        self.cached: deque = deque(maxlen=CACHE_SIZE)
        self.capture = False
        self.misses = 0

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if not any(c is cu_seqlens for c in self.cached):
            if self.capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.misses += 1
            cu_seqlens.tolist()  # the host read of repeat_interleave's size
            self.cached.append(cu_seqlens)
        return x * 2


@pytest.fixture
def fresh(monkeypatch):
    """Empty shared table and last-call record; capture as `state["capturing"]` says."""
    state = {"capturing": False}
    monkeypatch.setattr(fla_varlen, "_shared", {})
    monkeypatch.setattr(fla_varlen, "_last_eager", [None])
    monkeypatch.setattr(fla_varlen, "capturing", lambda t: state["capturing"])
    return state


def _sets(n: int, lens=(3, 70, 5)) -> list[dict]:
    edges = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return [{"x": torch.randn(4), "cu_seqlens_long": edges.clone()} for _ in range(n)]


def _bench_order(fla, sets, run):
    """What the graph timing does: every set eagerly, then the capture of a burst over them."""
    for i in sets:
        run(i)
    fla.capture = True
    try:
        for i in sets:
            run(i)
    finally:
        fla.capture = False


def test_own_offsets_per_set_miss_fla_tables_under_capture(fresh):
    fla = FakeFla()
    with pytest.raises(RuntimeError, match="capturing"):
        _bench_order(fla, _sets(5), lambda i: fla(i["x"], i["cu_seqlens_long"]))
    assert fla.misses == 5  # a miss on every eager call: 5 sets through a cache of 4


def test_shared_offsets_hit_fla_tables_on_every_call_after_the_first(fresh):
    fla = FakeFla()
    sets = _sets(5)

    def run(i):
        cu = fla_varlen.shared_offsets(i)
        return fla_varlen.call(fla, cu, i["x"], cu_seqlens=cu)

    def both(i):
        fresh["capturing"] = fla.capture
        return run(i)

    _bench_order(fla, sets, both)
    assert fla.misses == 1
    assert all(i[fla_varlen.SET_KEY] is sets[0]["cu_seqlens_long"] for i in sets)


def test_offsets_are_shared_by_content_only(fresh):
    a, b = _sets(2)
    (c,) = _sets(1, lens=(3, 71, 5))
    assert fla_varlen.shared_offsets(a) is fla_varlen.shared_offsets(b)
    assert fla_varlen.shared_offsets(c) is not fla_varlen.shared_offsets(a)
    assert torch.equal(fla_varlen.shared_offsets(c), c["cu_seqlens_long"])


def test_under_capture_only_the_last_eager_offsets_and_never_a_backward(fresh):
    """Under capture: the offsets of fla's last eager call pass; others, a set's first call and
    a backward (capturable=False) raise before fla runs."""
    a, (b,) = _sets(2, lens=(9,)), _sets(1, lens=(10,))
    calls = []

    def fla(cu_seqlens):
        calls.append(cu_seqlens)

    cu_a = fla_varlen.shared_offsets(a[0])
    fla_varlen.call(fla, cu_a, cu_seqlens=cu_a)
    cu_b = fla_varlen.shared_offsets(b)
    fresh["capturing"] = True
    fla_varlen.call(fla, cu_a, cu_seqlens=cu_a)
    with pytest.raises(RuntimeError, match="last eager call"):
        fla_varlen.call(fla, cu_b, cu_seqlens=cu_b)
    with pytest.raises(RuntimeError, match="forward's stream"):
        fla_varlen.call(fla, cu_a, cu_seqlens=cu_a, capturable=False)
    with pytest.raises(RuntimeError, match="first call is under capture"):
        fla_varlen.shared_offsets(a[1])  # known offsets, but telling so reads them
    assert calls == [cu_a, cu_a]
