"""The masked grouped GEMM with FP4 weights on an sm90 GPU: the suite's check and sanitize cases
against the fp64 reference, every tile (8 .. 64 tokens) on one problem, rows past the counts
left exactly as they were, counts outside [0, max_m] read as the nearest end, the three
scale forms (N-major words, K-major words, fp32 scales) giving the same bits, a CUDA graph
replayed with other counts, torch.compile with and without `out`, a DeepSeek-V3-sized decode
step, and our FP8-weight masked GEMM agreeing on the same problem (its weights re-quantized)."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.check import check_case, compare, true_fp32, verify
from forgekernel.bench.report import dtype_name
from forgekernel.bench.suites import gemm_fp4_masked as suite_module
from forgekernel.ops.fp4_pack import unpack_scale_words
from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked
from forgekernel.reference.gemm import gemm_fp4_masked_ref

pytestmark = pytest.mark.gpu

SUITE = suite_module.suite()
CUDA = torch.device("cuda")
CASES = tuple(SUITE.check_cases) + tuple(SUITE.sanitize_cases)
SENTINEL = -3.0
FULL = suite_module._case(5, 640, 1024, counts=(72,) * 5, max_m=72, expected_m=8)


def _inputs(case, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return SUITE.make_inputs(case, dtype, CUDA, gen)


def _args(inputs):
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "masked_m"))


def _counted(counts, max_m):
    return torch.arange(max_m, device=CUDA)[None, :] < torch.tensor(counts, device=CUDA)[:, None]


def _check(inputs, got, counts, sentinel=SENTINEL):
    a, b, sa, sb, _ = _args(inputs)
    with true_fp32():
        ref = gemm_fp4_masked_ref(a, b, sa, sb, torch.tensor(counts, dtype=torch.int32))
    low = suite_module.low_precision({**inputs, "counts": counts})
    counted = _counted(counts, a.shape[1])
    low_full = torch.zeros_like(got)
    for e, c in enumerate(counts):
        low_full[e, :c] = low[e]
    cmp = compare(got[counted], ref[counted], low_full[counted], atol=SUITE.atol)
    assert cmp.ok, cmp.message
    assert bool((got[~counted] == sentinel).all()), "rows past the counts were written"


@pytest.mark.parametrize(
    "case, dtype",
    [pytest.param(c, d, id=f"{c.name}-{dtype_name(d)}") for c in CASES for d in SUITE.dtypes],
)
def test_matches_the_reference(case, dtype):
    rec = check_case(SUITE, case, dtype, CUDA, seed=0)
    assert rec["passed"], rec["message"]


@pytest.mark.parametrize("expected_m", [1, 9, 17, 33, 65, 4096])
def test_every_tile_matches_the_reference(expected_m):
    case = suite_module._case(4, 384, 2048, counts=(130, 0, 7, 64), max_m=136)
    inputs = _inputs(case, seed=1)
    _, cmps = verify(SUITE, inputs, CUDA, run=lambda i, o: suite_module._run(i, o, expected_m))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c.name)
def test_rows_past_the_counts_are_left_alone(case):
    inputs = _inputs(case, seed=2)
    a, b = inputs["a"], inputs["b"]
    out = torch.full((*a.shape[:2], b.shape[1]), SENTINEL, dtype=torch.bfloat16, device=CUDA)
    got = gemm_fp4_grouped_masked(*_args(inputs), inputs["expected_m"], out=out)
    torch.cuda.synchronize()
    assert got is out
    _check(inputs, out, inputs["counts"])


def test_counts_outside_the_rows_read_as_the_nearest_end():
    inputs = _inputs(FULL, seed=3)
    inputs["masked_m"].copy_(torch.tensor([-5, 72, 1000, 0, 71], dtype=torch.int32))
    out = torch.full((5, 72, 640), SENTINEL, dtype=torch.bfloat16, device=CUDA)
    gemm_fp4_grouped_masked(*_args(inputs), 8, out=out)
    torch.cuda.synchronize()
    _check(inputs, out, [0, 72, 72, 0, 71])


def test_scale_forms_give_the_same_bits():
    """N-major int32 words (in place), K-major words (re-laid per call), fp32 scales (packed
    per call)."""
    inputs = _inputs(FULL, seed=8)
    a, b, sa, words, counts = _args(inputs)
    runs = [gemm_fp4_grouped_masked(a, b, sa, w, counts, 8) for w in (
        words, words.contiguous(), unpack_scale_words(words))]  # fmt: skip
    torch.cuda.synchronize()
    assert words.stride(1) == 1 and words.contiguous().stride(1) != 1
    for got in runs[1:]:
        assert torch.equal(got, runs[0])


def test_cuda_graph_replays_with_other_counts():
    inputs = _inputs(FULL, seed=4)
    args = _args(inputs)
    out = torch.full((5, 72, 640), SENTINEL, dtype=torch.bfloat16, device=CUDA)
    gemm_fp4_grouped_masked(*args, 8, out=out)  # load the kernel outside the capture
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            gemm_fp4_grouped_masked(*args, 8, out=out)
    first = None
    for counts in ([72, 72, 72, 72, 72], [3, 0, 72, 9, 40], [0, 0, 0, 0, 0], [1, 65, 8, 0, 16]):
        inputs["masked_m"].copy_(torch.tensor(counts, dtype=torch.int32))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        _check(inputs, out, counts)
        if first is None:
            first = out.clone()
        counted = _counted(counts, 72)
        assert torch.equal(out[counted], first[counted])


def test_torch_compile_with_and_without_out():
    inputs = _inputs(FULL, torch.float16, seed=5)
    counts = [5, 0, 72, 33, 8]
    inputs["masked_m"].copy_(torch.tensor(counts, dtype=torch.int32))

    @torch.compile(fullgraph=True)
    def into(a, b, sa, sb, masked_m, out):
        return (
            gemm_fp4_grouped_masked(a, b, sa, sb, masked_m, 16, out_dtype=torch.float16, out=out)
            * 1
        )

    @torch.compile(fullgraph=True)
    def fresh(a, b, sa, sb, masked_m):
        return gemm_fp4_grouped_masked(a, b, sa, sb, masked_m, 16, out_dtype=torch.float16)

    out = torch.full((5, 72, 640), SENTINEL, dtype=torch.float16, device=CUDA)
    got = into(*_args(inputs), out)
    new = fresh(*_args(inputs))
    torch.cuda.synchronize()
    _check(inputs, out, counts)
    counted = _counted(counts, 72)
    assert torch.equal(got, out) and torch.equal(new[counted], out[counted])


def test_deepseek_v3_decode_step():
    """32 experts, N 4096, K 7168, ~8 tokens each."""
    case = next(
        c for c in SUITE.bench_cases if c.name.startswith("E32:8d") and c.params["n"] == 4096
    )
    inputs = _inputs(case, seed=6)
    out, cmps = verify(SUITE, inputs, CUDA)
    assert len(out) == 32 and all(c.ok for c in cmps), [c.message for c in cmps if c.message]


def test_fp8_weight_gemm_agrees_on_the_same_problem():
    """Our FP8-weight masked GEMM (the bar's denominator) on the weights re-quantized to e4m3:
    the same answer to the FP8 re-quantization's error."""
    inputs = _inputs(FULL, seed=7)
    ours = gemm_fp4_grouped_masked(*_args(inputs), 8)
    theirs = SUITE.comparators()["fp8_ours"](inputs)
    torch.cuda.synchronize()
    rel = (ours.float() - theirs.float()).norm() / theirs.float().norm()
    assert float(rel) < 5e-2


# ---------------------------------------------------------------- the opt-in forms
FORMS = {"staged": False, "converter": 1, "converter2": 2}  # `_run_staged`'s converter


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "case, dtype",
    [pytest.param(c, d, id=f"{c.name}-{dtype_name(d)}") for c in CASES for d in SUITE.dtypes],
)
def test_opt_in_form_matches_the_reference(case, dtype, form):
    """The opt-in forms (`staged_sa`: the tokens' activation scales staged in the ring by the
    producer lanes' cp.async; `converter`: a converter warpgroup widening into shared memory,
    the MMAs' A from there) on the chooser's tile of every check and sanitize case."""
    from forgekernel.kernels.gemm.fp4.sm90.config import choose_tokens

    inputs = _inputs(case, dtype, seed=0)
    h = choose_tokens(inputs["expected_m"])
    run = lambda i, o: suite_module._run_staged(i, o, h, FORMS[form])  # noqa: E731
    _, cmps = verify(SUITE, inputs, CUDA, run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def _forced(inputs, form, tokens):
    """The output (E, max_m, N), SENTINEL past the counts, of the standard (form None) or an
    opt-in form on `tokens` per tile."""
    a, b = inputs["a"], inputs["b"]
    out = torch.full((*a.shape[:2], b.shape[1]), SENTINEL, dtype=torch.bfloat16, device=CUDA)
    views = tuple(out[e, :c] for e, c in enumerate(inputs["counts"]))
    if form is None:
        suite_module._run(inputs, views, suite_module.expected_for(tokens))
    else:
        suite_module._run_staged(inputs, views, tokens, FORMS[form])
    return out


BITS_CASE = suite_module._case(4, 384, 2048, counts=(130, 0, 7, 136), max_m=136)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("tokens", [8, 16, 32, 64])
def test_opt_in_form_gives_the_standard_bits_and_leaves_other_rows(tokens, form):
    """Same products, same promotion order: each opt-in form's every counted value equals the
    standard's bit for bit on the same tile (experts above the tile, an empty one, a count of
    max_m), and rows past the counts keep their sentinel. (converter: WGMMA with A from shared
    memory against A from registers, the same e4m3 values: predicted equal.)"""
    inputs = _inputs(BITS_CASE, seed=9)
    want = _forced(inputs, None, tokens)
    got = _forced(inputs, form, tokens)
    torch.cuda.synchronize()
    _check(inputs, got, inputs["counts"])
    assert torch.equal(want, got)


@pytest.mark.parametrize("dtype", SUITE.dtypes, ids=dtype_name)
def test_converter_96_tokens_a_tile(dtype):
    """The converter form's own tile (96 tokens: experts of 130, 0, 7, 136 rows take 2, 0, 1,
    2 token tiles) against the reference on the check cases with more than 64 tokens an
    expert, and rows past the counts left alone."""
    inputs = _inputs(BITS_CASE, seed=10)
    got = _forced(inputs, "converter", 96)
    torch.cuda.synchronize()
    _check(inputs, got, inputs["counts"])
    for case in (c for c in CASES if max(suite_module.expert_counts(c.params)) > 64):
        data = _inputs(case, dtype, seed=11)
        run = lambda i, o: suite_module._run_staged(i, o, 96, True)  # noqa: E731
        _, cmps = verify(SUITE, data, CUDA, run=run)
        assert all(c.ok for c in cmps), (case.name, [c.message for c in cmps])
