"""The grouped (MoE, contiguous) FP8 GEMM on an sm90 GPU: the suite's check and sanitize cases
against the fp64 reference, a CUDA graph capture replayed into a poisoned output,
torch.compile with `out=`, DeepGEMM's answer on the same inputs where it is installed (the
bench's comparator computes the same thing), and the M-first walk forced against the standard's
bands of 8 (bitwise). Padding rows are not the caller's: only real rows
are compared outside the suite's check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgekernel.bench.check import check_case, compare, true_fp32
from forgekernel.bench.report import dtype_name
from forgekernel.bench.suites import gemm_fp8_grouped as suite_module
from forgekernel.kernels.gemm.fp8.sm90 import launch
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED
from forgekernel.ops.gemm_fp8_grouped import gemm_fp8_grouped

pytestmark = pytest.mark.gpu

SUITE = suite_module.suite()
CUDA = torch.device("cuda")
CASES = tuple(SUITE.check_cases) + tuple(SUITE.sanitize_cases)
GRAPH_CASE = suite_module._case(4, 640, 1024, counts=(1, 300, 0, 129), tail=128)


def _inputs(case, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return SUITE.make_inputs(case, dtype, CUDA, gen)


def _args(inputs):
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "m_indices"))


def _check_real_rows(inputs, got):
    """Real rows of `got` against the reference, FlashAttention's criterion."""
    real = inputs["m_indices"] >= 0
    with true_fp32():
        ref = SUITE.reference(inputs)
    low = SUITE.low_precision(inputs)
    cmp = compare(got[real], ref[real], low[real], atol=SUITE.atol)
    assert cmp.ok, cmp.message


@pytest.mark.parametrize(
    "case, dtype",
    [pytest.param(c, d, id=f"{c.name}-{dtype_name(d)}") for c in CASES for d in SUITE.dtypes],
)
def test_matches_the_reference(case, dtype):
    rec = check_case(SUITE, case, dtype, CUDA, seed=0)
    assert rec["passed"], rec["message"]


def test_cuda_graph_capture():
    inputs = _inputs(GRAPH_CASE)
    args = _args(inputs)
    eager = gemm_fp8_grouped(*args)  # load the kernel outside the capture
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            got = gemm_fp8_grouped(*args)
    real = inputs["m_indices"] >= 0
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check_real_rows(inputs, got)
        assert torch.equal(got[real], eager[real])  # deterministic


def test_torch_compile_with_out():
    inputs = _inputs(GRAPH_CASE, torch.float16, seed=1)
    args = _args(inputs)

    @torch.compile(fullgraph=True)
    def f(a, b, sa, sb, idx, out):
        return gemm_fp8_grouped(a, b, sa, sb, idx, out_dtype=torch.float16, out=out) * 1

    out = SUITE.alloc_out(inputs).fill_(float("nan"))
    got = f(*args, out)
    torch.cuda.synchronize()
    real = inputs["m_indices"] >= 0
    _check_real_rows(inputs, out)
    assert torch.equal(got[real], out[real])


def test_deepgemm_agrees_on_real_rows():
    pytest.importorskip("deep_gemm")
    run = SUITE.comparators()["deepgemm"]
    inputs = _inputs(GRAPH_CASE)
    theirs = run(inputs).clone()
    torch.cuda.synchronize()
    _check_real_rows(inputs, theirs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_m_first_walk_matches_the_standard_bands(case):
    """The M-first walk (the standard until 2026-12-03) forced through the launcher on every
    check and sanitize case: the same real rows as the standard's bands of 8 (GROUPED),
    bitwise (each tile is computed alike whatever the order), and the reference's."""
    assert GROUPED.swizzle == 8
    inputs = _inputs(case)
    got = torch.full_like(SUITE.alloc_out(inputs), float("nan"))
    launch.gemm_fp8_grouped(*_args(inputs), got, config=dataclasses.replace(GROUPED, swizzle=1))
    _check_real_rows(inputs, got)
    real = inputs["m_indices"] >= 0
    assert torch.equal(got[real], gemm_fp8_grouped(*_args(inputs))[real])
