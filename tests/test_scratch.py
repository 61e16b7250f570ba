"""runtime/scratch.py on the CPU: one buffer per (name, dtype, device, stream) reused across
calls, never shared between names or streams, grown when a call needs more, and never handed
out (nor cached) while the stream captures a CUDA graph (the stream lookup replaced by a fake
current stream); the views a launcher carves out of one buffer (`scratch_views`), made once;
the zero flags of the stream-K and split-KV kernels (`flags`); and the split-KV launchers
(MLA decode, DSA, paged decode) reusing theirs. The CUDA side (a captured graph owning its
scratch, two streams at once) is tests/gpu/test_scratch_gpu.py."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
from forgekernel.runtime import scratch as scratch_module
from forgekernel.runtime.scratch import scratch

CPU = torch.device("cpu")
F32 = torch.float32


@pytest.fixture
def streams(monkeypatch):
    """A fake current stream: set `streams[0]` (None: the stream captures a graph)."""
    current = [7]
    monkeypatch.setattr(scratch_module, "current_stream", lambda device: current[0])
    scratch_module.release()
    yield current
    scratch_module.release()


def test_one_stream_reuses_one_buffer(streams):
    a = scratch("x", (3, 4), F32, CPU)
    assert scratch("x", (3, 4), F32, CPU) is a
    smaller = scratch("x", (2, 5), F32, CPU)  # another shape: the same memory, viewed
    assert smaller.shape == (2, 5) and smaller.data_ptr() == a.data_ptr()


def test_names_dtypes_and_streams_never_share(streams):
    a = scratch("x", (3, 4), F32, CPU)
    ptrs = {a.data_ptr(), scratch("y", (3, 4), F32, CPU).data_ptr(),
            scratch("x", (3, 4), torch.int32, CPU).data_ptr()}  # fmt: skip
    streams[0] = 8
    other = scratch("x", (3, 4), F32, CPU)
    assert len(ptrs | {other.data_ptr()}) == 4
    streams[0] = 7
    assert scratch("x", (3, 4), F32, CPU) is a


def test_growth_drops_the_short_buffer(streams):
    a = scratch("x", (4,), F32, CPU)
    big = scratch("x", (2, 100), F32, CPU)
    assert big.shape == (2, 100) and big.data_ptr() != a.data_ptr()
    again = scratch("x", (4,), F32, CPU)  # the old view is not handed out again
    assert again.data_ptr() == big.data_ptr()


def test_a_capture_gets_fresh_memory_and_caches_nothing(streams):
    eager = scratch("x", (3, 4), F32, CPU)
    streams[0] = None
    captured = [scratch("x", (3, 4), F32, CPU) for _ in range(2)]
    assert all(t.data_ptr() != eager.data_ptr() for t in captured)
    assert captured[0] is not captured[1]
    streams[0] = 7
    assert scratch("x", (3, 4), F32, CPU) is eager
    assert len(scratch_module._SLOTS) == 1


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.uint8])
def test_scratches_are_one_buffer_carved_in_order(streams, dtype):
    """`scratches`: the shapes as views of one buffer, one after another, each from a 16-byte
    boundary and none overlapping (odd sizes: 3 x 5, 7); the same tuple again on this stream,
    others on another stream and while a capture runs (nothing cached then); grown, new ones."""
    shapes = ((3, 5), (7,), (2, 1, 3))
    views = scratch_module.scratches("s", shapes, dtype, CPU)
    assert tuple(t.shape for t in views) == shapes and all(t.dtype == dtype for t in views)
    assert all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in views)
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in views]
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    base = views[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in views)
    assert scratch_module.scratches("s", shapes, dtype, CPU) is views
    streams[0] = 8
    assert views[0].data_ptr() != scratch_module.scratches("s", shapes, dtype, CPU)[0].data_ptr()
    streams[0] = None
    fresh = scratch_module.scratches("s", shapes, dtype, CPU)
    assert {t.data_ptr() for t in fresh}.isdisjoint(t.data_ptr() for t in views)
    streams[0] = 7
    assert scratch_module.scratches("s", shapes, dtype, CPU) is views
    grown = scratch_module.scratches("s", ((100,), (7,)), dtype, CPU)
    assert grown[0].data_ptr() != views[0].data_ptr() and grown[1].data_ptr() % 16 == 0
    assert len(scratch_module._SLOTS) == 2  # (s, stream 7) and (s, stream 8)


class _Halves:
    """A scratch_views layout: a buffer's two halves, counting how often it is viewed."""

    def __init__(self, numel: int):
        self.numel, self.made = numel, 0

    def views(self, buffer):
        self.made += 1
        half = self.numel // 2
        return buffer[:half], buffer[half : self.numel]


def test_scratch_views_are_made_once_per_buffer(streams):
    """`scratch_views`: the layout's views of the stream's buffer, made on first use and
    handed out again; a grown buffer gets new ones (of its own memory), another stream its
    own, a capture fresh memory and nothing cached."""
    small, big = _Halves(8), _Halves(64)
    first = scratch_module.scratch_views("w", small, F32, CPU)
    assert scratch_module.scratch_views("w", small, F32, CPU) is first and small.made == 1
    assert first[0].data_ptr() == scratch("w", (8,), F32, CPU).data_ptr()
    grown = scratch_module.scratch_views("w", big, F32, CPU)
    again = scratch_module.scratch_views("w", small, F32, CPU)
    assert small.made == 2 and again[0].data_ptr() == grown[0].data_ptr()
    streams[0] = 8
    assert scratch_module.scratch_views("w", small, F32, CPU)[0].data_ptr() != again[0].data_ptr()
    streams[0] = None
    captured = scratch_module.scratch_views("w", small, F32, CPU)
    assert captured[0].data_ptr() not in {again[0].data_ptr(), grown[0].data_ptr()}
    assert small.made == 4 and len(scratch_module._SLOTS) == 2


def test_flags_are_one_zero_buffer_per_name_and_stream():
    """`flags`: made zero once per (name, device, stream), the same tensor on every later call
    that fits, a new zero one when a launch needs more (the kernels leave them zero)."""
    scratch_module.release()
    first = scratch_module.flags("f", 8, CPU)
    assert first.dtype == torch.int32 and first.numel() >= 8 and not first.any()
    assert scratch_module.flags("f", 8, CPU) is first
    assert scratch_module.flags("g", 8, CPU) is not first
    grown = scratch_module.flags("f", first.numel() + 1, CPU)
    assert grown.numel() > first.numel() and not grown.any()
    assert scratch_module.flags("f", 4, CPU) is grown
    scratch_module.release()
    assert not scratch_module._FLAGS


def test_bounded(streams, monkeypatch):
    monkeypatch.setattr(scratch_module, "MAX_SHAPES", 3)
    monkeypatch.setattr(scratch_module, "MAX_SLOTS", 2)
    for n in range(1, 8):
        scratch("x", (n,), F32, CPU)
    assert len(scratch_module._SLOTS[("x", F32, CPU, 7)][1]) <= 3
    for stream in range(5):
        streams[0] = stream
        scratch("x", (1,), F32, CPU)
    assert len(scratch_module._SLOTS) <= 2


# ---------------------------------------------------------------- the launchers


def _recording_kernels(monkeypatch, launch, seen):
    """Every kernel a no-op recording the data pointers of the tensors it gets."""

    def get_kernel(spec, params):
        kind = dict(params)["kind"]

        def fn(*args):
            seen.append((kind, [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]))

        return fn

    monkeypatch.setattr(launch, "_plans", type(launch._plans)())
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)


def test_split_kv_launchers_reuse_their_partials(streams, monkeypatch):
    """Two MLA decodes (a split plan: partial pass + combine) on one stream hand the combine
    the same partial buffers; on another stream, others; the paged decode likewise."""
    seen = []
    _recording_kernels(monkeypatch, mla_launch, seen)
    bf = torch.bfloat16
    qn, qp = torch.zeros(1, 16, 512, dtype=bf), torch.zeros(1, 16, 64, dtype=bf)
    ckv, kpe = torch.zeros(70, 64, 512, dtype=bf), torch.zeros(70, 64, 64, dtype=bf)
    table, lens = torch.zeros(1, 64, dtype=torch.int32), torch.tensor([4096], dtype=torch.int32)
    out, lse = torch.empty(1, 16, 512, dtype=bf), torch.empty(1, 16)

    def decode():
        seen.clear()
        mla_launch.mla_decode(qn, qp, ckv, kpe, table, lens, 0.1, out, lse)
        assert [kind for kind, _ in seen] == ["partial", "combine"]
        return seen[1][1][:2]  # the combine's partial O and LSE

    first = decode()
    assert decode() == first
    streams[0] = 8
    assert not set(decode()) & set(first)

    seen = []
    _recording_kernels(monkeypatch, paged_launch, seen)
    q = torch.zeros(1, 32, 128, dtype=bf)
    k = v = torch.zeros(1030, 16, 8, 128, dtype=bf)
    table = torch.zeros(1, 1024, dtype=torch.int32)
    out, lse = torch.empty(1, 32, 128, dtype=bf), torch.empty(1, 32)

    def paged():
        seen.clear()
        paged_launch.paged_decode(q, k, v, table, lens, 0.1, out, lse)
        assert [kind for kind, _ in seen] == ["partial", "combine"]
        return seen[1][1][:2]

    first = paged()
    assert paged() == first
    streams[0] = 9
    assert not set(paged()) & set(first)
