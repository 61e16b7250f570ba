"""GEMM paths the suite checks do not reach: the stream-K workspace first made inside a CUDA
graph capture (its zero fill runs on replay), the block-scaled FP8 GEMM's suite cases, every
standard FP8 configuration forced on one problem (odd and even k-tile counts: both tails of the
two-fragment mainloop), FP8 stream K deterministic and replayable in a CUDA graph, and the
candidates reading A's scales M-major on ragged M."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import forgekernel
from forgekernel.bench.check import check_case, verify
from forgekernel.bench.report import dtype_name
from forgekernel.bench.suites import gemm_fp8 as fp8_suite_module
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_launch
from forgekernel.kernels.gemm.fp8.sm90.config import STANDARD_CONFIGS, choose_config

pytestmark = pytest.mark.gpu


def test_stream_k_first_called_inside_a_capture():
    torch.manual_seed(0)
    a = torch.randn(3, 7168, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(576, 7168, device="cuda", dtype=torch.bfloat16)  # 9 tiles: stream K
    want = a.float() @ b.float().t()
    forgekernel.gemm(a, b)  # load the kernel outside the capture
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            got = forgekernel.gemm(a, b)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert float((got.float() - want).abs().max()) < 0.05 * float(want.abs().max())
    with torch.cuda.stream(side):
        eager = forgekernel.gemm(a, b)
    torch.cuda.synchronize()
    assert torch.equal(eager, got)  # deterministic, and the eager workspace starts at zero


FP8 = fp8_suite_module.suite()


@pytest.mark.parametrize(
    "case, dtype",
    [
        pytest.param(c, d, id=f"{c.name}-{dtype_name(d)}")
        for c in FP8.check_cases + tuple(FP8.sanitize_cases)
        for d in FP8.dtypes
    ],
)
def test_gemm_fp8_matches_the_reference(case, dtype):
    rec = check_case(FP8, case, dtype, torch.device("cuda"), seed=0)
    assert rec["passed"], rec["message"]


@pytest.mark.parametrize("k_tiles", [20, 21])
@pytest.mark.parametrize("cfg", STANDARD_CONFIGS, ids=lambda c: c.tag())
def test_every_fp8_config_matches_the_reference(cfg, k_tiles):
    m = cfg.a_rows - 3 if cfg.a_rows else 200  # off every tile
    case = fp8_suite_module._case(m, 520, 128 * k_tiles)
    gen = torch.Generator(device="cuda").manual_seed(k_tiles)
    inputs = FP8.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)

    def run(inputs, out):
        fp8_launch.gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out, config=cfg)
        return out

    _, cmps = verify(FP8, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def test_fp8_stream_k_is_deterministic_and_replays_in_a_graph():
    # 12 tiles of 64x128: stream K (128x1536x7168 took it until fp8_tiles' 64x32 pick)
    case = fp8_suite_module._case(32, 1536, 7168)
    assert choose_config(32, 1536, 7168).stream_k
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = FP8.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
    args = (x["a"], x["b"], x["sa"], x["sb"])
    first = forgekernel.gemm_fp8(*args)
    assert torch.equal(forgekernel.gemm_fp8(*args), first)  # parts summed in k order
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            got = forgekernel.gemm_fp8(*args)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, first)


MN_MAJOR = [
    dataclasses.replace(c, scale_mn_major=True)
    for c in STANDARD_CONFIGS
    if c.tile_m == 128 and not c.stream_k
]


@pytest.mark.parametrize("given", ["k_major", "mn_major"])
@pytest.mark.parametrize("m", [200, 301, 1027])
@pytest.mark.parametrize("cfg", MN_MAJOR, ids=lambda c: c.tag())
def test_fp8_mn_major_scales_match_the_reference(cfg, m, given):
    """The candidates reading A's scales M-major (`scale_mn_major`, JIT-compiled: not prebuilt)
    on ragged M (301, 1027: the last tile row moved back by a multiple of 4 only, its box past
    M), from the suite's K-major scales (the launcher's copy) and from an M-major copy (as is);
    then captured in a graph (the copy inside the capture) and replayed."""
    case = fp8_suite_module._case(m, 520, 128 * 21)
    gen = torch.Generator(device="cuda").manual_seed(m)
    inputs = FP8.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
    if given == "mn_major":
        inputs["sa"] = fp8_launch.mn_major_copy(inputs["sa"])
        assert fp8_launch.takes_mn_major(inputs["sa"])

    def run(inputs, out):
        fp8_launch.gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out, config=cfg)
        return out

    _, cmps = verify(FP8, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first = run(inputs, FP8.alloc_out(inputs)).clone()
    out = FP8.alloc_out(inputs)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            run(inputs, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
