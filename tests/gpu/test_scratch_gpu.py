"""runtime/scratch.py on the GPU, through the split-KV launchers (the MLA decode's and the
paged decode's partial O / LSE reused across calls): a CUDA graph captured after eager calls
owns its scratch (none of the eager buffers in its kernels' arguments) and replays right on
new inputs while eager calls on other inputs run on another stream; two streams running
decodes at once use two sets of buffers and both get their sequential results."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.bench.harness import host_case
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
from forgekernel.runtime import scratch as scratch_module

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
# the suites' host cases: b1 h16 L4096 (MLA) and b1 hq32 hkv8 L16384 (paged), split plans
SUITES = {"mla_decode": mla_launch, "attention_paged": paged_launch}


def _problem(name: str, seed: int):
    suite = importlib.import_module(f"forgekernel.bench.suites.{name}").suite()
    gen = torch.Generator(DEV).manual_seed(seed)
    inputs = suite.make_inputs(host_case(suite), suite.dtypes_for_bench()[0], DEV, gen)
    return suite, inputs


def _result(suite, inputs):
    out = suite.alloc_out(inputs)
    suite.run_ours(inputs, out)
    torch.cuda.synchronize()
    return tuple(t.clone() for t in out)


@pytest.fixture
def partials(monkeypatch, request):
    """The launcher's kernels, real, with the partial buffers the combine reads recorded."""
    launch = SUITES[request.param]
    seen: list[tuple[int, int]] = []
    real = launch.get_kernel

    def get_kernel(spec, params):
        fn = real(spec, params)
        if dict(params)["kind"] != "combine":
            return fn

        def combine(partial_o, partial_lse, *rest):
            seen.append((partial_o.data_ptr(), partial_lse.data_ptr()))
            fn(partial_o, partial_lse, *rest)

        return combine

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "_plans", type(launch._plans)())
    scratch_module.release()
    yield request.param, seen
    scratch_module.release()


def _same(got, want) -> None:
    """(out, lse) as the sequential run gave them (a race on shared scratch is no rounding)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=1e-2, rtol=0)


@pytest.mark.parametrize("partials", list(SUITES), indirect=True)
def test_a_captured_graph_owns_its_scratch(partials):
    name, seen = partials
    suite, inputs = _problem(name, 0)
    _, other = _problem(name, 1)
    _, fresh = _problem(name, 2)
    want_fresh, want_other = _result(suite, fresh), _result(suite, other)
    if not seen:
        pytest.skip(f"{name}'s host case runs one split here (no combine, no scratch)")
    eager = set(seen)
    out = suite.alloc_out(inputs)
    suite.run_ours(inputs, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    seen.clear()
    with torch.cuda.graph(graph):
        suite.run_ours(inputs, out)
    assert seen and not set(seen) & eager, "the capture took the eager scratch"
    for key, t in inputs.items():  # the new problem in the captured tensors
        if isinstance(t, torch.Tensor):
            t.copy_(fresh[key])
    other_out = suite.alloc_out(other)
    side = torch.cuda.Stream()
    for _ in range(20):  # replays on a side stream while eager calls run on the default one
        with torch.cuda.stream(side):
            graph.replay()
        suite.run_ours(other, other_out)
    torch.cuda.synchronize()
    _same(out, want_fresh)
    _same(other_out, want_other)


@pytest.mark.parametrize("partials", list(SUITES), indirect=True)
def test_two_streams_use_two_buffers(partials):
    name, seen = partials
    (suite, a), (_, b) = _problem(name, 0), _problem(name, 1)
    want_a, want_b = _result(suite, a), _result(suite, b)
    if not seen:
        pytest.skip(f"{name}'s host case runs one split here (no combine, no scratch)")
    out_a, out_b = suite.alloc_out(a), suite.alloc_out(b)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    seen.clear()
    for _ in range(50):
        with torch.cuda.stream(s1):
            suite.run_ours(a, out_a)
        with torch.cuda.stream(s2):
            suite.run_ours(b, out_b)
    torch.cuda.synchronize()
    assert len(set(seen)) == 2, "one buffer per stream, reused"
    _same(out_a, want_a)
    _same(out_b, want_b)
