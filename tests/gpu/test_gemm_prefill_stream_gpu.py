"""The prefill configurations of issue 17 (config.py MID, PREFILL_STREAM, and MID streamed: out
of the standard set since the refit of 2026-12-02, its 1x2-cluster walk kept tested) forced
through the op on problems their walks meet every situation on
(tests/test_gemm_stream_k_clusters.py `walk_classes`): cluster blocks over the edge of M and N,
tiles cut into three parts and more, data-parallel rounds before the streamed ones. Each against
the fp64 reference with the suite's tolerance, every output element written (NaN-poisoned),
bitwise the same on a second call (the parts summed in k order), the stream-K flags left zero,
and replayed from a CUDA graph."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import MID, PREFILL_STREAM, split_for
from forgekernel.runtime import scratch

pytestmark = pytest.mark.gpu

MID_STREAMED = dataclasses.replace(MID, stream_k=True)  # stream K on the 1x2 cluster

SUITE = gemm_suite.suite()
PROBLEMS = [
    (129, 520, 4104, "nk"),  # 3 tile rows of 64: short of a wave, 3 parts
    (300, 2056, 4096, "kn"),  # 5 tile rows of 64 / 3 of 128 (c2x1: a dead CTA row), 9 columns
    (1026, 3592, 2056, "nk"),  # data-parallel rounds for MID
    (1091, 10248, 4104, "kn"),  # data-parallel rounds for LARGE, dead CTA row
    (4095, 1544, 4104, "nk"),  # data-parallel rounds for WIDE
]


def _flags_zero() -> bool:
    return all(
        int(f.abs().sum()) == 0 for key, f in scratch._FLAGS.items() if key[0] == "stream_k.flags"
    )


@pytest.mark.parametrize("m, n, k, layout", PROBLEMS, ids=lambda x: str(x))
@pytest.mark.parametrize("cfg", [MID, MID_STREAMED, *PREFILL_STREAM], ids=lambda c: c.tag())
def test_forced_prefill_config_matches_the_reference(cfg, m, n, k, layout):
    case = gemm_suite._case(m, n, k, layout)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    inputs = SUITE.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)

    def run(inputs, out):
        b_layout = inputs["b_layout"]
        return forgekernel.gemm(inputs["a"], inputs["b"], out=out, b_layout=b_layout, config=cfg)

    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first = run(inputs, torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))
    again = run(inputs, torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert not first.isnan().any() and torch.equal(first, again)
    assert _flags_zero()
    if cfg.stream_k:
        plan = split_for(cfg, m, n, k)
        assert plan.clusters * plan.cluster_size <= 132


@pytest.mark.parametrize("warmed", [False, True], ids=["fresh-stream", "warmed-stream"])
@pytest.mark.parametrize("cfg", [*PREFILL_STREAM, MID_STREAMED], ids=lambda c: c.tag())
def test_cluster_stream_k_replays_in_a_graph(cfg, warmed):
    """Captured on a fresh stream or on one that already ran the GEMM eagerly, the graph owns
    its workspace (runtime/scratch.py): partials from its pool, flags of its own made zero once
    in the capture (keyed by the capture's id) and shared by its two launches, so the second
    launch and every replay find them as the previous launch left them, which only the
    kernel's own reset makes zero; the warmed stream's eager workspace stays the eager calls'."""
    # for each of the three: data-parallel rounds, then cut tiles (a cluster's last unit as a
    # tile's part 0, a whole block between two cut ones) and a dead CTA skipping its part
    m, n, k = 1540, 5128, 1032
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    first = forgekernel.gemm(a, b, config=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        if warmed:
            forgekernel.gemm(a, b, config=cfg)  # caches the side stream's workspace
            torch.cuda.synchronize()
            assert ("stream_k.flags", a.device, side.cuda_stream) in scratch._FLAGS
        with torch.cuda.graph(graph, stream=side):
            got = forgekernel.gemm(a, b, config=cfg)
            again = forgekernel.gemm(a, b, config=cfg)  # a second launch on the same flags
    for _ in range(3):
        got.fill_(float("nan"))
        again.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, first) and torch.equal(again, first)
    assert _flags_zero()
