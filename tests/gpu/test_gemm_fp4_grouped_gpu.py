"""The contiguous-layout grouped GEMM with FP4 weights on an sm90 GPU: the suite's check and
sanitize cases against the fp64 reference, every tile, padding rows left exactly as they were,
torch.compile, and our FP8-weight contiguous GEMM agreeing on the same problem."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.check import check_case, verify
from forgekernel.bench.report import dtype_name
from forgekernel.bench.suites import gemm_fp4_grouped as suite_module
from forgekernel.ops.gemm_fp4_grouped import gemm_fp4_grouped

pytestmark = pytest.mark.gpu

SUITE = suite_module.suite()
CUDA = torch.device("cuda")
CASES = tuple(SUITE.check_cases) + tuple(SUITE.sanitize_cases)
SENTINEL = float("nan")  # no product is NaN: any value a real row can take would be ambiguous
MIXED = suite_module._case(4, 640, 1024, counts=(3, 128, 0, 77), tail=128)


def _inputs(case, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return SUITE.make_inputs(case, dtype, CUDA, gen)


def _args(inputs):
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "m_indices"))


@pytest.mark.parametrize(
    "case, dtype",
    [pytest.param(c, d, id=f"{c.name}-{dtype_name(d)}") for c in CASES for d in SUITE.dtypes],
)
def test_matches_the_reference(case, dtype):
    rec = check_case(SUITE, case, dtype, CUDA, seed=0)
    assert rec["passed"], rec["message"]


@pytest.mark.parametrize("expected_m", [None, 1, 9, 17, 33, 65])
def test_every_tile_matches_the_reference(expected_m):
    inputs = _inputs(MIXED, seed=1)
    _, cmps = verify(SUITE, inputs, CUDA, run=lambda i, o: suite_module._run(i, o, expected_m))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def test_padding_rows_are_left_alone():
    inputs = _inputs(MIXED, seed=2)
    a, b = inputs["a"], inputs["b"]
    out = torch.full((a.shape[0], b.shape[1]), SENTINEL, dtype=torch.bfloat16, device=CUDA)
    got = gemm_fp4_grouped(*_args(inputs), out=out)
    torch.cuda.synchronize()
    assert got is out
    padding = inputs["m_indices"] < 0
    assert bool(out[padding].isnan().all())
    assert not bool(out[~padding].isnan().any())


def test_torch_compile():
    inputs = _inputs(MIXED, torch.float16, seed=3)

    @torch.compile(fullgraph=True)
    def f(a, b, sa, sb, idx):
        return gemm_fp4_grouped(a, b, sa, sb, idx, out_dtype=torch.float16) * 1

    got = f(*_args(inputs))
    eager = gemm_fp4_grouped(*_args(inputs), out_dtype=torch.float16)
    torch.cuda.synchronize()
    real = inputs["m_indices"] >= 0
    assert torch.equal(got[real], eager[real])


def test_fp8_weight_gemm_agrees_on_the_same_problem():
    inputs = _inputs(MIXED, seed=4)
    ours = gemm_fp4_grouped(*_args(inputs))
    theirs = SUITE.comparators()["fp8_ours"](inputs)
    torch.cuda.synchronize()
    real = inputs["m_indices"] >= 0
    rel = (ours[real].float() - theirs[real].float()).norm() / theirs[real].float().norm()
    assert float(rel) < 5e-2


# ---------------------------------------------------------------- the opt-in forms
FORMS = {"staged": False, "converter": 1, "converter2": 2}  # `run_form`'s converter


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_opt_in_form_matches_the_reference(case, form):
    """The opt-in forms (docs/gemm/NOTES.md "FP4 at 16-96 tokens") on the contiguous layout's
    default tile, every check and sanitize case."""
    inputs = _inputs(case, seed=0)
    run = lambda i, o: suite_module.run_form(i, o, FORMS[form])  # noqa: E731
    _, cmps = verify(SUITE, inputs, CUDA, run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]


@pytest.mark.parametrize("form", FORMS)
def test_opt_in_form_gives_the_standard_bits_and_leaves_padding(form):
    """Same products, same promotion order: the form's rows equal the standard's bit for bit,
    padding rows keep their sentinel."""
    inputs = _inputs(MIXED, seed=5)
    a, b = inputs["a"], inputs["b"]
    outs = []
    for run in (suite_module.run_ours, lambda i, o: suite_module.run_form(i, o, FORMS[form])):
        out = torch.full((a.shape[0], b.shape[1]), SENTINEL, dtype=torch.bfloat16, device=CUDA)
        run(inputs, suite_module._rows(inputs, out))
        outs.append(out)
    torch.cuda.synchronize()
    padding = inputs["m_indices"] < 0
    assert bool(outs[1][padding].isnan().all())
    assert torch.equal(outs[0][~padding], outs[1][~padding])
